"""The grammar-backend suite: what the engine relies on when it masks logits with a backend's matchers.

Every check runs the backend on a small byte-level BPE tokenizer (:func:`~.models.byte_tokenizer`)
whose logits are wider than its vocabulary (padding ids must never be allowed). For each constraint
kind the backend declares in ``constraints``: valid documents are walked token by token through the
bitmask (every token allowed and accepted, EOS allowed exactly at the end, the matcher terminated
after it); invalid documents are refused by the bitmask before they end, and the matcher refuses a
token its mask disallows. Then rollback, the batched fill, refusals (a kind not declared, the
backend's ``unsupported_examples``, malformed schemas and grammars: always a
:class:`~modelrunner.errors.StructuredOutputError` naming the feature and the backend), and a tiny
``LLM`` whose constrained and free requests share batches.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import torch

from .base import Check, ConformanceError, NotApplicable, Suite, expect

PADDING = 6
"""Logits columns past the tokenizer's vocabulary."""

OBJECT = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "role": {"enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
    "home": {"type": "object", "properties": {"x": {"type": "number"}, "ok": {"type": "boolean"}},
             "required": ["x", "ok"], "additionalProperties": False}},
    "required": ["name", "age", "role", "tags", "home"], "additionalProperties": False}
"""The suite's JSON schema: strings with lengths, bounded integers, an enum, a bounded array, a nested object."""

VALID = {
    "json": [(OBJECT, {"name": "Ada", "age": 36, "role": "admin", "tags": ["x"], "home": {"x": -1.5, "ok": True}}),
             (OBJECT, {"name": "B", "age": 0, "role": "user", "tags": ["a", "bc"], "home": {"x": 2, "ok": False}}),
             ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [1, 22])],
    "json_object": [(None, {"a": [1, {"b": None}], "c": "x"}), (None, {})],
    "regex": [("[a-c]{2}-[0-9]+", "ab-12"), ("[a-c]{2}-[0-9]+", "cc-0")],
    "choice": [(["yes", "no", "maybe so"], "yes"), (["yes", "no", "maybe so"], "maybe so")],
    "grammar": [('root ::= "(" root ")" | "x"', "((x))"), ('root ::= "(" root ")" | "x"', "x")],
}
"""Kind → (constraint, a document it accepts) pairs (JSON documents as Python values, written compactly)."""

INVALID = {
    "json": [(OBJECT, '{"name":"Ada","age":200'), (OBJECT, '{"name":"Ada","age":3,"role":"root"'),
             (OBJECT, '{"name":"","age":3'), (OBJECT, '{"age":3}'),
             (OBJECT, '{"name":"A","age":1,"role":"user","tags":[],'),
             ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, "[1]"),
             ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, "[1,2,3,4]"),
             ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, '[1,"2"]')],
    "json_object": [(None, "[1]"), (None, '"s"'), (None, '{"a":}')],
    "regex": [("[a-c]{2}-[0-9]+", "ad"), ("[a-c]{2}-[0-9]+", "ab-")],
    "choice": [(["yes", "no", "maybe so"], "ye"), (["yes", "no", "maybe so"], "yess"),
               (["yes", "no", "maybe so"], "x")],
    "grammar": [('root ::= "(" root ")" | "x"', "(()"), ('root ::= "(" root ")" | "x"', "((x)")],
}
"""Kind → (constraint, a text that is no document of it, nor ends as one) pairs."""

MALFORMED = {
    "json": {"json": {"type": "frobnicate"}},
    "grammar": {"grammar": "root ::= ("},
}
"""Kind → a constraint no backend can compile (it must be refused by ``check``, not crash)."""


def _params(kind: str, constraint: Any) -> dict[str, Any]:
    return {"json_object": True} if kind == "json_object" else {kind: constraint}


def _text(kind: str, document: Any) -> str:
    return json.dumps(document, separators=(",", ":")) if kind in ("json", "json_object") else document


