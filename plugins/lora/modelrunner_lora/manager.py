"""One rank's LoRA state: adapters read (LRU of ``max_cpu_loras``), slots filled (``max_loras``), and the
forward hooks that add each step's deltas to the linear layers.

The hooks are on the layers only during steps that run an adapter: a base-model step runs the model
exactly as without LoRA, and compile backends that record or fuse layers step aside while hooks are
registered (they already do for any forward hook), so LoRA steps run the layers eagerly.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from modelrunner.api import LoRAKernel, LoRAMapping, LoRARequest

from .checkpoint import LoRAError, read_peft_adapter
from .layers import LoRALayer, ShardWeights, lora_layers, packed_mapping, resolve_all

Adapter = dict[str, dict[int, ShardWeights]]
"""A read adapter: layer name → packed index → this rank's ``(A, B·scaling)`` in the model's dtype, in
host memory."""


class LoRAManager:
    """Adapters for one model on one rank.

    :param model: the loaded (and parallelized) model; its LoRA-capable linear layers get slots.
    :param config: the configuration's ``lora`` section (``LoRAConfig``).
    :param kernel: the ``lora_kernels`` plugin instance that adds the deltas.
    """

    def __init__(self, model: nn.Module, config: Any, kernel: LoRAKernel, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        """The LoRA limits."""
        self.kernel = kernel
        """Adds the deltas (the ``lora_kernel`` config field's plugin)."""
        self.dtype = dtype
        """The activation dtype the deltas are computed in."""
        self.packed = packed_mapping(model)
        """Checkpoint projection → (fused layer, index)."""
        self.layers = {name: LoRALayer(m, name, config.max_loras, config.max_lora_rank, device, dtype)
                       for name, m in lora_layers(model).items()}
        """Layer name → its slots."""
        if not self.layers:
            raise LoRAError(f"{type(model).__name__} has no linear layer named like a LoRA target (q/k/v/o/gate/"
                            "up/down_proj or their fused forms): it cannot run LoRA adapters")
        self.requests: dict[int, LoRARequest] = {}
        """Every adapter added, by ``lora_int_id``."""
        self.read: collections.OrderedDict[int, Adapter] = collections.OrderedDict()
        """Adapters read from disk, least recently used first (at most ``max_cpu_loras``)."""
        self.slots: list[int | None] = [None] * config.max_loras
        """The adapter id in each slot (None: empty)."""
        self.mapping: LoRAMapping | None = None
        """This step's token → slot mapping (None outside LoRA steps)."""
        self.loads = 0
        """Adapters read from disk so far."""
        self._hooks: list[Any] = []

    # -- adapters --------------------------------------------------------------------------------

    def add(self, request: LoRARequest) -> None:
        """Read and check an adapter (again if it was dropped), keeping it among the read ones.

        :raises LoRAError: a bad checkpoint, or the id already names another path.
        """
        known = self.requests.get(request.lora_int_id)
        if known is not None and known.lora_path != request.lora_path:
            raise LoRAError(f"lora_int_id {request.lora_int_id} is already adapter {known.lora_name!r} at "
                            f"{known.lora_path!r}; give {request.lora_path!r} another id")
        if request.lora_int_id in self.read:
            self.read.move_to_end(request.lora_int_id)
            return
        adapter = self._read(request)
        self.requests[request.lora_int_id] = request
        self.read[request.lora_int_id] = adapter
        self.loads += 1
        while len(self.read) > self.config.cpu_loras:
            self.read.popitem(last=False)

    def _read(self, request: LoRARequest) -> Adapter:
        peft = read_peft_adapter(request.lora_path, self.config.max_lora_rank)
        adapter: Adapter = {}
        for name, shards in resolve_all(peft.modules, self.layers, self.packed, peft.path).items():
            layer = self.layers[name]
            adapter[name] = {}
            for index, weights in shards.items():
                a, b = layer.shard_weights(index, weights, peft.scaling, peft.path)
                # Kept in host memory (max_cpu_loras of them); copied to the device when given a slot.
                adapter[name][index] = (a.to(dtype=self.dtype), b.to(dtype=self.dtype))
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot is emptied); False when it was not added."""
        if self.requests.pop(lora_int_id, None) is None:
            return False
        self.read.pop(lora_int_id, None)
        self.slots = [None if s == lora_int_id else s for s in self.slots]
        return True

    def _activate(self, ids: Sequence[int]) -> dict[int, int]:
        """Slots for ``ids`` (each present in some slot afterwards); adapters not needed make room."""
        if len(ids) > len(self.slots):
            raise ValueError(f"a step uses {len(ids)} adapters but max_loras is {len(self.slots)}")
        where = {i: self.slots.index(i) for i in ids if i in self.slots}
        free = [s for s, i in enumerate(self.slots) if i is None or i not in ids]
        free.sort(key=lambda s: self.slots[s] is not None)  # empty slots first
        for lora_id in ids:
            if lora_id in where:
                continue
            if lora_id not in self.read:
                self.add(self.requests[lora_id])
            adapter = self.read[lora_id]
            self.read.move_to_end(lora_id)
            slot = free.pop(0)
            for name, layer in self.layers.items():
                layer.load(slot, adapter.get(name, {}))
            self.slots[slot] = lora_id
            where[lora_id] = slot
        return where

    # -- steps -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def step(self, seq_lora_ids: Sequence[int], query_lens: torch.Tensor,
             requests: dict[int, LoRARequest] | None = None) -> Iterator[bool]:
        """While running one step whose sequences use ``seq_lora_ids`` (0: base model): the adapters
        are in slots and the layers' hooks add their deltas. Yields whether any adapter runs.

        :param requests: the step's adapters by id, read here when this rank has not added them yet
            (tensor-parallel ranks other than the driver).
        """
        ids = sorted({i for i in seq_lora_ids if i})
        if not ids:
            self._unhook()
            yield False
            return
        for lora_id in ids:
            wanted = (requests or {}).get(lora_id)
            if wanted is not None and self.requests.get(lora_id) not in (None, wanted):
                self.remove(lora_id)  # unloaded and added again with another path (on the driver)
            if lora_id not in self.requests:
                if wanted is None:
                    raise LoRAError(f"adapter {lora_id} was never added on this rank")
                self.add(wanted)
        where = self._activate(ids)
        per_seq = torch.tensor([where[i] if i else -1 for i in seq_lora_ids], dtype=torch.long)
        token_slots = torch.repeat_interleave(per_seq, query_lens.cpu())
        device = next(iter(self.layers.values())).lora_a.device
        self.mapping = LoRAMapping.from_token_slots(token_slots).to(device)
        self._hook()
        try:
            yield True
        finally:
            self.mapping = None

    def _hook(self) -> None:
        if self._hooks:
            return
        for layer in self.layers.values():
            self._hooks.append(layer.module.register_forward_hook(self._hook_for(layer)))

    def _unhook(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _hook_for(self, layer: LoRALayer) -> Any:
        def add_delta(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor | None:
            mapping = self.mapping
            if mapping is None:
                return None
            x = args[0]
            shape = output.shape
            x2, y2 = x.reshape(-1, x.shape[-1]), output.reshape(-1, shape[-1])
            if layer.reduces:
                import torch.distributed as dist

                delta = self.kernel.apply(torch.zeros_like(y2), x2, layer.lora_a, layer.lora_b, mapping)
                dist.all_reduce(delta, group=module.tp_group)
                return (y2 + delta).reshape(shape)
            return self.kernel.apply(y2, x2, layer.lora_a, layer.lora_b, mapping).reshape(shape)

        return add_delta

    @property
    def slot_bytes(self) -> int:
        """Bytes the slots take on the model's device."""
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.lora_a, layer.lora_b))

    def stats(self) -> dict[str, Any]:
        """``{"adapters": added, "read": in memory, "slots": ids per slot, "loads": reads from disk}``."""
        return {"adapters": len(self.requests), "read": list(self.read), "slots": list(self.slots),
                "loads": self.loads, "layers": len(self.layers), "kernel": self.kernel.name,
                "slot_bytes": self.slot_bytes}
