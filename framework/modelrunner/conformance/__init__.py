"""Conformance suites, one per plugin kind, for a plugin's own CI and for ``modelrunner check``.

``suite(kind, name)`` builds the suite of one registered name; ``suites_for_plugin(plugin)`` every
suite of the names one plugin registered. See :mod:`.base` for what a suite is.
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import Check, CheckResult, ConformanceError, NotApplicable, Suite, expect, expect_close

SUITES = {
    "architectures": "modelrunner.conformance.adapter:AdapterSuite",
    "attention_backends": "modelrunner.conformance.attention:AttentionBackendSuite",
    "allocators": "modelrunner.conformance.allocator:AllocatorSuite",
    "compile_backends": "modelrunner.conformance.compile:CompileBackendSuite",
    "quantization_methods": "modelrunner.conformance.quantization:QuantizationMethodSuite",
    "logits_processors": "modelrunner.conformance.logits:LogitsProcessorSuite",
    "matmul_kernels": "modelrunner.conformance.matmul:MatmulKernelSuite",
}
"""Registry kind → ``module:class`` of its suite (imported when used)."""


def suite_class(kind: str) -> type[Suite]:
    """The suite class for a registry kind.

    :raises ValueError: not a kind with a suite.
    """
    if kind not in SUITES:
        raise ValueError(f"no conformance suite for kind {kind!r}; kinds: {', '.join(SUITES)}")
    module, _, cls = SUITES[kind].partition(":")
    return getattr(importlib.import_module(module), cls)


def suite(kind: str, name: str, plugins: Any = None, plugin: str | None = None, **options: Any) -> Suite:
    """The conformance suite of ``name`` of ``kind`` (e.g. ``suite("allocators", "paged")``).

    :param plugin: which plugin's ``name``, when several provide it.
    :param options: suite-specific settings (an adapter suite's ``config`` or ``checkpoint``).
    """
    return suite_class(kind)(name, plugins=plugins, plugin=plugin, **options)


def suites_for_plugin(plugin: str, plugins: Any = None) -> list[Suite]:
    """One suite per name ``plugin`` registered, of every kind that has a suite.

    :raises ValueError: no such plugin is loaded (the message lists the loaded ones), or it is broken.
    """
    from ..plugins import get_plugins

    plugins = plugins or get_plugins()
    if plugin not in plugins.infos:
        raise ValueError(f"no plugin {plugin!r} is loaded; loaded: {', '.join(sorted(plugins.infos))}")
    if plugin in plugins.broken:
        raise ValueError(f"plugin {plugin!r} is broken: {plugins.broken[plugin]}")
    out: list[Suite] = []
    for kind, names in plugins.registry.by_plugin(plugin).items():
        if kind not in SUITES:
            continue
        for name in names:
            out.append(suite(kind, name, plugins=plugins, plugin=plugin))
    return out


__all__ = ["Check", "CheckResult", "ConformanceError", "NotApplicable", "SUITES", "Suite", "expect", "expect_close",
           "suite", "suite_class", "suites_for_plugin"]
