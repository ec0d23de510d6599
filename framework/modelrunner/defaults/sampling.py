"""The kernel's logits processors (penalties, biases, masks, ``min_tokens``), declared like any plugin's."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..sampling.builtin import BUILTIN_PROCESSORS


@hookimpl
def register(registry: Any) -> None:
    """Declare the built-in logits processors."""
    registry.logits_processors(*BUILTIN_PROCESSORS)
