"""``x Wᵀ + b`` through the fastest matmul torch has for the device, dtype and shape, chosen by
timing on this machine, optionally on weights prepacked into oneDNN's blocked layout.

Every linear layer of the kernel goes through :func:`dense`, so adapters get the faster path for
free. On x86 CPUs three paths compete (in float32, and in bfloat16 where oneDNN computes it:
AVX512-BF16 or AMX): MKL's sgemm (``F.linear``), oneDNN's matmul on the
plain weight, and oneDNN's matmul on a weight reordered once into its blocked layout. Which wins
depends on the CPU and the shape (a Zen 1 machine prefers MKL at one row for shapes where Zen 3
prefers oneDNN), so :func:`prepack_weights` — which the ``cpu_fused`` compile backend applies — times
the three for each distinct weight shape at a decode-sized and a batch-sized input (once per
machine: the choices are cached on disk, see :mod:`modelrunner.timing_cache`) and gives each weight a
:class:`DensePlan`. Where the packed layout wins, the weight is kept *only* packed (the plain
parameter is released; a packed weight converts back losslessly, see :func:`unpack_weights`), so
the model holds one copy of each weight, not two; where it loses, nothing is packed.

A module opts in by listing its weight parameters in a ``DENSE_WEIGHTS`` class attribute and
passing them to :func:`dense` (2-D) or, for a 3-D stack of matrices (MoE experts), passing each
matrix with ``plan=dense_plan(param)`` and ``packed=plan.packed[i]``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..cache_dir import cache_root
from ..timing_cache import TIMING_ROWS, TimingCache, bucket, time_candidates

logger = logging.getLogger(__name__)

PLAN_ATTR = "dense_plan"
"""Attribute of a weight parameter holding its :class:`DensePlan`."""
PATHS = ("mkl", "onednn", "onednn_packed")
"""The float32 CPU matmul paths :func:`prepack_weights` times."""
PACKED_ONLY_TOLERANCE = 1.15
"""A weight is kept only packed when the packed path is at most this much slower than the best plain
path in the bucket where plain won (one copy of the weight beats a few percent there)."""


@dataclass
class DensePlan:
    """How :func:`dense` multiplies one weight: the path for decode-sized and batch-sized inputs,
    and the packed copy (None: not packed)."""

    decode: str
    """Path for inputs of at most :data:`~modelrunner.timing_cache.DECODE_ROWS` rows."""
    batch: str
    """Path for larger inputs."""
    packed: Any = None
    """The oneDNN-packed weight (a list of them for a 3-D stack), when a path uses it."""
    plain_released: bool = False
    """The plain parameter was released: the packed copy is the only one."""

    def path(self, rows: int) -> str:
        """The path an input of ``rows`` rows takes."""
        return self.decode if bucket(rows) == "decode" else self.batch


@functools.cache
def onednn_usable() -> bool:
    """Whether this torch build has oneDNN's fused linear op and its weight reorder."""
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def onednn_bf16_usable() -> bool:
    """Whether oneDNN computes bfloat16 matmuls on this CPU (it needs AVX512-BF16 or AMX; elsewhere
    torch converts to float32 and back, slower than float32 itself)."""
    try:
        return onednn_usable() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def planned_dtype(dtype: torch.dtype) -> bool:
    """Whether weights of ``dtype`` get a :class:`DensePlan` (and :func:`dense` takes oneDNN's paths
    for inputs of it): float32, and bfloat16 where :func:`onednn_bf16_usable`."""
    return onednn_usable() and (dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16_usable()))


@torch.library.custom_op("modelrunner::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's float32 linear on an unpacked weight, opaque to compilers (inductor's own lowering of
    the op accepts only frozen, constant weights)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


_onednn_in_graphs = False


@contextlib.contextmanager
def onednn_in_compiled_graphs(enabled: bool = True) -> Iterator[None]:
    """While tracing under this context, :func:`dense` puts oneDNN's linear (:func:`onednn_linear`,
    which inductor calls as an external kernel) into the graph instead of ``F.linear`` (which
    inductor lowers to MKL's sgemm, slower on the reference CPU).

    Meant for graphs whose weights inductor does not freeze (freezing prepacks ``F.linear``'s
    weights itself). Dynamo guards on the setting, so a graph traced with it is reused only with it.
    """
    global _onednn_in_graphs
    previous, _onednn_in_graphs = _onednn_in_graphs, enabled and onednn_usable()
    try:
        yield
    finally:
        _onednn_in_graphs = previous


