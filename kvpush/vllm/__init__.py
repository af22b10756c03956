"""KVPushConnector, loaded by vLLM through `kv_connector_module_path: "kvpush.vllm"`."""

import logging

from kvpush.settings import SETTINGS
from kvpush.vllm.connector import KVPushConnector

_log = logging.getLogger("kvpush")
if not _log.handlers:  # vLLM configures only its own logger; give ours the same shape
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvpush] %(message)s"))
    _log.addHandler(_handler)
    _log.setLevel(SETTINGS.log_level.upper())
    _log.propagate = False

__all__ = ["KVPushConnector"]
