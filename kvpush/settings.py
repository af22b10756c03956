"""Every environment variable kvpush reads, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    cache_dir: Path  # KVPUSH_CACHE_DIR: built models and other reusable files
    log_level: str  # KVPUSH_LOG_LEVEL: DEBUG, INFO, WARNING...
    # KVPUSH_FRONT_END_CONFIG: in a prefill engine's API server, the front end's configuration
    # (proxy/frontend.py; `kvpush serve --front-end-decode` sets it)
    front_end_config: str

    @classmethod
    def from_env(cls) -> Settings:
        cache = os.environ.get("KVPUSH_CACHE_DIR") or Path.home() / ".cache" / "kvpush"
        return cls(
            cache_dir=Path(cache),
            log_level=os.environ.get("KVPUSH_LOG_LEVEL", "INFO"),
            front_end_config=os.environ.get("KVPUSH_FRONT_END_CONFIG", ""),
        )


SETTINGS = Settings.from_env()
