"""``modelrunner check PLUGIN`` on the kernel's own attention plugin: the suite in a fresh process."""

from __future__ import annotations

import json

from plugin_dists import run_cli


def test_check_prints_the_table_and_exits_0():
    result = run_cli("check", "default-sdpa")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "| suite | check | status | s | message |"
    assert any(line.startswith("| attention_backends:torch_sdpa | eager/decode-only/gqa4x2/window=3 | passed |")
               for line in lines)
    assert lines[-1] == "default-sdpa: 40 passed, 0 failed, 0 skipped"
    assert "checking attention_backends:torch_sdpa" in result.stderr


def test_check_json_parses():
    result = run_cli("check", "default-sdpa", "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["plugin"] == "default-sdpa" and report["passed"] is True
    assert {r["suite"] for r in report["results"]} == {"attention_backends:torch_sdpa"}
    assert {r["status"] for r in report["results"]} == {"passed"}
    assert "compiled/mixed-chunked-prefill/gqa4x2/window=3" in {r["check"] for r in report["results"]}
