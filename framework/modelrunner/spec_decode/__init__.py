"""Speculative decoding: proposers (a plugin kind) guess tokens, the engine verifies them in one forward.

What the kernel keeps is the contract and the engine's side: the :class:`Proposer` interface, the
scheduling of ``1 + k`` query tokens, verification (``greedy_accept``, ``rejection_sample``) and the
counts (:class:`SpecCounters`). The speculator — which sequences speculate and how many tokens, the
per-batch-size cost model, and the containment of proposer calls — and the ``ngram`` proposer are the
``modelrunner-speculative`` distribution, whose speculator class the engine builds through the
:data:`SPECULATOR_GROUP` entry point when ``speculative_config`` is set.
"""

from __future__ import annotations

from ..sampling.rejection import greedy_accept, rejection_sample
from .counters import SpecCounters
from .proposer import ProposalRequest, Proposer, ProposerContext

SPECULATOR_GROUP = "modelrunner.speculative"
"""Entry-point group of the speculator class (entry point ``speculator``; ``modelrunner-speculative`` declares
``modelrunner_speculative:Speculator``). ``Speculator.create(config, executor, allocator, vocab_size,
tokenizer)`` builds it; the engine then sets its ``excluded`` predicate, asks ``propose(seqs,
max_model_len)`` each step (seq id → draft), reports ``observe(drafted, seconds, emitted)``,
``record(seq, proposed, accepted, emitted)`` and ``forget(seq_ids)``, and reads ``counters`` (a
:class:`SpecCounters`) and ``stats()``."""
SPECULATIVE_DIST = "modelrunner-speculative"
"""The distribution that provides speculative decoding, named when it is missing."""

__all__ = ["SPECULATIVE_DIST", "SPECULATOR_GROUP", "ProposalRequest", "Proposer", "ProposerContext", "SpecCounters",
           "greedy_accept", "rejection_sample"]
