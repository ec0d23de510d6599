"""The proposer suite: what the engine relies on when it asks a speculative-decoding proposer.

Proposals must be lists of valid token ids (``0 … vocab_size - 1``), at most as many as asked, one
list per sequence, in order, every step, for sequences that grow, end and come back (``forget``).
A proposer that runs a draft model is given the suite's tiny checkpoint as ``model``
(the target's vocabulary). Then a tiny ``LLM`` with the proposer generates greedily in one batch with a request that does not
speculate: its outputs must be plain decoding's (the engine's verification guarantees it; the check
catches a proposer that breaks the engine instead, e.g. by raising or by mutating the token lists).
"""

from __future__ import annotations

import random
from typing import Any

from .base import Check, ConformanceError, NotApplicable, Suite, expect

VOCAB = 256
"""The vocabulary size the stand-alone checks claim (the tiny checkpoint's)."""


def _sequences(rng: random.Random) -> list[list[int]]:
    """Token lists a proposer meets: random, repetitive (something to copy), one token, long."""
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(2, 40))],
            [5, 6, 7, 8] * 6 + [5, 6],
            [rng.randrange(VOCAB)],
            [9] * 30,
            [rng.randrange(VOCAB) for _ in range(300)]]


class ProposerSuite(Suite):
    """Checks one proposer on token lists, then inside a tiny engine."""

    kind = "proposers"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None) -> None:
        super().__init__(name, plugins=plugins, plugin=plugin)
        self._dir: Any = None

    def _checkpoint(self) -> Any:
        """The suite's tiny Llama (a 256-token vocabulary): the engine check's target, and the ``model``
        a proposer that runs a draft model is given."""
        import tempfile

        from transformers import LlamaConfig

        from .models import tiny_checkpoint

        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="modelrunner-proposer-")
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=128,
                             tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
        return tiny_checkpoint(config, self._dir.name)

    def _settings(self, k: int = 4) -> dict[str, Any]:
        return {"method": self.name, "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                "model": str(self._checkpoint()),
                "disable_by_batch_size": None}  # every step drafts: what is checked must not depend on timing

    def _config(self, k: int = 4) -> Any:
        from ..config import SpeculativeConfig

        try:
            return SpeculativeConfig(**self._settings(k))
        except ValueError as exc:
            raise NotApplicable(f"the proposer needs settings the suite cannot give it: {exc}") from None

    def proposer(self, k: int = 4) -> Any:
        """A fresh instance of the proposer under test."""
        from ..spec_decode import ProposerContext

        cls = self.plugins.registry.get_class(self.kind, self.name, self.provider())
        return cls(ProposerContext(self._config(k), VOCAB, None, self.plugins))

    def checks(self) -> list[Check]:
        """Valid proposals step after step; forgetting; exact outputs in an engine."""
        return [Check("valid-proposals", self._check_valid),
                Check("forget-and-reuse-ids", self._check_forget),
                Check("engine-outputs-unchanged", self._check_engine)]

    def _expect_valid(self, requests: list[Any], proposals: Any) -> None:
        expect(isinstance(proposals, (list, tuple)) and len(proposals) == len(requests),
               f"propose() for {len(requests)} sequences returned {type(proposals).__name__} "
               f"of length {len(proposals) if hasattr(proposals, '__len__') else '?'}")
        for request, proposal in zip(requests, proposals):
            ids = list(proposal)
            expect(len(ids) <= request.num_tokens, f"proposed {len(ids)} tokens for sequence {request.seq_id}, "
                                                   f"more than the {request.num_tokens} asked")
            bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < VOCAB]
            expect(not bad, f"proposed {bad[:3]} for sequence {request.seq_id}: not token ids below {VOCAB}")

    def _check_valid(self) -> str:
        from ..spec_decode import ProposalRequest

        rng = random.Random(0)
        proposer = self.proposer()
        seqs = _sequences(rng)
        proposed = 0
        for step in range(6):
            requests = [ProposalRequest(i, tuple(s), 1 + (i + step) % 4) for i, s in enumerate(seqs)]
            snapshot = [list(s) for s in seqs]
            proposals = proposer.propose(requests)
            self._expect_valid(requests, proposals)
            expect([list(r.token_ids) for r in requests] == snapshot, "propose() changed the token lists it was given")
            proposed += sum(len(p) for p in proposals)
            for s in seqs:
                s.append(rng.randrange(VOCAB))
        return f"{proposed} tokens proposed"

    def _check_forget(self) -> None:
        from ..spec_decode import ProposalRequest

        proposer = self.proposer()
        seqs = _sequences(random.Random(1))
        requests = [ProposalRequest(i, tuple(s), 3) for i, s in enumerate(seqs)]
        self._expect_valid(requests, proposer.propose(requests))
        proposer.forget([0, 1, 2])
        # The ids come back as other sequences (the engine reuses none, but a preempted one restarts).
        again = [ProposalRequest(i, tuple(reversed(s)), 2) for i, s in enumerate(seqs)]
        self._expect_valid(again, proposer.propose(again))

    def _check_engine(self) -> str:
        from ..sampling.params import SamplingParams
        from .models import make_llm

        self._config()  # NotApplicable before any work when the suite cannot configure it
        path = self._checkpoint()
        common = dict(plugins=self.plugins, dtype="float32", device="cpu", kv_cache_memory=4 * 2**20, compile=False,
                      block_size=8, max_model_len=128)
        method = f"{self.provider()}:{self.name}"
        prompts = ["t5 t6 t7 t5 t6 t7 t5 t6", "t9 t9 t9 t9", "t3 t40 t77 t12 t3 t40", "t100 t101"]
        params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True) for _ in prompts]
        params[3] = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logit_bias={7: 0.5})
        plain = make_llm(path, **common).generate(prompts, params, use_tqdm=False)
        llm = make_llm(path, **common, speculative_config={**self._settings(3), "method": method})
        spec = llm.generate(prompts, params, use_tqdm=False)
        for prompt, a, b in zip(prompts, plain, spec):
            if a.outputs[0].token_ids != b.outputs[0].token_ids:
                raise ConformanceError(f"with the proposer, {prompt!r} gave {b.outputs[0].token_ids}; plain "
                                       f"decoding gives {a.outputs[0].token_ids}")
        stats = llm.llm_engine.stats()["speculative"]
        expect(stats["proposer_errors"] == 0, f"propose() raised in {stats['proposer_errors']} step(s) (see the log)")
        return f"{stats['num_draft_tokens']} proposed, {stats['num_accepted_tokens']} accepted"
