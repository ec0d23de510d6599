"""The kernel's layers, as docs/architecture.md draws them: every import of a kernel module — at module
level or inside a function (``TYPE_CHECKING`` blocks aside: annotations only) — points to the same
layer or one below; every top-level module and package of the kernel is in exactly one layer; and an
import inside a function is there only to defer a heavy dependency, which its ``# lazy:`` comment says."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KERNEL = ROOT / "framework" / "modelrunner"
DOC = ROOT / "docs" / "architecture.md"


def layers_of_doc() -> dict[str, int]:
    """Unit (a top-level module or package of ``modelrunner``) → its layer number, from the table under
    the doc's "The layers" heading (rows ``| N name | `unit`, `unit` |``)."""
    text = DOC.read_text()
    section = text[text.index("### The layers"):]
    section = section[:section.index("\n#", 1)] if "\n#" in section[1:] else section
    layers: dict[str, int] = {}
    for number, units in re.findall(r"^\| (\d+) [^|]*\| ([^|]*) \|$", section, re.M):
        for unit in re.findall(r"`([\w.]+)`", units):
            assert unit not in layers, f"{unit} is in two layers"
            layers[unit] = int(number)
    return layers


def units() -> set[str]:
    """Every top-level module (without ``.py``) and package of the kernel; ``__init__`` for the package itself."""
    return {p.stem for p in KERNEL.glob("*.py")} | {p.name for p in KERNEL.iterdir()
                                                     if p.is_dir() and (p / "__init__.py").exists()}


def unit_of(path: Path) -> str:
    parts = path.relative_to(KERNEL).parts
    return parts[0] if len(parts) > 1 else path.stem


def kernel_imports(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, target unit, inside a function)`` for every import of a kernel module in ``path``,
    ``TYPE_CHECKING`` blocks left out."""
    package = ".".join(("modelrunner",) + path.relative_to(KERNEL).parts[:-1])
    found: list[tuple[int, str, bool]] = []

    def target(node: ast.ImportFrom | ast.Import) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        if not node.level:
            return [node.module or ""]
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
        return [f"{module}.{a.name}" for a in node.names] if not node.module else [module]

    def visit(nodes: list[ast.stmt], in_function: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse, in_function)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in target(node):
                    parts = name.split(".")
                    if parts[0] == "modelrunner":
                        found.append((node.lineno, parts[1] if len(parts) > 1 else "__init__", in_function))
                continue
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            for field in ("body", "orelse", "finalbody", "handlers"):
                block = getattr(node, field, None)
                if isinstance(block, list):
                    visit([n for n in block if isinstance(n, ast.stmt)] +
                          [s for h in block if isinstance(h, ast.ExceptHandler) for s in h.body], inner)

    visit(ast.parse(path.read_text()).body, False)
    return found


def test_every_kernel_module_is_in_one_layer_of_the_doc():
    layers = layers_of_doc()
    assert sorted(units() - set(layers)) == [], "add these to the table under 'The layers' in docs/architecture.md"
    assert sorted(set(layers) - units()) == [], "the table under 'The layers' names modules that are gone"


def test_no_import_points_up_a_layer_and_function_level_imports_are_marked_lazy():
    layers = layers_of_doc()
    upward, unmarked = [], []
    for path in sorted(KERNEL.rglob("*.py")):
        source = path.read_text().splitlines()
        here = unit_of(path)
        for line, there, in_function in kernel_imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if there != here and layers.get(there, -1) > layers.get(here, -1):
                upward.append(f"{where}: {here} (layer {layers.get(here)}) imports {there} (layer {layers.get(there)})")
            if in_function and "# lazy:" not in source[line - 1]:
                unmarked.append(f"{where}: {source[line - 1].strip()}")
    assert upward == [], "imports that point up a layer:\n" + "\n".join(upward)
    assert unmarked == [], ("imports inside functions without a '# lazy: <the heavy dependency>' comment (move "
                            "them to the top of the module; a cycle is removed by moving code, not by hiding "
                            "an import):\n" + "\n".join(unmarked))


def test_the_engine_step_is_schedule_forward_update_and_the_engine_stays_small():
    # Issue 54's bound: LLMEngine keeps requests and the loop; the work of a step lives in the scheduler,
    # BatchForward and StepUpdate (one call each).
    source = (KERNEL / "engine" / "llm_engine.py").read_text()
    tree = ast.parse(source)
    (engine,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "LLMEngine"]
    lines = engine.end_lineno - engine.lineno + 1
    assert lines <= 420, f"LLMEngine is {lines} lines (bound 420, module 450): move work into its parts"
    assert len(source.splitlines()) <= 450
    (step,) = [node for node in engine.body if isinstance(node, ast.FunctionDef) and node.name == "_run_step"]
    calls = {ast.unparse(node.func) for node in ast.walk(step) if isinstance(node, ast.Call)}
    assert {"self.scheduler.schedule", "self.forward.run", "self.update.apply"} <= calls
