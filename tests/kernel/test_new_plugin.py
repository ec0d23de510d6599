"""``modelrunner new-plugin``: a skeleton of every kind installs with pip, is listed by
``modelrunner plugins``, and passes its own conformance test and ``modelrunner check`` before anyone
changes a line. The kinds come from the scaffold itself, so a new kind is checked the day it lands."""

from __future__ import annotations

import json
import os
import subprocess
import re
import sys

import pytest

from modelrunner_kit.conformance import SUITES
from modelrunner_kit.scaffold import KINDS, adapter_architecture, new_plugin

from plugin_dists import run_cli

NAMES = {kind: "kit_" + kind.replace("-", "_") for kind in KINDS}
"""KIND → the skeleton's name in these tests (every kind ``new-plugin`` declares)."""
FAMILY_ADAPTER = "gpt_neox"
"""An adapter skeleton named after a transformers family the kernel's Llama-shaped decoder does not run."""


def registered(kind: str, name: str) -> str:
    """The name a skeleton registers: its own, or an adapter's architecture."""
    return adapter_architecture(name)[0] if kind == "adapter" else name


@pytest.fixture(scope="module")
def skeletons(tmp_path_factory):
    """Every kind's skeleton (and the ``gpt_neox`` adapter's), pip-installed into one target folder.
    One is written by the CLI as its README says; the others by the same function in this process
    (a CLI start costs seconds, thirteen of them most of this fixture)."""
    root = tmp_path_factory.mktemp("skeletons")
    first, *rest = [*NAMES.items(), ("adapter", FAMILY_ADAPTER)]
    result = run_cli("new-plugin", *first, "-o", str(root))
    assert result.returncode == 0, result.stderr
    assert f"modelrunner check {first[1]}" in result.stdout
    for kind, name in rest:
        new_plugin(kind, name, root)
    site = root / "site"
    dists = [str(root / f"modelrunner-{name.replace('_', '-')}") for name in [*NAMES.values(), FAMILY_ADAPTER]]
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                              "--target", str(site), *dists], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    return root, site


def test_every_kind_has_a_conformance_suite():
    assert set(KINDS.values()) <= set(SUITES), set(KINDS.values()) - set(SUITES)


def test_adapter_names_map_to_transformers_class_names():
    assert adapter_architecture("gpt_neox") == ("GPTNeoXForCausalLM", "gpt_neox")
    assert adapter_architecture("llama") == ("LlamaForCausalLM", "llama")
    assert adapter_architecture("kit_adapter") == ("KitAdapterForCausalLM", None)


def test_adapter_skeletons_test_with_their_own_family(tmp_path):
    for name in ("gpt_neox", "kit_adapter", "mistral"):
        folder = new_plugin("adapter", name, tmp_path)
        test = (folder / "tests" / "test_conformance.py").read_text()
        assert "LlamaConfig" not in test and f'suite("architectures", "{adapter_architecture(name)[0]}")' in test
    module = (tmp_path / "modelrunner-kit-adapter" / "modelrunner_kit_adapter" / "__init__.py").read_text()
    assert 'model_type="llama"' in module and "class KitAdapterForCausalLM(DecoderForCausalLM)" in module
    assert "class MistralForCausalLM(DecoderForCausalLM)" in \
        (tmp_path / "modelrunner-mistral" / "modelrunner_mistral" / "__init__.py").read_text()
    assert "transformers_adapter.load(" in (tmp_path / "modelrunner-gpt-neox" / "modelrunner_gpt_neox" /
                                            "__init__.py").read_text()


def test_installed_skeletons_are_listed_with_their_names(skeletons):
    _, site = skeletons
    result = run_cli("plugins", "--json", pythonpath=site)
    assert result.returncode == 0, result.stderr
    plugins = {p["name"]: p for p in json.loads(result.stdout)}
    for kind, name in [*NAMES.items(), ("adapter", FAMILY_ADAPTER)]:
        info = plugins[name]
        assert info["error"] is None, info
        assert info["api"] == ">=1.1,<2"
        assert info["provides"] == {KINDS[kind]: [registered(kind, name)]}


