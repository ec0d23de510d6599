"""Which matmul kernel a quantized layer runs, chosen by timing the candidates on this machine.

For every distinct ``(format, rows × columns)`` of a model and for two input sizes — ``decode``
(up to :data:`DECODE_ROWS` rows: one token per sequence) and ``batch`` (more) — each allowed
candidate is timed once on the layer's real weights, the fastest kept, and the choice cached on disk
per CPU model and software version (``kernels.json`` under the cache directory), so later loads
skip the timing. Candidates:

- ``reference``: dequantize to float32, then ``F.linear`` (always there; exact; slow).
- ``cpu_exact`` / ``cpu_q8``: the ``modelrunner-quant-cpu`` plugin's C++ kernels (float32
  activations; or activations quantized to int8 per 32-element block, as llama.cpp does).
- ``cpu_p16``: ``cpu_q8``'s arithmetic on weights regrouped in tiles of 16 rows (the plugin's p16
  layout), 2-3x faster at every row count. Where it can run it replaces ``cpu_q8`` among the timed
  candidates.
- ``cpu_p16_exact``: ``cpu_exact``'s arithmetic (float activations) on the p16 layout (AVX-512),
  1.3-1.6x ``cpu_exact`` at one row and at 64 on SmolLM2's shapes.
- ``cpu_p16_split``: as exact as ``cpu_p16_exact`` through VNNI dot products — each block of the
  activations split into three int8 digits, the rest below 2e-8 of its largest value — 2x
  ``cpu_p16_exact`` at one row on SmolLM2's LM head, slower at 64 rows (AVX-512 VNNI).
- ``int8_rowwise``: torch's int8 GEMM (``torch._int_mm``) with each activation row quantized to
  int8 on its own (per-channel int8 weights only; no copy of the weight). Per row, so a token's
  result does not depend on the other tokens of its batch (fbgemm's dynamic linear quantizes the
  whole batch with one scale, which does) — but too lossy to be chosen by timing (:data:`PINNED_ONLY`).

Candidates that quantize activations run only where the method allows them (``activations`` option).

A shape's kernels for both buckets come from one *family* — the kind of activations (float or int8)
and the layout (planar or p16) — the one whose fastest kernels take least time summed over the timed
row counts, so that a layer's storage has one layout and a request's activations are taken one way
(float or int8) however many rows share its step. A layer on a p16 family has its storage regrouped in place (no second
copy), and :meth:`~.planar.PlanarScheme.planar_storage` reads it back as planar rows.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..timing_cache import (
    DECODE_ROWS,
    TIMING_ROWS,
    TimingCache,
    time_candidates,
)
from .planar import dequantize_planar

logger = logging.getLogger(__name__)

KERNEL_VERSION = 5
"""Bumped when a candidate changes, so cached choices are remade."""


@functools.cache
def quant_cpu() -> Any:
    """The ``modelrunner_quant_cpu`` kernels when installed and built here, else None."""
    try:
        import modelrunner_quant_cpu as kernels
    except ImportError:
        return None
    try:
        return kernels if kernels.available() else None
    except Exception:  # noqa: BLE001 - a plugin that cannot build is as good as absent
        return None


def _plugin_build() -> str:
    """The quant-cpu plugin's version and a hash of its kernel source (a changed kernel times again)."""
    plugin = quant_cpu()
    if plugin is None:
        return "none"
    digest = hashlib.sha256()
    for source in sorted(Path(plugin.__file__).parent.glob("*.cpp")):
        digest.update(source.read_bytes())
    return f"{getattr(plugin, '__version__', '?')}-{digest.hexdigest()[:12]}"


# -- candidates ------------------------------------------------------------------------------------


def _reference(scheme: Any, layer: Any, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), scheme.dequantized(layer))


def _cpu(mode: str) -> Callable[[Any, Any, torch.Tensor], torch.Tensor]:
    def run(scheme: Any, layer: Any, x: torch.Tensor) -> torch.Tensor:
        qweight, scales, mins = scheme.planar_storage(layer)
        return quant_cpu().qlinear(x, qweight, scales, mins, scheme.group_size, scheme.bits, mode=mode)
    return run


