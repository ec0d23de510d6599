"""The CLI finds its subcommands through the ``modelrunner.subcommands`` entry points: the
``modelrunner-serve`` distribution declares ``serve`` and ``modelrunner-bench`` ``bench`` (and
``modelrunner-kit`` ``check`` and ``new-plugin``: test_kit_distribution.py); the kernel neither imports the
server nor depends on its web stack."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from cli_runs import hide_distribution, run_main

from modelrunner import cli

ROOT = Path(__file__).resolve().parents[2]
SERVER_ONLY = {"modelrunner_serve", "fastapi", "starlette", "uvicorn", "prometheus_client", "httpx"}


def test_the_subcommands_come_from_entry_points():
    declared = {ep.name: ep for ep in entry_points(group=cli.SUBCOMMAND_GROUP)}
    assert {"bench", "check", "new-plugin", "serve"} <= set(declared)
    assert declared["serve"].dist.name == "modelrunner-serve" and declared["serve"].value == "modelrunner_serve.cli"
    assert declared["bench"].dist.name == "modelrunner-bench" and declared["bench"].value == "modelrunner_bench.cli"


@pytest.mark.parametrize(("command", "dist", "argvs"), [
    ("serve", "modelrunner-serve", (["serve"], ["serve", "--model", "smollm2", "--port", "0"], ["serve", "--help"])),
    ("bench", "modelrunner-bench", (["bench"], ["bench", "compare", "--vary", "compile=false,true"],
                                    ["bench", "--help"])),
])
def test_a_subcommand_without_its_distribution_says_what_to_install(command, dist, argvs, monkeypatch, capsys):
    hide_distribution(monkeypatch, dist)
    for argv in argvs:
        code, out, err = run_main(argv, capsys)
        assert (code, out) == (2, ""), err
        assert err == f"modelrunner: error: 'modelrunner {command}' needs the {dist} distribution: pip install {dist}\n"
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0 and f"not installed: pip install {dist}" in out
    code, _, err = run_main(["plugins", "--no-such-option"], capsys)  # the others still parse their arguments
    assert code == 2 and "unrecognized arguments: --no-such-option" in err


def test_a_subcommand_that_fails_to_import_is_reported_by_name(tmp_path, monkeypatch, capsys):
    info = tmp_path / "modelrunner_exploding-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: modelrunner-exploding\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[modelrunner.subcommands]\nexplode = exploding_command\n")
    (tmp_path / "exploding_command.py").write_text("raise ImportError('no wheel for this platform')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run_main(["explode", "--anything"], capsys)
    assert (code, out) == (2, "")
    assert err == ("modelrunner: error: modelrunner-exploding installs it, but exploding_command failed to import: "
                   "ImportError: no wheel for this platform\n")
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0 and "broken (modelrunner-exploding)" in out


def _imported_tops(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            tops.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            tops.add(node.module.split(".")[0])
    return tops


def test_the_kernel_neither_imports_nor_requires_the_server():
    kernel = ROOT / "framework" / "modelrunner"
    offenders = {str(p.relative_to(ROOT)): sorted(_imported_tops(p) & SERVER_ONLY) for p in kernel.rglob("*.py")}
    assert not {p: names for p, names in offenders.items() if names}
    assert not (kernel / "serve").exists()
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [r for r in requires if r.split(">")[0].split("=")[0].replace("-", "_") in SERVER_ONLY]


def test_the_kernel_imports_none_of_the_distributions_split_from_it():
    split = {"modelrunner_serve", "modelrunner_bench", "modelrunner_data_parallel"}
    kernel = ROOT / "framework" / "modelrunner"
    offenders = {str(p.relative_to(ROOT)): sorted(_imported_tops(p) & split) for p in kernel.rglob("*.py")}
    assert not {p: names for p, names in offenders.items() if names}
    assert not (kernel / "bench").exists() and not (kernel / "data_parallel").exists()


def test_the_data_parallel_replica_and_the_cli_load_no_web_stack():
    code = ("import sys, modelrunner.cli, modelrunner.llm, modelrunner_data_parallel.replica\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(SERVER_ONLY)!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
