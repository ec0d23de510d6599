"""Speculative decoding's counts, as the engine reports them (``stats()["speculative"]``, the engine
loop's snapshots, the server's metrics), whichever speculator keeps them."""

from __future__ import annotations

import attrs

from ..wire import register as _wire_type


@_wire_type
@attrs.define
class SpecCounters:
    """Aggregate counts over every verification (vLLM's ``spec_decode`` metrics)."""

    num_drafts: int = 0
    """Verifications run (one per speculating sequence and step)."""
    num_draft_tokens: int = 0
    """Tokens proposed and scored."""
    num_accepted_tokens: int = 0
    """Proposed tokens the target accepted."""
    num_emitted_tokens: int = 0
    """Tokens appended by verifications (accepted plus the target's own one each)."""
    proposer_errors: int = 0
    """Steps whose proposer raised (nothing was speculated then)."""
    proposals_truncated: int = 0
    """Proposals cut at the tokens asked for (a proposer that proposed more, or an endless iterator)."""
    proposals_out_of_vocab: int = 0
    """Proposals cut at a token id outside the target's vocabulary (``< 0`` or ``>= vocab_size``): a
    proposer bug (another tokenizer, an off-by-one), reported once in the log and counted here."""
    proposer_timeouts: int = 0
    """Proposer calls that did not return within ``$MODELRUNNER_PROPOSER_TIMEOUT`` (the first one turns
    speculative decoding off)."""
