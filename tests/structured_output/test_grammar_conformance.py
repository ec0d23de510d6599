"""``modelrunner check`` runs the grammar-backend suite on the kernel's shipped backends (the new-plugin
skeleton's run is in ``tests/kernel/test_new_plugin.py``)."""

from __future__ import annotations

import json

from plugin_dists import run_cli


def test_check_passes_both_shipped_backends():
    result = run_cli("check", "default-grammars", "--json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["plugin"] == "default-grammars" and report["passed"] is True
    assert {r["suite"] for r in report["results"]} == {"grammar_backends:xgrammar", "grammar_backends:guidance"}
    assert {r["status"] for r in report["results"]} == {"passed"}  # every kind declared, nothing skipped
    checks = {r["check"] for r in report["results"]}
    assert {"json/valid", "json/invalid", "rollback", "batch-fill", "refusals", "engine"} <= checks
