"""``--vary`` parsing, output agreement, noise flags, formatting, and the CLI's usage errors."""

from __future__ import annotations

import argparse
import sys
import types

import pytest
from modelrunner_bench.agreement import token_agreement
from modelrunner_bench.machine import cpu_model, load_average, noise_reasons, versions
from modelrunner_bench.report import format_value
from modelrunner_bench.vary import configurations, label, parse_vary, split_top_level


def test_vary_values_are_parsed_like_set_values():
    vary = parse_vary(["kv_allocator=paged,contiguous", "max_num_seqs=4,8", "compile=true,false"])
    assert vary == [("kv_allocator", ["paged", "contiguous"]), ("max_num_seqs", [4, 8]), ("compile", [True, False])]
    assert len(configurations(vary)) == 8
    assert configurations(vary)[:2] == [{"kv_allocator": "paged", "max_num_seqs": 4, "compile": True},
                                        {"kv_allocator": "paged", "max_num_seqs": 4, "compile": False}]
    assert label(configurations(vary)[0]) == "kv_allocator=paged max_num_seqs=4 compile=true"


def test_json_values_may_hold_commas():
    assert split_top_level('{"a": 1, "b": [2, 3]},{},"x,y"') == ['{"a": 1, "b": [2, 3]}', "{}", '"x,y"']
    assert parse_vary(['compile_options={"a": 1, "b": 2},{}']) == [("compile_options", [{"a": 1, "b": 2}, {}])]


@pytest.mark.parametrize("item,message", [
    ("attention_backend", r"--vary expects KEY=V1,V2\[,...\], got 'attention_backend'"),
    ("=a,b", r"--vary expects KEY=V1,V2"),
    ("kv_allocator=", r"--vary expects KEY=V1,V2"),
    ("kv_alocator=a,b", r"unknown config key 'kv_alocator'; did you mean 'kv_allocator'\?"),
    ("kv_allocator=paged,,contiguous", r"empty value"),
    ("kv_allocator=paged,paged", r"a value is repeated"),
])
def test_a_malformed_vary_names_the_bad_value(item, message):
    with pytest.raises(ValueError, match=message):
        parse_vary([item])


def test_a_key_varied_twice_is_refused():
    with pytest.raises(ValueError, match="given twice"):
        parse_vary(["dtype=float32,bfloat16", "dtype=float16,float32"])


def test_token_agreement_counts_positions_and_prompts():
    base = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert token_agreement(base, base)["token_agreement"] == 1.0
    other = token_agreement(base, [[1, 2, 9, 9], [5, 6, 7, 8]])
    assert other == {"token_agreement": 0.75, "identical_prompts": 1, "num_prompts": 2, "first_divergence": [2, None]}
    shorter = token_agreement(base, [[1, 2, 3], [5, 6, 7, 8]])
    assert shorter["token_agreement"] == 7 / 8 and shorter["first_divergence"] == [3, None]


def test_noise_is_flagged_for_load_above_the_threads_and_for_spread():
    assert noise_reasons([0.5, 0.5, 0.5], [1.9, 1, 1], 2, {"latency_s": 0.05}) == []
    reasons = noise_reasons([3.1, 1, 1], [0.2, 0, 0], 2, {"latency_s": 0.25})
    assert reasons == ["load average 3.10 before the run exceeds the 2 thread(s) in use",
                       "latency_s spread 25.0% over the repetitions (limit 10%)"]
    assert noise_reasons(None, [1.5, 1, 1], 1, {}) == ["load average 1.50 after the run exceeds the 1 thread(s) in use"]


def test_machine_facts():
    assert cpu_model().strip()
    load = load_average()
    assert load is None or (len(load) == 3 and all(x >= 0 for x in load))
    import torch

    v = versions()
    assert v["torch"] == torch.__version__ and v["modelrunner"] and v["python"].count(".") == 2 and v["os"]


def test_values_are_shown_with_units():
    assert format_value("latency_s", 0.01234) == "12.34 ms"
    assert format_value("latency_s", 2.5) == "2.500 s"
    assert format_value("output_tokens_per_s", 1234.56) == "1,234.6/s"
    assert format_value("decode_steps", 7) == "7"
    assert format_value("decode_step_s", None) == "–"


@pytest.mark.parametrize("args,message", [
    (["latency", "--dataset", "x.jsonl"], "unrecognized arguments"),
    (["throughput", "--batch-size", "4"], "unrecognized arguments"),
    (["compare", "--vary", "kv_allocator=paged,contiguous", "--measure", "latency", "--num-prompts", "3"],
     "--num-prompts applies to throughput"),
    (["compare", "--vary", "kv_allocator=paged,contiguous", "--batch-size", "3"], "--batch-size applies to latency"),
    (["compare", "--vary", "kv_allocator=paged"], "compare needs at least two configurations"),
    (["compare", "--vary", "kv_allocator=paged,contiguous", "--set", "kv_allocator=paged"],
     "kv_allocator is given with both --set and --vary"),
    (["compare", "--vary", "kv_allocator=paged,contiguous", "--set", "max_num_seq=4"],
     "--set: unknown config key 'max_num_seq'; did you mean 'max_num_seqs'?"),
    (["throughput", "--set", "model=x"], "give the model with --model"),
    (["throughput", "--dataset", "d.jsonl", "--input-len", "8"], "--input-len sets synthetic prompts' length"),
    (["latency", "--repeat", "0"], "argument --repeat: expected a positive integer, got '0'"),
])
def test_usage_errors_are_one_line_with_status_2(bench, args, message):
    code, out, err = bench(*args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert message in lines[-1]
    if "unrecognized" not in message and "argument --" not in message:  # argparse prints its usage first
        assert len(lines) == 1 and lines[0].startswith("modelrunner: error: ")


def test_serve_delegates_every_argument_to_the_load_generator(bench, monkeypatch):
    seen = {}
    fake = types.ModuleType("modelrunner_serve.loadgen")
    fake.add_arguments = lambda parser: (parser.add_argument("--rate", type=float), parser.add_argument("--help-me",
                                                                                                       action="store_true"))

    def run(args: argparse.Namespace) -> int:
        seen["args"] = args
        return 7

    fake.run = run
    monkeypatch.setitem(sys.modules, "modelrunner_serve.loadgen", fake)
    code, _, _ = bench("serve", "--rate", "2.5", "--help-me")
    assert code == 7 and seen["args"].rate == 2.5 and seen["args"].help_me is True


def test_serve_says_when_the_load_generator_is_not_installed(bench, monkeypatch):
    import importlib.util

    try:
        present = importlib.util.find_spec("modelrunner_serve.loadgen") is not None
    except ModuleNotFoundError:
        present = False
    if present:
        monkeypatch.setitem(sys.modules, "modelrunner_serve.loadgen", None)  # import now raises ModuleNotFoundError
    code, out, err = bench("serve", "--help")
    assert code == 2 and out == ""
    assert err.strip() == ("modelrunner: error: bench serve needs the HTTP server's load generator "
                           "(modelrunner_serve.loadgen): pip install modelrunner-serve; bench latency and bench "
                           "throughput measure the engine offline")
