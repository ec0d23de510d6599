"""``modelrunner check`` runs the grammar-backend suite on each grammar-backend distribution of this
project (``plugins/grammar_*``; the new-plugin skeleton's run is in ``tests/kernel/test_new_plugin.py``)."""

from __future__ import annotations

import json

import pytest

from plugin_dists import run_cli


@pytest.mark.parametrize(("plugin", "backend"), [("grammar-xgrammar", "xgrammar"), ("grammar-llguidance", "guidance")])
def test_check_passes_each_grammar_plugin(plugin, backend):
    result = run_cli("check", plugin, "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["plugin"] == plugin and report["passed"] is True
    assert {r["suite"] for r in report["results"]} == {f"grammar_backends:{backend}"}
    assert {r["status"] for r in report["results"]} == {"passed"}  # every kind declared, nothing skipped
    checks = {r["check"] for r in report["results"]}
    assert {"json/valid", "json/invalid", "rollback", "batch-fill", "apply-bitmask", "refusals", "engine"} <= checks
