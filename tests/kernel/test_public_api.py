"""The plugin API is ``modelrunner.api``: every in-repo adapter and plugin imports the kernel through it
alone (which proves it is enough), and every name it lists exists."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import modelrunner.api as api

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_SOURCES = sorted(p for pattern in ("adapters_*/modelrunner_*/**/*.py", "plugins/*/modelrunner_*/**/*.py")
                        for p in ROOT.glob(pattern))


def _kernel_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a ``modelrunner`` module in ``path`` (any depth: functions,
    ``TYPE_CHECKING`` blocks)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "modelrunner"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "modelrunner":
            found.append((node.lineno, node.module))
    return found


def test_in_repo_plugins_import_the_kernel_only_through_modelrunner_api():
    assert len(PLUGIN_SOURCES) > 40  # every adapter and plugin package was found
    outside = [f"{path.relative_to(ROOT)}:{line}: {module}" for path in PLUGIN_SOURCES
               for line, module in _kernel_imports(path) if module != "modelrunner.api"]
    assert outside == [], "import these through modelrunner.api (add the name there if it is missing):\n" + \
        "\n".join(outside)


def test_every_name_the_api_lists_exists_and_each_kind_has_its_base_class():
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert missing == []
    from modelrunner.registry import CLASS_KINDS, base_class

    for kind in CLASS_KINDS:
        base = base_class(kind)
        assert getattr(api, base.__name__, None) is base, kind
    assert importlib.import_module("modelrunner.api").hookimpl is importlib.import_module("modelrunner").hookimpl
