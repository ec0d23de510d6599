"""Constraints no grammar backend can honour are refused before any token is generated (issue 52
item 5, issue 53 item 5): a ``$ref`` outside the schema (never fetched), one that does not resolve,
a schema no finite document satisfies (a ``$ref`` cycle with no way out, a required property that
contains itself, ``const`` against ``type``, ``anyOf: []``), and a regex or grammar that matches no
text. Each backend refuses them with :data:`MATCHES_NOTHING` or :data:`REMOTE_REF`; schemas that do
have documents (recursive ones included) still compile."""

from __future__ import annotations

import json

import pytest

from modelrunner import StructuredOutputError
from modelrunner.structured_output.backend import GrammarContext, GrammarSpec
from modelrunner.structured_output.backend_schema import MATCHES_NOTHING, REMOTE_REF, schema_problem
from modelrunner_grammar_llguidance import GuidanceBackend
from modelrunner_grammar_xgrammar import XGrammarBackend

NODE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
        "required": ["kids"]}

UNSATISFIABLE = [
    ({"$ref": "#"}, "$ref '#'"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, "#/$defs/a"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "#/properties/a"),
    ({"type": "string", "const": 5}, "const 5 is not of type 'string'"),
    ({"anyOf": []}, "#/anyOf is an empty list"),
    ({"type": "object", "properties": {"a": {"oneOf": []}}, "required": ["a"]}, "#/properties/a/oneOf"),
    ({"type": "string", "enum": [1, 2]}, "no value of enum"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength (5) is greater than maxLength (2)"),
    ({"type": "integer", "minimum": 1.2, "maximum": 1.8}, "no integer"),
    ({"type": "array", "minItems": 1, "items": False}, "schema false"),
    ({"type": "object", "required": ["z"], "properties": {"a": {}}, "additionalProperties": False}, "'z'"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/Missing"}}}, "does not resolve"),
]
HONOURABLE = [
    {"$defs": {"Node": NODE}, "$ref": "#/$defs/Node"},  # a tree: recursion with a way out
    {"type": "object", "properties": {"a": {"$ref": "#"}}},
    {"type": ["string", "null"], "const": None},
    {"type": "number", "const": 2},
    {"type": "integer", "exclusiveMinimum": 1, "maximum": 2},
    {"type": "object", "properties": {"p": {"$ref": "#/$defs/a~1b/properties/q"}},
     "$defs": {"a/b": {"type": "object", "properties": {"q": {"type": "integer"}}}}},
]


@pytest.mark.parametrize("schema, named", UNSATISFIABLE,
                         ids=lambda v: json.dumps(v)[:40] if isinstance(v, dict) else "")
def test_schemas_no_document_satisfies_are_named_with_their_place(schema, named):
    feature, message = schema_problem(schema)
    assert feature == MATCHES_NOTHING and named in message, message


@pytest.mark.parametrize("ref", ["http://example.com/s.json", "file:///etc/passwd", "other.json#/a", "#anchor"])
def test_refs_outside_the_schema_are_refused_never_fetched(ref):
    feature, message = schema_problem({"type": "object", "properties": {"a": {"$ref": ref}}})
    assert feature == REMOTE_REF and ref in message and "never fetched" in message


@pytest.mark.parametrize("schema", HONOURABLE, ids=lambda v: json.dumps(v)[:40])
def test_schemas_with_documents_pass(schema):
    assert schema_problem(schema) is None


@pytest.fixture(scope="module")
def backends(smollm2_tokenizer):
    tok = smollm2_tokenizer
    context = GrammarContext(tok, len(tok), frozenset([tok.eos_token_id]))
    return {"xgrammar": XGrammarBackend(context), "guidance": GuidanceBackend(context)}


def _refusal(backend, spec: GrammarSpec) -> StructuredOutputError:
    with pytest.raises(StructuredOutputError) as info:
        backend.check(spec)
        backend.compile(spec)
    return info.value


@pytest.mark.parametrize("name", ["xgrammar", "guidance"])
def test_every_backend_refuses_them_before_compiling(backends, name):
    backend = backends[name]
    for schema, _ in UNSATISFIABLE[:5]:
        assert _refusal(backend, GrammarSpec("json", json.dumps(schema))).feature == MATCHES_NOTHING
    remote = {"type": "object", "properties": {"a": {"$ref": "http://example.com/s.json"}}}
    assert _refusal(backend, GrammarSpec("json", json.dumps(remote))).feature == REMOTE_REF
    assert _refusal(backend, GrammarSpec("regex", r"a[^\s\S]")).feature == MATCHES_NOTHING
    for schema in HONOURABLE[:2]:
        spec = GrammarSpec("json", json.dumps(schema))
        backend.check(spec)
        backend.compile(spec)


def test_xgrammar_refuses_a_regex_or_grammar_whose_language_is_empty(backends):
    backend = backends["xgrammar"]
    for kind, value in [("grammar", 'root ::= a\na ::= "x" a'), ("regex", r"[^\x00-\U0010FFFF]"),
                        ("json", json.dumps({"type": "string", "pattern": r"[^\s\S]"})),
                        ("json", json.dumps({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}))]:
        error = _refusal(backend, GrammarSpec(kind, value))
        assert error.feature == MATCHES_NOTHING and "matches no text" in str(error), str(error)
    for kind, value in [("grammar", 'root ::= a\na ::= "x" a | "y"'), ("regex", "a{0}"), ("regex", r"\d\D")]:
        backend.check(GrammarSpec(kind, value))
        backend.compile(GrammarSpec(kind, value))
