"""What the architecture promises about who imports whom: no import cycle through the attention
layer, and no adapter importing another adapter."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _runtime_imports(path: Path, package: str) -> set[str]:
    """Absolute names of the modules ``path`` imports when it runs (``TYPE_CHECKING`` blocks left out)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    visit(inner)

    visit(tree.body)
    return found


def test_importing_the_attention_layer_imports_nothing_that_imports_it_back():
    probe = "import json, sys, modelrunner.layers.attention as a; print(json.dumps({m: getattr(sys.modules[m], '__file__', None) for m in sys.modules if m.startswith('modelrunner')}))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                       check=True).stdout)
    target = "modelrunner.layers.attention"
    offenders = []
    for name, file in loaded.items():
        if name == target or file is None or name in ("modelrunner", "modelrunner.layers"):
            continue
        package = name if file.endswith("__init__.py") else name.rpartition(".")[0]
        if target in _runtime_imports(Path(file), package):
            offenders.append(name)
    assert not offenders, f"modules loaded by {target} that import it back: {offenders}"


def test_no_adapter_imports_another_adapter():
    adapters = {p.name: next(p.glob("modelrunner_*")).name for p in ROOT.glob("adapters_*")}
    for folder, package in adapters.items():
        others = {pkg for f, pkg in adapters.items() if f != folder}
        for source in (ROOT / folder / package).rglob("*.py"):
            imported = _runtime_imports(source, package)
            assert not {m.split(".")[0] for m in imported} & others, f"{source} imports another adapter"
