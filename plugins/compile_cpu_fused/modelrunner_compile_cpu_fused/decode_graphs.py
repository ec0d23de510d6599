"""Decode steps replayed from a recorded graph: the decoder layers without Python in between
(the ``cpu_fused`` backend's ``decode_graphs`` option, on by default).

A decode step of a small model spends about half of its time in Python: each layer makes ~130
calls to go through norms, projections, rotary, the cache write and attention, for ~10 kernel
calls that do the work. Like vLLM's CUDA graphs, :class:`DecodeGraphs` records the layers once per
batch shape of up to :data:`MAX_ROWS` sequences (``torch.jit.trace``: the ops with their
arguments) and then replays the record in TorchScript's C++ interpreter; a recorded SmolLM2 layer
runs in ~70 µs where the eager one takes ~125 µs on 2 Zen 4 cores.

A graph is recorded only where nothing can differ between steps but tensor values:

- the attention backend says how its metadata enters the graph
  (:meth:`~modelrunner.layers.attention_backend.AttentionBackend.graph_inputs`; ``cpu_paged``
  does, for decode-only steps), and the graph is keyed by what it returns plus the hidden shape;
- no forward hook or pre-hook is registered on the layers (checked every step: a hook added later
  sends steps back to eager), and nothing is being compiled or traced;
- every module in the layers, and every linear layer's quantization scheme, is of a class known
  to decide in Python only from shapes, dtypes and settings, never from tensor values (a recording
  freezes such decisions): the kernel's own layers and schemes, and the classes plugins add with
  :func:`register_graph_safe` (a class the backend gave a hook-checking ``__call__``, see
  :mod:`.unhooked`, counts as the class it was built as). An MoE block, whose routing reads values,
  keeps the model eager;
- the recording's first replay gives exactly the eager step's outputs. A key whose recording
  fails or differs runs eagerly from then on, with one log line.

PyTorch marks ``torch.jit.trace`` deprecated (for ``torch.compile``/``torch.export``, which on this
path still recompile at every quantized layer's graph break); should it fail or go away, recording
fails and every step runs eagerly, as before this module.

Writing a step's keys/values twice (eagerly, then by the replay being checked) stores the same
values at the same slots, so the check changes nothing. Parameters are read by the graph as the
tensors they are: in-place updates are seen; a parameter or module *replaced* by another needs
:meth:`DecodeGraphs.clear`.
"""

from __future__ import annotations

import logging
import types
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from modelrunner.api import (Attention, DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP,
                             MergedColumnParallelLinear, QKVParallelLinear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                             SiluAndMul)
from modelrunner_quantization import GGMLMember, GGMLScheme, MixedGGMLScheme, PlanarScheme
from torch import nn
from torch.nn.modules import module as _module

from .unhooked import plain_type

logger = logging.getLogger(__name__)

MAX_ROWS = 16
"""Largest decode batch recorded. Python's share of a step is a few ms whatever the batch size: at 16
sequences that is under a tenth of a SmolLM2 step, while a recording costs ~20 eager steps."""
MAX_GRAPHS = 16
"""Most recorded keys per model (a batch whose size keeps changing would otherwise record many)."""
SIGHTINGS = 4
"""A key is recorded the fourth time a step has it: a batch size seen for only a step or two (a
batch draining as its sequences finish) costs no recording (~0.25 s for SmolLM2's 30 layers)."""


_SAFE: set[type] = set()


def register_graph_safe(cls: type) -> type:
    """Declare that modules (or quantization schemes) of exactly ``cls`` — not its subclasses — may
    be recorded into decode graphs: its ``forward`` branches in Python only on shapes, dtypes and
    fixed settings, never on tensor values. Usable as a class decorator."""
    _SAFE.add(cls)
    return cls


