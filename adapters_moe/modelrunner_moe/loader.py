"""Building an MoE model for a checkpoint, whichever expert layout transformers wrote.

Checkpoints come in three spellings of the same experts, all accepted:

- fused 3-D (transformers 5 in memory): ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` and
  ``mlp.experts.down_proj`` ``[E, H, I]``;
- per expert, Qwen names (what transformers 5.24 ``save_pretrained`` writes):
  ``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``;
- per expert, Mixtral's original names: ``block_sparse_moe.experts.{e}.w1|w3|w2.weight`` and
  ``block_sparse_moe.gate.weight``.

:class:`MoeCheckpoint` renames them onto :class:`~modelrunner.layers.fused_moe.FusedMoE`'s
parameters, and :func:`modelrunner.loading.weights.load_weights` does the rest (shapes, missing tensors).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from modelrunner.api import CheckpointError, ModelLoader, build_and_load, expert_tensor_name

from .model import MoeForCausalLM

PER_EXPERT_TENSOR = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
"""A per-expert projection: ``<prefix>.experts.<e>.<projection>.weight``."""

PROJECTION_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj",
                    "gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
"""Checkpoint projection name → the expert projection it is (Mixtral's ``w1/w3/w2`` are gate/up/down)."""

FUSED_EXPERT_TENSORS = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}
"""transformers 5's fused expert tensors → the :class:`FusedMoE` parameters they fill."""

CHECKPOINT_SPELLING = ((re.compile(r"\.experts\.expert(\d+)_(gate_proj|up_proj|down_proj)\b"), r".experts.\1.\2"),
                       (re.compile(r"\.experts\.w13_weight\b"), ".experts.gate_up_proj"),
                       (re.compile(r"\.experts\.w2_weight\b"), ".experts.down_proj"))
"""Model-side expert names → transformers' spelling, so errors name tensors as checkpoints do."""

LAYOUT_HINT = ("the experts load either fused (mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj "
               "[E, H, I]) or per expert (mlp.experts.<e>.gate_proj/up_proj/down_proj.weight, or "
               "block_sparse_moe.experts.<e>.w1/w3/w2.weight), for every expert the config declares")
"""Appended to checkpoint errors about expert tensors."""


def model_tensor_name(name: str) -> str:
    """The model parameter (or packed member) a checkpoint tensor of any expert layout feeds."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    match = PER_EXPERT_TENSOR.match(name)
    if match:
        projection = PROJECTION_NAMES[match["projection"]]
        return f"{match['prefix']}.{expert_tensor_name(int(match['expert']), projection)}"
    prefix, _, last = name.rpartition(".")
    if prefix.endswith(".experts") and last in FUSED_EXPERT_TENSORS:
        return f"{prefix}.{FUSED_EXPERT_TENSORS[last]}"
    return name


class MoeCheckpoint:
    """A checkpoint's ``(name, tensor)`` pairs with expert tensors renamed by :func:`model_tensor_name`.

    :param weights: the checkpoint as :func:`modelrunner.loading.weights.iter_weights` reads it.
    """

    def __init__(self, weights: Any) -> None:
        self.weights = weights
        """The underlying checkpoint."""
        self.path = getattr(weights, "path", "checkpoint")
        """The checkpoint directory (named in errors)."""
        self._original: dict[str, str] = {}

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.weights:
            renamed = model_tensor_name(name)
            self._original[renamed] = name
            yield renamed, tensor

    def file_of(self, name: str) -> Path | None:
        """The file a (renamed) tensor came from."""
        file_of = getattr(self.weights, "file_of", None)
        return file_of(self._original.get(name, name)) if file_of else None


def build_moe_model(source: Any, loader: ModelLoader) -> MoeForCausalLM:
    """The model for ``source`` with this rank's weights (its experts, its pipeline stage's layers),
    built with ``loader``'s device, dtype, ranks, attention backend and ``max_model_len``.

    :raises ValueError: an invalid MoE config (see :meth:`~.spec.MoeSpec.from_config`).
    :raises modelrunner.loading.weights.CheckpointError: missing weight file, wrong-shaped or missing tensor
        (expert tensors included, with the accepted layouts in the message).
    """
    try:
        return build_and_load(lambda: MoeForCausalLM(source.hf_config, loader.max_model_len, loader.parallel,
                                                     loader.attention_backend),
                              source, loader.device, loader.dtype, transform=MoeCheckpoint)
    except CheckpointError as e:
        message = str(e)
        if ".experts." not in message:
            raise
        for pattern, spelling in CHECKPOINT_SPELLING:
            message = pattern.sub(spelling, message)
        raise CheckpointError(f"{message}; {LAYOUT_HINT}") from e
