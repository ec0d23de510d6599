"""The C++ kernels are compiled when their packages install, never at run time: a run leaves
``TORCH_EXTENSIONS_DIR`` untouched, a build lock left there by a killed process stops nothing, a
process killed anywhere in start-up leaves nothing that stops the next one, and a package whose build
fails still installs."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATE = [sys.executable, "-m", "modelrunner.cli", "generate", "--max-tokens", "4", "The capital of France is"]


def _env(tmp_path: Path) -> dict[str, str]:
    # Empty caches, and a stale build lock as a builder SIGKILLed mid-build left it (the old hang).
    extensions = tmp_path / "torch_extensions"
    (extensions / "modelrunner_cpu_ops_0123456789ab").mkdir(parents=True)
    (extensions / "modelrunner_cpu_ops_0123456789ab" / "lock").touch()
    (extensions / "modelrunner_quant_cpu_0123456789ab").mkdir()
    (extensions / "modelrunner_quant_cpu_0123456789ab" / "lock").touch()
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ind")}


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.slow
def test_generate_builds_nothing_and_ignores_a_stale_build_lock(tmp_path):
    env = _env(tmp_path)
    before = _tree(Path(env["TORCH_EXTENSIONS_DIR"]))
    result = subprocess.run(GENERATE, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
    assert _tree(Path(env["TORCH_EXTENSIONS_DIR"])) == before


@pytest.mark.slow
def test_a_process_killed_anywhere_in_start_up_leaves_the_next_one_free_to_run(tmp_path):
    env = _env(tmp_path)
    # Killed while importing, while reading the checkpoint, while choosing kernels / generating.
    for delay in (0.5, 2.0, 4.0):
        proc = subprocess.Popen(GENERATE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    result = subprocess.run(GENERATE, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout


def test_a_package_whose_build_fails_still_installs(tmp_path):
    # As on a machine without a C++ compiler: pip reports it, the wheel has no library, and the
    # package's pure-torch path runs (tests/layers: test_without_its_installed_build_*).
    source = tmp_path / "attention_cpu"
    shutil.copytree(ROOT / "plugins" / "attention_cpu", source,
                    ignore=shutil.ignore_patterns("*.so", "*.egg-info", "build", "__pycache__"))
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "CXX": str(tmp_path / "no-such-c++")}
    result = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                             "-w", str(tmp_path / "wheels"), str(source)],
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "C++ kernels not built" in result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "modelrunner_attention_cpu/paged_decode_attention.cpp" in names
    assert not [n for n in names if n.endswith(".so")]


def test_no_project_code_builds_native_code_at_run_time():
    offenders = []
    for folder in ("framework", "packages", "plugins", "adapters_llama", "adapters_moe", "adapters_mm"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "setup.py":
                continue
            text = path.read_text(encoding="utf-8")
            if re.search(r"cpp_extension\.load|load_inline|FileBaton", text):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders
