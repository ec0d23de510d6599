"""Every CLI error is one line on stderr naming what is wrong, with exit status 2 — never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from plugin_dists import make_distribution

FAILING_FORWARD = '''
from modelrunner import hookimpl

@hookimpl(wrapper=True)
def forward(loaded):
    raise RuntimeError("the accelerator caught fire")
    yield  # a wrapper is a generator
'''


def _cli(*args: str | bytes, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if pythonpath is not None:
        env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, "-m", "modelrunner.cli", *args], capture_output=True, env=env,
                          timeout=300)


def _one_error(result: subprocess.CompletedProcess) -> str:
    stderr = result.stderr.decode(errors="replace")
    assert result.returncode == 2, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("modelrunner: error:")]
    others = [line for line in stderr.splitlines() if line.strip() and not line.startswith("modelrunner: ")]
    assert len(errors) == 1 and not others, stderr
    return errors[0]


def _checkpoint(tiny_llama_dir: Path, root: Path, **config_changes) -> Path:
    shutil.copytree(tiny_llama_dir, root)
    config = json.loads((root / "config.json").read_text())
    config.update(config_changes)
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("bad")
    from modelrunner.loading.source import DEFAULT_MODEL_ALIASES, _alias_file

    gguf = _alias_file(next(iter(DEFAULT_MODEL_ALIASES)))
    (root / "truncated.gguf").write_bytes(gguf.read_bytes()[:3_000_000])
    (root / "empty.gguf").write_bytes(b"")
    return {
        "heads": _checkpoint(tiny_llama_dir, root / "heads", num_attention_heads=5),
        "string": _checkpoint(tiny_llama_dir, root / "string", hidden_size="sixty-four"),
        "quantized": _checkpoint(tiny_llama_dir, root / "quantized",
                                 quantization_config={"quant_method": "awq", "bits": 4}),
        "truncated": root / "truncated.gguf",
        "empty": root / "empty.gguf",
        "cache": root / "cache",
    }


@pytest.mark.parametrize(("case", "expected"), [
    ("heads", "heads/config.json: The hidden size (64) is not a multiple of the number of attention heads (5)"),
    ("string", "string/config.json: Field 'hidden_size' expected int, got str"),
    ("quantized", "quantized with 'awq' (quantization_config in config.json)"),
    ("truncated", "truncated.gguf: tensor 'token_embd.weight' (Q8_0) ends at byte"),
    ("empty", "empty.gguf: the file is empty, not a GGUF checkpoint"),
])
def test_bad_checkpoints(bad_files, case, expected):
    line = _one_error(_cli("generate", "--model", str(bad_files[case]), "--set",
                           f"cache_dir={json.dumps(str(bad_files['cache']))}", "hello"))
    assert expected in line


def test_a_prompt_that_is_not_valid_utf8(tiny_llama_dir):
    line = _one_error(_cli("generate", "--model", str(tiny_llama_dir), b"caf\xe9 \xff"))
    assert "the prompt is not valid Unicode" in line


@pytest.mark.parametrize(("args", "expected"), [
    (["--set", "max_num_seq=4"], "unknown config key 'max_num_seq'; did you mean 'max_num_seqs'?"),
    (["--set", "block_size=zero"], "block_size must be a positive integer, got 'zero'"),
    (["--set", "kv_allocator=pagd"], "unknown allocator 'pagd'"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--top-p", "2"], "top_p must be a number in (0, 1]"),
])
def test_bad_settings(tiny_llama_dir, args, expected):
    assert expected in _one_error(_cli("generate", "--model", str(tiny_llama_dir), *args, "hello"))


def test_a_request_that_fails_during_generation(tiny_llama_dir, tmp_path):
    root = make_distribution(tmp_path / "site", "modelrunner-fire", "fire", "mr_fire", FAILING_FORWARD)
    line = _one_error(_cli("generate", "--model", str(tiny_llama_dir), "--max-tokens", "3", "hello",
                           pythonpath=root))
    assert "model forward failed: RuntimeError: the accelerator caught fire" in line
