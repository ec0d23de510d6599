"""The proposer interface: what a speculative-decoding proposer plugin implements."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar

import attrs

from ..config import SpeculativeConfig


@attrs.frozen
class ProposerContext:
    """What a proposer is built with."""

    config: SpeculativeConfig
    """The ``speculative_config`` (method, ``num_speculative_tokens``, the method's own settings)."""
    vocab_size: int
    """The target model's vocabulary size: valid proposals are ``0 … vocab_size - 1``."""
    runner_config: Any = None
    """The target's :class:`~modelrunner.config.RunnerConfig` (device, dtype, cache size), for proposers
    that run a model of their own; None in the conformance suite's stand-alone runs."""
    plugins: Any = None
    """The loaded plugins (to load a draft model through the adapters); None where not needed."""
    tokenizer: Any = None
    """The target's tokenizer (a draft model's must have the same vocabulary); None without one."""


@attrs.frozen
class ProposalRequest:
    """One sequence to propose for."""

    seq_id: int
    """Engine-wide sequence id (stable while the sequence lives; see :meth:`Proposer.forget`)."""
    token_ids: Sequence[int]
    """The prompt then every generated token so far (a tuple: read only)."""
    num_tokens: int
    """Most tokens to propose (at least 1)."""


class Proposer(abc.ABC):
    """Guesses the tokens that follow a sequence; the target model checks every guess.

    A proposer never changes what is generated, only how fast: the engine scores the proposals with
    the target model and keeps only what the target itself would have produced (greedy) or, when
    sampling, accepts each with the rejection rule that preserves the target distribution. A wrong
    guess costs a slot in the step's forward. Proposals outside the vocabulary are cut off by the
    engine (at the first bad id; counted as ``proposals_out_of_vocab`` in the engine's
    ``stats()["speculative"]``) and more than ``num_tokens`` are truncated (an iterator is read no
    further). Each call runs in a thread of its own and may take at most
    ``$MODELRUNNER_PROPOSER_TIMEOUT`` seconds (default 30): past that, speculative decoding is turned
    off for the engine's life and requests go on without drafts.

    Subclasses set ``name`` (the ``speculative_config`` method) and implement :meth:`propose`.

    :param context: the configuration and the target's vocabulary size.
    :raises ValueError: a configuration the proposer cannot run (named, with what would be accepted).
    """

    name: ClassVar[str] = "?"
    """The ``method`` this proposer is chosen by in ``speculative_config``."""

    def __init__(self, context: ProposerContext) -> None:
        self.context = context
        """The configuration and target vocabulary the proposer was built for."""

    @abc.abstractmethod
    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        """Guess what follows each request's tokens, in one call for the step's sequences.

        :param requests: the decoding sequences that speculate this step.
        :returns: one list per request, in order: at most ``num_tokens`` token ids (an empty list: no
            guess; the sequence decodes one token as usual).
        """

    def forget(self, seq_ids: Sequence[int]) -> None:
        """These sequences ended or lost their KV (preempted): drop any state kept for them."""
        return None

    def stats(self) -> dict[str, Any]:
        """The proposer's own counters for the engine's ``stats()`` (none by default)."""
        return {}
