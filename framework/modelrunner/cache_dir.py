"""Where modelrunner keeps what it works out once per machine: converted checkpoints, kernel timings."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(configured: str | Path | None = None) -> Path:
    """The cache directory: the config's ``cache_dir``, ``$MODELRUNNER_CACHE_DIR`` or ``~/.cache/modelrunner``."""
    root = configured or os.environ.get("MODELRUNNER_CACHE_DIR") or Path.home() / ".cache" / "modelrunner"
    return Path(root)


__all__ = ["cache_root"]
