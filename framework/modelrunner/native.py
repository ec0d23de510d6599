"""Loading the C++ operator libraries that packages built when they installed
(:mod:`modelrunner.native_build`): the best instruction-set variant this CPU runs, picked from what
``/proc/cpuinfo`` reports. Nothing is compiled here and nothing waits on a build lock.

``MODELRUNNER_NATIVE_VARIANT`` names the variant to load instead (``avx2``, ``generic`` …), to test
or measure another code path on a CPU that runs it.
"""

from __future__ import annotations

import functools
import importlib.machinery
import logging
import os
import platform
from collections.abc import Sequence
from pathlib import Path

import torch

from .errors import ModelRunnerError
from .native_build import VARIANTS, Variant, library_name, variants_for

log = logging.getLogger(__name__)

VARIANT_ENV = "MODELRUNNER_NATIVE_VARIANT"
"""Names the instruction-set variant to load instead of the best one this CPU runs."""


class NativeBuildError(ModelRunnerError, RuntimeError):
    """A package's C++ kernels are not available here: not built at install (no compiler then), no
    build this CPU can run, or a build that does not load (torch changed since it was built)."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags this CPU reports (``/proc/cpuinfo``); empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def runnable(variant: Variant) -> bool:
    """Whether this CPU runs code built for ``variant``."""
    if variant.name == "generic":
        return True
    return platform.machine().lower() in ("x86_64", "amd64") and variant.cpu_flags <= cpu_flags()


def _choices(names: Sequence[str]) -> list[Variant]:
    wanted = os.environ.get(VARIANT_ENV, "").strip()
    if not wanted:
        return [v for v in variants_for(names) if runnable(v)]
    known = {v.name: v for v in VARIANTS}
    if wanted not in known:
        raise NativeBuildError(f"{VARIANT_ENV}={wanted!r} is not a variant; known: {list(known)}")
    if wanted not in names:
        raise NativeBuildError(f"{VARIANT_ENV}={wanted!r}: this library is built only for {list(names)}")
    if not runnable(known[wanted]):
        missing = sorted(known[wanted].cpu_flags - cpu_flags())
        raise NativeBuildError(f"{VARIANT_ENV}={wanted!r}: this CPU cannot run it (it lacks {missing})")
    return [known[wanted]]


def built_file(package_dir: Path, stem: str, variant: str) -> Path | None:
    """The installed build of ``stem`` for ``variant`` in ``package_dir``, if pip built it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package_dir / (library_name(stem, variant) + suffix)
        if path.is_file():
            return path
    return None


def load_library(package_dir: Path, stem: str, variants: Sequence[str], what: str) -> str:
    """Load the best installed build of a package's operator library into this process.

    :param package_dir: the package folder the builds were installed into.
    :param stem: the library's stem in its :class:`~modelrunner.native_build.NativeLibrary` entry.
    :param variants: the variants it is built for (best first).
    :param what: the kernels in words, for messages (``the paged-attention kernel``).
    :returns: the loaded variant's name.
    :raises NativeBuildError: no build this CPU runs is installed, or it does not load; the message
        says which and how to rebuild.
    """
    choices = _choices(variants)
    for variant in choices:
        path = built_file(package_dir, stem, variant.name)
        if path is None:
            continue
        try:
            torch.ops.load_library(str(path))
        except (OSError, RuntimeError) as e:
            raise NativeBuildError(
                f"{what} ({path.name}) does not load: {e}; it was built for another torch — reinstall the "
                f"package with `pip install --no-build-isolation` to rebuild it") from e
        log.info("loaded %s, %s build (%s)", what, variant.name, path)
        return variant.name
    raise NativeBuildError(
        f"{what} {'is' if what.endswith('kernel') else 'are'} not built for this CPU: no "
        f"{' / '.join(library_name(stem, v.name) for v in choices)} library in {package_dir} (the build failed "
        f"or was skipped when the package installed — reinstall it with `pip install -v --no-build-isolation` "
        f"and a C++ compiler to see why)")


__all__ = ["NativeBuildError", "VARIANT_ENV", "built_file", "cpu_flags", "load_library", "runnable"]
