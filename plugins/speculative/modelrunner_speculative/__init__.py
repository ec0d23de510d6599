"""modelrunner plugin: speculative decoding — the speculator the engine builds when ``speculative_config``
is set, and the ``ngram`` proposer (prompt lookup).

The kernel keeps the proposer contract, the scheduling of ``1 + k`` query tokens and the verification
(greedy acceptance, rejection sampling); it builds :class:`Speculator` through the
``modelrunner.speculative`` entry point (``speculator``) and never imports this package by name. Other
proposers (``draft``, third parties') plug into the speculator through the ``proposers`` registry.
"""

from __future__ import annotations

from typing import Any

from modelrunner.api import hookimpl

from .bounded import PROPOSER_TIMEOUT_ENV, BoundedCalls, ProposerTimeoutError, proposer_timeout
from .ngram import NgramProposer, ngram_proposal
from .speculator import Speculator, StepCost

__all__ = ["PROPOSER_TIMEOUT_ENV", "BoundedCalls", "NgramProposer", "ProposerTimeoutError", "Speculator", "StepCost",
           "ngram_proposal", "proposer_timeout", "register"]


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``ngram`` proposer (``speculative_config={"method": "ngram", ...}``)."""
    registry.proposers(NgramProposer)
