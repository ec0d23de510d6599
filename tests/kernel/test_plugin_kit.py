"""The plugin API's promises to third parties: a versioned API range, deprecated hook arguments that
still work (warning once), declared capabilities, the capability matrix, and unsupported
combinations refused before anything loads."""

from __future__ import annotations

import importlib
import json
import sys
import warnings

import pytest

from modelrunner import LLM, PLUGIN_API_VERSION, SamplingParams
from modelrunner.capabilities import UnsupportedCombinationError
from modelrunner_kit.conformance.models import make_llm, tiny_checkpoint
from modelrunner.plugins import Plugins

from plugin_dists import listed, make_distribution, run_cli


@pytest.fixture
def install(tmp_path):
    """Lay out a plugin distribution and put it on ``sys.path`` for this test."""
    added: list[tuple[str, str]] = []

    def _install(entry: str, source: str) -> str:
        module = f"mr_kit_{entry.replace('-', '_')}"
        root = make_distribution(tmp_path / entry, f"mr-kit-{entry}", entry, module, source)
        sys.path.insert(0, str(root))
        importlib.invalidate_caches()
        added.append((str(root), module))
        return str(root)

    yield _install
    for root, module in added:
        sys.path.remove(root)
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


FUTURE = """
from modelrunner import hookimpl
PLUGIN_API = ">=2.0,<3"

@hookimpl
def register(registry):
    registry.allocators("future-alloc")
"""


def test_a_plugin_built_for_another_api_is_broken_with_both_versions_and_the_rest_load(install):
    install("future", FUTURE)
    plugins = Plugins(allow=["future"])
    error = plugins.broken["future"]
    assert ">=2.0,<3" in error and f"plugin API {PLUGIN_API_VERSION}" in error
    assert "future-alloc" not in plugins.registry.names("allocators")
    assert "paged" in plugins.registry.names("allocators")  # the kernel's own still load
    info = plugins.infos["future"]
    assert info.api == ">=2.0,<3" and info.error == error


def test_the_cli_lists_it_as_broken(tmp_path):
    root = make_distribution(tmp_path / "d", "mr-kit-future", "future", "mr_kit_future_cli", FUTURE)
    plugins = listed(run_cli("plugins", "--json", pythonpath=root))
    assert ">=2.0,<3" in plugins["future"]["error"] and PLUGIN_API_VERSION in plugins["future"]["error"]
    assert plugins["future"]["api"] == ">=2.0,<3"
    assert plugins["sample"]["error"] is None


def test_a_compatible_range_loads_and_a_malformed_one_is_named(install):
    install("current", FUTURE.replace(">=2.0,<3", ">=1.0,<2").replace("future-alloc", "current-alloc"))
    install("garbled", FUTURE.replace(">=2.0,<3", "version one").replace("future-alloc", "garbled-alloc"))
    plugins = Plugins(allow=["current", "garbled"])
    assert "current" not in plugins.broken and "current-alloc" in plugins.registry.names("allocators")
    assert "'version one' is not a version specifier" in plugins.broken["garbled"]


OLD_COMPILE = """
from modelrunner import hookimpl

CALLS = []

@hookimpl
def register(registry):
    registry.compile_backends("old-style")

@hookimpl
def compile(name, model, loaded, config):
    # Written against plugin API 1.0: wraps ``model`` rather than ``loaded.runnable``.
    CALLS.append(model is loaded.runnable)

    def run(*args, **kwargs):
        CALLS.append("forward")
        return model(*args, **kwargs)

    return run
"""


