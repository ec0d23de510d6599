"""The quantization methods ``gguf`` (a GGUF file's blocks run as stored) and ``int8`` / ``int4``
(weight-only quantization of any float checkpoint, done as it loads); ``none`` is the kernel's."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from torch import nn

from modelrunner.api import (GGML_FLOAT_TYPES, PLANAR_FORMS, FusedMoE, ParallelLMHead, QuantizationMethod,
                             VocabParallelEmbedding, WeightFormat, block_bytes, ggml_type_name, quantizable_layers)

from .experts import QuantizedExperts
from .ggml_scheme import GGMLScheme, MixedGGMLScheme
from .kernels import KernelSelector
from .planar import PlanarScheme, common_form

logger = logging.getLogger("modelrunner.quantization")  # under the library's logger, which the CLI and server configure


def _checkpoint_names(model: nn.Module, layer_name: str) -> list[str]:
    """The checkpoint tensors that feed ``layer_name``'s weight (the members of a packed layer)."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    parts = layer_name.split(".")
    for packed_name, members in packed.items():
        if parts and parts[-1] == packed_name:
            return [".".join([*parts[:-1], member, "weight"]) for member in members]
    return [f"{layer_name}.weight"]


def _rows_cols(layer: nn.Module) -> tuple[int, int]:
    return tuple(layer.weight.shape)  # on meta: this rank's float shape


def _prepare_layers(method: QuantizationMethod, model: nn.Module, schemes: dict[str, PlanarScheme]) -> None:
    """Create storage for every layer in ``schemes``; tied LM heads share their embedding's."""
    owners: dict[int, nn.Module] = {}
    for name, layer in quantizable_layers(model):
        if isinstance(layer, FusedMoE):
            if name in schemes:
                experts = QuantizedExperts(schemes[name])
                experts.create_storage(layer)
                method.layers[name] = experts
            continue
        original = id(layer.weight)
        if isinstance(layer, ParallelLMHead) and original in owners:
            owner = owners[original]
            if owner.quant_scheme is not None:
                owner.quant_scheme.share_with(layer, owner)
                method.layers[name] = owner.quant_scheme
            continue
        owners[original] = layer
        scheme = schemes.get(name)
        if scheme is None:
            continue
        scheme.create_storage(layer, *_rows_cols(layer))
        method.layers[name] = scheme


class _PlanarMethod(QuantizationMethod):
    """What the planar methods share: a kernel selector, and choosing kernels once weights are in."""

    devices = ("cpu", "cuda")
    tensor_parallel = True

    OPTIONS = {"activations": "float", "kernel": None}

    def __init__(self, options: dict[str, Any] | None = None, cache_dir: Any = None) -> None:
        super().__init__(options, cache_dir)
        self.kernels = KernelSelector(self.options["activations"], self.cache_dir, self.options["kernel"])
        """Times and remembers the matmul kernel of each shape."""

    def use_plugins(self, plugins: Any) -> None:
        """Time the matmul kernels of ``plugins`` (checking a pinned ``kernel`` now)."""
        self.kernels.use_plugins(plugins)

    def process_after_loading(self, model: nn.Module) -> None:
        """Choose (time, or read back) the kernel of every covered layer for decode and batch sizes;
        the layers a module names in ``fused_projections`` (e.g. a gated MLP's two projections) get
        one family, so that a fused kernel can run them in one call. The kernels are chosen for the
        activations' dtype, that of the model's float layers (a bfloat16 engine may run bf16 kernels
        exactly: :attr:`~.kernels.KernelSelector.dtype`)."""
        self.kernels.dtype = _activation_dtype(model)
        for module in model.modules():
            group = [getattr(module, name, None) for name in getattr(module, "fused_projections", ())]
            if len(group) > 1 and all(isinstance(getattr(layer, "quant_scheme", None), PlanarScheme)
                                      and layer.quant_scheme.kernels is self.kernels for layer in group):
                self.kernels.share_family([(layer.quant_scheme, layer) for layer in group])
        for name, layer in quantizable_layers(model):
            scheme = layer.quant_scheme
            if isinstance(scheme, QuantizedExperts):
                scheme.process_after_loading(layer)
            elif isinstance(scheme, MixedGGMLScheme):
                for member in layer.ggml_members:
                    self.kernels.prepare(member.quant_scheme, member)
            elif scheme is not None and not (isinstance(layer, VocabParallelEmbedding) and
                                             not isinstance(layer, ParallelLMHead)):
                self.kernels.prepare(scheme, layer)

    def stats(self, model: nn.Module) -> dict[str, Any]:
        """Also the kernel chosen for each shape."""
        return {**super().stats(model), "kernels": dict(sorted(self.kernels.choices.items()))}


