"""The kernel's speculative-decoding proposers: ``ngram`` (prompt lookup) and ``draft`` (a draft model),
declared like any plugin's."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..spec_decode.ngram import NgramProposer
from .draft_proposer import DraftModelProposer


@hookimpl
def register(registry: Any) -> None:
    """Declare the built-in proposers."""
    registry.proposers(NgramProposer, DraftModelProposer)