def test_a_deprecated_hook_argument_warns_once_naming_plugin_and_migration_and_still_works(install, tiny_llama_dir):
    install("old-compile", OLD_COMPILE)
    with pytest.warns(DeprecationWarning, match=r"plugin 'old-compile': the compile hook's argument 'model' is "
                                                r"deprecated: take `loaded` and wrap `loaded.runnable`"):
        plugins = Plugins(allow=["old-compile"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        Plugins(allow=["old-compile"])  # once per process
    module = sys.modules["mr_kit_old_compile"]
    llm = make_llm(tiny_llama_dir, plugins=plugins, compile=True, compile_backend="old-style")
    out = llm.generate(["hello there"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert module.CALLS[0] is True and module.CALLS.count("forward") >= 3


def test_an_unknown_capability_breaks_only_its_plugin(install):
    install("typo", """
from modelrunner import hookimpl

@hookimpl
def register(registry):
    registry.architectures("TypoForCausalLM", tensor_paralel=True)
""")
    plugins = Plugins(allow=["typo"])
    assert "unknown architectures capability 'tensor_paralel'" in plugins.broken["typo"]
    assert "did you mean 'tensor_parallel'" in plugins.broken["typo"]


def test_the_matrix_shows_what_each_piece_declares():
    result = run_cli("plugins", "--matrix", "--json")
    assert result.returncode == 0, result.stderr
    matrix = json.loads(result.stdout)
    archs = {(r["name"], r["plugin"]): r for r in matrix["architectures"]}
    llama = archs[("LlamaForCausalLM", "llama")]
    assert llama["tensor_parallel"] is True and llama["quantization"] == ["*"]
    generic = archs[("AutoModelForCausalLM", "default-transformers")]
    assert generic["tensor_parallel"] is False and generic["quantization"] == ["none"]
    backends = {r["name"]: r for r in matrix["attention_backends"]}
    assert backends["torch_sdpa"]["supports_sliding_window"] is True
    assert {r["name"]: r for r in matrix["allocators"]}["contiguous"]["prefix_caching"] is False
    assert {r["name"]: r for r in matrix["quantization_methods"]}["int8"]["devices"] == ["cpu", "cuda"]
    table = run_cli("plugins", "--matrix")
    assert table.returncode == 0, table.stderr
    assert "architectures:" in table.stdout and "| LlamaForCausalLM | llama | yes |" in table.stdout


@pytest.fixture(scope="module")
def generic_dir(tmp_path_factory):
    """A checkpoint of an architecture no installed adapter registers (the generic adapter loads it)."""
    return tiny_checkpoint("GPTNeoXForCausalLM", tmp_path_factory.mktemp("generic"))


def test_quantization_with_an_adapter_that_does_not_run_it_is_refused_before_loading(generic_dir):
    with pytest.raises(UnsupportedCombinationError,
                       match=r"adapter 'default-transformers' \(architecture GPTNeoXForCausalLM\) does not run "
                             r"quantization 'int8'; it supports: none"):
        LLM(str(generic_dir), quantization="int8")


def test_tensor_parallel_with_an_adapter_that_declares_none_is_refused(generic_dir):
    with pytest.raises(UnsupportedCombinationError,
                       match=r"adapter 'default-transformers' .* does not support tensor_parallel_size=2 "
                             r"\(it declares tensor_parallel=False\)"):
        LLM(str(generic_dir), tensor_parallel_size=2)


def test_an_attention_backend_with_an_adapter_that_runs_its_own_attention_is_refused(generic_dir):
    with pytest.raises(UnsupportedCombinationError,
                       match=r"adapter 'default-transformers' .* runs the model's own attention, not attention "
                             r"backends, so attention_backend='torch_sdpa' would be ignored"):
        LLM(str(generic_dir), attention_backend="torch_sdpa")


NO_WINDOW = """
from modelrunner import hookimpl
from modelrunner.layers.sdpa_attention import TorchSDPABackend

class NoWindowBackend(TorchSDPABackend):
    name = "no_window"
    priority = -100
    supports_sliding_window = False

@hookimpl
def register(registry):
    registry.attention_backends(NoWindowBackend)
"""


def test_a_backend_without_sliding_windows_is_refused_for_a_sliding_window_model(install, tmp_path):
    install("no-window", NO_WINDOW)
    plugins = Plugins(allow=["no-window", "llama"])
    mistral = tiny_checkpoint("MistralForCausalLM", tmp_path)
    with pytest.raises(ValueError, match=r"attention backend 'no_window' .*sliding.window.*8"):
        make_llm(mistral, plugins=plugins, attention_backend="no_window")
    # Without a window the same backend is fine.
    llama = tiny_checkpoint("LlamaForCausalLM", tmp_path)
    make_llm(llama, plugins=plugins, attention_backend="no_window", kv_cache_memory=8 << 20)
