"""Fixtures of the ``modelrunner bench`` tests: the CLI run in this process, and tiny-model options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_checks import KV_CACHE_BYTES


@pytest.fixture
def bench(capsys, monkeypatch):
    """``bench(*args) -> (exit status, stdout, stderr)``: ``modelrunner bench ...`` in this process
    (argparse's usage errors included).
    Worker processes it starts get one thread each."""
    from modelrunner.cli import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main(["bench", *args])
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def tiny_args(tiny_llama_dir: Path) -> list[str]:
    """Options that keep a run on the tiny random Llama to about a second."""
    return ["--model", str(tiny_llama_dir), "--set", f"kv_cache_memory={KV_CACHE_BYTES}", "--warmup", "1",
            "--repeat", "2"]


@pytest.fixture
def read_json():
    """Read a JSON report."""
    return lambda path: json.loads(Path(path).read_text())

