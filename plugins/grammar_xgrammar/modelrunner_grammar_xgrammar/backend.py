"""The ``xgrammar`` grammar backend (the default): JSON schemas, regexes, choices and GBNF grammars
compiled by xgrammar against the model's tokenizer, masks filled for the whole batch in parallel and
applied to the logits with xgrammar's CPU kernel."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import torch

from modelrunner.api import (MATCHES_NOTHING, GrammarBackend, GrammarMatcher, GrammarSpec, StructuredOutputError,
                             apply_bitmask)

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


# xgrammar's serialized expression kinds (Grammar.serialize_json, format "v18" of xgrammar 0.2): each
# expression is [kind, length, data...].
_BYTES, _CLASS, _CLASS_STAR, _EMPTY, _RULE, _SEQUENCE, _CHOICES, _TAG_DISPATCH, _REPEAT = range(9)
_CODE_POINTS = ((0, 0xD7FF), (0xE000, 0x10FFFF))  # what UTF-8 can encode (surrogates cannot)


class _UnknownFormat(Exception):
    """The serialized grammar is not in the format this module reads."""


def _class_is_empty(negated: bool, bounds: Sequence[int]) -> bool:
    """True when a character class (``bounds``: lo, hi, lo, hi, ...) holds no encodable character."""
    ranges = sorted(zip(bounds[0::2], bounds[1::2]))
    if not negated:
        return not any(lo <= hi and lo <= end and hi >= start for lo, hi in ranges for start, end in _CODE_POINTS)
    for start, end in _CODE_POINTS:  # a negated class is empty when its ranges cover every code point
        reach = start
        for lo, hi in ranges:
            if lo > reach:
                break
            reach = max(reach, hi + 1)
        if reach <= end:
            return False
    return True


def matches_nothing(grammar: Any) -> bool | None:
    """True when an ``xgrammar.Grammar`` accepts no finite text at all (its root rule can never end:
    a regex class that holds no character, a rule that only recurses, a required property that
    contains itself); None where its serialized form is not one this function reads."""
    try:
        data = json.loads(grammar.serialize_json())
        values, starts, rules, root = (data["grammar_expr_data"], data["grammar_expr_indptr"], data["rules"],
                                       data["root_rule_id"])
        bodies = [int(rule[1]) for rule in rules]

        def expression(i: int) -> tuple[int, list[int]]:
            item = values[starts[i]:starts[i + 1] if i + 1 < len(starts) else len(values)]
            if len(item) < 2 or item[1] != len(item) - 2:
                raise _UnknownFormat
            return item[0], item[2:]

        def rules_used(i: int) -> set[int]:
            kind, args = expression(i)
            if kind == _RULE:
                return {args[0]}
            if kind == _REPEAT:
                return {args[0]}
            if kind in (_SEQUENCE, _CHOICES):
                return set().union(*(rules_used(a) for a in args)) if args else set()
            return set()

        def ends(i: int) -> bool:
            kind, args = expression(i)
            if kind in (_BYTES, _CLASS_STAR, _EMPTY, _TAG_DISPATCH):
                return True
            if kind == _CLASS:
                return not _class_is_empty(bool(args[0]), args[1:])
            if kind == _RULE:
                return productive[args[0]]
            if kind == _SEQUENCE:
                return all(ends(a) for a in args)
            if kind == _CHOICES:
                return any(ends(a) for a in args)
            if kind == _REPEAT:
                return args[1] == 0 or productive[args[0]]
            raise _UnknownFormat

        productive = [False] * len(rules)
        users: list[set[int]] = [set() for _ in rules]
        for r, body in enumerate(bodies):
            for used in rules_used(body):
                users[used].add(r)
        pending = list(range(len(rules)))
        while pending:  # a rule turns productive at most once: a worklist, not rounds
            r = pending.pop()
            if not productive[r] and ends(bodies[r]):
                productive[r] = True
                pending.extend(users[r])
        return not productive[root]
    except (_UnknownFormat, ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError):
        return None


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
        return None if importlib.util.find_spec("xgrammar") else \
            "the xgrammar package is not installed (pip install xgrammar)"

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
        """An ``xgrammar.CompiledGrammar``; refuses (:data:`~modelrunner.structured_output.MATCHES_NOTHING`) a
        constraint that no finite text satisfies, which could only fail half-way."""
        compiler = self._compiler_instance()
        try:
            if spec.kind in ("json", "json_object"):
                schema = spec.value if spec.kind == "json" else '{"type": "object"}'
                compiled = compiler.compile_json_schema(schema, any_whitespace=spec.any_whitespace)
            elif spec.kind == "regex":
                compiled = compiler.compile_regex(spec.value)
            elif spec.kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(spec.choices))
            else:
                compiled = compiler.compile_grammar(spec.value)
        except Exception as e:  # noqa: BLE001 - what check() could not see, named
            raise self.unsupported(spec, f"this {spec.kind}", _reason(e)) from None
        if matches_nothing(compiled.grammar):
            raise StructuredOutputError(f"{spec.describe()} matches no text at all: no finite output satisfies it "
                                        f"(grammar backend {self.name!r})", feature=MATCHES_NOTHING,
                                        backend=self.name)
        return compiled

    def compiled_size(self, compiled: Any) -> int:
        """What xgrammar reports the compiled grammar takes in memory (bounds the engine's cache)."""
        return int(compiled.memory_size_bytes)

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

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """xgrammar's native ``apply_token_bitmask_inplace`` for float32 logits on the CPU (1.3-2.5x the
        kernel's torch version); elsewhere the kernel's :func:`~modelrunner.structured_output.apply_bitmask`."""
        native = _native_apply() if logits.device.type == "cpu" and logits.dtype == torch.float32 else None
        if native is None:
            apply_bitmask(logits, bitmask, rows)
        else:
            native(logits, bitmask, vocab_size=logits.shape[1], indices=list(rows))


_NATIVE: list[Any] = []


def _native_apply() -> Any:
    """xgrammar's ``apply_token_bitmask_inplace`` (None where it cannot be imported), looked up once."""
    if not _NATIVE:
        try:
            from xgrammar import apply_token_bitmask_inplace
        except ImportError:
            apply_token_bitmask_inplace = None
        _NATIVE.append(apply_token_bitmask_inplace)
    return _NATIVE[0]


__all__ = ["IGNORED_KEYWORDS", "XGrammarBackend", "XGrammarMatcher", "choice_grammar", "matches_nothing",
           "unsupported_keyword"]
