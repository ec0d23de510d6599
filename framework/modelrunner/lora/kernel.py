"""The batched LoRA apply (the ``lora_kernels`` plugin kind) and the per-step token→adapter mapping.

A step's tokens belong to up to ``max_loras`` adapters (and the base model). Every LoRA-carrying linear
layer holds its adapters' matrices stacked by *slot*: ``lora_a[slot]`` is ``[rank, in]`` and
``lora_b[slot]`` ``[out, rank]`` with the scaling folded into B. A kernel adds, for every token ``t`` of an
adapter, ``lora_b[slot] @ (lora_a[slot] @ x[t])`` to the layer's output row ``t`` — in the activation
dtype, beside whatever matmul computed the base output (dense or quantized); the base weights are
never changed.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import torch


@attrs.frozen
class LoRAMapping:
    """Which adapter slot each token of a step uses, grouped once per step for every layer."""

    token_slots: torch.Tensor
    """``[tokens]`` int64: the slot of each token's adapter, -1 for the base model."""
    groups: tuple[tuple[int, torch.Tensor | None], ...]
    """``(slot, rows)`` per adapter present: the token rows (ascending int64 indices) using it, or None
    when every token of the step does."""

    _masks: dict = attrs.field(factory=dict, eq=False, repr=False)

    def rank_mask(self, slots: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """``[tokens, slots · rank]``: 1 where the column (slot ``c // rank``) is the token's slot, else 0
        (computed once per step and shape)."""
        key = (slots, rank, dtype)
        mask = self._masks.get(key)
        if mask is None:
            columns = torch.arange(slots, device=self.token_slots.device).repeat_interleave(rank)
            mask = self._masks[key] = (self.token_slots.unsqueeze(1) == columns).to(dtype)
        return mask

    @classmethod
    def from_token_slots(cls, token_slots: torch.Tensor) -> LoRAMapping:
        """The mapping of ``token_slots`` (-1: base model), its groups computed once."""
        slots = sorted(s for s in token_slots.unique().tolist() if s >= 0)
        if len(slots) == 1 and bool((token_slots == slots[0]).all()):
            return cls(token_slots, ((slots[0], None),))
        return cls(token_slots, tuple((s, (token_slots == s).nonzero().flatten()) for s in slots))

    def to(self, device: torch.device) -> LoRAMapping:
        """The same mapping with its tensors on ``device``."""
        if self.token_slots.device == torch.device(device):
            return self
        return LoRAMapping(self.token_slots.to(device),
                           tuple((s, None if r is None else r.to(device)) for s, r in self.groups))


class LoRAKernel:
    """Adds the LoRA deltas of a step to a linear layer's output (subclass and register with
    ``registry.lora_kernels(cls)``; chosen by the ``lora_kernel`` config field)."""

    name: ClassVar[str] = ""
    """The name the kernel registers under."""
    devices: ClassVar[tuple[str, ...] | None] = None
    """Device types it runs on (None: any)."""

    def apply(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              mapping: LoRAMapping) -> torch.Tensor:
        """``y`` plus, for every token ``t`` whose slot ``s = mapping.token_slots[t] >= 0``,
        ``lora_b[s] @ (lora_a[s] @ x[t])``; rows of the base model unchanged. May update ``y`` in place.

        :param y: ``[tokens, out]`` the base layer's output.
        :param x: ``[tokens, in]`` the layer's input (same dtype as ``y``).
        :param lora_a: ``[slots, rank, in]``; ``lora_b``: ``[slots, out, rank]`` (scaling folded in).
        :returns: the output with the deltas added.
        """
        raise NotImplementedError


def reference_apply(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                    token_slots: torch.Tensor) -> torch.Tensor:
    """The math every kernel must match, token by token in float64 (for tests and the conformance suite)."""
    out = y.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] += lora_b[slot].double() @ (lora_a[slot].double() @ x[t].double())
    return out.to(y.dtype)
