"""Plugins that exit or hang are contained: a ``sys.exit`` at import is reported like any import
failure, and importing a plugin or running its ``load`` hook is bounded by a timeout that names it
(real distributions, real CLI processes; the bounds are set to seconds through the environment)."""

from __future__ import annotations

import json
import time

from plugin_dists import listed, make_distribution, run_cli

EXITS_AT_IMPORT = """
raise SystemExit(3)
"""

HANGS_AT_IMPORT = """
import time

time.sleep(600)
"""

HANGING_LOAD = """
import sys
import time

from modelrunner import hookimpl


@hookimpl
def register(registry):
    registry.architectures("SleepyForCausalLM", "ExitingForCausalLM")


@hookimpl
def load(source):
    if source.architecture == "ExitingForCausalLM":
        sys.exit(3)
    time.sleep(600)
"""


def test_a_plugin_calling_sys_exit_at_import_is_reported_by_name(tmp_path):
    root = make_distribution(tmp_path, "modelrunner-exits", "exits", "mr_exits_mod", EXITS_AT_IMPORT)
    plugins = listed(run_cli("plugins", "--json", pythonpath=root))
    assert plugins["exits"]["error"] == "SystemExit: 3 (the plugin called sys.exit while importing it)"
    assert plugins["sample"]["error"] is None
    text = run_cli("plugins", pythonpath=root)
    assert text.returncode == 0, text.stderr
    assert "exits  (modelrunner-exits 0.3)  hooks: BROKEN: SystemExit: 3" in text.stdout
    gen = run_cli("generate", "--model", "smollm2", "--set", "kv_allocator=warp", "hi", pythonpath=root)
    assert gen.returncode == 2, gen.stderr
    assert "unknown allocator 'warp'" in gen.stderr and "exits: SystemExit: 3" in gen.stderr
    assert "Traceback" not in gen.stderr


def test_a_plugin_hanging_at_import_is_reported_after_the_timeout(tmp_path):
    root = make_distribution(tmp_path, "modelrunner-hangs", "hangs", "mr_hangs_mod", HANGS_AT_IMPORT)
    started = time.monotonic()
    plugins = listed(run_cli("plugins", "--json", env={"MODELRUNNER_PLUGIN_TIMEOUT": "1"}, pythonpath=root))
    assert time.monotonic() - started < 60
    assert plugins["hangs"]["error"] == ("importing plugin 'hangs' did not finish within 1 s "
                                         "(MODELRUNNER_PLUGIN_TIMEOUT; 0 = no bound)")
    assert plugins["sample"]["error"] is None


def test_a_load_hook_that_hangs_or_exits_fails_naming_the_plugin(tmp_path, tiny_llama_dir):
    root = make_distribution(tmp_path / "dist", "modelrunner-sleepy", "sleepy", "mr_sleepy_mod", HANGING_LOAD)
    for arch in ("SleepyForCausalLM", "ExitingForCausalLM"):
        checkpoint = tmp_path / arch
        checkpoint.mkdir()
        config = json.loads((tiny_llama_dir / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps({**config, "architectures": [arch]}))
        for file in tiny_llama_dir.iterdir():
            if file.name != "config.json":
                (checkpoint / file.name).symlink_to(file)
    started = time.monotonic()
    hung = run_cli("generate", "--model", str(tmp_path / "SleepyForCausalLM"), "hi",
                   env={"MODELRUNNER_LOAD_TIMEOUT": "2", "MODELRUNNER_PLUGINS": "sleepy"}, pythonpath=root)
    assert time.monotonic() - started < 90
    assert hung.returncode == 2 and "Traceback" not in hung.stderr, hung.stderr
    assert ("plugin 'sleepy''s load hook did not finish within 2 s (MODELRUNNER_LOAD_TIMEOUT; 0 = no bound)"
            in hung.stderr)
    exited = run_cli("generate", "--model", str(tmp_path / "ExitingForCausalLM"), "hi",
                     env={"MODELRUNNER_PLUGINS": "sleepy"}, pythonpath=root)
    assert exited.returncode == 2 and "Traceback" not in exited.stderr, exited.stderr
    assert "plugin 'sleepy''s load hook called sys.exit(3)" in exited.stderr
