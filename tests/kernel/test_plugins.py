"""Plugin discovery through real entry points: installed, allowlisted, blocked, broken, misspelled."""

from __future__ import annotations


import pytest

from modelrunner.errors import UnknownNameError
from modelrunner.plugins import DEFAULT_PLUGINS, Plugins

from plugin_dists import listed, make_distribution, run_cli


BROKEN = """
raise ImportError("needs the 'warp-drive' package")
"""

MISSPELLED = """
from modelrunner import hookimpl

@hookimpl
def laod(source):
    return None
"""

GOOD_EXTRA = """
from modelrunner import hookimpl

@hookimpl
def register(registry):
    registry.allocators("extra-alloc")
"""


def test_installed_sample_plugin_is_listed_with_hooks_and_names():
    plugins = listed(run_cli("plugins", "--json"))
    sample = plugins["sample"]
    assert sample["distribution"] == "modelrunner-sample-plugin" and sample["version"] == "0.0.1"
    assert sample["hooks"] == ["compile", "register"]
    assert sample["provides"] == {"compile_backends": ["counting"]}
    assert sample["error"] is None
    for default in DEFAULT_PLUGINS:
        assert plugins[default]["distribution"] == "modelrunner"
    assert plugins["default-paged"]["provides"]["allocators"] == ["paged"]


def test_sample_plugin_is_actually_called(tiny_llama_dir):
    import modelrunner_sample

    from modelrunner import LLM, SamplingParams

    before = dict(modelrunner_sample.CALLS)
    llm = LLM(model=str(tiny_llama_dir), compile=True, compile_backend="counting")
    out = llm.generate(["hello there"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert modelrunner_sample.CALLS["compile"] == before["compile"] + 1
    assert modelrunner_sample.CALLS["forward"] >= before["forward"] + 3


def test_allowlist_limits_entry_points_and_empty_means_none():
    only_sample = listed(run_cli("plugins", "--json", env={"MODELRUNNER_PLUGINS": "sample"}))
    assert set(only_sample) == {"sample", *DEFAULT_PLUGINS}
    none = listed(run_cli("plugins", "--json", env={"MODELRUNNER_PLUGINS": ""}))
    assert set(none) == set(DEFAULT_PLUGINS)


def test_a_blocked_plugin_is_not_loaded_and_its_names_are_unknown():
    plugins = Plugins(block=["sample"])
    assert "sample" not in {i.name for i in plugins.list()}
    with pytest.raises(UnknownNameError, match="unknown compile backend 'counting'; installed: .*eager"):
        plugins.require("compile_backends", "counting")


def test_defaults_run_last_so_installed_plugins_override_them(tmp_path):
    plugins = Plugins()
    impls = plugins.hook.compile.get_hookimpls()
    # pluggy calls the list back to front: the default must be called after the sample plugin.
    order = [i.plugin_name for i in reversed(impls)]
    assert order.index("sample") < order.index("default-eager")
    assert all(i.trylast for i in impls if i.plugin_name in DEFAULT_PLUGINS)


def test_broken_plugin_is_reported_and_others_still_work(tmp_path):
    root = make_distribution(tmp_path, "modelrunner-broken", "broken", "mr_broken_mod", BROKEN)
    make_distribution(root, "modelrunner-extra", "extra", "mr_extra_mod", GOOD_EXTRA)
    plugins = listed(run_cli("plugins", "--json", pythonpath=root))
    assert plugins["broken"]["error"] == "ImportError: needs the 'warp-drive' package"
    assert plugins["broken"]["distribution"] == "modelrunner-broken"
    assert plugins["extra"]["provides"] == {"allocators": ["extra-alloc"]} and plugins["extra"]["error"] is None
    assert plugins["sample"]["error"] is None
    text = run_cli("plugins", pythonpath=root)
    assert "broken  (modelrunner-broken 0.3)  hooks: BROKEN: ImportError: needs the 'warp-drive' package" in text.stdout
    # Asking for something nobody else provides names the broken plugin and why.
    gen = run_cli("generate", "--model", "smollm2", "--set", "kv_allocator=warp", "hi", pythonpath=root)
    assert gen.returncode == 2
    assert "unknown allocator 'warp'" in gen.stderr and "broken: ImportError: needs the 'warp-drive' package" in gen.stderr
    assert "Traceback" not in gen.stderr


def test_misspelled_hook_fails_loudly(tmp_path):
    root = make_distribution(tmp_path, "modelrunner-typo", "typo", "mr_typo_mod", MISSPELLED)
    result = run_cli("plugins", pythonpath=root)
    assert result.returncode == 2
    assert "plugin 'typo' implements a hook that does not exist" in result.stderr and "laod" in result.stderr
    # Blocking it by name lets everything else load.
    ok = listed(run_cli("plugins", "--json", env={"MODELRUNNER_BLOCK_PLUGINS": "typo"}, pythonpath=root))
    assert "typo" not in ok and "sample" in ok


def test_loading_is_idempotent():
    from modelrunner.plugins import get_plugins

    first = get_plugins()
    assert get_plugins() is first
    assert first.registry.owner("compile_backends", "counting") == "sample"


def test_every_name_the_kernel_sends_to_a_project_distribution_is_provided_by_it():
    """``registry.PROJECT_NAMES`` restates what this project's distributions provide (it must answer
    when they are absent); with them all installed, each entry is what that distribution declares."""
    from modelrunner.plugins import get_plugins
    from modelrunner.registry import PROJECT_NAMES

    provided: dict[tuple[str, str], set[str]] = {}
    for info in get_plugins().infos.values():
        for kind, names in info.provides.items():
            provided.setdefault((info.distribution, kind), set()).update(names)
    for kind, names in PROJECT_NAMES.items():
        for name, dist in names.items():
            assert name in provided.get((dist, kind), set()), (kind, name, dist)
