"""Refusing, before anything loads, a configuration whose pieces do not support each other.

Plugins declare what each of their names supports (``registry.architectures("X", tensor_parallel=True,
quantization=("*",))``, attention backends' class attributes, …; see
:data:`modelrunner.registry.CAPABILITIES`). :func:`check_supported` compares the configuration with
those declarations and raises naming the piece, the setting and what the piece supports — rather
than failing deep inside a forward pass. Undeclared capabilities refuse nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import ModelRunnerError
from .registry import FALLBACK_ARCHITECTURE
from .registry import KINDS


class UnsupportedCombinationError(ModelRunnerError, ValueError):
    """Two configured pieces do not work together (the message names both and what is supported)."""


def adapter_name(plugins: Any, architecture: str, owner: str) -> str:
    """The name ``owner`` registered that loads ``architecture`` (the fallback name for a generic adapter)."""
    providers = plugins.registry.providers["architectures"]
    return architecture if owner in providers.get(architecture, []) else FALLBACK_ARCHITECTURE


def runs_quantization(plugins: Any, architecture: str, adapter: str, method: str) -> bool:
    """Whether the adapter ``adapter`` declares it runs quantization ``method`` (undeclared: yes)."""
    caps = plugins.registry.capabilities("architectures", adapter_name(plugins, architecture, adapter), adapter)
    methods = caps.get("quantization")
    return methods is None or "*" in methods or method in methods


def check_supported(plugins: Any, config: Any, device: torch.device, architecture: str, adapter: str,
                    quantization: str | None) -> None:
    """Refuse a combination a piece declares it does not support.

    :param architecture: the checkpoint's architecture; ``adapter`` the plugin that loads it.
    :param quantization: the quantization method chosen (None: dense weights).
    :raises UnsupportedCombinationError: naming the piece, the setting and what the piece supports.
    """
    registry = plugins.registry
    tp, pp = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    arch_name = adapter_name(plugins, architecture, adapter)
    caps = registry.capabilities("architectures", arch_name, adapter)
    piece = f"adapter {adapter!r} (architecture {architecture or arch_name})"
    _check_parallel(piece, caps, tp, pp)
    _check_device(piece, caps, device)
    if config.model.attention_backend is not None and caps.get("attention_backends") is False:
        raise UnsupportedCombinationError(
            f"{piece} runs the model's own attention, not attention backends, so "
            f"attention_backend={config.model.attention_backend!r} would be ignored; unset attention_backend or "
            "use an adapter that runs attention backends")
    method = quantization or "none"
    if not runs_quantization(plugins, architecture, adapter, method):
        raise UnsupportedCombinationError(
            f"{piece} does not run quantization {method!r}; it supports: {', '.join(caps['quantization'])} "
            "(methods apply to models built from the kernel's layers)")
    if quantization is not None:
        owner = registry.owner("quantization_methods", quantization)
        if owner is not None:
            qcaps = registry.capabilities("quantization_methods", quantization, owner)
            _check_device(f"quantization {quantization!r}", qcaps, device)
            if qcaps.get("tensor_parallel") is False and tp > 1:
                raise UnsupportedCombinationError(f"quantization {quantization!r} does not support "
                                                  f"tensor_parallel_size={tp} (it declares tensor_parallel=False)")
    backend = config.compile.backend_for(device, registry.names("compile_backends"))
    owner = registry.owner("compile_backends", backend)
    if owner is not None:
        ccaps = registry.capabilities("compile_backends", backend, owner)
        piece = f"compile backend {backend!r}"
        _check_parallel(piece, ccaps, tp, pp)
        _check_device(piece, ccaps, device)


def _check_parallel(piece: str, caps: dict[str, Any], tp: int, pp: int) -> None:
    for key, size, field in (("tensor_parallel", tp, "tensor_parallel_size"),
                             ("pipeline_parallel", pp, "pipeline_parallel_size")):
        if size > 1 and caps.get(key) is False:
            raise UnsupportedCombinationError(f"{piece} does not support {field}={size} (it declares {key}=False); "
                                              f"use {field}=1 or a piece that supports it")


def _check_device(piece: str, caps: dict[str, Any], device: torch.device) -> None:
    devices = caps.get("devices")
    if devices is not None and torch.device(device).type not in devices:
        raise UnsupportedCombinationError(f"{piece} does not run on {torch.device(device).type}; it runs on: "
                                          f"{', '.join(devices)}")


def capability_matrix(plugins: Any) -> dict[str, list[dict[str, Any]]]:
    """kind → one row per (name, plugin): ``{"name", "plugin", <capability>: value}`` (None: not
    declared) — what ``modelrunner plugins --matrix`` prints."""

    registry = plugins.registry
    out: dict[str, list[dict[str, Any]]] = {}
    for kind in KINDS:
        rows = []
        for name in registry.names(kind):
            for plugin in registry.providers[kind][name]:
                caps = registry.capabilities(kind, name, plugin)
                rows.append({"name": name, "plugin": plugin, **{k: _plain(v) for k, v in caps.items()}})
        if rows:
            out[kind] = rows
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def format_matrix(matrix: dict[str, list[dict[str, Any]]]) -> str:
    """The matrix as one Markdown table per kind (``?``: not declared)."""
    lines: list[str] = []
    for kind, rows in matrix.items():
        columns = list(rows[0])
        lines += [f"{kind}:", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        for row in rows:
            cells = []
            for column in columns:
                value = row[column]
                if value is None:
                    value = "?"
                elif isinstance(value, bool):
                    value = "yes" if value else "no"
                elif isinstance(value, list):
                    value = ", ".join(map(str, value))
                cells.append(str(value))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


__all__ = ["UnsupportedCombinationError", "adapter_name", "capability_matrix", "check_supported", "format_matrix",
           "runs_quantization"]
