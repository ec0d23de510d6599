"""The quantization-method plugin kind: how a model's layers store, load and multiply their weights.

The shape of vLLM's ``QuantizeMethodBase``, applied without adapter code: after an adapter's model
is built on the ``meta`` device, :meth:`QuantizationMethod.prepare` walks it and gives each layer it
covers — the kernel's linear layers, vocab-parallel embedding / LM head — a scheme that replaces its
float ``weight`` by quantized storage (create weights); the checkpoint then streams in through the
layers' own loaders, which shard it for tensor parallelism along whole groups; and
:meth:`QuantizationMethod.process_after_loading` finishes the layers (chooses their kernels by
timing them). Each layer's forward calls its scheme's ``apply`` (``embed`` for a table lookup).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import did_you_mean
from ..layers.embedding import VocabParallelEmbedding
from ..layers.fused_moe import FusedMoE
from ..layers.linear import LinearBase

logger = logging.getLogger(__name__)


def quantizable_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, layer)`` of every kernel layer a quantization method may cover: linear layers,
    vocab-parallel embeddings / LM heads and fused-MoE experts (other stages' placeholders left out)."""

    for name, module in model.named_modules():
        if isinstance(module, (LinearBase, VocabParallelEmbedding)) and "weight" in module._parameters or isinstance(module, FusedMoE) and "w13_weight" in module._parameters:
            yield name, module


class QuantizationMethod(abc.ABC):
    """A way of storing and running a model's weights, selectable by ``name`` (config field
    ``quantization``; options in ``quantization_options``). Plugins declare one with
    ``registry.quantization_methods(Cls)``.

    :param options: the method's options; unknown ones are refused naming the known ones.
    :param cache_dir: where the method may keep what it measured (kernel choices).
    """

    name: ClassVar[str] = "?"
    """Registry name."""
    checkpoint_formats: ClassVar[tuple[str, ...]] = ()
    """``quant_method`` values of a checkpoint's ``quantization_config`` this method reads (a
    checkpoint quantized otherwise is refused at load rather than run without its scales)."""
    OPTIONS: ClassVar[dict[str, Any]] = {}
    """Option name → default."""
    devices: ClassVar[tuple[str, ...] | None] = None
    """Device types the method runs on (None: not declared; a configuration on another is refused)."""
    tensor_parallel: ClassVar[bool | None] = None
    """Whether its storage splits across tensor-parallel ranks (False: refused with tensor_parallel_size > 1)."""
    covers_layers: ClassVar[bool] = True
    """Whether the method gives layers quantized storage (False only for a method that keeps dense
    weights, like ``none``); the conformance suite fails a method that declares it and covers none."""
    conformance_tolerance: ClassVar[float] = 0.1
    """The conformance suite's bound on a tiny model's max |logits − float logits| relative to max |float
    logits| (a lossless method declares 1e-4)."""

    def __init__(self, options: dict[str, Any] | None = None, cache_dir: str | Path | None = None) -> None:
        options = dict(options or {})
        unknown = sorted(set(options) - set(self.OPTIONS))
        if unknown:
            raise ValueError(f"quantization {self.name!r} has no option {unknown[0]!r}"
                             f"{did_you_mean(unknown[0], self.OPTIONS)} (options: {', '.join(self.OPTIONS) or 'none'})")
        self.options = {**self.OPTIONS, **options}
        """The options, defaults filled in."""
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        """Where measurements are kept."""
        self.layers: dict[str, Any] = {}
        """Layer name → its scheme, for the layers this method covers in the last model prepared."""
        self.device = torch.device("cpu")
        """The device the model is loaded on (set before :meth:`prepare`), for choosing storage that
        the kernels of that device run."""

    def use_plugins(self, plugins: Any) -> None:
        """Take what the method uses from the loaded plugins it came from (the matmul kernels its
        layers may run), called once before :meth:`check_source`; the default takes nothing.

        :raises UnknownNameError: an option names something no loaded plugin provides.
        """

    def check_source(self, source: Any) -> None:
        """Refuse a checkpoint this method cannot run (e.g. ``gguf`` needs a ``.gguf`` file).

        :raises ValueError: naming the method and the checkpoint.
        """

    @abc.abstractmethod
    def prepare(self, model: nn.Module, source: Any) -> None:
        """Give the layers this method covers their quantized storage, on the ``meta`` device."""

    def process_after_loading(self, model: nn.Module) -> None:
        """Finish the covered layers once their weights are in (the default does nothing)."""

    def stats(self, model: nn.Module) -> dict[str, Any]:
        """What :meth:`ModelRunner.stats` shows under ``quantization``: the method, the layers it covers and
        their formats."""
        formats: dict[str, int] = {}
        for scheme in self.layers.values():
            formats[repr(scheme)] = formats.get(repr(scheme), 0) + 1
        return {"method": self.name, "options": self.options, "layers": len(self.layers), "formats": formats}

    def __repr__(self) -> str:
        return f"<quantization {self.name!r} {self.options}>"


class NoQuantization(QuantizationMethod):
    """``none``: every weight stays in the model's float dtype (GGUF blocks are dequantized at load)."""

    name = "none"
    tensor_parallel = True
    covers_layers = False
    conformance_tolerance = 1e-4

    def prepare(self, model: nn.Module, source: Any) -> None:
        """Nothing to prepare."""


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as they are stored (quantized storage counted as is)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen or tensor.is_meta:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total
