"""Which matmul kernel a quantized layer runs, chosen by timing the registered candidates on this machine.

The candidates are the loaded plugins' matmul kernels (:class:`~modelrunner.quantization.matmul.MatmulKernel`, declared with
``registry.matmul_kernels(...)``) that claim the layer's weight format on its device. This
distribution's own are ``reference`` (:mod:`.reference`: dequantize, then ``F.linear``: every format, exact, slow), ``int8_rowwise``
(``torch._int_mm``, pinned only) and the library kernels of :mod:`.library` (``torch_int4pack``,
``torch_int8pack``, ``onednn_bf16``: bfloat16 activations); the ``modelrunner-quant-cpu`` plugin adds
its C++ kernels (``cpu_exact``, ``cpu_q8`` on planar storage; ``cpu_p16``, ``cpu_p16_exact``,
``cpu_p16_split`` on its p16 layout). Nothing here imports a kernel plugin.

For every distinct ``(format, rows × columns)`` of a model and for two input sizes — ``decode``
(up to :data:`DECODE_ROWS` rows: one token per sequence) and ``batch`` (more) — each allowed
candidate is timed once on the layer's real weights, the fastest kept, and the choice cached on disk
per CPU model and software version (``kernels.json`` under the cache directory; the kernels'
:meth:`~modelrunner.quantization.matmul.MatmulKernel.build_id` are part of it), so later loads skip the timing. Which
candidates are allowed:

- the kernel claims the format on the layer's device (:meth:`~modelrunner.quantization.matmul.MatmulKernel.supports`);
- a kernel of another layout than planar only on a layer that owns its storage (it is regrouped in
  place, which an expert's view of its stack cannot be), and a layer already regrouped runs only
  kernels of its layout (and the fallback, which reads any layout back as planar rows);
- a kernel's kind of activations (:meth:`~modelrunner.quantization.matmul.MatmulKernel.activation_kind`: ``float``,
  ``int8`` or ``bf16``) only where the method's ``activations`` option allows it — ``float`` only
  float, ``int8`` / ``bf16`` that kind (float where no kernel of it claims the format), ``auto`` any;
  ``timed = False`` kernels only when pinned (``kernel=``);
- the fallback (``reference``) only when nothing else can run; a kernel whose ``superseded_by``
  names an allowed one steps aside (the same arithmetic, slower at every row count);
- in a bfloat16 engine (:attr:`KernelSelector.dtype`) the activations are bfloat16 already, so a
  ``bf16`` kernel is as exact as a ``float`` one and counts as one; a kernel that rounds the weights
  (:attr:`~modelrunner.quantization.matmul.MatmulKernel.rounds_weights`: ``onednn_bf16``'s bfloat16 working copy) then runs
  the ``batch`` bucket under ``float`` too, never ``decode``: a single row stays exact, prompts and
  batches run at the bfloat16 GEMM's speed (AMX where the CPU has it).

A shape's kernels for both buckets come from one *family* — the kind of activations (float, int8 or
bf16) and the layout — the one whose slower bucket is closest to that bucket's fastest family (the
least of each family's largest ratio to the fastest over the timed row counts), so that a layer's storage has one layout and a request's activations are taken one way
(float, int8 or bf16) however many rows share its step. A layer whose family has another layout has
its storage regrouped in place by that kernel's :meth:`~modelrunner.quantization.matmul.MatmulKernel.pack` (no second copy),
and :meth:`~.planar.PlanarScheme.planar_storage` reads it back through the kernel's ``unpack``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from modelrunner.api import (DECODE_ROWS, PLANAR, TIMING_ROWS, MatmulKernel, QuantizedWeight, TimingCache,
                             UnknownNameError, WeightFormat, dequantize_planar, get_plugins, split_choice,
                             time_candidates)

logger = logging.getLogger("modelrunner.quantization")  # under the library's logger, which the CLI and server configure

KERNEL_VERSION = 10
"""Bumped when the selection rules change, so cached choices are remade."""
ACTIVATIONS = ("float", "int8", "bf16", "auto")
"""The values of the quantization methods' ``activations`` option (see :class:`KernelSelector`)."""


