"""What a conformance suite is: named checks on one plugin-provided name, run by pytest or by
``modelrunner check``.

A suite (:class:`Suite`) belongs to one kind and one name (``attention_backends`` / ``cpu_paged``).
Its :meth:`Suite.checks` are small, independent callables that raise :class:`ConformanceError`
(or any ``AssertionError``) naming what is wrong, or :class:`NotApplicable` when the check does not
apply to what the plugin declared (a backend without sliding-window support is not checked on
windows). Expensive set-up (a tiny checkpoint, a loaded model) is built once per suite, lazily, and
shared by its checks.

In a plugin's own tests, one line::

    test_conformance = modelrunner_kit.conformance.suite("attention_backends", "my_backend").as_pytest()

and on the command line: ``modelrunner check PLUGIN`` runs every suite of every name the plugin
registered.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import attrs


class ConformanceError(AssertionError):
    """A check found the plugin breaking the contract; the message says what and by how much."""


class NotApplicable(Exception):
    """The check does not apply to what the plugin declares (reported as skipped, not failed)."""


def expect(condition: bool, message: str) -> None:
    """Raise :class:`ConformanceError` with ``message`` unless ``condition``."""
    if not condition:
        raise ConformanceError(message)


def expect_close(got: Any, want: Any, atol: float, what: str) -> float:
    """Raise unless ``got`` and ``want`` (tensors) have the same shape and differ by at most ``atol``;
    returns the largest difference."""
    import torch

    got, want = torch.as_tensor(got), torch.as_tensor(want)
    expect(tuple(got.shape) == tuple(want.shape),
           f"{what}: shape {list(got.shape)}, expected {list(want.shape)}")
    diff = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    expect(diff <= atol, f"{what}: max |difference| {diff:.3g} exceeds {atol:g}")
    return diff


@attrs.frozen
class Check:
    """One named check of a suite."""

    name: str
    """Short and unique within the suite (``decode-only/gqa/window=3``)."""
    run: Callable[[], Any]
    """Raises on failure; returns anything (a measured value to report, or None)."""


@attrs.frozen
class CheckResult:
    """What running one check gave."""

    suite: str
    """``kind:name`` of the suite."""
    check: str
    """The check's name."""
    status: str
    """``passed``, ``failed`` or ``skipped``."""
    message: str = ""
    """Why it failed or was skipped; a measured value when it passed."""
    seconds: float = 0.0
    """How long it ran."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return attrs.asdict(self)


class Suite:
    """The checks of one plugin-provided name of one kind.

    :param name: the registered name under test.
    :param plugins: the loaded plugins to take it from (default: the process's).
    :param plugin: which plugin's ``name`` (when several provide it); None: the one the kernel would use.
    """

    kind: str = "?"
    """The registry kind this suite checks."""

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None) -> None:
        from modelrunner.plugins import get_plugins  # kernel internal: the process's loaded plugins

        self.name = name
        """The name under test."""
        self.plugins = plugins or get_plugins()
        """Where it comes from."""
        self.plugin = plugin
        """The providing plugin chosen (None: the kernel's choice)."""

    @property
    def title(self) -> str:
        """``kind:name``."""
        return f"{self.kind}:{self.name}"

    def provider(self) -> str:
        """The plugin under test: the chosen one, else (resolved once) the one the kernel would use.

        :raises ConformanceError: no loaded plugin provides the name (the message lists those that do
            and the broken plugins).
        """
        registry = self.plugins.registry
        if self.plugin is None:
            self.plugin = registry.owner(self.kind, self.name)
        if self.plugin is None:
            raise ConformanceError(registry.unknown(self.kind, self.name, self.plugins.broken))
        return self.plugin

    def checks(self) -> list[Check]:
        """The checks, in the order they run."""
        raise NotImplementedError

    def run(self, progress: Callable[[CheckResult], None] | None = None) -> list[CheckResult]:
        """Run every check (a failing one does not stop the others)."""
        results = []
        for check in self.checks():
            result = run_check(self.title, check)
            results.append(result)
            if progress is not None:
                progress(result)
        return results

    def as_pytest(self) -> Callable[..., None]:
        """A pytest test function parametrized over the checks (assign it to a ``test_*`` name)."""
        import pytest

        suite = self
        checks = self.checks()

        @pytest.mark.parametrize("check", checks, ids=[c.name for c in checks])
        def test_conformance(check: Check) -> None:
            try:
                check.run()
            except NotApplicable as e:
                pytest.skip(str(e))

        test_conformance.__doc__ = f"Conformance of {suite.title}."
        return test_conformance

    def __iter__(self) -> Iterator[Check]:
        return iter(self.checks())


def run_check(suite: str, check: Check) -> CheckResult:
    """Run one check, turning its outcome into a :class:`CheckResult`."""
    start = time.perf_counter()
    try:
        value = check.run()
    except NotApplicable as e:
        return CheckResult(suite, check.name, "skipped", str(e), time.perf_counter() - start)
    except AssertionError as e:
        return CheckResult(suite, check.name, "failed", str(e) or "assertion failed", time.perf_counter() - start)
    except Exception as e:  # noqa: BLE001 - a crash is a failure of the plugin, reported, not raised
        where = traceback.extract_tb(e.__traceback__)[-1]
        return CheckResult(suite, check.name, "failed",
                           f"raised {type(e).__name__}: {e} (at {where.filename}:{where.lineno})",
                           time.perf_counter() - start)
    return CheckResult(suite, check.name, "passed", "" if value is None else str(value), time.perf_counter() - start)


__all__ = ["Check", "CheckResult", "ConformanceError", "NotApplicable", "Suite", "expect", "expect_close",
           "run_check"]