def _bind_cpu(mode: str) -> Callable[[Any, Any], Callable[[torch.Tensor], torch.Tensor]]:
    def bind(scheme: Any, layer: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        return quant_cpu().bind_qlinear(*scheme.planar_storage(layer), scheme.group_size, scheme.bits, mode=mode)
    return bind


def is_p16(layer: Any) -> bool:
    """Whether ``layer``'s storage is in the quant-cpu plugin's p16 layout."""
    return getattr(layer.weight, "p16_rows", None) is not None


_P16_COPIES: weakref.WeakKeyDictionary[Any, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = \
    weakref.WeakKeyDictionary()
"""Layer → a p16 copy of its storage, while ``cpu_p16`` is timed on a layer still stored planar."""


def _p16_storage(scheme: Any, layer: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if is_p16(layer):
        return scheme.storage(layer)
    copy = _P16_COPIES.get(layer)
    if copy is None:
        copy = quant_cpu().pack_p16(*scheme.storage(layer), scheme.group_size, scheme.bits)
        _P16_COPIES[layer] = copy
    return copy


_P16_BINDERS = {"q8": "bind_qlinear_p16", "exact": "bind_qlinear_p16_exact", "split": "bind_qlinear_p16_split"}
"""The plugin's p16 kernels (its ``P16_KERNELS``) → their binders."""


def _bind_p16(kind: str) -> Callable[[Any, Any], Callable[[torch.Tensor], torch.Tensor]]:
    def bind(scheme: Any, layer: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        to_p16(scheme, layer)
        binder = getattr(quant_cpu(), _P16_BINDERS[kind])
        return binder(*scheme.storage(layer), layer.weight.p16_rows, scheme.group_size, scheme.bits)
    return bind


def _p16(kind: str) -> Callable[[Any, Any, torch.Tensor], torch.Tensor]:
    def run(scheme: Any, layer: Any, x: torch.Tensor) -> torch.Tensor:
        rows = layer.weight.logical_shape[0]
        binder = getattr(quant_cpu(), _P16_BINDERS[kind])
        return binder(*_p16_storage(scheme, layer), rows, scheme.group_size, scheme.bits)(x)
    return run


def to_p16(scheme: Any, layer: Any) -> None:
    """Regroup ``layer``'s planar storage into the p16 layout, in place (the same parameters, their
    data replaced: a tied embedding sharing them follows)."""
    if is_p16(layer):
        return
    rows = layer.weight.shape[0]
    data, scales, mins = _P16_COPIES.pop(layer, None) or quant_cpu().pack_p16(
        *scheme.storage(layer), scheme.group_size, scheme.bits)
    with torch.no_grad():
        layer.weight.data = data
        layer.weight_scales.data = scales
        if mins is not None:
            layer.weight_mins.data = mins
    layer.weight.p16_rows = rows


BINDERS: dict[str, Callable[[Any, Any], Callable[[torch.Tensor], torch.Tensor]]] = {
    "cpu_exact": _bind_cpu("exact"),
    "cpu_q8": _bind_cpu("q8"),
    "cpu_p16": _bind_p16("q8"),
    "cpu_p16_exact": _bind_p16("exact"),
    "cpu_p16_split": _bind_p16("split"),
}
"""Candidate → ``bind(scheme, layer)``: the candidate for one layer's storage as a callable of ``x``
(looked up once; the others are bound with :func:`functools.partial`)."""


def _int8_rowwise(scheme: Any, layer: Any, x: torch.Tensor) -> torch.Tensor:
    # Each row of x (one token) quantized on its own: a token's result never depends on its batch.
    qweight, scales, _ = scheme.planar_storage(layer)
    x = x.float()
    row_scale = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    xq = torch.round(x / row_scale).clamp_(-127, 127).to(torch.int8)
    return torch._int_mm(xq, qweight.t()).float() * row_scale * scales.reshape(1, -1).float()


CANDIDATES: dict[str, tuple[Callable[..., torch.Tensor], bool]] = {
    "reference": (_reference, True),
    "cpu_exact": (_cpu("exact"), True),
    "cpu_q8": (_cpu("q8"), False),
    "cpu_p16": (_p16("q8"), False),
    "cpu_p16_exact": (_p16("exact"), True),
    "cpu_p16_split": (_p16("split"), True),
    "int8_rowwise": (_int8_rowwise, False),
}
"""name → (kernel, exact: computes with float activations)."""

P16_KERNELS = {"cpu_p16": "q8", "cpu_p16_exact": "exact", "cpu_p16_split": "split"}
"""Candidates that read the p16 layout (the others read planar storage) → the plugin's name for them."""


PINNED_ONLY = frozenset({"int8_rowwise"})
"""Candidates timing never picks (``kernel=`` runs them): one int8 scale per token over a whole row
lost too much — SmolLM2's int8 perplexity +3.1% against +0.5% with the per-32-value activation
blocks of ``cpu_q8`` (and +0.3% with float activations)."""


def usable(name: str, scheme: Any, layer: Any = None) -> bool:
    """Whether candidate ``name`` can run ``scheme``'s format (and ``layer``'s shape) on this machine."""
    if name.startswith("cpu_"):
        if layer is not None and layer.weight.device.type != "cpu":
            return False
        cols = layer.weight.logical_shape[-1] if layer is not None else 32
        # The C++ kernels work in 32-element blocks.
        if not (quant_cpu() is not None and cols % 32 == 0 and scheme.group_size % 32 == 0):
            return False
        if name in P16_KERNELS:
            # Regrouped in place: only storage a layer owns (not an expert's view of its stack).
            owns = layer is None or getattr(layer, "quant_scheme", None) is scheme
            kind = P16_KERNELS[name]
            supported = getattr(quant_cpu(), "p16_supported" if kind == "q8" else f"p16_{kind}_supported", None)
            return owns and supported is not None and supported(scheme.bits)
        return layer is None or not is_p16(layer)  # the other kernels read planar storage
    if name == "int8_rowwise":
        return scheme.bits == 8 and not scheme.has_mins and scheme.per_row and hasattr(torch, "_int_mm")
    return True


# -- choosing ------------------------------------------------------------------------------------


class KernelSelector:
    """Times the allowed candidates for each shape of a model once and remembers the fastest.

    :param activations: ``float`` (exact kernels only), ``int8`` (kernels that quantize activations;
        exact ones as fallback), ``auto`` (per shape, the kind whose kernels are fastest over the timed
        row counts). Within what it allows, each shape takes one family (see the module's text) for
        every row count.
    :param cache_dir: where ``kernels.json`` keeps the choices (None: not kept).
    :param kernel: one candidate for every shape it can run (to measure one against another); None: timed.
    """

    def __init__(self, activations: str = "float", cache_dir: Path | None = None, kernel: str | None = None) -> None:
        if activations not in ("float", "int8", "auto"):
            raise ValueError(f"activations must be 'float', 'int8' or 'auto', got {activations!r}")
        if kernel is not None and kernel not in CANDIDATES:
            raise ValueError(f"kernel must be one of {', '.join(CANDIDATES)} (or unset: timed), got {kernel!r}")
        self.kernel = kernel
        """The pinned candidate (None: the fastest, timed)."""
        self.activations = activations
        """Which kinds of kernel may run."""
        self.cache_dir = cache_dir
        """Where the on-disk choices live (None: not kept)."""
        self.choices: dict[str, str] = {}
        """Shape key → chosen candidate, for this model."""
        self.timings: dict[str, dict[str, float]] = {}
        """Shape key → candidate → measured seconds (for the shapes timed in this process)."""
        self.families: dict[str, str] = {}
        """Shape (any row count) → its kernels' family, e.g. ``float-p16`` (where more than one could run)."""
        self._cache: TimingCache | None = None
        self._bound: weakref.WeakKeyDictionary[Any, tuple[Any, Callable]] = weakref.WeakKeyDictionary()
        self._fused: weakref.WeakKeyDictionary[Any, tuple[Any, Any, Callable | None]] = weakref.WeakKeyDictionary()

    @property
    def cache(self) -> TimingCache:
        """The on-disk choices (made lazily: the thread count is read when the first shape is timed)."""
        if self._cache is None:
            self._cache = TimingCache(self.cache_dir, (f"quant-cpu {_plugin_build()}", f"quant {KERNEL_VERSION}"))
        return self._cache

    def _allowed(self, scheme: Any, layer: Any) -> list[str]:
        names = [n for n in CANDIDATES if n not in PINNED_ONLY and usable(n, scheme, layer)]
        if self.activations == "float":
            names = [n for n in names if CANDIDATES[n][1]]
        elif self.activations == "int8":
            names = [n for n in names if not CANDIDATES[n][1]] or [n for n in names if CANDIDATES[n][1]]
        if len(names) > 1 and "reference" in names:
            names.remove("reference")  # the fallback only: every other candidate beats it
        if "cpu_p16" in names and "cpu_q8" in names:
            names.remove("cpu_q8")  # the same arithmetic, slower at every row count
        if self.kernel is None:
            family = self._family(scheme, layer, names)
            names = [n for n in names if _family(n) == family]
        return names

    def _family(self, scheme: Any, layer: Any, names: list[str]) -> str:
        """The family of ``layer``'s shape among those of ``names``, for every row count alike: the one
        whose fastest kernel takes least time summed over the timed row counts."""
        families = {_family(n) for n in names}
        if len(families) == 1:
            return families.pop()
        shape = self.key(scheme, layer, "any")
        if shape not in self.families:
            qualified = f"family|{','.join(names)}|{shape}"
            cached = self.cache.get(qualified)
            if cached in families:
                family = cached
            else:
                total = dict.fromkeys(sorted(families), 0.0)
                for bucket_name in TIMING_ROWS:
                    times = self._measure(scheme, layer, bucket_name, names)
                    for kind in total:
                        total[kind] += min(t for n, t in times.items() if _family(n) == kind)
                family = min(total, key=total.get)
                self.cache.put(qualified, family)
            self.families[shape] = family
            logger.info("kernels for %s: %s", shape, family)
        return self.families[shape]

    @staticmethod
    def key(scheme: Any, layer: Any, bucket: str) -> str:
        """``int4:g32:mins:960x576:decode`` — what a choice depends on."""
        rows, cols = layer.weight.logical_shape
        return f"int{scheme.bits}:g{scheme.group_size}:{'mins' if scheme.has_mins else 'sym'}:{rows}x{cols}:{bucket}"

    def prepare(self, scheme: Any, layer: Any) -> None:
        """Choose the kernels of ``layer`` for both buckets now (timing them unless cached)."""
        if all(self._choice(scheme, layer, name) in P16_KERNELS for name in TIMING_ROWS):
            to_p16(scheme, layer)
        _P16_COPIES.pop(layer, None)

    def bound(self, scheme: Any, layer: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        """``layer``'s matmul as one callable of a 2-D, contiguous float32 ``x``, bound to its storage on
        first use (storage is written in place, never replaced, once loaded), so a step pays no
        lookups. Where both buckets chose the same kernel it is that kernel alone: no branch on the
        row count."""
        bound = self._bound.get(layer)
        if bound is None or bound[0] is not scheme:
            decode = self._bind(scheme, layer, "decode")
            if self._choice(scheme, layer, "decode") == self._choice(scheme, layer, "batch"):
                run = decode
            else:
                batch = self._bind(scheme, layer, "batch")

                def run(x: torch.Tensor) -> torch.Tensor:
                    return (decode if x.shape[0] <= DECODE_ROWS else batch)(x)
            bound = (scheme, run)
            self._bound[layer] = bound
        return bound[1]

    def gated_mlp(self, gu_scheme: Any, gate_up: Any, down_scheme: Any, down: Any
                  ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """``down(silu(gate(x)) * up(x))`` as one kernel call of a 2-D, contiguous float32 ``x`` where,
        in each row bucket, both projections run the same p16 kernel (the same numbers as the three
        calls it replaces); None elsewhere. Bound on first use, like :meth:`bound`."""
        entry = self._fused.get(gate_up)
        if entry is None or entry[0] is not gu_scheme or entry[1] is not down_scheme:
            run = None
            layers = ((gu_scheme, gate_up), (down_scheme, down))
            plugin = quant_cpu()
            chosen = {b: {self._choice(s, layer, b) for s, layer in layers} for b in TIMING_ROWS}
            if (down_scheme.kernels is self and hasattr(plugin, "bind_gated_mlp_p16")
                    and all(len(c) == 1 and c <= P16_KERNELS.keys() for c in chosen.values())
                    and all(is_p16(layer) for _, layer in layers)):
                parts = [(*s.storage(layer), layer.weight.p16_rows, s.group_size, s.bits) for s, layer in layers]
                names = {b: next(iter(c)) for b, c in chosen.items()}
                decode = plugin.bind_gated_mlp_p16(*parts, kernel=P16_KERNELS[names["decode"]])
                if names["decode"] == names["batch"]:
                    run = decode
                else:
                    batch = plugin.bind_gated_mlp_p16(*parts, kernel=P16_KERNELS[names["batch"]])

                    def run(x: torch.Tensor) -> torch.Tensor:
                        return (decode if x.shape[0] <= DECODE_ROWS else batch)(x)
            entry = (gu_scheme, down_scheme, run)
            self._fused[gate_up] = entry
        return entry[2]

    def traced(self, scheme: Any, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ`` for compilers (torch.compile, torch.export): the chosen candidate reads the
        layer's storage through its attributes on every call, so a tracer sees the layer's parameters
        (not tensors captured in a closure, which an exported program would hold as constants) and
        guards on no per-layer state. Branches on the row count only where the buckets' choices differ."""
        decode, batch = self._choice(scheme, layer, "decode"), self._choice(scheme, layer, "batch")
        name = decode if decode == batch or x.shape[0] <= DECODE_ROWS else batch
        return CANDIDATES[name][0](scheme, layer, x)

    def _bind(self, scheme: Any, layer: Any, bucket_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        name = self._choice(scheme, layer, bucket_name)
        binder = BINDERS.get(name)
        return binder(scheme, layer) if binder is not None else functools.partial(CANDIDATES[name][0], scheme, layer)

    def _choice(self, scheme: Any, layer: Any, bucket_name: str) -> str:
        key = self.key(scheme, layer, bucket_name)
        name = self.choices.get(key)
        if name is not None:
            return name
        allowed = self._allowed(scheme, layer)
        if self.kernel is not None:
            if not usable(self.kernel, scheme, layer):
                raise ValueError(f"kernel {self.kernel!r} cannot run {key} here (usable: "
                                 f"{', '.join(n for n in CANDIDATES if usable(n, scheme, layer))})")
            self.choices[key] = self.kernel
            return self.kernel
        qualified = f"{self.activations}|{','.join(allowed)}|{key}"
        cached = self.cache.get(qualified)
        if cached in allowed:
            self.choices[key] = cached
            return cached
        name = allowed[0] if len(allowed) == 1 else self._time(scheme, layer, bucket_name, key, allowed)
        self.choices[key] = name
        self.cache.put(qualified, name)
        logger.info("kernel for %s: %s", key, name)
        return name

    def _measure(self, scheme: Any, layer: Any, bucket_name: str, names: list[str]) -> dict[str, float]:
        """Seconds of each candidate in ``names`` at ``bucket_name``'s rows (measured once per process)."""
        key = self.key(scheme, layer, bucket_name)
        known = self.timings.setdefault(key, {})
        missing = [n for n in names if n not in known]
        if missing:
            cols = layer.weight.logical_shape[1]
            x = torch.randn(TIMING_ROWS[bucket_name], cols, generator=torch.Generator().manual_seed(0))
            known.update(time_candidates({n: functools.partial(CANDIDATES[n][0], scheme, layer, x) for n in missing}))
        return {n: known[n] for n in names if n in known}

    def _time(self, scheme: Any, layer: Any, bucket_name: str, key: str, allowed: list[str]) -> str:
        times = self._measure(scheme, layer, bucket_name, allowed)
        if not times:
            raise RuntimeError(f"no matmul kernel can run {key} (tried {', '.join(allowed)})")
        return min(times, key=times.get)


def _family(name: str) -> str:
    """A candidate's family: its activations and the layout it reads, e.g. ``float-p16``."""
    return f"{'float' if CANDIDATES[name][1] else 'int8'}-{'p16' if name in P16_KERNELS else 'planar'}"


__all__ = ["CANDIDATES", "DECODE_ROWS", "P16_KERNELS", "PINNED_ONLY", "KernelSelector", "dequantize_planar", "is_p16",
           "quant_cpu", "to_p16", "usable"]
