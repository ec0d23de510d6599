"""Structured outputs on the real default model (``LLM("smollm2")``, its tokenizer read from the GGUF
file), through each shipped grammar backend chosen by config: bounded JSON schemas, greedy and
sampled, every completion that stops parses and validates; regex, choice and json_object match."""

from __future__ import annotations

import json
import re

import pytest

from modelrunner import LLM, SamplingParams, StructuredOutputsParams

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow


def _object(properties: dict, **extra) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False,
            **extra}


NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SCHEMAS = {
    "person": _object({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "enums": _object({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L"]}}),
    "bounded-array": _object({"fruits": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                         "minItems": 1, "maxItems": 3}}),
    "nested": _object({"user": _object({"id": {"type": "integer", "minimum": 1, "maximum": 1000},
                                        "active": {"type": "boolean"}}),
                       "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2}}),
    "number-bounds": _object({"celsius": {"type": "number", "minimum": -50, "maximum": 50},
                              "unit": {"const": "C"}}),
    "status": _object({"ok": {"type": "boolean"}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}),
    "points": _object({"points": {"type": "array", "minItems": 2, "maxItems": 2,
                                  "items": _object({"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                                    "y": {"type": "integer", "minimum": 0, "maximum": 9}})}}),
    "nullable": _object({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10}, {"type": "null"}]}}),
    "pattern": _object({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "top-level-array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                        "minItems": 2, "maxItems": 4},
    "refs": {"$defs": {"city": _object({"city": {"type": "string", "maxLength": 8},
                                        "country": {"enum": ["FR", "DE", "IT"]}})},
             **_object({"home": {"$ref": "#/$defs/city"}, "work": {"$ref": "#/$defs/city"}})},
    "mixed": _object({"title": {"type": "string", "maxLength": 10}, "year": {"type": "integer", "minimum": 1900,
                                                                              "maximum": 2100},
                      "rating": {"type": "number", "minimum": 0, "maximum": 5}, "genre": {"enum": ["drama", "comedy"]}}),
}
"""Twelve bounded schemas: required fields, enums, consts, arrays with limits, nested objects, number
bounds, anyOf, a pattern, $ref."""


FREE = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
CITIES = ["Paris", "Berlin", "Rome"]
ROOMY = ("person", "nullable")
"""Schemas generated with JSON's free whitespace (the others compact, to keep the test short)."""


def _ask(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Answer in JSON only. {what}"}]


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def batch(request):
    """One batch on the default model, the backend swapped by config (vLLM's ``structured_outputs_config``):
    every schema (even ones greedy, odd ones sampled), a regex, a choice with ``n=2``, a JSON object and
    a free request; and the free request alone."""
    llm = LLM("smollm2", device="cpu", max_model_len=512, kv_cache_memory=64 << 20, compile=False,
              structured_outputs_config={"backend": request.param})  # eager: no decode graphs to record
    alone = llm.chat(_ask("Say hello."), FREE, use_tqdm=False)[0].outputs[0].token_ids
    work: dict[str, tuple[list[dict], SamplingParams]] = {}
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, seed=i)
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=name not in ROOMY)
        work[name] = (_ask(f"Give an example of a {name.replace('-', ' ')} record."),
                      SamplingParams(max_tokens=80, structured_outputs=so, **sampling))
    work["regex"] = (_ask("What is today's date?"),
                     SamplingParams(max_tokens=16, temperature=0.0, structured_outputs={"regex": DATE}))
    work["choice"] = (_ask("Capital of France?"), SamplingParams(max_tokens=8, n=2, temperature=1.0, seed=3,
                                                                 structured_outputs={"choice": CITIES}))
    work["json_object"] = (_ask("Describe a cat."), SamplingParams(
        max_tokens=24, temperature=0.0, structured_outputs={"json_object": True, "disable_any_whitespace": True}))
    work["free"] = (_ask("Say hello."), FREE)
    outs = llm.chat([c for c, _ in work.values()], [p for _, p in work.values()], use_tqdm=False)
    yield llm, dict(zip(work, outs)), alone
    llm.shutdown()


def test_bounded_schemas_give_valid_json_greedy_and_sampled(batch):
    llm, outs, _ = batch
    stopped = 0
    for name, schema in SCHEMAS.items():
        completion = outs[name].outputs[0]
        assert completion.finish_reason in ("stop", "length"), (name, completion)
        if completion.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(completion.text), schema)  # every stopped output parses and validates
    assert stopped >= 0.75 * len(SCHEMAS), f"only {stopped} of {len(SCHEMAS)} finished"
    assert llm.stats()["structured_outputs"]["backends"] == [llm.engine.config.structured_outputs.backend]


def test_regex_and_choice_outputs_match(batch):
    _, outs, _ = batch
    regex = outs["regex"].outputs[0]
    assert regex.finish_reason == "stop" and re.fullmatch(DATE, regex.text), regex
    assert [c.finish_reason for c in outs["choice"].outputs] == ["stop", "stop"]
    assert all(c.text in CITIES for c in outs["choice"].outputs), outs["choice"].outputs


def test_json_object_gives_a_json_object(batch):
    completion = batch[1]["json_object"].outputs[0]
    if completion.finish_reason == "stop":
        assert isinstance(json.loads(completion.text), dict)
    else:  # cut by max_tokens: still a prefix of one
        assert completion.text.startswith("{")


def test_a_free_request_generates_what_it_does_alone(batch):
    _, outs, alone = batch
    assert outs["free"].outputs[0].token_ids == alone
