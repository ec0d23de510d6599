"""Builds the kernel's C++ layer ops when the package installs (``pip install --no-build-isolation``):
one library per instruction-set variant, next to ``modelrunner/layers/cpu_ops.py``. Everything else
about the package is in ``pyproject.toml``."""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup

# Read by path: importing the package itself would need its dependencies installed already.
_spec = importlib.util.spec_from_file_location(
    "modelrunner_native_build", Path(__file__).resolve().parent / "framework" / "modelrunner" / "native_build.py")
native_build = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = native_build
_spec.loader.exec_module(native_build)

setup(**native_build.setup_kwargs([
    native_build.NativeLibrary("modelrunner.layers", "framework/modelrunner/layers/cpu_ops.cpp", "cpu_ops"),
]))