def test_each_skeleton_passes_its_own_conformance_test(skeletons):
    # The adapter's suite (tensor-parallel runs included) is the costly one: its own test runs the same
    # suite as `modelrunner check`, which test_each_skeleton_passes_modelrunner_check runs.
    # One pytest run over every skeleton's tests (importlib mode: their test files share a name; no
    # skeleton's pyproject.toml as the ini file, which would name the others' tests relative to it);
    # the report counts the passes per skeleton, so each suite must really run.
    root, site = skeletons
    folders = {name: f"modelrunner-{name.replace('_', '-')}" for kind, name in NAMES.items() if kind != "adapter"}
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA",
                             "--import-mode=importlib", "--rootdir", str(root), "-c", os.devnull,
                             *(f"{folder}/tests" for folder in folders.values())],
                            capture_output=True, text=True, env=env, timeout=600, cwd=root)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    passed = {name: len(re.findall(rf"^PASSED {re.escape(folder)}/", result.stdout, re.MULTILINE))
              for name, folder in folders.items()}
    assert all(passed.values()), passed  # checks passed in each, not all skipped


@pytest.mark.parametrize(("kind", "name"), [*NAMES.items(), ("adapter", FAMILY_ADAPTER)])
def test_each_skeleton_passes_modelrunner_check(skeletons, kind, name):
    # Straight after generation and installation, as its README says to run it.
    _, site = skeletons
    result = run_cli("check", name, "--json", pythonpath=site)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["plugin"] == name and report["passed"] is True
    assert {r["suite"] for r in report["results"]} == {f"{KINDS[kind]}:{registered(kind, name)}"}
    assert any(r["status"] == "passed" for r in report["results"]), report
    status = {r["check"]: r["status"] for r in report["results"]}
    if kind == "matmul-kernel":
        # Every format it claims matches the dequantized reference; a malformed format is refused.
        assert status["int4:g32:mins/rows=64"] == status["refuses-unclaimed-formats"] == "passed"
    if kind == "grammar-backend":
        # A pure-Python choice backend: choices walk through its masks, the kinds it does not declare
        # are refused (and their checks skipped), and it runs in a tiny LLM beside free requests.
        assert status["choice/valid"] == status["choice/invalid"] == status["refusals"] == status["engine"] == "passed"
        assert status["json/valid"] == "skipped"
    if kind == "lora-kernel":  # a batched-gather kernel matches the reference math, mixed groups included
        assert status["decode-mixed/float32"] == status["prefill-interleaved/float32"] == "passed"
    if kind == "adapter" and name != FAMILY_ADAPTER:
        assert status["logits"] == status["tensor-parallel=2"] == "passed"  # built from the kernel's layers


def test_modelrunner_check_runs_an_adapter_on_the_authors_config(skeletons):
    # The configuration an author's bug hides in (GPT-NeoX without the parallel residual), not the default.
    _, site = skeletons
    rope = '{"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}'
    result = run_cli("check", FAMILY_ADAPTER, "--config", "use_parallel_residual=false", "--config",
                     f"rope_parameters={rope}", "--json", pythonpath=site)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["passed"] is True and any(r["status"] == "passed" for r in report["results"])


def test_bad_kinds_names_and_existing_folders_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unknown plugin kind 'backend'; kinds: adapter, attention-backend"):
        new_plugin("backend", "x", tmp_path)
    with pytest.raises(ValueError, match=r"plugin name 'My-Plugin' must be lowercase"):
        new_plugin("allocator", "My-Plugin", tmp_path)
    new_plugin("allocator", "twice", tmp_path)
    with pytest.raises(ValueError, match=r"modelrunner-twice already exists"):
        new_plugin("allocator", "twice", tmp_path)
    result = run_cli("new-plugin", "backend", "x", "--output", str(tmp_path))
    assert result.returncode != 0 and result.stderr.count("\n") == 1 and "unknown plugin kind" in result.stderr
