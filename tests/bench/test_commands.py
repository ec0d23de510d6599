"""``bench latency`` and ``bench throughput`` on a tiny random model: the JSON, field by field."""

from __future__ import annotations

import json

import pytest
from bench_checks import KV_CACHE_BYTES, check_environment, check_summary


def test_latency(bench, tiny_args, tiny_llama_dir, tmp_path, read_json):
    out_json = tmp_path / "latency.json"
    code, out, err = bench("latency", *tiny_args, "--batch-size", "3", "--input-len", "12", "--output-len", "6",
                           "--output-json", str(out_json))
    assert code == 0, err
    report = read_json(out_json)
    check_environment(report)
    assert report["command"] == "latency" and report["model"] == str(tiny_llama_dir)
    assert report["overrides"] == {"kv_cache_memory": KV_CACHE_BYTES}
    # The full configuration, defaults included, and what it resolved to.
    assert report["config"]["cache"]["kv_cache_memory"] == KV_CACHE_BYTES
    assert report["config"]["cache"]["kv_allocator"] == "paged" and report["config"]["scheduler"]["max_num_seqs"] == 256
    assert report["resolved"]["adapter"] == "llama" and report["resolved"]["dtype"] == "float32"
    assert report["resolved"]["attention_backend"] in ("torch_sdpa", "cpu_paged")
    w = report["workload"]
    assert (w["num_prompts"], w["input_len"], w["output_len"], w["seed"]) == (3, 12, 6, 0)
    assert (w["prompt_tokens"], w["output_tokens"], w["source"]) == (36, 18, "synthetic")
    assert report["settings"] == {"warmup": 1, "repeat": 2, "threads": None}
    assert report["primary_metric"] == {"name": "latency_s", "higher_is_better": False}
    assert len(report["warmup_repetitions"]) == 1 and len(report["repetitions"]) == 2
    for i, rep in enumerate(report["repetitions"]):
        assert rep["index"] == i
        assert rep["prefill_steps"] == 1 and rep["decode_steps"] == 5  # 6 tokens: 1 from the prefill, 5 decodes
        assert 0 < rep["prefill_s"] < rep["latency_s"]
        assert rep["prefill_s"] + 5 * rep["decode_step_s"] <= rep["latency_s"] * 1.5
        assert rep["output_tokens_per_s"] == pytest.approx(18 / rep["latency_s"])
    check_summary(report["summary"], report["repetitions"])
    assert report["outputs"]["stable_across_repetitions"] is True
    assert report["outputs"]["digest"] == report["repetitions"][0]["outputs_digest"]
    # stdout holds the results table, stderr nothing but progress.
    assert "| latency_s |" in out and "| decode_step_s |" in out and "bench latency" in out
    assert report["noisy"] == ("NOISY MACHINE" in out)


def test_throughput(bench, tiny_args, tmp_path, read_json):
    out_json = tmp_path / "throughput.json"
    code, out, err = bench("throughput", *tiny_args, "--num-prompts", "5", "--input-len", "10", "--output-len", "4",
                           "--seed", "7", "--output-json", str(out_json))
    assert code == 0, err
    report = read_json(out_json)
    check_environment(report)
    assert report["command"] == "throughput"
    assert report["primary_metric"] == {"name": "output_tokens_per_s", "higher_is_better": True}
    assert (report["workload"]["num_prompts"], report["workload"]["seed"]) == (5, 7)
    for rep in report["repetitions"]:
        assert (rep["prompt_tokens"], rep["output_tokens"]) == (50, 20)
        assert rep["output_tokens_per_s"] == pytest.approx(20 / rep["elapsed_s"])
        assert rep["total_tokens_per_s"] == pytest.approx(70 / rep["elapsed_s"])
        assert rep["requests_per_s"] == pytest.approx(5 / rep["elapsed_s"])
        assert 0 < rep["median_ttft_s"] <= rep["elapsed_s"] and rep["median_tpot_s"] > 0
    check_summary(report["summary"], report["repetitions"])
    assert "| output_tokens_per_s |" in out and "| total_tokens_per_s |" in out


def test_throughput_of_a_dataset(bench, tiny_args, tmp_path, read_json, smollm2_tokenizer):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "The river and the mountain", "output_len": 3}) + "\n"
                    + json.dumps({"prompt_token_ids": [11, 12, 13, 14]}) + "\n")
    out_json = tmp_path / "dataset.json"
    code, _, err = bench("throughput", *tiny_args, "--dataset", str(data), "--output-len", "5",
                         "--output-json", str(out_json))
    assert code == 0, err
    report = read_json(out_json)
    prompt_tokens = len(smollm2_tokenizer.encode("The river and the mountain")) + 4
    assert report["workload"]["dataset"] == str(data) and report["workload"]["input_len"] is None
    assert (report["workload"]["num_prompts"], report["workload"]["prompt_tokens"]) == (2, prompt_tokens)
    assert all((r["prompt_tokens"], r["output_tokens"]) == (prompt_tokens, 8) for r in report["repetitions"])


def test_a_bad_configuration_is_one_line_with_status_2(bench, tiny_args):
    code, out, err = bench("latency", *tiny_args, "--set", "attention_backend=nope")
    assert code == 2 and out == ""
    assert err.strip().startswith("modelrunner: error: unknown attention backend 'nope'")
    assert len(err.strip().splitlines()) == 1


def test_prompts_too_long_for_the_model_are_refused_before_measuring(bench, tiny_args):
    code, _, err = bench("latency", *tiny_args, "--set", "max_model_len=16", "--input-len", "12", "--output-len", "8")
    assert code == 2
    assert "prompt 0 has 12 tokens: with 8 new tokens it exceeds max_model_len=16" in err
