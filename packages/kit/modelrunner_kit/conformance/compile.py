"""The compile-backend suite: a compiled tiny Llama computes what the eager one does, and stops compiling.

Two ``LLM`` s on one tiny random Llama checkpoint, one with ``compile=True`` and the backend under
test, one eager, run the same fixed script of steps through the runner (prompts alone, decode-only
steps of 1 to 4 rows, prompt chunks among decodes, sequences crossing block boundaries), then the
same greedy ``generate``. Logits must agree within ``atol`` and greedy tokens exactly. The script and
the generation then run a second time: with every step shape seen once, a dynamo-based backend must
not trace or compile again (``torch._dynamo`` frame and graph counts unchanged; for a backend that
does not use dynamo they stay unchanged trivially).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch

from .base import Check, ConformanceError, NotApplicable, Suite, expect

SCRIPT: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = (
    ("prefill", ((0, 10), (1, 6))),
    *[("decode", ((0, 1), (1, 1)))] * 3,
    ("mixed", ((0, 1), (1, 1), (2, 13))),
    *[("decode", ((0, 1), (1, 1), (2, 1)))] * 3,
    ("mixed", ((2, 1), (3, 5))),
    ("mixed", ((0, 1), (3, 4), (1, 1))),
    *[("decode", ((0, 1), (1, 1), (2, 1), (3, 1)))] * 2,
    *[("decode", ((3, 1),))] * 2,
    ("prefill", ((4, 7),)),
    ("decode", ((4, 1), (0, 1))),
)
"""The steps: ``(kind, ((sequence, new tokens), ...))``; a sequence's first entry is its prompt (or
its first chunk), later entries continue it."""
BLOCK_SIZE = 8
"""KV-cache block size of both LLMs (sequences of the script cross two block boundaries)."""
GENERATE = ((5, 6), (8, 4), (11, 2))
"""``(prompt length, max_tokens)`` of the greedy generation: its decode batch shrinks from 3 to 1."""
_FIRST_ID = 1_000_000  # scratch sequence ids, clear of the engine's


def _token(seq: int, position: int) -> int:
    """The script's fixed token at ``position`` of sequence ``seq`` (never a special token)."""
    return 3 + (37 * seq + 11 * position + position * position) % 250


def run_script(runner: Any) -> list[torch.Tensor]:
    """Each step's logits ``[sequences, vocab]`` of :data:`SCRIPT` through ``runner.execute_model``
    (the scratch allocator's blocks are freed afterwards)."""
    from modelrunner.api import ForwardBatch

    alloc, done, out = runner.scratch_allocator(), {}, []
    try:
        for _, step in SCRIPT:
            ids, new, starts = [], [], []
            for seq, n in step:
                sid, start = _FIRST_ID + seq, done.get(seq, 0)
                tokens = [_token(seq, p) for p in range(start, start + n)]
                if seq not in done:
                    alloc.allocate(sid, tokens, extra_keys=("conformance", sid))
                else:
                    expect(alloc.append_slots(sid, tokens) == [], "the scratch allocator asked for block copies")
                ids.append(sid), new.append(tokens), starts.append(start)
                done[seq] = start + n
            batch = ForwardBatch.build(ids, new, starts, [alloc.block_table(i) for i in ids], runner.block_size,
                                       [[len(t) - 1] for t in new])
            out.append(runner.execute_model(batch).logits)
    finally:
        for seq in done:
            if _FIRST_ID + seq in alloc:
                alloc.free(_FIRST_ID + seq)
    return out


def generate_greedy(llm: Any) -> list[list[int]]:
    """The greedy tokens of :data:`GENERATE`'s prompts, generated together."""
    from modelrunner import SamplingParams

    prompts = [{"prompt_token_ids": [_token(9 + i, p) for p in range(n)]} for i, (n, _) in enumerate(GENERATE)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in GENERATE]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def dynamo_counts() -> dict[str, int]:
    """Frames dynamo converted and graphs it captured so far in this process."""
    from torch._dynamo.utils import counters

    return {"frames": int(counters["frames"]["total"]), "graphs": int(counters["stats"]["unique_graphs"])}


