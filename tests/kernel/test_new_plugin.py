"""``modelrunner new-plugin``: a skeleton of every kind installs with pip, is listed by
``modelrunner plugins``, and passes its own conformance test before anyone changes a line."""

from __future__ import annotations

import json
import os
import subprocess
import re
import sys

import pytest

from modelrunner.scaffold import KINDS, new_plugin

from plugin_dists import run_cli

NAMES = {
    "adapter": "kit_adapter",
    "attention-backend": "kit_attention",
    "allocator": "kit_allocator",
    "compile-backend": "kit_compile",
    "quantization-method": "kit_quant",
    "logits-processor": "kit_logits",
    "matmul-kernel": "kit_matmul",
}
"""KIND → the skeleton's name in these tests."""


@pytest.fixture(scope="module")
def skeletons(tmp_path_factory):
    """Every kind's skeleton, written by the CLI and pip-installed into one target folder."""
    root = tmp_path_factory.mktemp("skeletons")
    for kind, name in NAMES.items():
        result = run_cli("new-plugin", kind, name, "--dir", str(root))
        assert result.returncode == 0, result.stderr
        assert f"modelrunner check {name}" in result.stdout
    site = root / "site"
    dists = [str(root / f"modelrunner-{name.replace('_', '-')}") for name in NAMES.values()]
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "--target", str(site), *dists], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    return root, site


def test_every_kind_has_a_skeleton():
    assert set(NAMES) == set(KINDS)


def test_installed_skeletons_are_listed_with_their_names(skeletons):
    _, site = skeletons
    result = run_cli("plugins", "--json", pythonpath=site)
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    for kind, name in NAMES.items():
        info = plugins[name]
        assert info["error"] is None, info
        assert info["api"] == ">=1.1,<2"
        registered = "KitAdapterForCausalLM" if kind == "adapter" else name
        assert info["provides"] == {KINDS[kind]: [registered]}


def test_each_skeleton_passes_its_own_conformance_test(skeletons):
    root, site = skeletons
    tests = [str(root / f"modelrunner-{name.replace('_', '-')}" / "tests") for name in NAMES.values()]
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    passed = {}
    for name, folder in zip(NAMES.values(), tests):  # one run each: every skeleton's suite must really run
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", folder],
                                capture_output=True, text=True, env=env, timeout=600, cwd=root)
        assert result.returncode == 0, name + ": " + result.stdout[-4000:] + result.stderr[-2000:]
        found = re.search(r"(\d+) passed", result.stdout)
        passed[name] = int(found.group(1)) if found else 0
    assert all(passed.values()), passed  # checks passed in each, not all skipped


def test_modelrunner_check_runs_a_skeletons_suite(skeletons):
    _, site = skeletons
    result = run_cli("check", "kit_allocator", "--json", pythonpath=site)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["plugin"] == "kit_allocator" and report["passed"] is True
    assert {r["suite"] for r in report["results"]} == {"allocators:kit_allocator"}
    assert any(r["status"] == "passed" for r in report["results"])


def test_modelrunner_check_runs_the_matmul_kernel_skeletons_suite(skeletons):
    # Straight after generation: every format it claims matches the dequantized reference at 1, 5
    # and 64 rows, a malformed format is refused, a strided input is handled.
    _, site = skeletons
    result = run_cli("check", "kit_matmul", "--json", pythonpath=site)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["passed"] is True
    assert {r["suite"] for r in report["results"]} == {"matmul_kernels:kit_matmul"}
    status = {r["check"]: r["status"] for r in report["results"]}
    assert status["int4:g32:mins/rows=64"] == status["refuses-unclaimed-formats"] == "passed"


def test_bad_kinds_names_and_existing_folders_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown plugin kind 'backend'; kinds: adapter, attention-backend"):
        new_plugin("backend", "x", tmp_path)
    with pytest.raises(ValueError, match=r"plugin name 'My-Plugin' must be lowercase"):
        new_plugin("allocator", "My-Plugin", tmp_path)
    new_plugin("allocator", "twice", tmp_path)
    with pytest.raises(ValueError, match=r"modelrunner-twice already exists"):
        new_plugin("allocator", "twice", tmp_path)
    result = run_cli("new-plugin", "backend", "x", "--dir", str(tmp_path))
    assert result.returncode != 0 and result.stderr.count("\n") == 1 and "unknown plugin kind" in result.stderr
