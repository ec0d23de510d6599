"""Structured-output parameters and configuration, without a model: vLLM's names, eager validation with
errors that name the bad value, the deprecated spellings, the grammar backends as a plugin kind."""

from __future__ import annotations

import warnings

import pytest

import modelrunner
from modelrunner import SamplingParams, StructuredOutputError
from modelrunner.config import RunnerConfig, StructuredOutputsConfig
from modelrunner.plugins import get_plugins
from modelrunner.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from modelrunner.structured_output import GrammarSpec, allowed_token_ids, bitmask_from_allowed, bitmask_to_bool
from modelrunner_grammar_xgrammar.backend import unsupported_keyword

from plugin_dists import listed, run_cli


def test_vllm_import_paths():
    assert modelrunner.StructuredOutputsParams is StructuredOutputsParams
    assert modelrunner.GuidedDecodingParams is GuidedDecodingParams
    from modelrunner.sampling_params import SamplingParams as from_module

    assert from_module is SamplingParams


@pytest.mark.parametrize("params", [dict(json={"type": "object"}), dict(json='{"type": "integer"}'),
                                    dict(regex="[a-z]+"), dict(choice=["a", "b"]), dict(grammar='root ::= "x"'),
                                    dict(json_object=True),
                                    dict(json={"type": "object"}, whitespace_pattern=r"[ ]?")])
def test_each_constraint_kind_is_accepted(params):
    so = StructuredOutputsParams(**params)
    assert so.kind == next(iter(params))
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    assert SamplingParams(structured_outputs=params).structured_outputs == so  # a dict of its fields


@pytest.mark.parametrize("params, message", [
    (dict(), r"exactly one constraint of json, regex, choice, grammar, json_object; none is given"),
    (dict(json={"type": "object"}, regex="a"), r"several are given \(json, regex\)"),
    (dict(json=[1, 2]), r"structured_outputs.json must be a JSON schema: a dict.*got \[1, 2\]"),
    (dict(json="{not json"), r"structured_outputs.json is not valid JSON"),
    (dict(regex="a(b"), r"structured_outputs.regex 'a\(b' is not a valid regular expression"),
    (dict(regex=""), r"structured_outputs.regex must be a non-empty regular expression"),
    (dict(choice=[]), r"structured_outputs.choice must be a non-empty list of strings"),
    (dict(choice=["a", 3]), r"structured_outputs.choice entries must be non-empty strings, got 3"),
    (dict(grammar="  "), r"structured_outputs.grammar must be a non-empty grammar"),
    (dict(regex="a", whitespace_pattern=" "), r"whitespace_pattern applies to json and json_object only"),
    (dict(json_object=True, whitespace_pattern="("), r"whitespace_pattern '\(' is not a valid regular expression"),
])
def test_bad_parameters_are_refused_eagerly_naming_them(params, message):
    with pytest.raises(StructuredOutputError, match=message) as info:
        StructuredOutputsParams(**params)
    assert isinstance(info.value, ValueError)  # a server's 400


def test_unknown_dict_fields_and_wrong_types_are_refused():
    with pytest.raises(StructuredOutputError, match=r"unknown structured_outputs field\(s\) \['jsn'\]; known: "):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match=r"structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")


def test_a_pydantic_model_stands_for_its_schema():
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str
        population: int

    assert StructuredOutputsParams(json=City).schema()["required"] == ["name", "population"]


def test_guided_decoding_is_the_deprecated_spelling():
    with pytest.warns(DeprecationWarning, match="GuidedDecodingParams is deprecated"):
        guided = GuidedDecodingParams(choice=["x", "y"])
    with pytest.warns(DeprecationWarning, match=r"guided_decoding=...\) is deprecated; use structured_outputs"):
        sp = SamplingParams(guided_decoding=guided)
    assert sp.structured_outputs is guided and sp.guided_decoding is None
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="both set; keep one"):
        SamplingParams(guided_decoding={"regex": "a"}, structured_outputs={"regex": "b"})


