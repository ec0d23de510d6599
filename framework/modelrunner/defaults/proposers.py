"""The kernel's speculative-decoding proposer ``ngram`` (prompt lookup), declared like any plugin's; ``draft``
(a draft model) is the ``modelrunner-proposer-draft`` distribution's."""

from __future__ import annotations

from typing import Any

from ..hookspecs import hookimpl
from ..spec_decode.ngram import NgramProposer


@hookimpl
def register(registry: Any) -> None:
    """Declare the built-in proposer."""
    registry.proposers(NgramProposer)
