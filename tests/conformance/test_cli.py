"""``modelrunner check PLUGIN`` on the kernel's own attention plugin: the suite in a fresh process; and
the options that run the adapter and quantization suites on the author's own config or checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from modelrunner_kit.conformance import suite
from modelrunner.plugins import get_plugins
from plugin_dists import run_cli


def test_check_prints_the_table_and_exits_0():
    result = run_cli("check", "default-sdpa")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "| suite | check | status | s | message |"
    assert any(line.startswith("| attention_backends:torch_sdpa | eager/decode-only/gqa4x2/window=3 | passed |")
               for line in lines)
    assert lines[-1] == "default-sdpa: 52 passed, 0 failed, 0 skipped"
    assert "checking attention_backends:torch_sdpa" in result.stderr


def test_check_json_parses():
    result = run_cli("check", "default-sdpa", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["plugin"] == "default-sdpa" and report["passed"] is True
    assert {r["suite"] for r in report["results"]} == {"attention_backends:torch_sdpa"}
    assert {r["status"] for r in report["results"]} == {"passed"}
    assert "compiled/mixed-chunked-prefill/gqa4x2/window=3" in {r["check"] for r in report["results"]}


def test_check_config_values_are_overrides_or_a_path(tmp_path):
    from modelrunner_kit.conformance.cli import parse_config
    from modelrunner_kit.conformance.models import tiny_config

    assert parse_config(["use_parallel_residual=false", "layer_norm_eps=1e-6", "hidden_act=gelu", "x=None",
                         'rope_parameters={"partial_rotary_factor": 0.5}']) == {
        "use_parallel_residual": False, "layer_norm_eps": 1e-6, "hidden_act": "gelu", "x": None,
        "rope_parameters": {"partial_rotary_factor": 0.5}}
    tiny_config("GPTNeoXForCausalLM").to_json_file(str(tmp_path / "config.json"))
    assert parse_config([str(tmp_path)]) == str(tmp_path)
    config = parse_config([str(tmp_path / "config.json"), "use_parallel_residual=False"])
    assert config.use_parallel_residual is False and config.architectures == ["GPTNeoXForCausalLM"]
    with pytest.raises(ValueError, match=r"GPTNeoXConfig has no field 'no_such_field' to set to 1; its fields: "
                                         r".*, use_parallel_residual, vocab_size$"):
        parse_config([str(tmp_path), "no_such_field=1"])


def test_check_config_naming_an_unknown_field_is_a_usage_error(capsys):
    # One line naming the field, the close ones and the config's fields, exit 2: not every check failing on it.
    from modelrunner.cli import main

    if "llama" not in get_plugins().infos:
        pytest.skip("modelrunner-llama is not installed")
    assert main(["check", "llama", "--config", "rms_norm_epsilon=1e-5", "--config", "num_hidden_layers=1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("modelrunner: error: --config rms_norm_epsilon=...: LlamaConfig has no field "
                          "'rms_norm_epsilon' to set to 1e-05 (did you mean 'rms_norm_eps'?); its fields: "), err
    assert "hidden_size, " in err and ", rms_norm_eps, " in err


def test_check_options_reach_the_suites_that_take_them(tmp_path):
    from modelrunner_kit.conformance import suites_for_plugin
    from modelrunner_kit.conformance.models import checkpoint_config

    if "llama" not in get_plugins().infos:
        pytest.skip("modelrunner-llama is not installed")
    suites = suites_for_plugin("llama", config={"num_hidden_layers": 1, "rms_norm_eps": 1e-5}, root=tmp_path)
    assert suites and all(s.kind == "architectures" for s in suites)
    for checked in suites:
        config = checkpoint_config(checked.checkpoint)
        assert (config["num_hidden_layers"], config["rms_norm_eps"]) == (1, 1e-5)
        assert config["architectures"] == [checked.name]
    given = suites[0].checkpoint
    assert suites_for_plugin("llama", checkpoint=given)[0].checkpoint == given
    with pytest.raises(ValueError, match=r"config applies to the architectures suites; plugin 'default-sdpa' "
                                         r"registers attention_backends"):
        suites_for_plugin("default-sdpa", config={"num_hidden_layers": 1})
    result = run_cli("check", "llama", "--checkpoint", str(tmp_path / "missing"))
    assert result.returncode != 0 and "--checkpoint" in result.stderr and "no such file" in result.stderr


def test_tiny_checkpoints_go_to_a_folder_of_this_process():
    import subprocess
    import sys

    from modelrunner_kit.conformance.models import scratch_root

    root = scratch_root()
    assert root == scratch_root() and root.is_dir() and root.name.startswith("modelrunner-conformance-")
    assert suite("quantization_methods", "int4").root == root
    probe = "from modelrunner_kit.conformance.models import scratch_root as s; r = s(); print(r, r.is_dir())"
    other = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert other[0] != str(root) and other[1] == "True"  # another process (a concurrent check) has its own
    assert not Path(other[0]).exists()  # removed when that process ended


def test_check_device_reaches_the_suites_that_run_models_and_bad_values_are_refused():
    import torch
    from modelrunner_kit.conformance import suites_for_plugin

    if "llama" not in get_plugins().infos:
        pytest.skip("modelrunner-llama is not installed")
    assert {s.device for s in suites_for_plugin("llama", device="cpu")} == {"cpu"}
    assert suites_for_plugin("default-sdpa", device="cpu")[0].device == torch.device("cpu")
    with pytest.raises(ValueError, match=r"device applies to the .*plugin 'default-paged' registers allocators"):
        suites_for_plugin("default-paged", device="cpu")
    result = run_cli("check", "default-sdpa", "--device", "tpu")
    assert result.returncode != 0 and "--device 'tpu': expected cpu, cuda or cuda:N" in result.stderr
    if not torch.cuda.is_available():
        result = run_cli("check", "default-sdpa", "--device", "cuda")
        assert result.returncode != 0 and "no CUDA device" in result.stderr
