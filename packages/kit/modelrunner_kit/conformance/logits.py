"""The logits-processor suite: what the engine relies on when it calls a processor once per step.

The engine hands a processor the logits rows of every request that uses it, in whatever order and
company the scheduler produced, so a processor must treat each row on its own: same result alone or
batched with rows of other arguments, in any order; deterministic; shape, dtype and device kept;
nothing but ``-inf`` masking turning finite logits non-finite. It must refuse bad arguments with a
``ValueError`` naming them, and run in a real :class:`~modelrunner.LLM` without changing the
completions of requests that do not use it.

Example arguments come from the class (``example_args``, and ``invalid_args`` for arguments it must
refuse) or from the suite's ``examples=`` / ``invalid=`` options. For a named processor each is the
``args`` dict a request gives with its name; for a built-in one, the
:class:`~modelrunner.SamplingParams` keyword arguments that turn it on.
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import Check, ConformanceError, NotApplicable, Suite, expect

ROWS = 6
"""Rows of the batches the processor is applied to."""


def _close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    try:  # equal infinities count as equal
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    except AssertionError as e:
        raise ConformanceError(f"{what}: {' '.join(str(e).split())}") from None


class LogitsProcessorSuite(Suite):
    """Checks one logits processor on example requests, directly and inside a tiny Llama ``LLM``.

    :param examples: the processor's arguments to check with (default: the class's ``example_args``).
    :param invalid: arguments it must refuse (default: the class's ``invalid_args``).
    :param device: where the logits live.
    """

    kind = "logits_processors"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None,
                 examples: Sequence[Mapping[str, Any]] | None = None,
                 invalid: Sequence[Mapping[str, Any]] | None = None, device: str = "cpu") -> None:
        super().__init__(name, plugins=plugins, plugin=plugin)
        self.device = torch.device(device)
        """Where the logits are."""
        self._examples, self._invalid = examples, invalid
        self._state: dict[str, Any] = {}

    # -- set-up (once per suite) -------------------------------------------------------------

    def processor_class(self) -> type:
        """The processor class under test (the chosen plugin's, else the one the kernel would use)."""
        if "cls" not in self._state:
            self._state["cls"] = self.plugins.registry.get_class(self.kind, self.name, self.provider())
        return self._state["cls"]

    def _processor(self) -> Any:
        if "processor" not in self._state:
            from modelrunner.sampling import ProcessorContext  # kernel internal: what the engine passes a processor
            from .models import EOS, VOCAB_SIZE, tiny_tokenizer

            context = ProcessorContext(vocab_size=VOCAB_SIZE, tokenizer=tiny_tokenizer(),
                                       eos_token_ids=frozenset({EOS}))
            self._state["processor"] = self.processor_class()(context)
        return self._state["processor"]

    def params(self, example: Mapping[str, Any], **sampling: Any) -> tuple[Any, dict[str, Any]]:
        """``(SamplingParams, args)`` of a request using the processor with ``example``."""
        from modelrunner import SamplingParams

        if self.processor_class().builtin:
            return SamplingParams(**{**sampling, **example}), {}
        return SamplingParams(**sampling, logits_processors=[(self._request_name(), dict(example))]), dict(example)

    def _request_name(self) -> str:
        """The name a request gives: bare when it already resolves to the plugin under test."""
        try:
            owner = self.plugins.registry.owner(self.kind, self.name)
        except Exception:  # noqa: BLE001 - a conflict: pick the plugin explicitly
            owner = None
        return self.name if owner == self.plugin else f"{self.plugin}:{self.name}"

    def examples(self) -> list[tuple[dict[str, Any], Any, Any]]:
        """``(example, params, state)`` of every example; NotApplicable when there are none."""
        if "examples" not in self._state:
            cls = self.processor_class()
            given = self._examples if self._examples is not None else getattr(cls, "example_args", ())
            if not given:
                raise NotApplicable(f"logits processor {self.name!r} gives no example arguments (declare "
                                    "`example_args` on the class, or pass examples= to the suite)")
            found = []
            for i, example in enumerate(given):
                try:
                    params, args = self.params(example)
                    state = self._processor().request_state(params, args)
                except ValueError as e:
                    raise ConformanceError(f"example {i} {dict(example)!r} was refused: {e}") from None
                expect(state is not None, f"example {i} {dict(example)!r}: request_state returned None, so a request "
                                          "giving it would not use the processor")
                found.append((dict(example), params, state))
            self._state["examples"] = found
        return self._state["examples"]

    def _batch(self, seed: int = 0) -> tuple[torch.Tensor, list[Any], list[str]]:
        """Logits, rows and a description of each row: :data:`ROWS` rows cycling through the examples,
        each with its own prompt, output so far and logits."""
        from modelrunner.api import LogitsRow
        from .models import VOCAB_SIZE

        gen = torch.Generator().manual_seed(seed)
        examples = self.examples()
        rows, labels = [], []
        for r in range(max(ROWS, 2 * len(examples))):
            example, params, state = examples[r % len(examples)]
            prompt = torch.randint(3, VOCAB_SIZE, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen)
            output = torch.randint(3, VOCAB_SIZE, (int(torch.randint(0, 6, (1,), generator=gen)),), generator=gen)
            rows.append(LogitsRow(state=state, params=params, prompt_token_ids=prompt.tolist(),
                                  output_token_ids=output.tolist()))
            labels.append(f"row {r} (example {example!r}, {len(output)} tokens generated)")
        logits = (3 * torch.randn(len(rows), VOCAB_SIZE, generator=gen)).to(self.device)
        return logits, rows, labels

    def _apply(self, logits: torch.Tensor, rows: list[Any]) -> torch.Tensor:
        out = self._processor().apply(logits.clone(), rows)
        expect(isinstance(out, torch.Tensor), f"apply returned {type(out).__name__}, expected a tensor")
        return out

    # -- checks --------------------------------------------------------------------------------

    def check_output(self) -> None:
        """Shape, dtype and device kept; finite logits stay finite or become -inf (masking)."""
        logits, rows, labels = self._batch()
        out = self._apply(logits, rows)
        expect(tuple(out.shape) == tuple(logits.shape), f"apply returned shape {list(out.shape)} for logits of "
                                                        f"shape {list(logits.shape)}")
        expect(out.dtype == logits.dtype, f"apply returned dtype {out.dtype} for {logits.dtype} logits")
        expect(out.device == logits.device, f"apply returned logits on {out.device}, given them on {logits.device}")
        bad = torch.isnan(out) | torch.isposinf(out)
        if bool(bad.any()):
            r, c = (int(i) for i in bad.nonzero()[0])
            raise ConformanceError(f"{labels[r]}: finite logit of token {c} became {out[r, c].item()} "
                                   "(only -inf masking may make logits non-finite)")

    def check_changes_logits(self) -> str:
        """The processor does something: its example requests change some logit (a processor that
        returns its input unchanged would pass every other check)."""
        logits, rows, _ = self._batch()
        out = self._apply(logits, rows)
        changed = int((out != logits).any(dim=1).sum())
        expect(changed > 0, f"apply left all {len(rows)} rows of the example requests unchanged: the processor does "
                            "nothing for them (check apply, or give example_args that use it)")
        return f"{changed} of {len(rows)} rows changed"

    def check_batch_independence(self) -> None:
        """Each row's result is the same alone as in a batch with other rows, in either order."""
        logits, rows, labels = self._batch()
        batched = self._apply(logits, rows)
        order = list(reversed(range(len(rows))))
        reordered = self._apply(logits[order], [rows[i] for i in order])
        for r in range(len(rows)):
            alone = self._apply(logits[r:r + 1], [rows[r]])[0]
            _close(batched[r], alone, f"{labels[r]}: batched with {len(rows) - 1} other rows vs alone")
            _close(reordered[order.index(r)], alone, f"{labels[r]}: in a batch in reverse order vs alone")

    def check_determinism(self) -> None:
        """The same inputs give the same logits twice."""
        logits, rows, _ = self._batch()
        first, second = self._apply(logits, rows), self._apply(logits, rows)
        _close(second, first, "a second apply on the same inputs vs the first", tol=0.0)

    def check_default_requests(self) -> None:
        """A built-in processor is not used by a request that sets none of its fields."""
        from modelrunner import SamplingParams

        if not self.processor_class().builtin:
            raise NotApplicable("a named processor runs only for the requests that name it")
        state = self._processor().request_state(SamplingParams(), {})
        expect(state is None, f"built-in processor {self.name!r} would run for every request: request_state "
                              f"returned {state!r} for the default SamplingParams()")

    def check_rejects_bad_args(self) -> None:
        """Each invalid example is refused with a ValueError naming every argument it gives."""
        cls = self.processor_class()
        invalid = self._invalid if self._invalid is not None else getattr(cls, "invalid_args", ())
        if not invalid:
            raise NotApplicable(f"logits processor {self.name!r} gives no invalid arguments to check (declare "
                                "`invalid_args` on the class, or pass invalid= to the suite)")
        for example in invalid:
            try:
                params, args = self.params(example)
                state = self._processor().request_state(params, args)
            except ValueError as e:
                missing = [k for k in example if str(k) not in str(e)]
                expect(not missing, f"arguments {dict(example)!r} were refused with {str(e)!r}, which does not name "
                                    f"{', '.join(map(repr, missing))}")
                continue
            raise ConformanceError(f"arguments {dict(example)!r} were accepted (request_state gave {state!r}); "
                                   "expected a ValueError naming them")

    def check_end_to_end(self) -> str:
        """In an ``LLM``: requests using each example complete, and a request beside them that does not
        use the processor gets the completion it gets beside the same requests not using it."""
        from modelrunner import SamplingParams

        llm = self._llm()
        greedy = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
        prompts = ["t5 t9 t17 t33", "t40 t41 t7"]
        for example, _, _ in self.examples():
            params, _ = self.params(example, **greedy)
            with_it = llm.generate(prompts, [params, SamplingParams(**greedy)], use_tqdm=False)
            without = llm.generate(prompts, SamplingParams(**greedy), use_tqdm=False)
            tokens = with_it[0].outputs[0].token_ids
            expect(len(tokens) == 4, f"example {example!r}: {len(tokens)} tokens generated, asked for 4")
            other, alone = with_it[1].outputs[0].token_ids, without[1].outputs[0].token_ids
            expect(list(other) == list(alone), f"example {example!r}: a request not using the processor generated "
                                               f"{list(other)} beside one using it, {list(alone)} otherwise")
        return f"{len(self.examples())} example(s) generated"

    def _llm(self) -> Any:
        if "llm" not in self._state:
            from .models import make_llm, tiny_checkpoint

            self._state["dir"] = tempfile.TemporaryDirectory(prefix="modelrunner-conformance-")
            path = tiny_checkpoint("LlamaForCausalLM", self._state["dir"].name)
            self._state["llm"] = make_llm(path, plugins=self.plugins, dtype="float32", device=self.device.type,
                                          kv_cache_memory=8 * 2**20, enable_prefix_caching=False,
                                          compile=False)
        return self._state["llm"]

    def checks(self) -> list[Check]:
        """Output, batch independence, determinism, default requests, bad arguments, end to end."""
        return [Check("output-shape-dtype-finite", self.check_output),
                Check("changes-logits", self.check_changes_logits),
                Check("batch-independence", self.check_batch_independence),
                Check("determinism", self.check_determinism),
                Check("default-requests-untouched", self.check_default_requests),
                Check("rejects-bad-arguments", self.check_rejects_bad_args),
                Check("end-to-end", self.check_end_to_end)]


__all__ = ["ROWS", "LogitsProcessorSuite"]
