"""kvpush's log lines inside vLLM's processes, shaped like vLLM's own.

vLLM configures only its own logger, so without a handler kvpush's INFO lines would be lost
and its warnings printed bare. `attach()` gives the "kvpush" logger one, at the level of
KVPUSH_LOG_LEVEL; it is called where kvpush starts running inside vLLM (the connector, and
the two ASGI middlewares), never at import, so importing kvpush changes no logging.
"""

from __future__ import annotations

import logging

from kvpush.settings import SETTINGS


def attach() -> None:
    log = logging.getLogger("kvpush")
    if log.handlers:  # attached already, or the application configured it
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvpush] %(message)s"))
    log.addHandler(handler)
    log.setLevel(SETTINGS.log_level.upper())
    log.propagate = False