class GrammarBackendSuite(Suite):
    """Checks one grammar backend directly (a byte-level tokenizer, padded logits) and in a tiny ``LLM``."""

    kind = "grammar_backends"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None) -> None:
        super().__init__(name, plugins=plugins, plugin=plugin)
        self._state: dict[str, Any] = {}

    # -- set-up (once per suite) -------------------------------------------------------------

    def backend_class(self) -> type:
        """The backend class under test (the chosen plugin's, else the one the kernel would use)."""
        return self.plugins.registry.get_class(self.kind, self.name, self.provider())

    def _backend(self) -> Any:
        if "backend" not in self._state:
            # kernel internal: what the engine passes a backend
            from modelrunner.structured_output import GrammarContext
            from .models import byte_tokenizer

            cls = self.backend_class()
            reason = cls.unavailable_reason()
            if reason is not None:
                raise NotApplicable(f"{self.name!r} cannot run here: {reason}")
            tokenizer = byte_tokenizer()
            self._state["tokenizer"] = tokenizer
            self._state["vocab"] = len(tokenizer) + PADDING
            self._state["backend"] = cls(GrammarContext(tokenizer, self._state["vocab"],
                                                        frozenset({tokenizer.eos_token_id})))
        return self._state["backend"]

    @property
    def vocab(self) -> int:
        """Logits width (the tokenizer's vocabulary plus :data:`PADDING`)."""
        self._backend()
        return self._state["vocab"]

    @property
    def eos(self) -> int:
        """The tokenizer's EOS id."""
        self._backend()
        return self._state["tokenizer"].eos_token_id

    def _spec(self, **params: Any) -> Any:
        from modelrunner import StructuredOutputsParams
        from modelrunner.api import GrammarSpec

        return GrammarSpec.of(StructuredOutputsParams(**params))

    def _compiled(self, kind: str, constraint: Any) -> Any:
        key = (kind, json.dumps(constraint))
        cache = self._state.setdefault("compiled", {})
        if key not in cache:
            spec = self._spec(**_params(kind, constraint))
            self._backend().check(spec)
            cache[key] = self._backend().compile(spec)
        return cache[key]

    def _allowed(self, matcher: Any) -> torch.Tensor:
        # kernel internal: the engine's bitmask layout
        from modelrunner.structured_output import allocate_bitmask, bitmask_to_bool

        bitmask = allocate_bitmask(1, self.vocab)
        self._backend().fill_bitmasks([matcher], bitmask, [0])
        return bitmask_to_bool(bitmask, self.vocab)[0]

    def _tokens(self, text: str) -> list[int]:
        self._backend()
        return self._state["tokenizer"].encode(text, add_special_tokens=False)

    def _supports(self, kind: str) -> None:
        if kind not in self._backend().constraints:
            raise NotApplicable(f"{self.name!r} does not declare {kind} among its constraints")

    def _check_padding(self, allowed: torch.Tensor, where: str) -> None:
        padded = allowed[self.vocab - PADDING:]
        expect(not bool(padded.any()), f"{where}: the mask allows ids past the tokenizer's vocabulary "
                                       f"({(padded.nonzero().flatten() + self.vocab - PADDING).tolist()})")

    # -- checks ------------------------------------------------------------------------------

    def check_valid(self, kind: str) -> str:
        """Each valid document of ``kind`` walks through the mask to EOS, and the matcher terminates."""
        self._supports(kind)
        backend = self._backend()
        for constraint, document in VALID[kind]:
            text = _text(kind, document)
            matcher = backend.matcher(self._compiled(kind, constraint))
            for i, token in enumerate(self._tokens(text)):
                allowed = self._allowed(matcher)
                self._check_padding(allowed, f"{text!r} at token {i}")
                expect(bool(allowed[token]), f"{kind} {constraint!r}: the mask refuses token {i} ({token}) of the "
                                             f"valid document {text!r}")
                expect(i == 0 or not bool(allowed[self.eos]) or kind in ("regex", "grammar", "choice"),
                       f"{kind}: EOS allowed in the middle of {text!r} (token {i})")
                expect(matcher.accept_tokens([token]) is True,
                       f"{kind} {constraint!r}: accept_tokens refused token {i} of {text!r}, which its mask allowed")
            allowed = self._allowed(matcher)
            expect(bool(allowed[self.eos]), f"{kind} {constraint!r}: EOS is not allowed after the complete "
                                            f"document {text!r}")
            expect(matcher.accept_tokens([self.eos]) is True, f"{kind}: accept_tokens refused EOS after {text!r}")
            expect(matcher.is_terminated() is True, f"{kind}: not terminated after {text!r} and EOS")
        return f"{len(VALID[kind])} document(s) accepted"

    def check_invalid(self, kind: str) -> str:
        """Each invalid text of ``kind`` is refused by the mask before it ends (or EOS is refused after
        it), and ``accept_tokens`` refuses the token the mask refused."""
        self._supports(kind)
        backend = self._backend()
        for constraint, text in INVALID[kind]:
            matcher = backend.matcher(self._compiled(kind, constraint))
            refused = None
            for i, token in enumerate(self._tokens(text)):
                if not bool(self._allowed(matcher)[token]):
                    refused = (i, token)
                    break
                expect(matcher.accept_tokens([token]) is True, f"{kind}: accept_tokens refused token {i} of "
                                                               f"{text!r}, which its mask allowed")
            if refused is None:
                expect(not bool(self._allowed(matcher)[self.eos]),
                       f"{kind} {constraint!r}: every token of the invalid {text!r} passed and EOS is allowed after it")
                continue
            expect(matcher.accept_tokens([refused[1]]) is False,
                   f"{kind} {constraint!r}: the mask refused token {refused[0]} of {text!r} but accept_tokens took it")
        return f"{len(INVALID[kind])} text(s) refused"

    def check_eos_only_when_complete(self) -> str:
        """EOS is not allowed before anything was generated where the constraint needs text."""
        backend = self._backend()
        kinds = [k for k in ("json", "json_object", "choice", "regex") if k in backend.constraints]
        if not kinds:
            raise NotApplicable(f"{self.name!r} declares none of json, json_object, choice, regex")
        for kind in kinds:
            constraint = VALID[kind][0][0]
            allowed = self._allowed(backend.matcher(self._compiled(kind, constraint)))
            expect(not bool(allowed[self.eos]), f"{kind} {constraint!r}: EOS allowed before any text")
            expect(bool(allowed.any()), f"{kind} {constraint!r}: the first mask allows nothing")
        return f"checked {', '.join(kinds)}"

    def _walkable(self) -> tuple[str, Any, list[int]]:
        backend = self._backend()
        for kind in ("json", "json_object", "regex", "grammar", "choice"):
            if kind in backend.constraints:
                constraint, document = VALID[kind][-1 if kind == "choice" else 0]
                return kind, constraint, self._tokens(_text(kind, document))
        raise NotApplicable(f"{self.name!r} declares no constraint kind the suite knows")

    def check_rollback(self) -> str:
        """After accepting tokens and rolling back, the mask is the one at that earlier point, and the
        document completes from there."""
        backend = self._backend()
        kind, constraint, tokens = self._walkable()
        expect(len(tokens) >= 3, f"the suite's {kind} document is too short to roll back ({tokens})")
        matcher = backend.matcher(self._compiled(kind, constraint))
        at = len(tokens) - 2
        expect(matcher.accept_tokens(tokens[:at]) is True, f"{kind}: accept_tokens refused a valid prefix")
        before = self._allowed(matcher)
        expect(matcher.accept_tokens(tokens[at:]) is True, f"{kind}: accept_tokens refused the valid rest")
        matcher.rollback(len(tokens) - at)
        after = self._allowed(matcher)
        expect(torch.equal(before, after), f"{kind}: after rollback({len(tokens) - at}) the mask differs from the one "
                                           "at that point")
        expect(matcher.accept_tokens(tokens[at:]) is True, f"{kind}: the rest was refused after the rollback")
        expect(matcher.accept_tokens([self.eos]) is True and matcher.is_terminated() is True,
               f"{kind}: EOS not accepted, or not terminated, after the rollback and the rest")
        return f"rolled back {len(tokens) - at} tokens of {kind}"

    def check_batch_fill(self) -> str:
        """``fill_bitmasks`` over several matchers at different points writes each into its row (rows
        given out of order) exactly as filling them one by one, and leaves the other rows alone."""
        from modelrunner.structured_output import allocate_bitmask  # kernel internal: the engine's bitmask layout

        backend = self._backend()
        kind, constraint, tokens = self._walkable()
        compiled = self._compiled(kind, constraint)
        matchers = []
        for n in range(min(len(tokens), 5)):
            matcher = backend.matcher(compiled)
            expect(matcher.accept_tokens(tokens[:n]) is True, f"{kind}: accept_tokens refused a valid prefix")
            matchers.append(matcher)
        rows = [2 * i + 1 for i in range(len(matchers))][::-1]
        bitmask = allocate_bitmask(2 * len(matchers) + 1, self.vocab).fill_(0x55)
        backend.fill_bitmasks(matchers, bitmask, rows)
        for matcher, row in zip(matchers, rows):
            alone = allocate_bitmask(1, self.vocab)
            matcher.fill_bitmask(alone, 0)
            expect(torch.equal(bitmask[row], alone[0]), f"{kind}: row {row} of the batched fill differs from "
                                                         "the matcher's own fill")
        untouched = [r for r in range(bitmask.shape[0]) if r not in rows]
        expect(bool((bitmask[untouched] == 0x55).all()), "fill_bitmasks wrote rows it was not given")
        return f"{len(matchers)} matchers"

    def check_apply_bitmask(self) -> str:
        """``apply_bitmask`` (the backend's own kernel, where it overrides the kernel's) masks exactly what
        :func:`~modelrunner.structured_output.apply_bitmask` masks: the given rows (out of order) of
        float32 and bfloat16 logits, with bitmasks filled by the backend and by hand; other rows kept."""
        from modelrunner.api import apply_bitmask, bitmask_from_allowed
        from modelrunner.structured_output import allocate_bitmask  # kernel internal: the engine's bitmask layout

        backend = self._backend()
        kind, constraint, _ = self._walkable()
        matcher = backend.matcher(self._compiled(kind, constraint))
        bitmask = allocate_bitmask(4, self.vocab)
        matcher.fill_bitmask(bitmask, 0)
        bitmask[1] = bitmask_from_allowed([0, self.vocab - 1], self.vocab)
        bitmask[3] = bitmask_from_allowed(range(0, self.vocab, 3), self.vocab)
        rows = [3, 0, 1]
        generator = torch.Generator().manual_seed(0)
        for dtype in (torch.float32, torch.bfloat16):
            logits = torch.randn(4, self.vocab, generator=generator).to(dtype)
            want = logits.clone()
            apply_bitmask(want, bitmask, rows)
            backend.apply_bitmask(logits, bitmask, rows)
            expect(torch.equal(logits, want), f"apply_bitmask on {dtype} logits differs from the kernel's "
                                              "modelrunner.structured_output.apply_bitmask")
        return f"{len(rows)} of 4 rows, float32 and bfloat16"

    def check_refusals(self) -> str:
        """Kinds not declared, the backend's ``unsupported_examples`` and malformed constraints raise
        :class:`~modelrunner.errors.StructuredOutputError` naming the feature and the backend."""
        from modelrunner.api import StructuredOutputError

        backend = self._backend()
        cases = [(f"undeclared kind {k}", _params(k, VALID[k][0][0]), k) for k in VALID if k not in backend.constraints]
        cases += [(f"unsupported example {e!r}", e, None) for e in backend.unsupported_examples]
        cases += [(f"malformed {k}", m, None) for k, m in MALFORMED.items() if k in backend.constraints]
        for what, params, feature in cases:
            try:
                spec = self._spec(**params)
            except StructuredOutputError:
                continue  # refused before any backend saw it
            try:
                backend.check(spec)
                backend.compile(spec)
            except StructuredOutputError as e:
                expect(bool(e.feature) and e.feature in str(e), f"{what}: the error does not name its feature: {e}")
                expect(e.backend == backend.name and repr(backend.name) in str(e),
                       f"{what}: the error does not name the backend: {e}")
                if feature is not None:
                    expect(e.feature == feature, f"{what}: feature {e.feature!r}, expected {feature!r}")
                continue
            except Exception as e:  # noqa: BLE001 - the point of the check
                raise ConformanceError(f"{what}: raised {type(e).__name__} ({e}), not StructuredOutputError") from e
            raise ConformanceError(f"{what}: accepted (check and compile raised nothing)")
        return f"{len(cases)} refused"

    def _llm(self) -> Any:
        if "llm" not in self._state:
            from transformers import LlamaConfig

            from .models import MAX_POSITION, byte_tokenizer, make_llm, tiny_checkpoint

            tokenizer = byte_tokenizer()
            config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=len(tokenizer) + PADDING,
                                 max_position_embeddings=MAX_POSITION, bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                                 tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
            self._state["dir"] = tempfile.TemporaryDirectory(prefix="modelrunner-conformance-")
            path = tiny_checkpoint(config, self._state["dir"].name)
            tokenizer.save_pretrained(str(path))
            self._state["llm"] = make_llm(path, plugins=self.plugins, dtype="float32", device="cpu",
                                          kv_cache_memory=8 * 2**20, compile=False,
                                          structured_outputs_config={"backend": f"{self.provider()}:{self.name}"})
        return self._state["llm"]

    def check_engine(self) -> str:
        """In a tiny ``LLM`` configured with this backend: constrained requests (choice; a small JSON
        schema where declared) beside a free one, greedy and sampled, finish with ``stop`` inside their
        constraint, and the free request generates what it does alone."""
        from modelrunner import SamplingParams

        backend_cls = self.backend_class()
        if backend_cls.unavailable_reason() is not None:
            raise NotApplicable(f"{self.name!r} cannot run here: {backend_cls.unavailable_reason()}")
        llm = self._llm()
        choices = ["yes", "no", "maybe so"]
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                  "additionalProperties": False}
        free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        alone = llm.generate("free", free, use_tqdm=False)[0].outputs[0].token_ids
        done = 0
        for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=7)):
            prompts, params = ["pick:", "free"], [SamplingParams(max_tokens=24, structured_outputs={"choice": choices},
                                                                 **sampling), free]
            if "json" in backend_cls.constraints:
                prompts.append("json:")
                params.append(SamplingParams(max_tokens=40, **sampling, structured_outputs={
                    "json": schema, "disable_any_whitespace": True}))
            outs = llm.generate(prompts, params, use_tqdm=False)
            choice = outs[0].outputs[0]
            expect(choice.finish_reason == "stop" and choice.text in choices,
                   f"{sampling}: the choice request gave {choice.text!r} ({choice.finish_reason}), not one of {choices}")
            expect(list(outs[1].outputs[0].token_ids) == list(alone),
                   f"{sampling}: the free request generated {list(outs[1].outputs[0].token_ids)} beside constrained "
                   f"ones, {list(alone)} alone")
            if len(outs) > 2:
                out = outs[2].outputs[0]
                expect(out.finish_reason == "stop", f"{sampling}: the json request ended with {out.finish_reason!r} "
                                                    f"after {out.text!r}")
                try:
                    value = json.loads(out.text)
                except ValueError as e:
                    raise ConformanceError(f"{sampling}: the json request gave {out.text!r}, not JSON ({e})") from e
                expect(isinstance(value, dict) and set(value) == {"ok"} and isinstance(value["ok"], bool),
                       f"{sampling}: {out.text!r} does not match {schema}")
            done += len(outs) - 1
        return f"{done} constrained completions valid"

    def checks(self) -> list[Check]:
        """Per kind valid and invalid documents; EOS, rollback, batched fill, masking, refusals; the engine."""
        out: list[Check] = []
        for kind in VALID:
            out.append(Check(f"{kind}/valid", lambda kind=kind: self.check_valid(kind)))
            out.append(Check(f"{kind}/invalid", lambda kind=kind: self.check_invalid(kind)))
        out += [Check("eos-only-when-complete", self.check_eos_only_when_complete),
                Check("rollback", self.check_rollback),
                Check("batch-fill", self.check_batch_fill),
                Check("apply-bitmask", self.check_apply_bitmask),
                Check("refusals", self.check_refusals),
                Check("engine", self.check_engine)]
        return out


__all__ = ["INVALID", "MALFORMED", "OBJECT", "PADDING", "VALID", "GrammarBackendSuite"]
