"""The matmul-kernel suite: a registered kernel against the dequantized float reference.

For every format of :data:`FORMATS` the kernel claims on the suite's device (its ``supports``), a
random float weight is quantized into that format (planar, then the kernel's ``pack`` for a layout
of its own), and the kernel's ``run`` and ``bind`` on random ``x`` of 1, 5 and 64 rows are compared
with ``F.linear(x, dequantize_planar(...))``; a packed layout must ``unpack`` to the planar bytes.
Formats it does not claim are skipped — and refused: the selector pinned to it says so rather than
run it. A strided ``x`` must give the right numbers or raise an error that says why; a fused gated
MLP, where the kernel has one, must equal the three calls.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .base import Check, ConformanceError, NotApplicable, Suite, expect

FORMATS: dict[str, tuple[int, int, bool, bool]] = {
    "int4:g32:mins": (4, 32, True, False),
    "int4:g128:mins": (4, 128, True, False),
    "int8:g32:sym": (8, 32, False, False),
    "int8:per-row:sym": (8, 0, False, True),
}
"""Format label → ``(bits, group_size, has_mins, per_row)`` (group 0: the row's width), as the
kernel's quantization methods make them (GGUF Q4_0/Q4_1/Q8_0, ``int4``, ``int8``)."""
ROWS = (1, 5, 64)
"""Rows of ``x`` checked: one token, a few, a batch (each side of the selector's decode bucket)."""
WEIGHT_ROWS, WEIGHT_COLS = 40, 256
"""The weight's shape: rows not a multiple of 16 or 32 (a tiled layout pads them), columns a multiple of 128."""
EXACT_RTOL = 1e-5
"""Largest |difference| / max |reference| of an exact kernel (float activations: summation order only)."""
APPROX_RTOL = 5e-2
"""The same for a kernel that quantizes activations (``exact = False``; int8 per block is about 1e-2)."""


def _format(label: str, cols: int = WEIGHT_COLS) -> Any:
    from modelrunner.api import WeightFormat

    bits, group, mins, per_row = FORMATS[label]
    return WeightFormat(bits, group or cols, mins, per_row)


def planar_weight(label: str, rows: int = WEIGHT_ROWS, cols: int = WEIGHT_COLS, seed: int = 0) -> Any:
    """A random ``rows × cols`` weight quantized into format ``label``, planar."""
    from modelrunner.api import QuantizedWeight
    from modelrunner.api import quantize_planar  # the reference quantizer

    fmt = _format(label, cols)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    return QuantizedWeight(*quantize_planar(w, fmt.bits, fmt.group_size, not fmt.has_mins), fmt, rows, cols)


def reference_matmul(weight: Any, x: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` in float32, ``W`` the float weight a planar :class:`~modelrunner.quantization.QuantizedWeight` encodes."""
    from modelrunner.api import dequantize_planar

    return F.linear(x.float(), dequantize_planar(*weight.storage, weight.format.group_size, weight.format.bits))


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    diff = (got.float() - want.float()).abs().max()
    if not torch.isfinite(diff):
        return float("inf")
    return diff.item() / max(want.abs().max().item(), 1e-30)


class MatmulKernelSuite(Suite):
    """Checks one matmul kernel on every format of :data:`FORMATS` it claims.

    :param device: where the kernel runs (every check is skipped when it claims nothing there).
    """

    kind = "matmul_kernels"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None, device: str = "cpu") -> None:
        super().__init__(name, plugins=plugins, plugin=plugin)
        self.device = torch.device(device)
        """Where the checks run."""
        self._kernel: Any = None

    def kernel_class(self) -> type:
        """The kernel class under test (the chosen plugin's, else the one the kernel would use)."""
        return self.plugins.registry.get_class(self.kind, self.name, self.provider())

    def _setup(self) -> Any:
        if self._kernel is None:
            self._kernel = self.kernel_class()()
        return self._kernel

    def _claims(self, label: str) -> bool:
        claims = type(self._setup()).supports(_format(label), self.device)
        expect(isinstance(claims, bool), f"supports({label}, {self.device.type!r}) returned {claims!r}, not a bool")
        return claims

    def _weight(self, label: str, rows: int = WEIGHT_ROWS, cols: int = WEIGHT_COLS, seed: int = 0) -> tuple[Any, Any]:
        """(planar weight, the same in the kernel's layout, on the device)."""
        from modelrunner.api import QuantizedWeight
        from modelrunner.quantization.matmul import PLANAR  # kernel internal: the reference weight format

        kernel = self._setup()
        planar = planar_weight(label, rows, cols, seed)
        planar = planar._replace(data=planar.data.to(self.device), scales=planar.scales.to(self.device),
                                 mins=None if planar.mins is None else planar.mins.to(self.device))
        if kernel.layout == PLANAR:
            return planar, planar
        packed = QuantizedWeight(*type(kernel).pack(planar), planar.format, planar.rows, planar.cols, kernel.layout)
        back = type(kernel).unpack(packed)
        for what, got, want in zip(("values", "scales", "mins"), back, planar.storage):
            expect((got is None) == (want is None) and (got is None or torch.equal(got.cpu(), want.cpu())),
                   f"{label}: unpack(pack(weight)) {what} differ from the planar ones")
        return planar, packed

    def _tolerance(self) -> float:
        return EXACT_RTOL if self._setup().exact else APPROX_RTOL

    def _check_format(self, label: str, rows: int) -> str:
        if not self._claims(label):
            raise NotApplicable(f"{self.name!r} does not claim {label} on {self.device.type}")
        kernel = self._setup()
        planar, weight = self._weight(label)
        x = torch.randn(rows, WEIGHT_COLS, generator=torch.Generator().manual_seed(rows)).to(self.device)
        want = reference_matmul(planar, x)
        worst = 0.0
        for how, got in (("run", kernel.run(weight, x)), ("bind", kernel.bind(weight)(x))):
            expect(isinstance(got, torch.Tensor) and tuple(got.shape) == (rows, WEIGHT_ROWS)
                   and got.dtype == torch.float32,
                   f"{label}, {rows} rows: {how} returned {getattr(got, 'dtype', type(got))} "
                   f"{list(getattr(got, 'shape', []))}, expected float32 [{rows}, {WEIGHT_ROWS}]")
            error = _relative(got.cpu(), want.cpu())
            expect(error <= self._tolerance(),
                   f"{label}, {rows} rows: {how} differs from the dequantized reference by {error:.3g} of its "
                   f"largest value (allowed {self._tolerance():g}{'' if kernel.exact else ', exact = False'})")
            worst = max(worst, error)
        return f"max relative difference {worst:.2g}"

    def _check_refuses(self) -> str:
        from modelrunner.api import WeightFormat
        from modelrunner_quantization import KernelSelector  # picks kernels as the runner does

        cls = type(self._setup())
        malformed = WeightFormat(3, 32, True)
        expect(cls.supports(malformed, self.device) is False,
               f"supports() claims {malformed} (no planar weight has 3 bits): a kernel must claim only what it runs")
        unclaimed = [label for label in FORMATS if not self._claims(label)]
        for label in unclaimed:
            selector = KernelSelector("auto", kernel=f"{self.provider()}:{self.name}", plugins=self.plugins)
            scheme, layer = _layer(label, selector)
            try:
                selector.prepare(scheme, layer)
            except ValueError as e:
                expect(self.name in str(e), f"{label}: the refusal does not name the kernel: {e}")
                continue
            raise ConformanceError(f"{label}: a selector pinned to {self.name!r} ran a format it does not claim")
        return f"refuses {', '.join(unclaimed) or 'only the malformed format (it claims every one)'}"

    def _check_strided(self) -> str:
        claimed = [label for label in FORMATS if self._claims(label)]
        if not claimed:
            raise NotApplicable(f"{self.name!r} claims none of the formats on {self.device.type}")
        kernel = self._setup()
        planar, weight = self._weight(claimed[0])
        x = torch.randn(WEIGHT_COLS, 5, generator=torch.Generator().manual_seed(7)).to(self.device).t()
        try:
            got = kernel.run(weight, x)
        except (ValueError, RuntimeError, TypeError) as e:
            expect("contiguous" in str(e).lower() or "stride" in str(e).lower(),
                   f"a strided x raised {type(e).__name__} without saying it must be contiguous: {e}")
            return "refused with a clear error"
        error = _relative(got.cpu(), reference_matmul(planar, x).cpu())
        expect(error <= self._tolerance(), f"a strided x gave results {error:.3g} off the reference")
        return "computed"

    def _check_gated_mlp(self) -> str:
        claimed = [label for label in FORMATS if self._claims(label)]
        if not claimed:
            raise NotApplicable(f"{self.name!r} claims none of the formats on {self.device.type}")
        kernel = self._setup()
        hidden, inner = WEIGHT_COLS, WEIGHT_COLS // 2
        _, gate_up = self._weight(claimed[0], 2 * inner, hidden, seed=1)
        _, down = self._weight(claimed[0], hidden, inner, seed=2)
        fused = kernel.bind_gated_mlp(gate_up, down)
        if fused is None:
            raise NotApplicable(f"{self.name!r} has no fused gated MLP (bind_gated_mlp returns None)")
        x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(3)).to(self.device)
        h = kernel.run(gate_up, x)
        want = kernel.run(down, (F.silu(h[:, :inner]) * h[:, inner:]).contiguous())
        error = _relative(fused(x).cpu(), want.cpu())
        expect(error <= EXACT_RTOL, f"the fused gated MLP differs from its three calls by {error:.3g}")
        return f"max relative difference {error:.2g}"

    def checks(self) -> list[Check]:
        """Every format × row count, then refusal, strided input and the fused gated MLP."""
        out = [Check(f"{label}/rows={rows}", lambda label=label, rows=rows: self._check_format(label, rows))
               for label in FORMATS for rows in ROWS]
        out.append(Check("refuses-unclaimed-formats", self._check_refuses))
        out.append(Check("strided-input", self._check_strided))
        out.append(Check("gated-mlp", self._check_gated_mlp))
        return out


def _layer(label: str, selector: Any) -> tuple[Any, Any]:
    """A quantized layer of format ``label`` (``PlanarScheme`` and module), its weights random."""
    from torch import nn

    from modelrunner_quantization import PlanarScheme

    bits, group, mins, _ = FORMATS[label]
    scheme = PlanarScheme(bits, group, has_mins=mins, kernels=selector, quantize_floats=True, symmetric=not mins)
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.empty(WEIGHT_ROWS, WEIGHT_COLS, device="meta"), requires_grad=False)
    scheme.create_storage(layer, WEIGHT_ROWS, WEIGHT_COLS)
    weight = planar_weight(label)
    layer.weight = nn.Parameter(weight.data, requires_grad=False)
    layer.weight.logical_shape = (WEIGHT_ROWS, WEIGHT_COLS)
    layer.weight_scales = nn.Parameter(weight.scales, requires_grad=False)
    layer.weight_mins = None if weight.mins is None else nn.Parameter(weight.mins, requires_grad=False)
    layer.quant_scheme = scheme
    return scheme, layer


__all__ = ["APPROX_RTOL", "EXACT_RTOL", "FORMATS", "ROWS", "MatmulKernelSuite", "planar_weight", "reference_matmul"]
