"""Structured outputs: a request's constraint on what it may generate (vLLM's ``StructuredOutputsParams``).

``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`` makes every token of the
completion keep the text a prefix of a document the constraint accepts; the completion ends with
``finish_reason="stop"`` once the constraint is complete. Exactly one kind is given: ``json`` (a JSON
schema), ``regex``, ``choice`` (one of a list of strings), ``grammar`` (GBNF / EBNF, ``root ::= ...``)
or ``json_object=True`` (any JSON object). The parameters are checked here, when they are built;
whether the configured grammar backend supports every feature of a schema is checked when the
request is added (:class:`~modelrunner.errors.StructuredOutputError` either way).
"""

from __future__ import annotations

import json as _json
import re
import warnings
from typing import Any

import attrs

from ..errors import StructuredOutputError
from ..wire import register as _wire_type

CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The constraint kinds a request may give (exactly one)."""


def _schema(value: Any) -> Any:
    # A pydantic model class stands for its JSON schema (as vLLM's server does for `response_format`).
    schema = getattr(value, "model_json_schema", None)
    if isinstance(value, type) and callable(schema):
        return schema()
    return value


def _choices(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _fail(field: str, message: str) -> StructuredOutputError:
    return StructuredOutputError(f"structured_outputs.{field} {message}", feature=field)


def check_regex(field: str, pattern: Any) -> None:
    """Raise :class:`StructuredOutputError` naming ``field`` unless ``pattern`` is a non-empty string
    that compiles as a regular expression."""
    if not isinstance(pattern, str) or not pattern:
        raise _fail(field, f"must be a non-empty regular expression string, got {pattern!r}")
    try:
        re.compile(pattern)
    except re.error as e:
        raise _fail(field, f"{pattern!r} is not a valid regular expression: {e}") from None


@_wire_type
@attrs.frozen(kw_only=True)
class StructuredOutputsParams:
    """One request's output constraint: exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object`` (vLLM's names). Checked when built; :class:`~modelrunner.errors.StructuredOutputError`
    (a ``ValueError``) names what is wrong."""

    json: dict[str, Any] | str | None = attrs.field(default=None, converter=_schema)
    """A JSON schema (a dict, a string holding one, or a pydantic model class): the output is one JSON
    document valid against it."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices)
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A context-free grammar in GBNF / EBNF (``root ::= "yes" | "no"``); ``guidance`` also reads Lark."""
    json_object: bool | None = None
    """True: the output is any JSON object (OpenAI's ``response_format={"type": "json_object"}``)."""
    whitespace_pattern: str | None = None
    """With ``json`` / ``json_object``: a regex for the whitespace allowed between JSON tokens (default:
    any JSON whitespace). Only the ``guidance`` backend honours it; ``auto`` picks guidance for it."""
    disable_any_whitespace: bool = False
    """With ``json`` / ``json_object``: no whitespace between JSON tokens (compact documents; a small
    model cannot wander into endless newlines)."""

    def __attrs_post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """The constraint kind given (one of :data:`CONSTRAINT_KINDS`)."""
        return next(k for k in CONSTRAINT_KINDS if self._is_set(k))

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return bool(value) if kind == "json_object" else value is not None

    def validate(self) -> StructuredOutputsParams:
        """Check the constraint; returns ``self``.

        :raises StructuredOutputError: none or several kinds given, a schema that is not a JSON
            object, an invalid regex, an empty or non-string choice list, an empty grammar.
        """
        given = [k for k in CONSTRAINT_KINDS if self._is_set(k)]
        if len(given) != 1:
            what = f"several are given ({', '.join(given)})" if given else "none is given"
            raise StructuredOutputError(f"structured_outputs needs exactly one constraint of {', '.join(CONSTRAINT_KINDS)}"
                                        f"; {what}", feature="structured_outputs")
        if self.json is not None:
            self.schema()
        if self.regex is not None:
            check_regex("regex", self.regex)
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not self.choice:
                raise _fail("choice", f"must be a non-empty list of strings, got {self.choice!r}")
            bad = next((c for c in self.choice if not isinstance(c, str) or not c), None)
            if bad is not None:
                raise _fail("choice", f"entries must be non-empty strings, got {bad!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise _fail("grammar", f"must be a non-empty grammar string (GBNF: root ::= ...), got {self.grammar!r}")
        if self.json_object not in (None, True, False):
            raise _fail("json_object", f"must be True, False or None, got {self.json_object!r}")
        if self.whitespace_pattern is not None:
            if given[0] not in ("json", "json_object"):
                raise _fail("whitespace_pattern", f"applies to json and json_object only, not to {given[0]}")
            check_regex("whitespace_pattern", self.whitespace_pattern)
        if not isinstance(self.disable_any_whitespace, bool):
            raise _fail("disable_any_whitespace", f"must be True or False, got {self.disable_any_whitespace!r}")
        return self

    def schema(self) -> dict[str, Any]:
        """The JSON schema of a ``json`` constraint, as a dict.

        :raises StructuredOutputError: ``json`` is not a dict or a string holding a JSON object.
        """
        value = self.json
        if isinstance(value, str):
            try:
                value = _json.loads(value)
            except ValueError as e:
                raise _fail("json", f"is not valid JSON ({e}); give a JSON schema as a dict or a JSON string") from None
        if not isinstance(value, dict):
            raise _fail("json", f"must be a JSON schema: a dict, or a string holding a JSON object; got {value!r:.120}")
        return value


@_wire_type
@attrs.frozen(kw_only=True)
class GuidedDecodingParams(StructuredOutputsParams):
    """Deprecated: vLLM's older name of :class:`StructuredOutputsParams` (building one warns)."""

    backend: str | None = None
    """The grammar backend for this request alone (vLLM 0.x); None: the engine's configured one."""

    def __attrs_post_init__(self) -> None:
        warnings.warn("GuidedDecodingParams is deprecated; use StructuredOutputsParams (same fields) with "
                      "SamplingParams(structured_outputs=...)", DeprecationWarning, stacklevel=3)
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            raise _fail("backend", f"must be a grammar backend name or None, got {self.backend!r}")
        super().__attrs_post_init__()


def as_structured_outputs(value: Any) -> Any:
    """``value`` itself, or a :class:`StructuredOutputsParams` built from a dict of its fields."""
    if isinstance(value, dict):
        known = {f.name for f in attrs.fields(StructuredOutputsParams)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise StructuredOutputError(f"unknown structured_outputs field(s) {unknown}; known: {', '.join(sorted(known))}",
                                        feature=unknown[0])
        return StructuredOutputsParams(**value)
    return value


__all__ = ["CONSTRAINT_KINDS", "GuidedDecodingParams", "StructuredOutputsParams", "as_structured_outputs",
           "check_regex"]
