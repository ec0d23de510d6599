"""Speculative decoding: proposers (a plugin kind) guess tokens, the engine verifies them in one forward."""

from __future__ import annotations

from .ngram import NgramProposer, ngram_proposal
from .proposer import ProposalRequest, Proposer, ProposerContext
from ..sampling.rejection import greedy_accept, rejection_sample
from .speculator import SpecCounters, Speculator

__all__ = ["NgramProposer", "ProposalRequest", "Proposer", "ProposerContext", "SpecCounters", "Speculator",
           "greedy_accept", "ngram_proposal", "rejection_sample"]