def _onednn_applies(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 2 and x.shape[0] > 0 and planned_dtype(x.dtype)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
          packed: torch.Tensor | None = None, plan: DensePlan | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` of shape ``[rows, in]``.

    :param plan: the weight's :class:`DensePlan` (default: the one :func:`prepack_weights` attached to
        ``weight``). Without one, oneDNN's matmul on the plain weight where it applies, else ``F.linear``.
    :param packed: ``weight`` prepacked for oneDNN, in place of ``plan.packed`` (one matrix of a stack).
    """
    if torch.compiler.is_compiling():
        # Compilers get the plain linear (inductor picks, and with freezing prepacks, its own
        # matmul) unless a backend asked for oneDNN's op in its graphs.
        if _onednn_in_graphs and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2:
            return onednn_linear(x, weight, bias)
        return F.linear(x, weight, bias)
    if not _onednn_applies(x):
        return F.linear(x, weight, bias)
    if plan is None:
        plan = getattr(weight, PLAN_ATTR, None)
    path = "onednn_packed" if plan is None and packed is not None else (plan.path(x.shape[0]) if plan else "onednn")
    if path == "onednn_packed":
        return _onednn(x, packed if packed is not None else plan.packed, bias)
    if path == "onednn":
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


def dense_plan(weight: torch.Tensor) -> DensePlan | None:
    """The :class:`DensePlan` :func:`prepack_weights` attached to ``weight``, or None."""
    return getattr(weight, PLAN_ATTR, None)


def packed_weight(weight: torch.Tensor) -> Any:
    """The packed copy :func:`prepack_weights` attached to ``weight`` (a list for a 3-D stack), or None."""
    plan = dense_plan(weight)
    return None if plan is None else plan.packed


def time_paths(matrix: torch.Tensor, rows: int, packed: Any = None) -> dict[str, float]:
    """Seconds of each path :func:`dense` can take for ``matrix`` (all of :data:`PATHS` for a
    :func:`planned_dtype`, else ``mkl``: ``F.linear``) multiplying ``rows`` random rows of its dtype
    (``packed``: its oneDNN-packed copy, made here when None); a path that cannot run is left out."""
    x = torch.randn(rows, matrix.shape[1], generator=torch.Generator().manual_seed(0)).to(matrix.dtype)
    paths = {"mkl": functools.partial(F.linear, x, matrix)}
    if planned_dtype(matrix.dtype):
        if packed is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(matrix)
        paths["onednn"] = functools.partial(_onednn, x, matrix, None)
        paths["onednn_packed"] = functools.partial(_onednn, x, packed, None)
    return time_candidates(paths)


def _timed(matrix: torch.Tensor, cache: TimingCache) -> dict[str, tuple[str, bool]]:
    """bucket → (fastest path, whether the packed path is within :data:`PACKED_ONLY_TOLERANCE` of
    it) for a weight of ``matrix``'s shape and dtype: timed on ``matrix`` once per machine, then cached."""
    rows, cols = matrix.shape
    out: dict[str, tuple[str, bool]] = {}
    packed = None
    tag = "fp32" if matrix.dtype == torch.float32 else str(matrix.dtype).removeprefix("torch.")
    for name, timing_rows in TIMING_ROWS.items():
        key = f"dense:{tag}:{rows}x{cols}:{name}"
        best, _, ok = (cache.get(key) or "").partition(";")
        if best in PATHS and ok in ("0", "1"):
            out[name] = (best, ok == "1")
            continue
        if packed is None:
            packed = torch.ops.mkldnn._reorder_linear_weight(matrix)
        times = time_paths(matrix, timing_rows, packed)
        if not times:
            raise RuntimeError(f"no {matrix.dtype} matmul path runs a {rows}x{cols} weight")
        best = min(times, key=times.get)
        ok = times.get("onednn_packed", float("inf")) <= times[best] * PACKED_ONLY_TOLERANCE
        out[name] = (best, ok)
        cache.put(key, f"{best};{int(ok)}")
        logger.info("dense path for %dx%d at %d rows: %s (%s)", rows, cols, timing_rows, best,
                    ", ".join(f"{n} {t * 1e6:.0f} us" for n, t in sorted(times.items())))
    return out


def _plan(timed: dict[str, tuple[str, bool]], shared: bool) -> tuple[DensePlan, bool]:
    """The plan for timed choices, and whether a packed copy is needed."""
    decode, batch = timed["decode"][0], timed["batch"][0]
    if "onednn_packed" not in (decode, batch):
        return DensePlan(decode, batch), False
    if not shared and all(ok for _, ok in timed.values()):
        return DensePlan("onednn_packed", "onednn_packed", plain_released=True), True
    return DensePlan(decode, batch), True


def _pack(weight: torch.Tensor) -> Any:
    if weight.dim() == 2:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    return [torch.ops.mkldnn._reorder_linear_weight(w) for w in weight.detach()]


def _released(weight: nn.Parameter) -> nn.Parameter:
    """A stand-in for a parameter whose only copy is now packed: same shape and dtype, on ``meta`` (any
    use of its values fails loudly instead of reading garbage)."""
    stand_in = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)
    stand_in.__dict__.update({k: v for k, v in weight.__dict__.items() if k != PLAN_ATTR})
    return stand_in


def prepack_weights(model: nn.Module, cache_dir: Any = None, path: str = "auto") -> int:
    """Give every weight a module lists in ``DENSE_WEIGHTS`` its :class:`DensePlan`, packing it for
    oneDNN where the packed path measures fastest (timed per shape on this machine, cached under
    ``cache_dir``; default the cache directory of :func:`modelrunner.cache_dir.cache_root`).

    Only CPU weights of a :func:`planned_dtype` are planned (elsewhere :func:`dense` does not use oneDNN). A weight whose
    packed path wins (or is within :data:`PACKED_ONLY_TOLERANCE` in the other bucket) is kept only
    packed: its parameter becomes a ``meta`` stand-in of the same shape, unless another module shares
    it (a tied LM head keeps the embedding's plain rows). Planning again first undoes the last plan.

    :param path: ``auto`` (timed per shape), or one of :data:`PATHS` for every weight and input size
        (to measure one path against another).
    :returns: bytes the packed copies take.
    :raises ValueError: an unknown ``path``.
    """
    if path != "auto" and path not in PATHS:
        raise ValueError(f"dense path must be 'auto' or one of {', '.join(PATHS)}, got {path!r}")
    if not onednn_usable():
        return 0
    unpack_weights(model)
    cache = TimingCache(cache_root(cache_dir))
    counts: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        counts[id(param)] = counts.get(id(param), 0) + 1
    total = 0
    planned: dict[int, DensePlan] = {}
    with torch.no_grad():
        for module in model.modules():
            for name in getattr(module, "DENSE_WEIGHTS", ()):
                weight = getattr(module, name, None)
                if (not isinstance(weight, nn.Parameter) or id(weight) in planned or not planned_dtype(weight.dtype)
                        or weight.device.type != "cpu" or weight.dim() not in (2, 3) or weight.is_meta):
                    continue
                matrix = weight.detach() if weight.dim() == 2 else weight.detach()[0]
                timed = _timed(matrix, cache) if path == "auto" else {b: (path, True) for b in TIMING_ROWS}
                plan, needs_packed = _plan(timed, shared=counts.get(id(weight), 1) > 1)
                if needs_packed:
                    plan.packed = _pack(weight)
                    total += weight.numel() * weight.element_size()
                planned[id(weight)] = plan
                if plan.plain_released:
                    stand_in = _released(weight)
                    setattr(stand_in, PLAN_ATTR, plan)
                    module._parameters[name] = stand_in
                else:
                    setattr(weight, PLAN_ATTR, plan)
    return total


def plan_summary(model: nn.Module) -> dict[str, Any]:
    """What :func:`prepack_weights` decided: ``{"RxC": "decode path / batch path"}`` per weight
    shape, and the bytes of plain weights released (kept only packed)."""
    shapes: dict[str, str] = {}
    released = 0
    seen: set[int] = set()
    for param in model.parameters():
        plan = dense_plan(param)
        if plan is None or id(param) in seen:
            continue
        seen.add(id(param))
        rows, cols = param.shape[-2:]
        shapes[f"{rows}x{cols}"] = f"{plan.decode} / {plan.batch}"
        if plan.plain_released:
            released += param.numel() * param.element_size()
    return {"paths": dict(sorted(shapes.items())), "released_plain_bytes": released}


def unpack_weights(model: nn.Module) -> None:
    """Undo :func:`prepack_weights`: weights kept only packed get their plain parameter back (the
    packed layout converts back exactly), and every plan and packed copy is dropped."""
    with torch.no_grad():
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                plan = dense_plan(param) if param is not None else None
                if plan is None:
                    continue
                if plan.plain_released:
                    packed = plan.packed
                    plain = packed.to_dense() if not isinstance(packed, list) else \
                        torch.stack([p.to_dense() for p in packed])
                    restored = nn.Parameter(plain, requires_grad=False)
                    restored.__dict__.update({k: v for k, v in param.__dict__.items() if k != PLAN_ATTR})
                    module._parameters[name] = restored
                else:
                    delattr(param, PLAN_ATTR)