def test_config_takes_vllms_structured_outputs_config_and_the_older_backend_name():
    assert RunnerConfig.from_dict({"structured_outputs_config": {"backend": "guidance"}}).structured_outputs == \
        StructuredOutputsConfig(backend="guidance")
    assert RunnerConfig.from_dict({"structured_outputs_backend": "xgrammar"}).structured_outputs.backend == "xgrammar"
    assert RunnerConfig().structured_outputs.backend == "auto"
    with pytest.warns(DeprecationWarning, match="guided_decoding_backend is deprecated"):
        config = RunnerConfig.from_dict({"guided_decoding_backend": "guidance"})
    assert config.structured_outputs.backend == "guidance"
    with pytest.raises(ValueError, match=r"unknown structured_outputs_config key 'backnd'; did you mean 'backend'\?"):
        RunnerConfig.from_dict({"structured_outputs_config": {"backnd": "xgrammar"}})
    with pytest.raises(ValueError, match=r"structured_outputs_backend must be a non-empty string, got ''"):
        RunnerConfig.from_dict({"structured_outputs_config": {"backend": ""}})


def test_grammar_backends_are_a_plugin_kind_listed_by_the_cli():
    # Each backend is a distribution of its own; the kernel ships none.
    plugins = listed(run_cli("plugins", "--json"))
    assert plugins["grammar-xgrammar"]["provides"] == {"grammar_backends": ["xgrammar"]}
    assert plugins["grammar-xgrammar"]["distribution"] == "modelrunner-grammar-xgrammar"
    assert plugins["grammar-llguidance"]["provides"] == {"grammar_backends": ["guidance"]}
    assert plugins["grammar-llguidance"]["distribution"] == "modelrunner-grammar-llguidance"
    assert not any("grammar_backends" in p["provides"] for p in plugins.values() if p["distribution"] == "modelrunner")
    registry = get_plugins().registry
    assert registry.capabilities("grammar_backends", "xgrammar", "grammar-xgrammar") == {
        "constraints": ("json", "json_object", "regex", "choice", "grammar"), "auto_order": 10}
    assert registry.capabilities("grammar_backends", "guidance", "grammar-llguidance")["auto_order"] == 20


def test_xgrammar_refuses_keywords_it_would_ignore_wherever_they_are():
    schema = {"type": "object", "properties": {"not": {"type": "integer"},  # a property named like a keyword
                                               "tags": {"type": "array", "items": {"type": "string"}}}}
    assert unsupported_keyword(schema) is None
    schema["properties"]["tags"]["uniqueItems"] = True
    assert unsupported_keyword(schema) == ("uniqueItems", "#/properties/tags")
    assert unsupported_keyword({"anyOf": [{"type": "integer"}, {"not": {"const": 1}}]}) == ("not", "#/anyOf/1")
    assert unsupported_keyword({"allOf": [{"type": "integer"}, {"minimum": 1}]}) == ("allOf", "#")


def test_spec_keys_keep_schema_order_and_whitespace_choice():
    a = GrammarSpec.of(StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}}))
    b = GrammarSpec.of(StructuredOutputsParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}'))
    assert a == b and a.value.index('"b"') < a.value.index('"a"')
    compact = GrammarSpec.of(StructuredOutputsParams(json_object=True, disable_any_whitespace=True))
    assert compact.any_whitespace is False
    assert GrammarSpec.of(StructuredOutputsParams(json_object=True), any_whitespace=False).any_whitespace is False


def test_bitmask_helpers_round_trip():
    allowed = [0, 1, 31, 32, 63, 64, 99]
    row = bitmask_from_allowed(allowed, 100)
    assert row.dtype.is_signed and row.shape == (4,)
    assert allowed_token_ids(row, 100) == allowed
    assert bitmask_to_bool(row.reshape(1, -1), 100)[0].sum() == len(allowed)


def test_no_warnings_for_the_current_spelling():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"])).clone()


def test_applying_a_bitmask_masks_exactly_the_listed_rows():
    import torch

    from modelrunner.structured_output import GrammarContext, apply_bitmask
    from modelrunner_grammar_llguidance import GuidanceBackend
    from modelrunner_grammar_xgrammar import XGrammarBackend

    vocab, rows = 100, [0, 2]
    bitmask = torch.stack([bitmask_from_allowed(ids, vocab) for ids in ([1, 50, 99], [7], [0, 31, 32])])
    context = GrammarContext(None, vocab, frozenset())
    # The kernel's torch version, xgrammar's native kernel (its backend's override), the base class's default.
    for name, apply in (("torch", apply_bitmask), ("xgrammar", XGrammarBackend(context).apply_bitmask),
                        ("guidance", GuidanceBackend(context).apply_bitmask)):
        logits = torch.randn(3, vocab)
        want = logits.clone()
        for r in rows:
            keep = bitmask_to_bool(bitmask[r:r + 1], vocab)[0]
            want[r, ~keep] = float("-inf")
        apply(logits, bitmask, rows)
        assert torch.equal(logits, want), name
