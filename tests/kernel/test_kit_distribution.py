"""The plugin kit (conformance suites, ``modelrunner check``, ``modelrunner new-plugin``, test helpers) is
its own distribution, ``modelrunner-kit`` (packages/kit, package ``modelrunner_kit``): the kernel neither
holds nor imports it, its subcommands come from its entry points, and without it they say what to install.
The kit imports the kernel through ``modelrunner.api`` and ``modelrunner``, and marks every internal it needs."""

from __future__ import annotations

import ast
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from cli_runs import hide_distribution, run_main

from modelrunner import cli

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "framework" / "modelrunner"
KIT = ROOT / "packages" / "kit"
KIT_COMMANDS = {"check": "modelrunner_kit.conformance.cli", "new-plugin": "modelrunner_kit.scaffold.cli"}


def test_check_and_new_plugin_are_the_kits_entry_points():
    declared = {ep.name: ep for ep in entry_points(group=cli.SUBCOMMAND_GROUP)}
    assert {name: (declared[name].dist.name, declared[name].value) for name in KIT_COMMANDS} == \
        {name: ("modelrunner-kit", module) for name, module in KIT_COMMANDS.items()}
    kit = tomllib.loads((KIT / "pyproject.toml").read_text())["project"]
    assert kit["name"] == "modelrunner-kit" and kit["entry-points"]["modelrunner.subcommands"] == KIT_COMMANDS
    kernel = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not set(kernel.get("entry-points", {}).get("modelrunner.subcommands", {})) & set(KIT_COMMANDS)


@pytest.mark.parametrize("argv", [["check"], ["check", "default-paged", "--json"], ["check", "--help"],
                                  ["new-plugin"], ["new-plugin", "allocator", "my_alloc"], ["new-plugin", "--help"]])
def test_without_the_kit_check_and_new_plugin_say_what_to_install(argv, monkeypatch, capsys):
    hide_distribution(monkeypatch, "modelrunner-kit")
    code, out, err = run_main(argv, capsys)
    assert (code, out) == (2, ""), err
    assert err == (f"modelrunner: error: 'modelrunner {argv[0]}' needs the modelrunner-kit distribution: "
                   "pip install modelrunner-kit\n")


def test_without_the_kit_help_lists_its_commands_as_not_installed(monkeypatch, capsys):
    hide_distribution(monkeypatch, "modelrunner-kit")
    code, out, _ = run_main(["--help"], capsys)
    assert code == 0 and out.count("not installed: pip install modelrunner-kit") == 2, out


def _kit_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every ``modelrunner`` import in ``path`` (any depth)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "modelrunner"]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] == "modelrunner":
            found.append((node.lineno, node.module))
    return found


def _marked(lines: list[str], line: int) -> bool:
    """Whether the import on ``line`` (1-based), or the run of imports and comments right above it, says
    ``# kernel internal``."""
    index = line - 1
    while index >= 0:
        text = lines[index].strip()
        if "# kernel internal" in text.lower():
            return True
        if index < line - 1 and not text.startswith(("from ", "import ", "#")):
            return False
        index -= 1
    return False


def test_the_kernel_neither_holds_nor_imports_the_kit():
    assert not [d for d in ("conformance", "scaffold", "testing") if (KERNEL / d).exists()]
    assert not (KERNEL / "kv_cache" / "testing.py").exists()
    offenders = []
    for path in KERNEL.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n.split(".")[0] == "modelrunner_kit" for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def test_the_kit_imports_the_kernel_through_its_public_modules_or_says_why_not():
    sources = sorted((KIT / "modelrunner_kit").rglob("*.py"))
    assert len(sources) > 20
    unmarked = []
    for path in sources:
        lines = path.read_text(encoding="utf-8").splitlines()
        for line, module in _kit_imports(path):
            if module in ("modelrunner", "modelrunner.api"):
                continue
            if not _marked(lines, line):
                unmarked.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert unmarked == [], "use modelrunner.api / modelrunner, or say why with '# kernel internal: ...':\n" + \
        "\n".join(unmarked)
