"""Small plugin distributions laid out on disk for a subprocess's ``sys.path``, and running the CLI there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path


def make_distribution(root: Path, dist: str, entry: str, module: str, source: str) -> Path:
    """Lay out an 'installed' distribution (dist-info + module) under ``root`` for sys.path."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist.replace('-', '_')}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[modelrunner]\n{entry} = {module}\n")
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    return root


def run_cli(*args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None):
    full_env = {**os.environ, **(env or {})}
    if pythonpath is not None:
        full_env["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{full_env.get('PYTHONPATH', '')}"
    return subprocess.run([sys.executable, "-m", "modelrunner.cli", *args], capture_output=True, text=True,
                          env=full_env, timeout=120)


def listed(result) -> dict[str, dict]:
    assert result.returncode == 0, result.stderr
    return {p["name"]: p for p in json.loads(result.stdout)}


def hide_distribution(monkeypatch, dist: str) -> None:
    """Make the entry points the kernel looks features up by (``plugins.feature_class``) skip those of
    ``dist``, as if it were not installed (the plugins already loaded stay)."""
    import modelrunner.plugins as kernel_plugins

    real = kernel_plugins.entry_points

    def without(**selection):
        return [ep for ep in real(**selection) if ep.dist is None or ep.dist.name != dist]

    monkeypatch.setattr(kernel_plugins, "entry_points", without)
