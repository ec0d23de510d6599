"""The ``xgrammar`` grammar backend (the default): JSON schemas, regexes, choices and GBNF grammars
compiled by xgrammar against the model's tokenizer, masks filled for the whole batch in parallel."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import StructuredOutputError
from .backend import GrammarBackend, GrammarMatcher, GrammarSpec

IGNORED_KEYWORDS = ("uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
                    "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedItems")
"""JSON-schema keywords xgrammar accepts but does not enforce (0.2.x): refused here rather than ignored."""

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMAS = ("items", "additionalProperties", "propertyNames", "contains", "not", "if", "then", "else",
               "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf", "items")


def unsupported_keyword(schema: Any) -> tuple[str, str] | None:
    """``(keyword, where)`` of the first keyword of ``schema`` xgrammar would not enforce (one of
    :data:`IGNORED_KEYWORDS`, or an ``allOf`` of several schemas), or None."""
    def walk(node: Any, where: str) -> tuple[str, str] | None:
        if not isinstance(node, dict):
            return None
        for keyword in IGNORED_KEYWORDS:
            if keyword in node:
                return keyword, where
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return "allOf", where
        for key in _SUBSCHEMA_MAPS:
            for name, sub in (node.get(key) or {}).items() if isinstance(node.get(key), dict) else ():
                found = walk(sub, f"{where}/{key}/{name}")
                if found:
                    return found
        for key in _SUBSCHEMAS:
            if isinstance(node.get(key), dict):
                found = walk(node[key], f"{where}/{key}")
                if found:
                    return found
        for key in _SUBSCHEMA_LISTS:
            if isinstance(node.get(key), list):
                for i, sub in enumerate(node[key]):
                    found = walk(sub, f"{where}/{key}/{i}")
                    if found:
                        return found
        return None

    return walk(schema, "#")


def _reason(error: Exception) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(error).strip().splitlines()[0] if str(error).strip() else "")


def choice_grammar(choices: Sequence[str]) -> str:
    """A GBNF grammar accepting exactly one of ``choices`` (JSON string escapes are GBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class XGrammarMatcher(GrammarMatcher):
    """An ``xgrammar.GrammarMatcher`` (rollback is unlimited in xgrammar 0.2)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        """The xgrammar matcher."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """xgrammar writes the whole row."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_tokens(self, tokens: Sequence[int]) -> bool:
        """Accept each token in turn (False at the first refused one)."""
        return all(self.matcher.accept_token(int(t)) for t in tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens."""
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        """True after the stop token was accepted."""
        return self.matcher.is_terminated()


class XGrammarBackend(GrammarBackend):
    """xgrammar (https://github.com/mlc-ai/xgrammar): the default backend, first in ``auto``.

    Refuses what xgrammar would accept but not enforce (:data:`IGNORED_KEYWORDS`, ``allOf`` of several
    schemas) and ``whitespace_pattern``; ``auto`` sends those to ``guidance``.
    """

    name = "xgrammar"
    auto_order = 10
    unsupported_examples = ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
                            {"regex": "(?=a)b"})
    max_threads = max(1, min(4, os.cpu_count() or 1))
    """Threads xgrammar fills a batch's bitmask rows with (at most the machine's)."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._compiler: Any = None
        self._batch: Any = None

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """None when the xgrammar package is importable."""
        return None if importlib.util.find_spec("xgrammar") else "the xgrammar package is not installed (pip install xgrammar)"

    def check(self, spec: GrammarSpec) -> None:
        """Parse the constraint with xgrammar (no tokenizer work); refuse what it would not enforce."""
        super().check(spec)
        import xgrammar as xgr

        if spec.whitespace_pattern is not None:
            raise self.unsupported(spec, "whitespace_pattern", "use the guidance backend (or auto)")
        try:
            if spec.kind == "json":
                found = unsupported_keyword(spec.schema)
                if found:
                    keyword, where = found
                    raise self.unsupported(spec, f"json schema keyword {keyword!r}",
                                           f"at {where}; xgrammar would not enforce it (guidance does some)")
                xgr.Grammar.from_json_schema(spec.value, any_whitespace=spec.any_whitespace)
            elif spec.kind == "regex":
                xgr.Grammar.from_regex(spec.value)
            elif spec.kind == "choice":
                xgr.Grammar.from_ebnf(choice_grammar(spec.choices))
            elif spec.kind == "grammar":
                xgr.Grammar.from_ebnf(spec.value)
        except StructuredOutputError:
            raise
        except Exception as e:  # noqa: BLE001 - xgrammar reports a parse error as RuntimeError (or others)
            feature = {"json": "this json schema", "regex": "this regex", "choice": "these choices",
                       "grammar": "this grammar"}.get(spec.kind, spec.kind)
            raise self.unsupported(spec, feature, _reason(e)) from None

    def _compiler_instance(self) -> Any:
        with self.lock:
            if self._compiler is None:
                import xgrammar as xgr

                ctx = self.context
                info = xgr.TokenizerInfo.from_huggingface(ctx.tokenizer, vocab_size=ctx.vocab_size,
                                                          stop_token_ids=sorted(ctx.eos_token_ids) or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
            return self._compiler

    def compile(self, spec: GrammarSpec) -> Any:
        """An ``xgrammar.CompiledGrammar``."""
        compiler = self._compiler_instance()
        try:
            if spec.kind in ("json", "json_object"):
                schema = spec.value if spec.kind == "json" else '{"type": "object"}'
                return compiler.compile_json_schema(schema, any_whitespace=spec.any_whitespace)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choices))
            return compiler.compile_grammar(spec.value)
        except Exception as e:  # noqa: BLE001 - what check() could not see, named
            raise self.unsupported(spec, f"this {spec.kind}", _reason(e)) from None

    def matcher(self, compiled: Any) -> XGrammarMatcher:
        """A fresh ``xgrammar.GrammarMatcher``."""
        import xgrammar as xgr

        return XGrammarMatcher(xgr.GrammarMatcher(compiled))

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Every row at once with ``xgrammar.BatchGrammarMatcher`` (threads in C++)."""
        if len(matchers) < 4:
            return super().fill_bitmasks(matchers, bitmask, rows)
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher(self.max_threads)
        self._batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask, list(rows))


__all__ = ["IGNORED_KEYWORDS", "XGrammarBackend", "XGrammarMatcher", "choice_grammar", "unsupported_keyword"]
