"""Every environment variable kvpush reads, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    cache_dir: Path  # KVPUSH_CACHE_DIR: built models and other reusable files
    log_level: str  # KVPUSH_LOG_LEVEL: DEBUG, INFO, WARNING...

    @classmethod
    def from_env(cls) -> Settings:
        cache = os.environ.get("KVPUSH_CACHE_DIR") or Path.home() / ".cache" / "kvpush"
        return cls(cache_dir=Path(cache), log_level=os.environ.get("KVPUSH_LOG_LEVEL", "INFO"))


SETTINGS = Settings.from_env()
