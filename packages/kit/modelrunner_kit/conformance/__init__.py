"""Conformance suites, one per plugin kind, for a plugin's own CI and for ``modelrunner check``.

``suite(kind, name)`` builds the suite of one registered name; ``suites_for_plugin(plugin)`` every
suite of the names one plugin registered. See :mod:`.base` for what a suite is.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .base import Check, CheckResult, ConformanceError, NotApplicable, Suite, expect, expect_close

SUITES = {
    "architectures": "modelrunner_kit.conformance.adapter:AdapterSuite",
    "attention_backends": "modelrunner_kit.conformance.attention:AttentionBackendSuite",
    "allocators": "modelrunner_kit.conformance.allocator:AllocatorSuite",
    "compile_backends": "modelrunner_kit.conformance.compile:CompileBackendSuite",
    "quantization_methods": "modelrunner_kit.conformance.quantization:QuantizationMethodSuite",
    "logits_processors": "modelrunner_kit.conformance.logits:LogitsProcessorSuite",
    "matmul_kernels": "modelrunner_kit.conformance.matmul:MatmulKernelSuite",
    "grammar_backends": "modelrunner_kit.conformance.grammar:GrammarBackendSuite",
    "tool_parsers": "modelrunner_kit.conformance.tool_parser:ToolParserSuite",
    "proposers": "modelrunner_kit.conformance.proposer:ProposerSuite",
    "lora_kernels": "modelrunner_kit.conformance.lora:LoRAKernelSuite",
    "executors": "modelrunner_kit.conformance.executor:ExecutorSuite",
    "pooling_methods": "modelrunner_kit.conformance.pooling:PoolingMethodSuite",
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


def accepts(kind: str, option: str) -> bool:
    """Whether the suite of ``kind`` takes the setting ``option`` (an adapter suite's ``config`` …)."""
    return option in inspect.signature(suite_class(kind).__init__).parameters


def suites_for_plugin(plugin: str, plugins: Any = None, **options: Any) -> list[Suite]:
    """One suite per name ``plugin`` registered, of every kind that has a suite.

    :param options: settings for the suites that take them (``checkpoint=`` for the adapter and
        quantization suites, ``config=`` for the adapter suite); the others run without.
    :raises ValueError: no such plugin is loaded (the message lists the loaded ones), it is broken, or
        none of its suites takes one of ``options``.
    """
    from modelrunner.plugins import get_plugins  # kernel internal: the process's loaded plugins

    plugins = plugins or get_plugins()
    if plugin not in plugins.infos:
        raise ValueError(f"no plugin {plugin!r} is loaded; loaded: {', '.join(sorted(plugins.infos))}")
    if plugin in plugins.broken:
        raise ValueError(f"plugin {plugin!r} is broken: {plugins.broken[plugin]}")
    kinds = [kind for kind in plugins.registry.by_plugin(plugin) if kind in SUITES]
    for option in options:
        if not any(accepts(kind, option) for kind in kinds):
            takers = [kind for kind in SUITES if accepts(kind, option)]
            raise ValueError(f"{option} applies to the {', '.join(takers)} suites; plugin {plugin!r} registers "
                             f"{', '.join(kinds) or 'nothing they check'}")
    out: list[Suite] = []
    for kind, names in plugins.registry.by_plugin(plugin).items():
        if kind not in SUITES:
            continue
        mine = {k: v for k, v in options.items() if accepts(kind, k)}
        for name in names:
            out.append(suite(kind, name, plugins=plugins, plugin=plugin, **mine))
    return out


__all__ = ["Check", "CheckResult", "ConformanceError", "NotApplicable", "SUITES", "Suite", "accepts", "expect",
           "expect_close", "suite", "suite_class", "suites_for_plugin"]
