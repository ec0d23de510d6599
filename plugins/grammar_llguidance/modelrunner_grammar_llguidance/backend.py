"""The ``guidance`` grammar backend: llguidance (https://github.com/guidance-ai/llguidance), vLLM's
``guidance``. Its JSON-schema compiler refuses the keywords it does not implement, so a refusal is
always explicit; it honours ``whitespace_pattern`` and reads Lark grammars as well as GBNF."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from typing import Any

import torch

from modelrunner.api import MATCHES_NOTHING, GrammarBackend, GrammarMatcher, GrammarSpec, StructuredOutputError


class GuidanceMatcher(GrammarMatcher):
    """An ``llguidance.LLMatcher``.

    :param eos_token_ids: accepted once the grammar is complete (llguidance itself consumes nothing then).
    """

    def __init__(self, matcher: Any, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.matcher = matcher
        """The llguidance matcher."""
        self.eos_token_ids = eos_token_ids
        """The model's EOS tokens."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """llguidance writes the whole row."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Consume the tokens (False, in an error state, at a refused one); once the grammar is complete
        only EOS is accepted (and consumes nothing, as in vLLM)."""
        if self.matcher.is_stopped() and not self.matcher.is_error():
            return all(int(t) in self.eos_token_ids for t in tokens)
        return bool(self.matcher.consume_tokens([int(t) for t in tokens]))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens."""
        if num_tokens and not self.matcher.rollback(num_tokens):
            raise ValueError(f"llguidance cannot roll back {num_tokens} tokens: {self.matcher.get_error()}")

    def is_terminated(self) -> bool:
        """True once nothing but EOS may follow (llguidance's "stopped")."""
        return bool(self.matcher.is_stopped())


def _feature(message: str) -> str:
    keys = re.search(r"Unimplemented keys: \[([^\]]*)\]", message)
    if keys:
        names = [k.strip().strip('"') for k in keys.group(1).split(",") if k.strip()]
        return "json schema keyword " + ", ".join(repr(n) for n in names)
    return ""


class GuidanceBackend(GrammarBackend):
    """llguidance: second in ``auto`` (what xgrammar refuses: ``allOf`` of several schemas,
    ``whitespace_pattern``, Unicode classes in regexes). Refuses JSON-schema keywords it does not
    implement (``uniqueItems``, ``contains``, ``not``, ``if``/``then``, ``propertyNames``, ...)."""

    name = "guidance"
    auto_order = 20
    unsupported_examples = ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
                            {"regex": "(?=a)b"})

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._tokenizer: Any = None
        self._executor: Any = None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the llguidance package is importable."""
        return None if importlib.util.find_spec("llguidance") else \
            "the llguidance package is not installed (pip install llguidance)"

    def grammar_text(self, spec: GrammarSpec) -> str:
        """The llguidance grammar (a JSON string) of ``spec``."""
        from llguidance import LLMatcher, grammar_from

        if spec.kind in ("json", "json_object"):
            options: dict[str, Any] = {"whitespace_flexible": spec.any_whitespace}
            if spec.whitespace_pattern is not None:
                options["whitespace_pattern"] = spec.whitespace_pattern
            return LLMatcher.grammar_from_json_schema(spec.value if spec.kind == "json" else '{"type": "object"}',
                                                      defaults=options)
        if spec.kind == "choice":
            return grammar_from("choice", spec.value)
        return grammar_from(spec.kind, spec.value)

    def check(self, spec: GrammarSpec) -> None:
        """Validate the grammar with llguidance (no tokenizer work)."""
        super().check(spec)
        from llguidance import LLMatcher

        try:
            grammar = self.grammar_text(spec)
        except Exception as e:  # noqa: BLE001 - a GBNF grammar that does not convert, a malformed schema
            raise self.unsupported(spec, f"this {spec.kind}", str(e)) from None
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
        if failed:
            message = " ".join(messages[0].split()) if messages else "invalid"
            raise self.unsupported(spec, _feature(message) or f"this {spec.kind}", message)

    def _ll_tokenizer(self) -> Any:
        with self.lock:
            if self._tokenizer is None:
                import llguidance
                import llguidance.hf

                ctx = self.context
                self._tokenizer = llguidance.hf.from_tokenizer(ctx.tokenizer, n_vocab=ctx.vocab_size,
                                                               eos_token=sorted(ctx.eos_token_ids) or None)
                self._executor = llguidance.LLExecutor()
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> Any:
        """An ``LLMatcher`` at the grammar's start (each sequence gets a deep copy); refuses
        (:data:`~modelrunner.structured_output.MATCHES_NOTHING`) a constraint whose first token llguidance finds
        impossible (a regex class that holds no character, say)."""
        from llguidance import LLMatcher

        tokenizer = self._ll_tokenizer()
        matcher = LLMatcher(tokenizer, self.grammar_text(spec), log_level=0)
        if matcher.is_error():
            message = " ".join(matcher.get_error().split())
            raise self.unsupported(spec, _feature(message) or f"this {spec.kind}", message)
        # The first mask builds llguidance's lexer tables (up to seconds): here, off the step path; the
        # sequences' deep copies share them.
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

        fill_next_token_bitmask(matcher, allocate_token_bitmask(1, self.context.vocab_size), 0)
        if matcher.is_error():  # nothing can even start: the constraint matches no text
            raise StructuredOutputError(f"{spec.describe()} matches no text at all: no output can begin to satisfy it "
                                        f"(grammar backend {self.name!r})", feature=MATCHES_NOTHING,
                                        backend=self.name)
        return matcher

    def matcher(self, compiled: Any) -> GuidanceMatcher:
        """A deep copy of the compiled matcher."""
        return GuidanceMatcher(compiled.deep_copy(), self.context.eos_token_ids)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Every row at once with ``llguidance.LLExecutor`` (threads in Rust)."""
        if len(matchers) < 4 or not bitmask.is_contiguous():
            return super().fill_bitmasks(matchers, bitmask, rows)
        from llguidance.torch import fill_next_token_bitmask_par

        fill_next_token_bitmask_par(self._executor, [(m.matcher, int(r)) for m, r in zip(matchers, rows)], bitmask)


__all__ = ["GuidanceBackend", "GuidanceMatcher"]