def registered_kernels(plugins: Any) -> dict[str, type[MatmulKernel]]:
    """Name → class of every loaded matmul kernel, installed plugins' first (registration order), the
    kernel's defaults last; a name two installed plugins declare appears once per plugin as
    ``plugin:name`` (install order never decides)."""
    registry = plugins.registry
    out: dict[str, type[MatmulKernel]] = {}
    names = registry.providers["matmul_kernels"]
    for name in names:
        owners = registry.candidates("matmul_kernels", name)
        for owner in owners:
            key = name if len(owners) == 1 else f"{owner}:{name}"
            out[key] = registry.get_class("matmul_kernels", name, owner)
    return out


def layout_of(layer: Any) -> str:
    """The layout ``layer``'s storage is in: ``planar``, or the layout of the kernel that regrouped it."""
    packed_by = getattr(layer.weight, "packed_by", None)
    return PLANAR if packed_by is None else packed_by.layout


class KernelSelector:
    """Times the allowed registered kernels for each shape of a model once and remembers the fastest.

    :param activations: ``float`` (exact kernels only), ``int8`` (kernels that quantize activations
        to int8; exact ones as fallback), ``bf16`` (kernels that round them to bfloat16; exact ones as
        fallback), ``auto`` (per shape, the kind whose kernels are fastest over the timed row counts).
        Within what it allows, each shape takes one family (see the module's text) for every row count.
    :param cache_dir: where ``kernels.json`` keeps the choices (None: not kept).
    :param kernel: one registered kernel for every shape it can run (to measure one against
        another); None: timed.
    :param plugins: where the kernels come from (None: the process's plugins, on first use;
        :meth:`use_plugins` sets them).
    """

    def __init__(self, activations: str = "float", cache_dir: Path | None = None, kernel: str | None = None,
                 plugins: Any = None) -> None:
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be 'float', 'int8', 'bf16' or 'auto', got {activations!r}")
        if kernel is not None and not (isinstance(kernel, str) and kernel):
            # The name itself is checked against the registry once the plugins are known (use_plugins).
            raise ValueError(f"kernel must be the name of a registered matmul kernel (or unset: timed), got {kernel!r}")
        self.kernel = kernel
        """The pinned kernel (None: the fastest, timed)."""
        self.activations = activations
        """Which kinds of kernel may run."""
        self.cache_dir = cache_dir
        """Where the on-disk choices live (None: not kept)."""
        self.plugins = plugins
        """The loaded plugins the kernels come from (None: the process's, looked up on first use)."""
        self.choices: dict[str, str] = {}
        """Shape key → chosen kernel, for this model."""
        self.timings: dict[str, dict[str, float]] = {}
        """Shape key → kernel → measured seconds (for the shapes timed in this process)."""
        self.families: dict[str, str] = {}
        """Shape (any row count) → its kernels' family, e.g. ``float-p16`` (where more than one could run)."""
        self.dtype = torch.float32
        """The dtype of the activations the model's layers hand over: the engine's (the method sets it
        once the weights are in). In a bfloat16 engine, rounding activations to bfloat16 loses
        nothing: ``bf16`` kernels count as ``float`` (exact) there, and kernels that round the weights
        (:attr:`~modelrunner.quantization.matmul.MatmulKernel.rounds_weights`) may run the ``batch`` bucket under ``float``."""
        self._kernels: dict[str, MatmulKernel] | None = None
        self._cache: TimingCache | None = None
        self._bound: weakref.WeakKeyDictionary[Any, tuple[Any, Callable]] = weakref.WeakKeyDictionary()
        self._fused: weakref.WeakKeyDictionary[Any, tuple[Any, Any, Callable | None]] = weakref.WeakKeyDictionary()
        self._copies: weakref.WeakKeyDictionary[Any, dict[str, tuple]] = weakref.WeakKeyDictionary()
        """Layer → layout → a regrouped copy of its storage, while a kernel of that layout is timed on
        a layer still stored planar (dropped once the layer is prepared)."""

    def use_plugins(self, plugins: Any) -> None:
        """Take the kernels from ``plugins`` (the ones the quantization method came from), checking a
        pinned ``kernel`` now.

        :raises UnknownNameError: the pinned kernel is not registered (the message lists those that are).
        """
        self.plugins, self._kernels = plugins, None
        self.candidates  # noqa: B018 - resolves and checks the pinned name

    @property
    def candidates(self) -> dict[str, MatmulKernel]:
        """Name → an instance of every registered matmul kernel (made once).

        :raises UnknownNameError: the pinned ``kernel`` is not among them.
        """
        if self._kernels is None:
            if self.plugins is None:
                self.plugins = get_plugins()
            classes = registered_kernels(self.plugins)
            if self.kernel is not None and self.kernel not in classes:
                picked, bare = split_choice(self.kernel)
                if picked is not None and picked in self.plugins.registry.providers["matmul_kernels"].get(bare, []):
                    classes[self.kernel] = self.plugins.registry.get_class("matmul_kernels", bare, picked)
                else:
                    raise UnknownNameError(self.plugins.registry.unknown("matmul_kernels", bare, self.plugins.broken)
                                           + " (quantization option 'kernel'; unset: the fastest, timed)")
            self._kernels = {name: cls() for name, cls in classes.items()}
        return self._kernels

    @property
    def cache(self) -> TimingCache:
        """The on-disk choices (made lazily: the thread count is read when the first shape is timed)."""
        if self._cache is None:
            builds = sorted({f"{type(k).__module__}.{type(k).__qualname__}={k.build_id()}"
                             for k in self.candidates.values() if k.build_id()})
            self._cache = TimingCache(self.cache_dir, (f"matmul {';'.join(builds)}", f"quant {KERNEL_VERSION}"))
        return self._cache

    # -- which kernels may run ---------------------------------------------------------------------

    def usable(self, name: str, scheme: Any, layer: Any = None) -> bool:
        """Whether kernel ``name`` can run ``scheme``'s format (and ``layer``'s storage) on this machine."""
        kernel = self.candidates[name]
        device = layer.weight.device if layer is not None else torch.device("cpu")
        if not kernel.supports(WeightFormat.of(scheme), device):
            return False
        if layer is None:
            return True
        stored = layout_of(layer)
        if stored != PLANAR:
            return kernel.layout == stored or kernel.fallback
        # Regrouped in place: only storage a layer owns (not an expert's view of its stack).
        return kernel.layout == PLANAR or getattr(layer, "quant_scheme", None) is scheme

    def kind_of(self, name: str) -> str:
        """Kernel ``name``'s kind of activations in this engine: its own
        (:meth:`~modelrunner.quantization.matmul.MatmulKernel.activation_kind`), except that ``bf16`` is ``float`` where the
        activations are bfloat16 already (:attr:`dtype`)."""
        kind = self.candidates[name].activation_kind()
        return "float" if kind == "bf16" and self.dtype == torch.bfloat16 else kind

    def family_of(self, name: str) -> str:
        """A kernel's family: its kind of activations (:meth:`kind_of`) and the layout it reads, e.g.
        ``float-p16``, ``bf16-int4pack``."""
        return f"{self.kind_of(name)}-{self.candidates[name].layout}"

    def in_bucket(self, name: str, bucket: str) -> bool:
        """Whether timing may give kernel ``name`` ``bucket``'s rows: a kernel that rounds the weights
        runs under ``activations="float"`` only in a bfloat16 engine and only in the ``batch`` bucket
        (a single row's result stays exact); every other kernel, every bucket."""
        if not self.candidates[name].rounds_weights or self.activations != "float":
            return True
        return bucket != "decode" and self.dtype == torch.bfloat16

    def _complete(self, names: list[str]) -> set[str]:
        """The families of ``names`` with a kernel for every bucket (:meth:`in_bucket`)."""
        return {f for f in {self.family_of(n) for n in names}
                if all(any(self.family_of(n) == f and self.in_bucket(n, b) for n in names) for b in TIMING_ROWS)}

    def _allowed(self, scheme: Any, layer: Any, bucket: str | None = None) -> list[str]:
        """The kernels that may run ``layer`` (in ``bucket``: its row count; None: any): the unpinned
        ones of its shape's one family."""
        names = self._unfiltered(scheme, layer)
        if not names:
            raise RuntimeError(f"no loaded matmul kernel runs {self.key(scheme, layer, 'any')} (loaded: "
                               f"{', '.join(self.candidates) or 'none'}); the modelrunner-quantization plugin's "
                               "'reference' kernel runs every format: is it installed and not blocked?")
        if self.kernel is None:
            family = self._family(scheme, layer, names)
            names = [n for n in names if self.family_of(n) == family and (bucket is None or self.in_bucket(n, bucket))]
        return names

    def _unfiltered(self, scheme: Any, layer: Any) -> list[str]:
        """The kernels allowed on ``layer`` before one family is chosen among them."""
        kernels = self.candidates
        names = [n for n, k in kernels.items() if k.timed and self.usable(n, scheme, layer)]
        if self.activations != "auto":
            kind = [n for n in names if self.kind_of(n) == self.activations]
            names = kind if kind or self.activations == "float" else \
                [n for n in names if self.kind_of(n) == "float"]  # exact where none of the kind can run
        if len(names) > 1:
            others = [n for n in names if not kernels[n].fallback]  # every other candidate beats it...
            if self._complete(others):
                names = others  # ...where they cover every bucket
        return [n for n in names if not any(s in names for s in kernels[n].superseded_by)]

    def _family(self, scheme: Any, layer: Any, names: list[str]) -> str:
        """The family of ``layer``'s shape among those of ``names``, for every row count alike (see
        :meth:`_fastest_family`)."""
        families = self._complete(names) or {self.family_of(n) for n in names}
        if len(families) == 1:
            return families.pop()
        shape = self.key(scheme, layer, "any")
        if shape not in self.families:
            family = self._fastest_family(f"family|{self._mode()}|{','.join(names)}|{shape}", families,
                                          [(scheme, layer, names)])
            self.families[shape] = family
            logger.info("kernels for %s: %s", shape, family)
        return self.families[shape]

    def _fastest_family(self, qualified: str, families: set[str], layers: list[tuple[Any, Any, list[str]]]) -> str:
        """Of ``families``, the cached choice under ``qualified``, else (timed, then cached) the one
        closest to the fastest in its slower bucket: per bucket, each family's fastest kernels summed
        over the layers, divided by the smallest such sum; the family whose larger ratio is least wins
        (ties: the least time in all). A 64-row call takes tens of times a one-row call, so summing
        raw times would let the batch bucket alone decide, however much faster a family decodes.
        ``layers``: ``(scheme, layer, names)``."""
        cached = self.cache.get(qualified)
        if cached in families:
            return cached
        kinds = sorted(families)
        totals = {bucket_name: dict.fromkeys(kinds, 0.0) for bucket_name in TIMING_ROWS}
        for scheme, layer, names in layers:
            for bucket_name, total in totals.items():
                times = self._measure(scheme, layer, bucket_name, [n for n in names if self.in_bucket(n, bucket_name)])
                for kind in kinds:
                    total[kind] += min((t for n, t in times.items() if self.family_of(n) == kind), default=float("inf"))

        def regret(kind: str) -> tuple[float, float]:
            ratios = [total[kind] / max(min(total.values()), 1e-12) for total in totals.values()]
            return max(ratios), sum(total[kind] for total in totals.values())

        family = min(kinds, key=regret)
        self.cache.put(qualified, family)
        return family

    def share_family(self, layers: list[tuple[Any, Any]]) -> None:
        """Give ``layers`` — ``(scheme, layer)`` pairs that run back to back, such as a gated MLP's two
        projections — one family: among those every one of them can run, the one closest to the
        fastest over all of them in its slower bucket (:meth:`_fastest_family`). Then a kernel's
        fused form (:meth:`~modelrunner.quantization.matmul.MatmulKernel.bind_gated_mlp`) can run them in one call, where
        choosing each shape alone could split them between families on a near tie. Where one of the
        shapes already has a family, each keeps its own; a pinned ``kernel`` leaves this to the pin."""
        shapes = [self.key(s, layer, "any") for s, layer in layers]
        if self.kernel is not None or any(shape in self.families for shape in shapes):
            return
        allowed = [self._unfiltered(s, layer) for s, layer in layers]
        common = set.intersection(*(self._complete(names) for names in allowed))
        if not common:
            return
        if len(common) == 1:
            family = common.pop()
        else:
            qualified = f"family|{self._mode()}|{'+'.join(shapes)}|{';'.join(','.join(names) for names in allowed)}"
            family = self._fastest_family(qualified, common, [(s, layer, names) for (s, layer), names
                                                              in zip(layers, allowed, strict=True)])
        for shape in shapes:
            self.families[shape] = family
        logger.info("kernels for %s together: %s", " + ".join(shapes), family)

    # -- storage in a kernel's layout --------------------------------------------------------------

    def _weight(self, scheme: Any, layer: Any, kernel: MatmulKernel) -> QuantizedWeight:
        """``layer``'s weight as ``kernel`` reads it: stored, read back as planar rows, or a regrouped
        copy (while it is timed on a layer still stored planar)."""
        rows, cols = layer.weight.logical_shape
        fmt = WeightFormat.of(scheme)
        stored = layout_of(layer)
        if kernel.layout == stored:
            storage = scheme.storage(layer)
        elif kernel.layout == PLANAR:
            storage = scheme.planar_storage(layer)
        else:
            copies = self._copies.setdefault(layer, {})
            storage = copies.get(kernel.layout)
            if storage is None:  # packed from planar storage, or from GGUF blocks kept as stored
                source = scheme.storage(layer) if fmt.ggml_type else scheme.planar_storage(layer)
                storage = copies[kernel.layout] = type(kernel).pack(QuantizedWeight(*source, fmt, rows, cols))
        return QuantizedWeight(*storage, fmt, rows, cols, kernel.layout)

    def _pack_in_place(self, scheme: Any, layer: Any, kernel: MatmulKernel) -> None:
        """Regroup ``layer``'s planar storage into ``kernel``'s layout, in place (the same parameters,
        their data replaced: a tied embedding sharing them follows)."""
        if layout_of(layer) == kernel.layout:
            return
        rows, cols = layer.weight.logical_shape
        packed = self._copies.pop(layer, {}).get(kernel.layout)
        if packed is None:
            packed = type(kernel).pack(QuantizedWeight(*scheme.storage(layer), WeightFormat.of(scheme), rows, cols))
        data, scales, mins = packed
        with torch.no_grad():
            layer.weight.data = data
            if layer.weight_scales is not None:  # GGUF blocks kept as stored have none of their own
                layer.weight_scales.data = scales
            if mins is not None:
                layer.weight_mins.data = mins
        layer.weight.packed_by = type(kernel)

    # -- choosing ------------------------------------------------------------------------------------

    @staticmethod
    def key(scheme: Any, layer: Any, bucket: str) -> str:
        """``int4:g32:mins:960x576:decode`` (``ggml:Q4_K:…`` for blocks kept as stored) — what a choice
        depends on."""
        rows, cols = layer.weight.logical_shape
        return f"{WeightFormat.of(scheme)}:{rows}x{cols}:{bucket}"

    def prepare(self, scheme: Any, layer: Any) -> None:
        """Choose the kernels of ``layer`` for both buckets now (timing them unless cached), and give
        its storage their layout."""
        layouts = {self.candidates[self._choice(scheme, layer, name)].layout for name in TIMING_ROWS}
        if len(layouts) == 1 and PLANAR not in layouts:
            self._pack_in_place(scheme, layer, self.candidates[self._choice(scheme, layer, "decode")])
        self._copies.pop(layer, None)

    def bound(self, scheme: Any, layer: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        """``layer``'s matmul as one callable of a 2-D, contiguous ``x`` — float32 or the engine's dtype
        (:attr:`dtype`), the output in ``x``'s dtype — bound to its storage on
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
        in each row bucket, both projections run the same kernel, stored in its layout, and that
        kernel has a fused form (:meth:`~modelrunner.quantization.matmul.MatmulKernel.bind_gated_mlp`: the same numbers as
        the three calls it replaces); None elsewhere. Bound on first use, like :meth:`bound`."""
        entry = self._fused.get(gate_up)
        if entry is None or entry[0] is not gu_scheme or entry[1] is not down_scheme:
            run = None
            layers = ((gu_scheme, gate_up), (down_scheme, down))
            chosen = {b: {self._choice(s, layer, b) for s, layer in layers} for b in TIMING_ROWS}
            if down_scheme.kernels is self and all(len(c) == 1 for c in chosen.values()):
                kernels = {b: self.candidates[next(iter(c))] for b, c in chosen.items()}
                fused = {}
                for b, kernel in kernels.items():
                    if all(layout_of(layer) == kernel.layout for _, layer in layers):
                        fused[b] = kernel.bind_gated_mlp(*(self._weight(s, layer, kernel) for s, layer in layers))
                if len(fused) == len(kernels) and all(f is not None for f in fused.values()):
                    decode, batch = fused["decode"], fused["batch"]
                    if kernels["decode"] is kernels["batch"]:
                        run = decode
                    else:
                        def run(x: torch.Tensor) -> torch.Tensor:
                            return (decode if x.shape[0] <= DECODE_ROWS else batch)(x)
            entry = (gu_scheme, down_scheme, run)
            self._fused[gate_up] = entry
        return entry[2]

    def traced(self, scheme: Any, layer: Any, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ`` for compilers (torch.compile, torch.export): the chosen kernel's ``run`` reads the
        layer's storage through its attributes on every call, so a tracer sees the layer's parameters
        (not tensors captured in a closure, which an exported program would hold as constants) and
        guards on no per-layer state. Branches on the row count only where the buckets' choices differ."""
        decode, batch = self._choice(scheme, layer, "decode"), self._choice(scheme, layer, "batch")
        name = decode if decode == batch or x.shape[0] <= DECODE_ROWS else batch
        kernel = self.candidates[name]
        if x.dtype is torch.float32 or x.dtype in kernel.input_dtypes:
            return kernel.run(self._weight(scheme, layer, kernel), x)
        return kernel.run(self._weight(scheme, layer, kernel), x.float()).to(x.dtype)

    def _bind(self, scheme: Any, layer: Any, bucket_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        kernel = self.candidates[self._choice(scheme, layer, bucket_name)]
        if kernel.layout != PLANAR and layout_of(layer) == PLANAR and getattr(layer, "quant_scheme", None) is scheme:
            self._pack_in_place(scheme, layer, kernel)  # a layer bound before it was prepared
        run = kernel.bind(self._weight(scheme, layer, kernel))
        if self.dtype is torch.float32 or self.dtype in kernel.input_dtypes:
            return run

        def via_float32(x: torch.Tensor) -> torch.Tensor:  # the engine's activations, converted both ways
            return run(x) if x.dtype is torch.float32 else run(x.float()).to(x.dtype)
        return via_float32

    def _choice(self, scheme: Any, layer: Any, bucket_name: str) -> str:
        key = self.key(scheme, layer, bucket_name)
        name = self.choices.get(key)
        if name is not None:
            return name
        allowed = self._allowed(scheme, layer, bucket_name)
        if self.kernel is not None:
            if not self.usable(self.kernel, scheme, layer):
                raise ValueError(f"kernel {self.kernel!r} cannot run {key} here (usable: "
                                 f"{', '.join(n for n in self.candidates if self.usable(n, scheme, layer))})")
            self.choices[key] = self.kernel
            return self.kernel
        qualified = f"{self._mode()}|{','.join(allowed)}|{key}"
        cached = self.cache.get(qualified)
        if cached in allowed:
            self.choices[key] = cached
            return cached
        name = allowed[0] if len(allowed) == 1 else self._time(scheme, layer, bucket_name, key, allowed)
        self.choices[key] = name
        self.cache.put(qualified, name)
        logger.info("kernel for %s: %s", key, name)
        return name

    def _mode(self) -> str:
        """What the allowed kernels depend on besides the shape: ``activations`` and :attr:`dtype`."""
        return f"{self.activations}:{str(self.dtype).removeprefix('torch.')}"

    def _measure(self, scheme: Any, layer: Any, bucket_name: str, names: list[str]) -> dict[str, float]:
        """Seconds of each kernel in ``names`` at ``bucket_name``'s rows (measured once per process)."""
        key = self.key(scheme, layer, bucket_name)
        known = self.timings.setdefault(key, {})
        missing = [n for n in names if n not in known]
        if missing:
            cols = layer.weight.logical_shape[1]
            x = torch.randn(TIMING_ROWS[bucket_name], cols, generator=torch.Generator().manual_seed(0))

            def timed(kernel: MatmulKernel) -> Callable[[], torch.Tensor]:
                # The storage is looked up inside the call, so a kernel whose packing fails is skipped.
                return lambda: kernel.run(self._weight(scheme, layer, kernel), x)

            known.update(time_candidates({n: timed(self.candidates[n]) for n in missing}))
        return {n: known[n] for n in names if n in known}

    def _time(self, scheme: Any, layer: Any, bucket_name: str, key: str, allowed: list[str]) -> str:
        times = self._measure(scheme, layer, bucket_name, allowed)
        if not times:
            raise RuntimeError(f"no matmul kernel can run {key} (tried {', '.join(allowed)})")
        return min(times, key=times.get)


__all__ = ["ACTIVATIONS", "DECODE_ROWS", "KERNEL_VERSION", "KernelSelector", "dequantize_planar", "layout_of"]
