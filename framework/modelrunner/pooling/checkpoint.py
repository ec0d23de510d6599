"""A checkpoint's own pooling settings: its sentence-transformers modules, as vLLM reads them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last",
            "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
            "pooling_mode_weightedmean_tokens": "weightedmean"}
"""sentence-transformers' ``Pooling`` config flag → the pooling method name it means (the kernel ships
``cls``, ``mean`` and ``last``; a plugin may provide the others)."""
ST_MODE_NAMES = {"lasttoken": "last", "mean_sqrt_len_tokens": "mean_sqrt_len"}
"""sentence-transformers' ``pooling_mode`` string → the method name, where they differ."""
DEFAULT_METHOD = "last"
"""The method of a checkpoint that says nothing (vLLM's default for decoder embedding models)."""


@attrs.frozen
class CheckpointPooling:
    """The pooling a checkpoint declares (None: it says nothing)."""

    method: str | None = None
    """The method its ``Pooling`` module uses."""
    normalize: bool | None = None
    """Whether its modules end with ``Normalize`` (None without sentence-transformers modules)."""
    source: str = ""
    """The file it was read from (named in errors)."""


def checkpoint_pooling(directory: Path | None) -> CheckpointPooling:
    """What ``modules.json`` and its ``Pooling`` module's ``config.json`` in ``directory`` declare
    (nothing for a checkpoint without them, a GGUF file, or unreadable files)."""
    if directory is None or not (Path(directory) / "modules.json").is_file():
        return CheckpointPooling()
    directory = Path(directory)
    try:
        modules: list[dict[str, Any]] = json.loads((directory / "modules.json").read_text())
    except (OSError, ValueError):
        return CheckpointPooling()
    kinds = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
    normalize = any(k.endswith(".Normalize") for k in kinds)
    pooling = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return CheckpointPooling(None, normalize, str(directory / "modules.json"))
    path = directory / str(pooling.get("path", "")) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return CheckpointPooling(None, normalize, str(directory / "modules.json"))
    method = next((name for key, name in ST_MODES.items() if config.get(key)), None)
    mode = config.get("pooling_mode")  # sentence-transformers >= 5 writes one string (or a list of them)
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if method is None and isinstance(mode, str):
        method = ST_MODE_NAMES.get(mode, mode)
    return CheckpointPooling(method, normalize, str(path))


__all__ = ["CheckpointPooling", "DEFAULT_METHOD", "ST_MODES", "ST_MODE_NAMES", "checkpoint_pooling"]
