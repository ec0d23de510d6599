"""``modelrunner new-plugin``: a working skeleton of a plugin distribution, for each kind."""

from __future__ import annotations

import re
from pathlib import Path

from .templates import KINDS, MODULES, PYPROJECT, README, SUMMARIES, TEST, TEST_OPTIONS, USAGE

NAME = re.compile(r"^[a-z][a-z0-9_]{0,40}$")
"""Plugin names: lowercase letters, digits and underscores, starting with a letter."""


def new_plugin(kind: str, name: str, directory: str | Path = ".") -> Path:
    """Write the skeleton of a ``kind`` plugin called ``name`` into ``directory/modelrunner-<name>``.

    :returns: the distribution's folder.
    :raises ValueError: an unknown kind, a bad name, or a folder that already exists (nothing is overwritten).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
    if not NAME.match(name):
        raise ValueError(f"plugin name {name!r} must be lowercase letters, digits and underscores, starting with "
                         "a letter (it becomes the entry point, the module and the registered name)")
    dist = "modelrunner-" + name.replace("_", "-")
    module = f"modelrunner_{name}"
    cls = "".join(part.capitalize() for part in name.split("_"))
    target = Path(directory) / dist
    if target.exists():
        raise ValueError(f"{target} already exists; pick another name or --dir")
    fields = {"name": name, "cls": cls, "dist": dist, "module": module, "entry": name}
    fields["summary"] = SUMMARIES[kind].format(**fields)
    registered = f"{cls}ForCausalLM" if kind == "adapter" else name
    imports, options = TEST_OPTIONS.get(kind, ("", ""))
    files = {
        "pyproject.toml": PYPROJECT.format(**fields),
        "README.md": README.format(**fields, usage=USAGE[kind].format(**fields)),
        f"{module}/__init__.py": MODULES[kind].format(**fields),
        "tests/test_conformance.py": TEST.format(kind=KINDS[kind], name=registered, imports=imports,
                                                  options=options.format(**fields)),
    }
    for relative, text in files.items():
        path = target / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return target


__all__ = ["KINDS", "new_plugin"]
