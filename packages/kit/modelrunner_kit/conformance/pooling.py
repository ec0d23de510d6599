"""The pooling-method suite: what the engine relies on when it pools a prompt into an embedding.

Directly, on random hidden states: the method declares what it reads, returns one float32 vector
of its ``output_size()`` for prompts of 1 to 40 tokens, the same twice, without touching its input
(the kernel's own ``last`` / ``mean`` / ``cls`` also match their formulas). In a tiny ``LLM``
configured with it: embeddings of prompts prefilled whole, in chunks and from the prefix cache, beside
a generating request, equal the method applied to transformers' own final hidden states of the rows
it reads (float32, 1e-4), normalised to length 1 by default, and the generating request produces
what it does alone.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from .base import Check, ConformanceError, Suite, expect, expect_close

HIDDEN = 64
"""Hidden size of the direct checks (and of the tiny model)."""
PROMPT_LENGTHS = (1, 2, 7, 40)
"""Prompt lengths of the direct checks."""
TOLERANCE = 1e-4
"""Largest |difference| from transformers' hidden states pooled by the method (float32)."""
REFERENCE = {"last": lambda h: h[-1], "mean": lambda h: h.mean(0), "cls": lambda h: h[0]}
"""The kernel's methods → their formula over every prompt token's hidden state."""


