"""The quantization-method page's fp8 example, as a reader would use it: its files written out from
docs/plugins/quantization-method.md, pip-installed (into a folder of its own, put on the path of the
commands that use it, so the shared venv stays as it was), run through ``modelrunner check fp8`` (a
GGUF source included) and used by ``modelrunner generate`` on the default model, a GGUF file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from docs_blocks import code_blocks, write_files
from plugin_dists import run_cli

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plugins" / "quantization-method.md"
PACKAGE = "modelrunner-fp8/"

pytestmark = pytest.mark.slow  # generates with the real default model


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The example's distribution, written from the page and installed into its own target folder."""
    root = tmp_path_factory.mktemp("fp8-example")
    written = write_files(code_blocks(PAGE), PACKAGE, root)
    assert {p.relative_to(root).as_posix() for p in written} == {
        "modelrunner-fp8/pyproject.toml", "modelrunner-fp8/modelrunner_fp8/__init__.py"}
    target = root / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              "--no-deps", "--no-build-isolation", "--target", str(target), str(root / PACKAGE)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    return target


def test_the_example_passes_modelrunner_check_with_a_gguf_source(site):
    result = run_cli("check", "fp8", "--json", pythonpath=site)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    status = {r["check"]: r["status"] for r in report["results"]}
    assert report["passed"] and {r["suite"] for r in report["results"]} == {"quantization_methods:fp8"}
    # It runs the GGUF file (rather than refusing it), and splits across two ranks.
    gguf = next(r for r in report["results"] if r["check"] == "gguf-source")
    assert gguf["status"] == "passed" and gguf["message"].startswith("runs "), gguf
    for check in ("covers-layers", "logits", "layers", "tensor-parallel=2", "weight-bytes", "options"):
        assert status[check] == "passed", (check, report)


def test_the_example_generates_with_the_default_model(site):
    result = run_cli("generate", "The capital of France is", "--max-tokens", "6", "--set", "quantization=fp8",
                     "--stats", pythonpath=site)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout, result.stdout
    stats = dict(line.split(None, 1) for line in result.stderr.splitlines() if line.startswith("quantization."))
    assert stats["quantization.method"].strip() == "fp8"
    assert int(stats["quantization.layers"]) == 120  # every linear layer of SmolLM2-135M's 30 blocks