def _activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s first float parameter outside its quantized layers (a norm's weight):
    the engine's dtype, which the activations have."""
    for module in model.modules():
        if getattr(module, "quant_scheme", None) is None:
            for param in module.parameters(recurse=False):
                if param.is_floating_point():
                    return param.dtype
    return torch.float32


class GGUFMethod(_PlanarMethod):
    """``gguf``: a GGUF file's quantized tensors run as stored. Where a registered kernel reads a
    format's blocks itself on the model's device (:attr:`~modelrunner.quantization.matmul.MatmulKernel.ggml_types`: the
    quant-cpu plugin's ``cpu_ggml`` for the K-quants) a layer keeps the file's bytes
    (:class:`~.ggml_scheme.GGMLScheme`); otherwise every common format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
    Q2_K … Q6_K, IQ4_NL, IQ4_XS) is regrouped into the planar layout without loss
    (:mod:`modelrunner.quantization.ggml_formats`). A fused layer (q/k/v, gate/up) whose members the file stores in
    different formats keeps one storage in the narrowest form that holds each exactly (e.g. Q4_K with
    Q6_K: 8-bit values, groups of 16). Other types (IQ2/IQ3 …) are dequantized at load. What stays
    as stored and what was dequantized is logged at INFO and shown by ``stats()``.
    Chosen automatically for ``.gguf`` files.

    Options: ``activations`` — ``float`` (default, exact: float32 activations, the file's weights
    exactly), ``int8`` (activations quantized per 32-element block, as llama.cpp does), ``bf16``
    (activations rounded to bfloat16: torch's packed int4 op, oneDNN's bf16 GEMM) or ``auto`` (per
    shape, the fastest of the three). Quantized or rounded activations are faster in batches but
    move a result by a rounding step when float noise upstream differs (another batch composition),
    so the default stays exact.
    """

    name = "gguf"
    conformance_tolerance = 1e-4  # the file's own weights, exactly

    def __init__(self, options: dict[str, Any] | None = None, cache_dir: Any = None) -> None:
        super().__init__(options, cache_dir)
        self.tensor_formats: dict[str, Counter[str]] = {"as_stored": Counter(), "dequantized": Counter()}
        """ggml format → how many of the model's tensors stay in it (``as_stored``) and how many were
        dequantized to the engine's dtype (``dequantized``), for the last model prepared."""
        self.dequantized_dtype = "float32"
        """The dtype dequantized tensors got (the engine's)."""

    def check_source(self, source: Any) -> None:
        """Only a GGUF file read in place has blocks to keep."""
        if getattr(source, "gguf", None) is None:
            raise ValueError(f"quantization 'gguf' runs .gguf files; {source.path} is not one (use int8 or int4 "
                             "to quantize a float checkpoint)")

    def prepare(self, model: nn.Module, source: Any) -> None:
        """Keep every layer whose checkpoint tensors all have planar forms as stored (a fused layer of
        several formats in their common form)."""
        self.check_source(source)
        types = source.gguf.weight_types()
        schemes: dict[str, PlanarScheme] = {}
        kept: Counter[str] = Counter()
        dequantized: Counter[str] = Counter()
        for name, layer in quantizable_layers(model):
            names = _checkpoint_names(model, name)
            found = [types.get(n) for n in names]
            if None in found:
                continue  # not in this file (e.g. another stage's layer), or a tied head
            if len(set(found)) == 1 and self._reads_blocks(found[0]):
                schemes[name] = GGMLScheme(found[0], self.kernels)
                kept.update(ggml_type_name(t) for t in found)
            elif len(found) > 1 and hasattr(layer, "placement") and all(self._reads_blocks(t) for t in found):
                schemes[name] = MixedGGMLScheme(found, self.kernels)  # each member's blocks as stored
                kept.update(ggml_type_name(t) for t in found)
            elif all(t in PLANAR_FORMS for t in found):
                form = common_form([PLANAR_FORMS[t] for t in found])
                kinds = "+".join(sorted({ggml_type_name(t) for t in found}))
                schemes[name] = PlanarScheme(form.bits, form.group_size, has_mins=form.has_mins, kernels=self.kernels,
                                             source_type=kinds, scale_dtype=form.scale_dtype)
                kept.update(ggml_type_name(t) for t in found)
            else:
                dequantized.update(ggml_type_name(t) for t in found if t not in GGML_FLOAT_TYPES)
        self.tensor_formats = {"as_stored": kept, "dequantized": dequantized}
        self.dequantized_dtype = str(_float_dtype(model)).removeprefix("torch.")
        if kept or dequantized:
            logger.info("gguf: %s", self.summary())
        _prepare_layers(self, model, schemes)

    def summary(self) -> str:
        """``96 Q4_K, 17 Q6_K as stored; dequantized to float32: 2 IQ2_XS`` — the last model's tensors."""
        kept, dequantized = self.tensor_formats["as_stored"], self.tensor_formats["dequantized"]
        text = (", ".join(f"{n} {k}" for k, n in sorted(kept.items())) or "nothing") + " as stored"
        if dequantized:
            text += f"; dequantized to {self.dequantized_dtype}: " + \
                ", ".join(f"{n} {k}" for k, n in sorted(dequantized.items()))
        return text

    def _reads_blocks(self, ggml_type: int) -> bool:
        """Whether to keep ``ggml_type``'s blocks as the file stores them: a kernel other than the
        reference reads them on the model's device (a pinned ``kernel`` decides alone), and they are
        smaller than their planar form (Q5_0 and the K-quants; Q4_0, Q4_1 and Q8_0 are the same bytes
        either way, and planar storage has more kernels)."""
        if ggml_type not in PLANAR_FORMS:
            return False
        form = PLANAR_FORMS[ggml_type]
        values, nbytes = block_bytes(ggml_type)
        scale_bytes = form.scale_dtype.itemsize * (2 if form.has_mins else 1)
        if self.kernels.kernel is None and nbytes / values >= form.bits / 8 + scale_bytes / form.group_size:
            return False
        fmt = WeightFormat(*form[:3], ggml_type=ggml_type)
        candidates = self.kernels.candidates
        if self.kernels.kernel is not None:
            return candidates[self.kernels.kernel].supports(fmt, self.device)
        return any(k.timed and not k.fallback and k.supports(fmt, self.device) for k in candidates.values())

    def stats(self, model: nn.Module) -> dict[str, Any]:
        """Also ``tensors``: per ggml format, how many tensors stay as stored and how many were dequantized."""
        return {**super().stats(model), "tensors": {k: dict(sorted(v.items())) for k, v in self.tensor_formats.items()},
                "summary": self.summary()}


def _float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype a dequantized weight of ``model`` gets (its first float parameter's, still on meta)."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32


class _LoadTimeMethod(_PlanarMethod):
    """Quantizes a float checkpoint's linear layers as their tensors load (the float weight is never
    materialised). Options: ``activations``; ``lm_head`` — quantize the LM head too."""

    BITS = 8
    OPTIONS = {"activations": "float", "lm_head": False, "kernel": None}

    def __init__(self, options: dict[str, Any] | None = None, cache_dir: Any = None) -> None:
        super().__init__(options, cache_dir)
        if not isinstance(self.options["lm_head"], bool):
            raise ValueError(f"quantization {self.name!r} option lm_head must be True or False, got "
                             f"{self.options['lm_head']!r}")

    def _scheme(self) -> PlanarScheme:
        raise NotImplementedError

    def check_source(self, source: Any) -> None:
        """A GGUF file is already quantized: use ``gguf`` (or ``none`` to dequantize it)."""
        if getattr(source, "gguf", None) is not None:
            raise ValueError(f"quantization {self.name!r} quantizes float checkpoints; {source.path} is a GGUF file "
                             "(use quantization='gguf')")

    def prepare(self, model: nn.Module, source: Any) -> None:
        """A planar scheme for every linear layer (and the LM head with ``lm_head=True``)."""
        self.check_source(source)
        schemes = {}
        for name, layer in quantizable_layers(model):
            if isinstance(layer, VocabParallelEmbedding) and not (isinstance(layer, ParallelLMHead)
                                                                   and self.options["lm_head"]):
                continue
            schemes[name] = self._scheme()
        _prepare_layers(self, model, schemes)


class Int8Method(_LoadTimeMethod):
    """``int8``: symmetric per-output-channel int8 weights, quantized at load from any float checkpoint.

    ``activations``: ``float`` (int8 weights × float32 activations), ``int8`` (activations quantized
    too, per token: torch's int8 GEMM or the quant-cpu kernel), ``bf16`` (activations rounded to
    bfloat16: torch's ``_weight_int8pack_mm``), ``auto`` (the fastest, per shape; default).
    """

    name = "int8"
    conformance_tolerance = 0.05
    OPTIONS = {"activations": "auto", "lm_head": False, "kernel": None}

    def _scheme(self) -> PlanarScheme:
        return PlanarScheme(8, 0, has_mins=False, kernels=self.kernels, quantize_floats=True, source_type="float")


class Int4Method(_LoadTimeMethod):
    """``int4``: asymmetric group-wise int4 weights (``group_size`` 32, 64 or 128), quantized at load.

    ``activations``: ``float`` (default, exact int4 × float32), ``int8``, ``bf16`` or ``auto``.
    """

    name = "int4"
    conformance_tolerance = 0.3  # round-to-nearest int4/g32 gives 0.22-0.26 on the suite's tiny random models
    OPTIONS = {"activations": "float", "lm_head": False, "group_size": 32, "kernel": None}

    def __init__(self, options: dict[str, Any] | None = None, cache_dir: Any = None) -> None:
        super().__init__(options, cache_dir)
        if self.options["group_size"] not in (32, 64, 128):
            raise ValueError(f"int4 group_size must be 32, 64 or 128, got {self.options['group_size']!r}")

    def _scheme(self) -> PlanarScheme:
        return PlanarScheme(4, self.options["group_size"], has_mins=True, kernels=self.kernels,
                            quantize_floats=True, source_type="float")


METHODS = (GGUFMethod, Int8Method, Int4Method)
"""The quantization methods this distribution declares."""
__all__ = ["METHODS", "GGUFMethod", "Int4Method", "Int8Method"]