class CompileBackendSuite(Suite):
    """Checks one compile backend against the eager one on a tiny Llama.

    :param device: where the LLMs run (every check is skipped where the backend declares other devices).
    :param options: the backend's ``compile_options``.
    :param atol: the largest logit difference accepted.
    """

    kind = "compile_backends"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None, device: str = "cpu",
                 options: dict[str, Any] | None = None, atol: float = 1e-4) -> None:
        super().__init__(name, plugins=plugins, plugin=plugin)
        self.device = torch.device(device)
        """Where the LLMs run."""
        self.options = dict(options or {})
        """The backend's ``compile_options``."""
        self.atol = atol
        """Largest accepted logit difference."""
        self._state: dict[str, Any] = {}

    def _once(self, key: str, make: Callable[[], Any]) -> Any:
        """``make()`` the first time, its value (or its exception, raised again) afterwards."""
        if key not in self._state:
            try:
                self._state[key] = (True, make())
            except NotApplicable:
                raise
            except Exception as e:  # noqa: BLE001 - every check depending on it fails the same way
                self._state[key] = (False, e)
        ok, value = self._state[key]
        if not ok:
            raise value
        return value

    def _choice(self) -> str:
        registry = self.plugins.registry
        self.provider()
        devices = registry.capabilities(self.kind, self.name, self.plugin).get("devices")
        if devices is not None and self.device.type not in devices:
            raise NotApplicable(f"compile backend {self.name!r} declares devices {', '.join(devices)}, "
                                f"not {self.device.type}")
        return f"{self.plugin}:{self.name}"

    def _llms(self) -> tuple[Any, Any]:
        """``(eager LLM, compiled LLM)``, made once."""
        choice = self._choice()

        def make() -> tuple[Any, Any]:
            from .models import make_llm, tiny_checkpoint

            self._state["dir"] = tmp = tempfile.TemporaryDirectory(prefix="modelrunner-conformance-")
            path = tiny_checkpoint("LlamaForCausalLM", tmp.name)
            config = {"dtype": "float32", "device": self.device.type, "block_size": BLOCK_SIZE,
                      "kv_cache_memory": 16 * 2**20, "enable_prefix_caching": False}
            eager = make_llm(path, plugins=self.plugins, compile=False, **config)
            try:
                compiled = make_llm(path, plugins=self.plugins, compile=True, compile_backend=choice,
                                    compile_cache_dir=f"{tmp.name}/compile-cache", compile_options=self.options,
                                    **config)
            except Exception as e:
                raise ConformanceError(f"an LLM with compile backend {choice!r} failed to build: "
                                       f"{type(e).__name__}: {e}") from e
            return eager, compiled

        return self._once("llms", make)

    def _first_round(self) -> dict[str, Any]:
        """Both LLMs' script logits and greedy tokens (the compiled one's warm-up)."""
        def make() -> dict[str, Any]:
            eager, compiled = self._llms()
            return {"eager": run_script(eager.runner), "compiled": run_script(compiled.runner),
                    "eager_tokens": generate_greedy(eager), "compiled_tokens": generate_greedy(compiled)}

        return self._once("round1", make)

    def _compare(self, kind: str) -> str:
        first = self._first_round()
        worst = 0.0
        for i, ((label, step), want, got) in enumerate(zip(SCRIPT, first["eager"], first["compiled"])):
            if label != kind:
                continue
            expect(got.dtype == torch.float32 and tuple(got.shape) == tuple(want.shape),
                   f"step {i} ({kind}, {len(step)} sequences): logits {got.dtype} of shape {list(got.shape)}, "
                   f"eager gives {want.dtype} of shape {list(want.shape)}")
            diff = (got - want).abs().max().item()
            expect(diff <= self.atol, f"step {i} ({kind}, {len(step)} sequences): logits differ from eager by "
                                      f"{diff:.3g} (more than {self.atol:g})")
            worst = max(worst, diff)
        return f"max |difference| {worst:.2g}"

    def check_greedy(self) -> None:
        """Every step's greedy token, and a whole greedy generation, equal eager's."""
        first = self._first_round()
        for i, (want, got) in enumerate(zip(first["eager"], first["compiled"])):
            w, g = want.argmax(-1).tolist(), got.argmax(-1).tolist()
            expect(w == g, f"step {i} ({SCRIPT[i][0]}): greedy tokens {g}, eager gives {w}")
        expect(first["compiled_tokens"] == first["eager_tokens"],
               f"greedy generation gave {first['compiled_tokens']}, eager gives {first['eager_tokens']}")

    def check_no_recompile(self) -> str:
        """A second round of the same step shapes traces and compiles nothing, and gives the same logits."""
        first = self._first_round()
        _, compiled = self._llms()
        before = dynamo_counts()
        again = run_script(compiled.runner)
        tokens = generate_greedy(compiled)
        after = dynamo_counts()
        grew = {k: after[k] - before[k] for k in after if after[k] != before[k]}
        expect(not grew, "the second round of the same step shapes compiled again: "
                         + ", ".join(f"{n} more dynamo {k}" for k, n in grew.items()))
        for i, (a, b) in enumerate(zip(first["compiled"], again)):
            diff = (a - b).abs().max().item()
            expect(diff <= self.atol, f"step {i} ({SCRIPT[i][0]}): second-round logits differ from the first "
                                      f"by {diff:.3g}")
        expect(tokens == first["compiled_tokens"], f"second greedy generation gave {tokens}, the first "
                                                   f"{first['compiled_tokens']}")
        return f"dynamo frames {after['frames']}, graphs {after['graphs']}"

    def checks(self) -> list[Check]:
        """Logits parity per step kind, greedy tokens, no recompilation."""
        return [Check("logits/prefill", lambda: self._compare("prefill")),
                Check("logits/decode-only", lambda: self._compare("decode")),
                Check("logits/mixed-prefill-decode", lambda: self._compare("mixed")),
                Check("greedy-tokens", self.check_greedy),
                Check("no-recompile-after-warm-up", self.check_no_recompile)]


__all__ = ["BLOCK_SIZE", "GENERATE", "SCRIPT", "CompileBackendSuite", "dynamo_counts", "generate_greedy",
           "run_script"]
