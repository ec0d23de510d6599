"""What the front of a data-parallel deployment knows of its replicas' engines."""

from __future__ import annotations

from typing import Any

import attrs

from modelrunner import RunnerConfig


@attrs.frozen
class FrontEngine:
    """What the front knows of the replicas' engines (the part of ``LLM.engine`` the server reads)."""

    config: RunnerConfig
    """The deployment's configuration."""
    vocab_size: int
    """Valid token ids are ``0 … vocab_size - 1``."""
    max_model_len: int
    """Longest sequence (prompt + output)."""
    tokenizer: Any
    """Replica 0's tokenizer."""


__all__ = ["FrontEngine"]
