"""The proposer suite: what the engine relies on when it asks a speculative-decoding proposer.

Proposals must be lists of valid token ids (``0 … vocab_size - 1``), at most as many as asked, one
list per sequence, in order, every step, for sequences that grow, end and come back (``forget``).
A proposer that runs a draft model is given the suite's tiny checkpoint as ``model``
(the target's vocabulary). Then a tiny ``LLM`` with the proposer generates greedily in one batch with a
request that does not speculate: its outputs must be plain decoding's (the engine's verification
guarantees it; the check catches a proposer that breaks the engine instead, e.g. by raising, by
mutating the token lists or by proposing ids outside the vocabulary). Last, the proposer must guess
where guessing is easy: a target whose greedy output continues a passage its prompt repeats (so the
continuation is a copy of the context) must accept a fair share of its drafts; a proposer whose
drafts are off by one position proposes plenty there and has nearly none accepted.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from .base import Check, ConformanceError, NotApplicable, Suite, expect

VOCAB = 256
"""The vocabulary size the stand-alone checks claim (the tiny checkpoint's)."""
PASSAGE = (17, 203, 88, 41, 150, 9, 230, 66, 121, 35, 190, 74)
"""The passage the copy check's prompt repeats (distinct ids, none special); the copying target's
greedy output goes on repeating it."""
MIN_COPY_ACCEPTANCE = 0.3
"""Least share of drafted tokens accepted on the copy check's prompt, whose continuation a copying
proposer (``ngram``, or a draft model of the target) guesses all but entirely."""


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

    def _copying_checkpoint(self) -> Any:
        """A one-layer Llama that continues :data:`PASSAGE` cyclically: one-hot embeddings, attention and
        MLP outputs zeroed, and an LM head that maps each passage token to the next one (any other token
        to itself). The copy check's target, and the ``model`` a draft-model proposer is given there."""
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from .models import tiny_tokenizer

        self._checkpoint()  # the temporary folder
        path = self._dir.name + "/copying-llama"
        if Path(path, "tokenizer.json").is_file():
            return path
        config = LlamaConfig(hidden_size=VOCAB, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=128,
                             tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
        model = LlamaForCausalLM(config).eval()
        following = list(range(VOCAB))
        for i, token in enumerate(PASSAGE):
            following[token] = PASSAGE[(i + 1) % len(PASSAGE)]
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(torch.eye(VOCAB))
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            head = torch.zeros(VOCAB, VOCAB)
            head[following, list(range(VOCAB))] = 1.0  # logits[next(t)] is the largest after token t
            model.lm_head.weight.copy_(head)
        model.save_pretrained(path)
        tiny_tokenizer(VOCAB).save_pretrained(path)
        return path

    def _settings(self, k: int = 4, model: Any = None) -> dict[str, Any]:
        return {"method": self.name, "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                "model": str(model or self._checkpoint()),
                "disable_by_batch_size": None}  # every step drafts: what is checked must not depend on timing

    def _config(self, k: int = 4, model: Any = None) -> Any:
        from modelrunner.config import SpeculativeConfig  # kernel internal: the engine's speculative config

        try:
            return SpeculativeConfig(**self._settings(k, model))
        except ValueError as exc:
            raise NotApplicable(f"the proposer needs settings the suite cannot give it: {exc}") from None

    def proposer(self, k: int = 4, model: Any = None) -> Any:
        """A fresh instance of the proposer under test (``model``: the draft checkpoint it is given;
        default the suite's tiny one)."""
        from modelrunner.api import ProposerContext

        cls = self.plugins.registry.get_class(self.kind, self.name, self.provider())
        return cls(ProposerContext(self._config(k, model), VOCAB, None, self.plugins))

    def checks(self) -> list[Check]:
        """Valid proposals step after step; forgetting; exact outputs in an engine; acceptance where the
        target copies its context."""
        return [Check("valid-proposals", self._check_valid),
                Check("forget-and-reuse-ids", self._check_forget),
                Check("engine-outputs-unchanged", self._check_engine),
                Check("acceptance-on-copied-text", self._check_acceptance)]

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
        from modelrunner.api import ProposalRequest

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
        from modelrunner.api import ProposalRequest

        proposer = self.proposer()
        seqs = _sequences(random.Random(1))
        requests = [ProposalRequest(i, tuple(s), 3) for i, s in enumerate(seqs)]
        self._expect_valid(requests, proposer.propose(requests))
        proposer.forget([0, 1, 2])
        # The ids come back as other sequences (the engine reuses none, but a preempted one restarts).
        again = [ProposalRequest(i, tuple(reversed(s)), 2) for i, s in enumerate(seqs)]
        self._expect_valid(again, proposer.propose(again))

    def _check_engine(self) -> str:
        from modelrunner import SamplingParams
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
        expect(stats["proposals_out_of_vocab"] == 0,
               f"{stats['proposals_out_of_vocab']} proposal(s) had token ids outside the target's vocabulary "
               f"(0 … {VOCAB - 1}); the engine cut them there")
        return f"{stats['num_draft_tokens']} proposed, {stats['num_accepted_tokens']} accepted"

    def _check_acceptance(self) -> str:
        from modelrunner import SamplingParams
        from .models import make_llm

        self._config()
        path = self._copying_checkpoint()
        k = 4
        prompt = [*PASSAGE, *PASSAGE, *PASSAGE[:4]]
        llm = make_llm(path, plugins=self.plugins, dtype="float32", device="cpu", kv_cache_memory=4 * 2**20,
                       compile=False, block_size=8, max_model_len=128,
                       speculative_config={**self._settings(k, path), "method": f"{self.provider()}:{self.name}"})
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=40, temperature=0.0,
                                                                           ignore_eos=True), use_tqdm=False)
        tokens = [*prompt, *out[0].outputs[0].token_ids]
        stats = llm.llm_engine.stats()["speculative"]
        drafted, accepted = stats["num_draft_tokens"], stats["num_accepted_tokens"]
        oov = stats["proposals_out_of_vocab"]
        measured = (f"on a prompt that repeats a {len(PASSAGE)}-token passage, whose greedy continuation repeats "
                    f"it again, {accepted} of {drafted} drafted tokens were accepted")
        if not drafted:
            if oov:
                raise ConformanceError(f"{measured}: every one of its {oov} proposals began with a token id outside "
                                       f"the vocabulary (0 … {VOCAB - 1})")
            raise NotApplicable(f"{measured}: it proposed nothing there (acceptance not measured)")
        rate = accepted / drafted
        if rate < MIN_COPY_ACCEPTANCE:
            raise ConformanceError(
                f"{measured} ({rate:.0%}); a proposer that guesses the continuation of copied text gets close to "
                f"100% there (the kernel's ngram does), and at least {MIN_COPY_ACCEPTANCE:.0%} is expected"
                f"{self._diagnosis(tokens, len(prompt), k, path)}")
        return f"{accepted} of {drafted} drafted tokens accepted ({rate:.0%}) on text that copies its prompt"

    def _diagnosis(self, tokens: list[int], start: int, k: int, model: Any) -> str:
        """Why drafts were rejected, when a fresh proposer replayed over the final tokens shows it: its
        first guesses match the token one position later (or earlier) than the one that follows."""
        from modelrunner.api import ProposalRequest

        try:
            proposer = self.proposer(k, model)
            shifts = {0: 0, 1: 0, -1: 0}
            for i in range(start, len(tokens) - 1):
                guess = list(proposer.propose([ProposalRequest(0, tuple(tokens[:i]), k)])[0])[:1]
                for shift in shifts:
                    shifts[shift] += guess == [tokens[i + shift]]
            proposer.forget([0])
        except Exception:  # noqa: BLE001 - a diagnosis only; the failure stands without it
            return ""
        if max(shifts[1], shifts[-1]) <= max(shifts[0], 2):
            return ""
        later = shifts[1] >= shifts[-1]
        return (f"; replayed over the output, its first guess matches the token one position "
                f"{'later' if later else 'earlier'} than the next one {shifts[1 if later else -1]} times and the next "
                f"one {shifts[0]} times: are its drafts off by one?")