def _kernel_classes() -> None:
    if _SAFE:
        return
    for cls in (SiluAndMul, Attention, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear, RMSNorm,
                RotaryEmbedding, PlanarScheme, GGMLScheme, MixedGGMLScheme, GGMLMember, DecoderAttention, DecoderLayer,
                GatedMLP):
        register_graph_safe(cls)


def unsafe_part(modules: Sequence[nn.Module]) -> str | None:
    """The class name of the first module (or linear layer's quantization scheme) among ``modules``
    not declared graph-safe, or None when all are."""
    _kernel_classes()
    for module in modules:
        for part in (module, getattr(module, "quant_scheme", None)):
            cls = plain_type(part) if part is not None else None
            if cls is not None and cls not in _SAFE:
                return f"{cls.__module__}.{cls.__qualname__}"
    return None


class DecodeGraphs:
    """Recorded decode graphs of one decoder, keyed by batch shape.

    :param layers: the decoder layers a step runs, in order; ``norm`` the final norm. Each layer is
        called as ``layer(positions, hidden, residual, kv_cache, metadata)`` and returns
        ``(hidden, residual)``; the norm as ``norm(hidden, residual)`` → ``(hidden, residual)``.
    :param backend: the attention backend (asked for :meth:`graph_inputs` every step).
    """

    def __init__(self, layers: Sequence[nn.Module], norm: nn.Module, backend: Any) -> None:
        self.layers = list(layers)
        """The layers the graphs run."""
        self.norm = norm
        """The final norm."""
        self.backend = backend
        """The attention backend whose metadata enters the graphs."""
        self._graphs: dict[Any, Any] = {}  # key → traced graph, or None where recording failed
        self._seen: dict[Any, int] = {}
        self.replays = 0
        """Steps run from a graph."""
        self.refused: dict[str, str] = {}
        """``repr(key)`` → why that key runs eagerly."""
        self.unsafe: str | None = None
        """The first class in the layers not declared graph-safe (then every step runs eagerly), or None."""
        self.clear()

    def clear(self) -> None:
        """Forget every graph and look at the layers' parts again: call it after replacing a
        parameter tensor or a module in the layers (not after in-place updates)."""
        self._modules = [m for part in (*self.layers, self.norm) for m in part.modules()]
        self.unsafe = unsafe_part(self._modules)
        # The modules' hook dicts themselves: registering a hook inserts into them, so one C-level
        # truth test per dict sees it (6 µs a step for SmolLM2's 362 modules; their attributes: 40 µs).
        self._hook_dicts = [d for m in self._modules for d in (m._forward_hooks, m._forward_pre_hooks)]
        self._graphs.clear()
        self._seen.clear()
        self.refused.clear()

    def stats(self) -> dict[str, Any]:
        """``{"graphs": recorded keys, "replays": steps, "refused": {key: reason}}``, and ``"off"``
        (why) where a part of the layers is not graph-safe."""
        out = {"graphs": sum(g is not None for g in self._graphs.values()), "replays": self.replays,
               "refused": dict(self.refused)}
        if self.unsafe is not None:
            out["off"] = f"{self.unsafe} is not declared graph-safe"
        return out

    def run(self, positions: torch.Tensor, hidden: torch.Tensor, kv_caches: Sequence[torch.Tensor],
            metadata: Any) -> torch.Tensor | None:
        """The final hidden states of a first-stage step starting from the embeddings ``hidden``,
        from a graph; None where this step runs eagerly (the caller then runs the layers)."""
        if (self.unsafe is not None or hidden.shape[0] > MAX_ROWS or torch.compiler.is_compiling()
                or torch.jit.is_tracing()):
            return None
        spec = self.backend.graph_inputs(metadata)
        if spec is None or self._hooked():
            return None
        key = (spec.key, tuple(hidden.shape), hidden.dtype, len(kv_caches))
        graph = self._graphs.get(key, False)
        if graph is None:
            return None
        inputs = (positions, hidden, *spec.tensors, *kv_caches)
        if graph is not False:
            self.replays += 1
            with torch.jit.optimized_execution(False):  # its optimising passes cost 0.2 s, and gain nothing here
                return graph(*inputs)
        seen = self._seen[key] = self._seen.get(key, 0) + 1
        if seen < SIGHTINGS or len(self._graphs) >= MAX_GRAPHS:
            return None
        return self._record(key, spec, inputs)

    def _hooked(self) -> bool:
        if _module._global_forward_hooks or _module._global_forward_pre_hooks:
            return True
        return any(self._hook_dicts)

    def _eager(self, rebuild: Callable[..., Any], count: int) -> Callable[..., torch.Tensor]:
        layers, norm = self.layers, self.norm

        def step(positions: torch.Tensor, hidden: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
            metadata = rebuild(*rest[:count])
            residual = None
            for layer, kv_cache in zip(layers, rest[count:]):
                hidden, residual = layer(positions, hidden, residual, kv_cache, metadata)
            return norm(hidden, residual)[0]

        return step

    def _record(self, key: Any, spec: Any, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        step = self._eager(spec.rebuild, len(spec.tensors))
        want = step(*inputs)
        try:
            with warnings.catch_warnings():
                # The parts are graph-safe: what the tracer warns about are shape checks, fixed per key.
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.trace's own notice
                graph = torch.jit.trace(step, inputs, check_trace=False)
            with torch.jit.optimized_execution(False):
                got = graph(*inputs)
        except Exception as e:  # noqa: BLE001 - whatever the tracer refuses, the step runs eagerly
            return self._refuse(key, f"recording failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})",
                                want)
        if not torch.equal(got, want):
            return self._refuse(key, f"replay differs from the eager step (max |Δ| "
                                     f"{(got - want).abs().max().item():.3g})", want)
        self._graphs[key] = graph
        logger.debug("decode graph recorded for %r", key)
        return want

    def _refuse(self, key: Any, reason: str, out: torch.Tensor) -> torch.Tensor:
        self._graphs[key] = None
        self.refused[repr(key)] = reason
        logger.info("decode steps keyed %r run eagerly: %s", key, reason)
        return out


def run_layers(self: DecoderForCausalLM, layers: list[nn.Module], positions: torch.Tensor, hidden: torch.Tensor,
               residual: torch.Tensor | None, kv_caches: list[torch.Tensor], metadata: Any) -> Any:
    """:meth:`DecoderForCausalLM.run_layers` replayed from ``self.decode_graphs`` where it can be."""
    if residual is None:
        replayed = self.decode_graphs.run(positions, hidden, kv_caches, metadata)
        if replayed is not None:
            return replayed
    return DecoderForCausalLM.run_layers(self, layers, positions, hidden, residual, kv_caches, metadata)


def bind_decode_graphs(model: nn.Module) -> DecodeGraphs | None:
    """Replay ``model``'s decode steps from recorded graphs from now on: sets ``model.decode_graphs``
    and binds :func:`run_layers` onto the instance. Only for a :class:`DecoderForCausalLM` whose
    ``run_layers`` is the kernel's, in one process (no tensor or pipeline parallelism), on the CPU;
    returns the graphs, or None where they do not apply."""
    if (not isinstance(model, DecoderForCausalLM) or type(model).run_layers is not DecoderForCausalLM.run_layers
            or model.parallel.tp_size != 1 or model.parallel.pp_size != 1
            or model.model.norm.weight.device.type != "cpu"):
        return None
    graphs = model.__dict__.get("decode_graphs")
    if graphs is None:
        layers = list(model.model.layers)[model.model.start_layer:model.model.end_layer]
        graphs = model.decode_graphs = DecodeGraphs(layers, model.model.norm, model.attn_backend)
        model.run_layers = types.MethodType(run_layers, model)
    return graphs


__all__ = ["MAX_GRAPHS", "MAX_ROWS", "SIGHTINGS", "DecodeGraphs", "bind_decode_graphs", "register_graph_safe",
           "run_layers", "unsafe_part"]
