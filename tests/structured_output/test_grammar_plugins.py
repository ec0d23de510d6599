"""Grammar backends are plugins of their own distributions (``plugins/grammar_xgrammar``,
``plugins/grammar_llguidance``): the kernel imports neither library, and a structured-output request
that needs a backend which is not there is refused naming the backend and the package to install,
while plain requests run as before."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from modelrunner import LLM, SamplingParams, StructuredOutputError
from modelrunner.errors import UnknownNameError
from modelrunner.plugins import Plugins, get_plugins
from modelrunner.sampling_params import GuidedDecodingParams
from modelrunner.structured_output import GRAMMAR_PACKAGES
from modelrunner.structured_output.manager import missing_backend_message

PLUGINS = {"grammar-xgrammar": "modelrunner-grammar-xgrammar", "grammar-llguidance": "modelrunner-grammar-llguidance"}
FOLDERS = [Path(__file__).resolve().parents[2] / "plugins" / f for f in ("grammar_xgrammar", "grammar_llguidance")]
TINY = dict(device="cpu", max_model_len=128, kv_cache_memory=8 << 20, compile=False)
CHOICE = SamplingParams(max_tokens=4, temperature=0.0, structured_outputs={"choice": ["yes", "no"]})


def test_the_packages_named_are_the_plugins_distributions():
    assert set(GRAMMAR_PACKAGES.values()) == set(PLUGINS.values())
    for entry, dist in PLUGINS.items():
        assert any(ep.name == entry for ep in importlib.metadata.distribution(dist).entry_points)


@pytest.fixture(scope="module")
def bare_llm(tiny_llama_dir) -> LLM:
    """An engine with both grammar plugins blocked ($MODELRUNNER_BLOCK_PLUGINS' list)."""
    return LLM(str(tiny_llama_dir), plugins=get_plugins(block=list(PLUGINS)), **TINY)


def test_without_a_backend_a_structured_request_names_the_packages(bare_llm):
    assert bare_llm.engine.structured_outputs.auto_order() == []
    with pytest.raises(StructuredOutputError, match=r"no grammar backend is installed for backend='auto': "
                                                    r"pip install modelrunner-grammar-xgrammar or "
                                                    r"modelrunner-grammar-llguidance"):
        bare_llm.generate("a", CHOICE, use_tqdm=False)
    out = bare_llm.generate("a", SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3  # the engine serves requests without constraints


def test_a_requests_own_backend_that_is_blocked_is_refused_with_the_reason(bare_llm):
    with pytest.warns(DeprecationWarning):  # vLLM 0.x's per-request backend, still honoured
        guided = GuidedDecodingParams(choice=["yes", "no"], backend="guidance")
    params = SamplingParams(max_tokens=4, structured_outputs=guided)
    with pytest.raises(StructuredOutputError) as info:
        bare_llm.generate("a", params, use_tqdm=False)
    message = str(info.value)
    assert "grammar backend 'guidance' is not loaded: its package modelrunner-grammar-llguidance is installed" \
        in message
    assert "MODELRUNNER_BLOCK_PLUGINS" in message and info.value.backend == "guidance"


def test_a_configured_backend_that_is_blocked_fails_at_construction(tiny_llama_dir):
    plugins = get_plugins(block=["grammar-xgrammar"])
    with pytest.raises(UnknownNameError, match=r"grammar backend 'xgrammar' is not loaded: its package "
                                               r"modelrunner-grammar-xgrammar is installed .*installed grammar "
                                               r"backends: guidance"):
        LLM(str(tiny_llama_dir), plugins=plugins, structured_outputs_config={"backend": "xgrammar"}, **TINY)
    llm = LLM(str(tiny_llama_dir), plugins=plugins, **TINY)  # auto: guidance alone
    assert llm.engine.structured_outputs.auto_order() == ["guidance"]
    out = llm.generate("a", CHOICE, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")


def test_a_backend_whose_package_is_not_installed_names_the_package(monkeypatch):
    """As where neither distribution is installed: no entry points, no distributions."""
    entry_points, distribution = importlib.metadata.entry_points, importlib.metadata.distribution

    def without_ours(**kwargs):
        return importlib.metadata.EntryPoints(ep for ep in entry_points(**kwargs) if ep.name not in PLUGINS)

    def not_ours(name):
        if name in PLUGINS.values():
            raise importlib.metadata.PackageNotFoundError(name)
        return distribution(name)

    monkeypatch.setattr(importlib.metadata, "entry_points", without_ours)
    monkeypatch.setattr(importlib.metadata, "distribution", not_ours)
    plugins = Plugins()
    assert plugins.registry.names("grammar_backends") == []
    assert missing_backend_message("xgrammar", plugins) == (
        "grammar backend 'xgrammar' is not installed: it comes with the modelrunner-grammar-xgrammar package "
        "(pip install modelrunner-grammar-xgrammar); installed grammar backends: none")
    assert "pip install modelrunner-grammar-llguidance" in missing_backend_message("guidance", plugins)
    assert missing_backend_message("outlines", plugins).startswith("unknown grammar backend 'outlines'")


SCRIPT = """
import importlib.abc, json, sys

class Hide(importlib.abc.MetaPathFinder):
    tried = []
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("xgrammar", "llguidance"):
            self.tried.append(name)
            raise ImportError(f"{name} is hidden")
        return None

sys.meta_path.insert(0, Hide())
from modelrunner import LLM, SamplingParams, StructuredOutputError

llm = LLM(sys.argv[1], device="cpu", max_model_len=128, kv_cache_memory=8 << 20, compile=False)
try:
    llm.generate("a", SamplingParams(max_tokens=2, structured_outputs={"regex": "[ab]"}), use_tqdm=False)
    error = None
except StructuredOutputError as e:
    error = str(e)
text = llm.generate("a", SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)[0].outputs[0].text
print(json.dumps({"error": error, "tried": Hide.tried, "plain": text,
                  "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("xgrammar", "llguidance"))}))
"""


def test_the_kernel_imports_neither_grammar_library(tiny_llama_dir, monkeypatch):
    """A process with both plugins blocked never imports xgrammar or llguidance, not even to mask."""
    monkeypatch.setenv("MODELRUNNER_BLOCK_PLUGINS", ",".join(PLUGINS))
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tiny_llama_dir)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tried"] == [] and report["loaded"] == []
    assert "pip install modelrunner-grammar-xgrammar" in report["error"]


def test_a_backends_masking_kernel_that_raises_falls_back_to_the_kernels(tiny_llama_dir, monkeypatch, caplog):
    from modelrunner_grammar_xgrammar import XGrammarBackend

    def broken(self, logits, bitmask, rows):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(XGrammarBackend, "apply_bitmask", broken)
    llm = LLM(str(tiny_llama_dir), structured_outputs_config={"backend": "xgrammar"}, **TINY)
    out = llm.generate("a", CHOICE, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert "grammar backend 'xgrammar' failed to apply a token mask (RuntimeError: no kernel here)" in caplog.text
