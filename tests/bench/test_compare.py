"""``bench compare``: configurations in their own processes, interleaved, ratios with intervals, and
greedy outputs checked against the baseline (a fast but wrong backend must not look like a win)."""

from __future__ import annotations

import json
import os
import statistics

import pytest
from bench_checks import KV_CACHE_BYTES, check_environment, check_summary
from modelrunner.plugins import get_plugins

PERTURBED_ENV = "MODELRUNNER_TEST_PERTURBED_ATTENTION"
SMALL = ["--num-prompts", "3", "--input-len", "12", "--output-len", "6"]


def _rows(out: str) -> dict[str, str]:
    """Table rows by configuration label."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].isdigit():
            rows[cells[1]] = line
    return rows


def test_real_configurations_agree_and_are_measured_interleaved(bench, tiny_args, tmp_path, read_json):
    backends = ["torch_sdpa", "cpu_paged"] if "cpu_paged" in get_plugins().attention_backends("cpu") else ["torch_sdpa"]
    out_json, chart = tmp_path / "compare.json", tmp_path / "compare.png"
    code, out, err = bench("compare", *tiny_args, *SMALL, "--vary", "kv_allocator=paged,contiguous",
                           "--vary", f"attention_backend={','.join(backends)}", "--require-same-output",
                           "--output-json", str(out_json), "--plot", str(chart))
    assert code == 0, err
    report = read_json(out_json)
    check_environment(report, threads=1)
    assert report["command"] == "compare" and report["measure"] == "throughput"
    assert report["vary"] == {"kv_allocator": ["paged", "contiguous"], "attention_backend": backends}
    assert report["baseline"] == 0 and report["failed"] == [] and report["outputs_differ"] == []
    configs = report["configurations"]
    assert [c["overrides"] for c in configs] == [{"kv_allocator": a, "attention_backend": b}
                                                 for a in ("paged", "contiguous") for b in backends]
    for c in configs:
        assert c["status"] == "ok" and c["error"] is None and c["threads"] == 1
        # Each setting really took effect, in a process of its own.
        assert c["resolved"]["kv_allocator"] == c["overrides"]["kv_allocator"]
        assert c["resolved"]["attention_backend"] == c["overrides"]["attention_backend"]
        assert c["config"]["cache"]["kv_allocator"] == c["overrides"]["kv_allocator"]
        assert len(c["repetitions"]) == 2 and len(c["warmup_repetitions"]) == 1
        check_summary(c["summary"], c["repetitions"])
        assert c["outputs"]["same_as_baseline"] is True and c["outputs"]["token_agreement"] == 1.0
        assert c["outputs"]["stable_across_repetitions"] is True
        assert c["workload"]["digest"] == configs[0]["workload"]["digest"]
    assert len({c["pid"] for c in configs} | {os.getpid()}) == len(configs) + 1
    # Repetitions interleave: every configuration's round r starts before any configuration's round r + 1.
    for r in range(1):
        assert max(c["repetitions"][r]["started_at"] for c in configs) < \
            min(c["repetitions"][r + 1]["started_at"] for c in configs)
    assert [c["repetitions"][0]["started_at"] for c in configs] == \
        sorted(c["repetitions"][0]["started_at"] for c in configs)
    # The ratio is the median of the per-round ratios, inside its interval.
    base = [r["output_tokens_per_s"] for r in configs[0]["repetitions"]]
    for c in configs[1:]:
        mine = [r["output_tokens_per_s"] for r in c["repetitions"]]
        ratio = c["speed_ratio"]
        assert ratio["ratio"] == pytest.approx(statistics.median(m / b for m, b in zip(mine, base)))
        assert ratio["low"] <= ratio["ratio"] <= ratio["high"] and ratio["rounds"] == 2
        expected = "no measurable difference" if ratio["low"] <= 1 <= ratio["high"] else \
            "faster" if ratio["low"] > 1 else "slower"
        assert ratio["verdict"] == expected
    assert configs[0]["speed_ratio"]["verdict"] == "baseline"
    rows = _rows(out)
    assert set(rows) == {c["label"] for c in configs}
    for c in configs[1:]:
        assert c["speed_ratio"]["verdict"] in rows[c["label"]] and "same: 100.0% of tokens" in rows[c["label"]]
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_backend_with_different_outputs_is_caught(bench, tiny_args, tmp_path, read_json, monkeypatch):
    monkeypatch.setenv(PERTURBED_ENV, "1")  # the workers register the deliberately wrong backend
    out_json = tmp_path / "perturbed.json"
    code, out, err = bench("compare", *tiny_args, *SMALL, "--vary", "attention_backend=torch_sdpa,perturbed_sdpa",
                           "--output-json", str(out_json))
    assert code == 0, err  # without --require-same-output a difference is reported, not fatal
    report = read_json(out_json)
    assert report["outputs_differ"] == [1] and report["failed"] == []
    perturbed = report["configurations"][1]
    assert perturbed["resolved"]["attention_backend"] == "perturbed_sdpa"
    outputs = perturbed["outputs"]
    assert outputs["same_as_baseline"] is False and outputs["comparable"] is True
    assert 0 <= outputs["token_agreement"] < 1 and outputs["identical_prompts"] < 3
    assert any(d is not None for d in outputs["first_divergence"])
    row = _rows(out)["attention_backend=perturbed_sdpa"]
    assert "**OUTPUTS DIFFER**" in row
    assert "**Outputs differ from the baseline** for #1 (attention_backend=perturbed_sdpa)" in out

    code, out, err = bench("compare", *tiny_args, *SMALL, "--warmup", "0", "--repeat", "1",
                           "--vary", "attention_backend=torch_sdpa,perturbed_sdpa", "--require-same-output")
    assert code == 1, err
    assert "**OUTPUTS DIFFER**" in _rows(out)["attention_backend=perturbed_sdpa"]


def test_a_configuration_that_fails_to_load_is_reported_and_the_others_run(bench, tiny_args, tmp_path, read_json):
    out_json = tmp_path / "failed.json"
    code, out, err = bench("compare", *tiny_args, *SMALL, "--warmup", "0", "--repeat", "1",
                           "--vary", "attention_backend=nope,torch_sdpa", "--vary", "max_num_seqs=2,4",
                           "--output-json", str(out_json))
    assert code == 1, err
    report = read_json(out_json)
    assert report["failed"] == [0, 1] and report["baseline"] == 2
    for c in report["configurations"][:2]:
        assert c["status"] == "failed" and c["failed_during"] == "load" and c["repetitions"] == []
        assert c["error"].startswith("unknown attention backend 'nope'; installed: ")
    ok = report["configurations"][2:]
    assert [c["status"] for c in ok] == ["ok", "ok"] and all(len(c["repetitions"]) == 1 for c in ok)
    # One round gives a ratio but no interval, and the table says so.
    assert ok[1]["speed_ratio"]["low"] is None and ok[1]["speed_ratio"]["verdict"] == "too few repetitions"
    assert [c["resolved"]["attention_backend"] for c in ok] == ["torch_sdpa", "torch_sdpa"]
    assert ok[1]["config"]["scheduler"]["max_num_seqs"] == 4
    rows = _rows(out)
    assert "**failed** (load): unknown attention backend 'nope'" in rows["attention_backend=nope max_num_seqs=2"]
    assert "baseline" in rows["attention_backend=torch_sdpa max_num_seqs=2"]
    assert "too few repetitions" in rows["attention_backend=torch_sdpa max_num_seqs=4"]
    assert "speed vs #2" in out and "With 1 repetition(s) there is no interval" in out


def test_latency_can_be_compared_too(bench, tiny_args, tmp_path, read_json):
    out_json = tmp_path / "latency.json"
    code, out, err = bench("compare", *tiny_args, "--measure", "latency", "--batch-size", "2", "--input-len", "8",
                           "--output-len", "4", "--vary", "max_num_batched_tokens=8,64", "--require-same-output",
                           "--output-json", str(out_json))
    assert code == 0, err
    report = read_json(out_json)
    assert report["primary_metric"] == {"name": "latency_s", "higher_is_better": False}
    chunked, whole = report["configurations"]
    # 2 prompts × 8 tokens: in steps of 8 tokens the prefill takes several steps, in steps of 64 one.
    assert all(r["prefill_steps"] > 1 for r in chunked["repetitions"])
    assert [r["prefill_steps"] for r in whole["repetitions"]] == [1, 1]
    base = [r["latency_s"] for r in chunked["repetitions"]]
    mine = [r["latency_s"] for r in whole["repetitions"]]
    assert whole["speed_ratio"]["ratio"] == pytest.approx(statistics.median(b / m for b, m in zip(base, mine)))
    assert whole["outputs"]["same_as_baseline"] is True
    assert "latency_s (median)" in out


def test_grammar_backends_compare_on_a_constrained_dataset(bench, tiny_args, tmp_path, read_json):
    """Issue 33's backend comparison: the same constrained prompts under each grammar backend, in
    processes of their own. These regexes allow the same tokens in both backends, so greedy outputs
    are equal (not so for every constraint: llguidance allows only the canonical tokenization of a
    choice's words, xgrammar any spelling of them)."""
    data = tmp_path / "constrained.jsonl"
    data.write_text("\n".join(json.dumps(line) for line in (
        {"prompt": "Numbers:", "structured_outputs": {"regex": "[0-9]{1,3}(, [0-9]{1,3}){0,3}"}},
        {"prompt": "A count:", "structured_outputs": {"regex": "[0-9]{1,6}"}},
        {"prompt": "Anything:"})) + "\n")
    out_json = tmp_path / "grammars.json"
    code, out, err = bench("compare", *tiny_args, "--warmup", "0", "--repeat", "1", "--dataset", str(data),
                           "--output-len", "8",
                           "--vary", "structured_outputs_backend=xgrammar,guidance", "--require-same-output",
                           "--output-json", str(out_json))
    assert code == 0, out + err
    report = read_json(out_json)
    configs = report["configurations"]
    assert [c["resolved"]["structured_outputs_backend"] for c in configs] == ["xgrammar", "guidance"]
    assert all(c["workload"]["constrained_prompts"] == 2 for c in configs)
    assert report["outputs_differ"] == [] and configs[1]["outputs"]["same_as_baseline"] is True


def test_lora_kernels_compare_on_a_dataset_of_adapters(bench, tiny_args, tiny_llama_dir, tmp_path, read_json,
                                                       monkeypatch):
    """Issue 35: a LoRA kernel written with ``new-plugin`` (a batched gather), installed, and compared
    with the kernel's ``torch`` on prompts spread over two adapters and the base model."""
    import subprocess
    import sys

    from modelrunner_kit.scaffold import new_plugin
    from peft_adapters import save_peft_adapter

    folder = new_plugin("lora-kernel", "gather_lora", tmp_path)
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "--target", str(site), str(folder)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    adapters = [save_peft_adapter(tiny_llama_dir, tmp_path / f"a{i}", seed=i + 1) for i in range(2)]
    data = tmp_path / "adapters.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Story {i}:", **({"lora": str(adapters[i % 3])} if i % 3 < 2
                                                                       else {})}) for i in range(6)) + "\n")
    out_json = tmp_path / "lora.json"
    code, out, err = bench("compare", *tiny_args, "--warmup", "0", "--repeat", "1", "--dataset", str(data),
                           "--output-len", "6", "--set", "enable_lora=true", "--set", "max_loras=2",
                           "--set", "max_lora_rank=8", "--vary", "lora_kernel=torch,gather_lora",
                           "--output-json", str(out_json))
    assert code == 0, out + err
    report = read_json(out_json)
    configs = report["configurations"]
    assert [c["resolved"]["lora_kernel"] for c in configs] == ["torch", "gather_lora"]
    assert all(c["workload"]["lora_prompts"] == 4 and c["workload"]["lora_adapters"] == 2 for c in configs)
    assert report["outputs_differ"] == []  # both kernels compute the same deltas
    # The dataset's adapters really run: its LoRA prompts' tokens are not the base model's.
    import attrs

    from modelrunner import LLM
    from modelrunner_bench.throughput import measure_throughput
    from modelrunner_bench.workload import WorkloadSpec, build_workload

    llm = LLM(str(tiny_llama_dir), enable_lora=True, max_loras=2, max_lora_rank=8, kv_cache_memory=KV_CACHE_BYTES)
    try:
        workload = build_workload(WorkloadSpec(dataset=str(data), output_len=6), llm.get_tokenizer())
        _, with_loras = measure_throughput(llm, workload)
        _, base = measure_throughput(llm, attrs.evolve(workload, loras=None))
    finally:
        llm.shutdown()
    assert [a == b for a, b in zip(with_loras, base)] == [i % 3 == 2 for i in range(6)]
