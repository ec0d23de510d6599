"""The LoRA-kernel suite: a registered kernel against the reference math on random token groups.

Every case builds random stacked adapters (``[slots, rank, in]`` / ``[slots, out, rank]``), a base
output ``y`` and an input ``x``, assigns each token a slot or the base model (-1), and compares the
kernel's ``apply`` with :func:`~modelrunner.lora.kernel.reference_apply`: one token, a decode-sized
batch of mixed adapters, a prefill-sized one with interleaved groups, a step of one adapter only, rows
of the base model left exactly as they were, and the activation dtypes the kernel runs.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Check, NotApplicable, Suite, expect, expect_close

CASES: dict[str, tuple[int, int, int, int, int, str]] = {
    "one-token": (1, 2, 8, 64, 48, "mixed"),
    "decode-mixed": (16, 4, 16, 64, 96, "mixed"),
    "prefill-interleaved": (96, 3, 8, 128, 64, "interleaved"),
    "one-adapter": (33, 2, 16, 64, 64, "single"),
    "base-and-one-adapter": (20, 2, 4, 32, 32, "base-and-one"),
}
"""Case → ``(tokens, slots, rank, in_features, out_features, how tokens pick slots)``."""
DTYPE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
"""Largest |difference| relative to the largest |reference| value, per activation dtype."""


def _slots(tokens: int, slots: int, how: str, gen: torch.Generator) -> torch.Tensor:
    if how == "single":
        return torch.full((tokens,), slots - 1, dtype=torch.long)
    if how == "base-and-one":
        return torch.where(torch.arange(tokens) % 2 == 0, 1, -1).long()
    if how == "interleaved":
        return (torch.arange(tokens) % (slots + 1) - 1).long()
    return torch.randint(-1, slots, (tokens,), generator=gen)


def random_case(tokens: int, slots: int, rank: int, d_in: int, d_out: int, how: str, dtype: torch.dtype,
                device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``(y, x, lora_a, lora_b, token_slots)`` of one case, random."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.5).to(device=device, dtype=dtype)

    token_slots = _slots(tokens, slots, how, gen)
    return rand(tokens, d_out), rand(tokens, d_in), rand(slots, rank, d_in), rand(slots, d_out, rank), token_slots


class LoRAKernelSuite(Suite):
    """Checks one LoRA kernel against the reference math.

    :param device: where the kernel runs (every check is skipped when it does not run there).
    """

    kind = "lora_kernels"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None, device: str = "cpu") -> None:
        super().__init__(name, plugins=plugins, plugin=plugin)
        self.device = torch.device(device)
        """Where the checks run."""
        self._kernel: Any = None

    def _setup(self) -> Any:
        if self._kernel is None:
            cls = self.plugins.registry.get_class(self.kind, self.name, self.provider())
            if cls.devices is not None and self.device.type not in cls.devices:
                raise NotApplicable(f"{self.name!r} runs on {', '.join(cls.devices)}, not {self.device.type}")
            self._kernel = cls()
        return self._kernel

    def _run(self, case: str, dtype: torch.dtype) -> str:
        from modelrunner.api import LoRAMapping, reference_apply

        kernel = self._setup()
        y, x, a, b, token_slots = random_case(*CASES[case], dtype=dtype, device=self.device)
        want = reference_apply(y, x, a, b, token_slots)
        before = y.clone()
        mapping = LoRAMapping.from_token_slots(token_slots).to(self.device)
        got = kernel.apply(y, x, a, b, mapping)
        expect(isinstance(got, torch.Tensor) and got.dtype == dtype,
               f"{case}: apply returned {type(got).__name__} {getattr(got, 'dtype', '')}, expected a {dtype} tensor")
        base_rows = (token_slots < 0).nonzero().flatten().to(self.device)
        expect(torch.equal(got.index_select(0, base_rows), before.index_select(0, base_rows)),
               f"{case}: rows of the base model (slot -1) changed")
        scale = max(want.abs().max().item(), 1e-6)
        diff = expect_close(got / scale, want / scale, DTYPE_TOLERANCE[dtype], f"{case} ({dtype})")
        return f"relative max |Δ| {diff:.2g}"

    def checks(self) -> list[Check]:
        """Every case in float32, then the decode case in bfloat16."""
        out = [Check(f"{case}/float32", lambda case=case: self._run(case, torch.float32)) for case in CASES]
        out.append(Check("decode-mixed/bfloat16", lambda: self._run("decode-mixed", torch.bfloat16)))
        return out