class PoolingMethodSuite(Suite):
    """Checks one pooling method directly and in a tiny ``LLM``."""

    kind = "pooling_methods"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None) -> None:
        super().__init__(name, plugins=plugins, plugin=plugin)
        self._state: dict[str, Any] = {}

    def method_class(self) -> type:
        """The class under test."""
        return self.plugins.registry.get_class(self.kind, self.name, self.provider())

    def _method(self) -> Any:
        # kernel internal: what the engine passes a pooling method
        from modelrunner.pooling.method import PoolingContext

        if "method" not in self._state:
            self._state["method"] = self.method_class()(PoolingContext(HIDDEN))
        return self._state["method"]

    def check_declares(self) -> str:
        """``reads`` is one of :data:`~modelrunner.pooling.READS`; ``output_size()`` a positive int."""
        from modelrunner.pooling.method import READS  # kernel internal: the rows a pooling method may read

        cls = self.method_class()
        expect(cls.reads in READS, f"reads is {cls.reads!r}; expected one of {', '.join(READS)}")
        size = self._method().output_size()
        expect(isinstance(size, int) and not isinstance(size, bool) and size > 0,
               f"output_size() returned {size!r}, expected a positive int")
        return f"reads {cls.reads}, output size {size}"

    def check_vectors(self, length: int) -> str:
        """One prompt of ``length`` tokens: a float32 vector of ``output_size()``, finite, the same
        twice, its input untouched (and, for the kernel's methods, their formula)."""
        from modelrunner.pooling.method import rows_read  # kernel internal: the rows a pooling method may read

        method = self._method()
        gen = torch.Generator().manual_seed(length)
        every = torch.randn(length, HIDDEN, generator=gen)
        token_ids = torch.randint(0, 256, (length,), generator=gen).tolist()
        positions = rows_read(type(method).reads, length)
        hidden = every[positions.start:positions.stop].clone()
        before = hidden.clone()
        got = method.pool(hidden, token_ids)
        size = method.output_size()
        expect(isinstance(got, torch.Tensor) and got.dtype == torch.float32 and tuple(got.shape) == (size,),
               f"pool returned {type(got).__name__} {getattr(got, 'dtype', '')} {list(getattr(got, 'shape', []))}, "
               f"expected a float32 [{size}] tensor")
        expect(bool(torch.isfinite(got).all()), "pool returned NaN or inf for finite hidden states")
        expect(torch.equal(hidden, before), "pool modified the hidden states it was given")
        expect(torch.equal(method.pool(hidden, token_ids), got), "pool gave different vectors for the same input")
        if self.provider() == "default-pooling" and self.name in REFERENCE:
            expect_close(got, REFERENCE[self.name](every), 1e-6, f"{self.name} of {length} tokens")
        return f"{len(positions)} row(s) read"

    def _llm(self) -> Any:
        if "llm" not in self._state:
            from .models import make_llm, reference_model, tiny_checkpoint

            self._state["dir"] = tempfile.TemporaryDirectory(prefix="modelrunner-conformance-")
            path = tiny_checkpoint("LlamaForCausalLM", self._state["dir"].name)
            self._state["reference"] = reference_model(path)
            self._state["llm"] = make_llm(path, plugins=self.plugins, dtype="float32", device="cpu",
                                          kv_cache_memory=8 * 2**20, compile=False, max_num_batched_tokens=16,
                                          pooling_type=f"{self.provider()}:{self.name}")
        return self._state["llm"]

    def check_engine(self) -> str:
        """Embeddings in a tiny ``LLM`` (prompts whole, chunked over a 16-token budget, and again once
        their prefix is cached; a generating request in the same steps) against transformers' hidden states
        pooled by the method; the default output has length 1."""
        from modelrunner import PoolingParams, SamplingParams
        from modelrunner.pooling import rows_read  # kernel internal: the rows a pooling method may read

        llm = self._llm()
        reference = self._state["reference"]
        method = llm.engine.pooler.method
        prompts = [[1, 5, 9], [1] + list(range(3, 40)), [1] + list(range(3, 40))]
        free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        alone = llm.generate([[1, 7, 7, 8]], free, use_tqdm=False)[0].outputs[0].token_ids
        engine = llm.engine
        done: dict[str, Any] = {}
        engine.add_request("free", [1, 7, 7, 8], free, on_output=engine.collect(done))
        raw = PoolingParams(normalize=False)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"pool-{i}", prompt, raw, on_output=engine.collect(done))
        while len(done) < len(prompts) + 1:
            engine.advance()
        expect(list(done["free"].outputs[0].token_ids) == list(alone),
               f"a generating request gave {list(done['free'].outputs[0].token_ids)} beside pooling ones, "
               f"{list(alone)} alone")
        worst = 0.0
        for i, prompt in enumerate(prompts):
            out = done[f"pool-{i}"]
            expect(out.error is None and out.outputs.data is not None, f"prompt {i} was not pooled: {out.error}")
            with torch.no_grad():
                every = reference.model(torch.tensor([prompt])).last_hidden_state[0].float()
            rows = rows_read(type(method).reads, len(prompt))
            want = method.pool(every[rows.start:rows.stop].clone(), prompt)
            worst = max(worst, expect_close(out.outputs.data, want, TOLERANCE, f"prompt {i} ({len(prompt)} tokens)"))
        again = llm.encode([prompts[1]], raw, use_tqdm=False)[0]  # its prefix now cached
        worst = max(worst, expect_close(again.outputs.data, done["pool-1"].outputs.data, TOLERANCE,
                                        "a prompt embedded again (after its prefix was cached)"))
        if type(method).reads == "last":
            expect(again.num_cached_tokens > 0, "a method reading only the last token did not reuse the prefix cache")
        unit = llm.embed([prompts[0]], use_tqdm=False)[0].outputs.embedding
        norm = float(torch.tensor(unit).norm())
        expect(abs(norm - 1.0) < 1e-5, f"the default embedding has length {norm:.6g}, expected 1 (normalised)")
        if not engine.get_num_unfinished_requests() == 0:
            raise ConformanceError("requests were left unfinished in the engine")
        return f"max |Δ| {worst:.2g} over {len(prompts)} prompts"

    def checks(self) -> list[Check]:
        """What it declares; vectors for prompts of several lengths; the engine."""
        return [Check("declares", self.check_declares),
                *(Check(f"vector/{n}-tokens", lambda n=n: self.check_vectors(n)) for n in PROMPT_LENGTHS),
                Check("engine", self.check_engine)]


__all__ = ["PROMPT_LENGTHS", "PoolingMethodSuite", "REFERENCE", "TOLERANCE"]
