"""What an embedding request asks for (vLLM's ``PoolingParams``), and which output sizes a model allows."""

from __future__ import annotations

from typing import Any

import attrs

TASKS = ("embed", "token_embed")
"""``embed``: one vector per prompt (the pooling method's); ``token_embed``: one per prompt token."""


@attrs.define
class PoolingParams:
    """How to turn one prompt into an embedding (vLLM's ``PoolingParams``); pass it where
    ``SamplingParams`` would go (``LLM.encode``, ``LLMEngine.add_request``)."""

    dimensions: int | None = None
    """Keep the first this many entries (Matryoshka truncation, then renormalised when ``normalize``);
    only for models trained for it (their config's ``matryoshka_dimensions`` or ``is_matryoshka``)."""
    normalize: bool | None = None
    """L2-normalise the embedding; None: the model's default (the ``pooling_normalize`` config field,
    else the checkpoint's sentence-transformers modules, else True)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last this many prompt tokens (None: the whole prompt, which must fit ``max_model_len``)."""
    task: str = "embed"
    """What to return: ``embed`` (one pooled vector) or ``token_embed`` (every prompt token's vector)."""

    def validate(self) -> PoolingParams:
        """Check every field's type and range; returns self.

        :raises ValueError: naming the field and what it accepts.
        """
        for field in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{field} must be a positive integer or None, got {value!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True, False or None, got {self.normalize!r}")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}; got {self.task!r}")
        return self

    def clone(self) -> PoolingParams:
        """A copy (the engine keeps its own)."""
        return attrs.evolve(self)


def matryoshka_dimensions(hf_config: Any) -> tuple[int, ...] | bool:
    """The output sizes a checkpoint was trained to be truncated to: its config's
    ``matryoshka_dimensions`` list; True for ``is_matryoshka`` (any size); False: none (its
    embeddings keep their full size)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return tuple(int(d) for d in dims)
    return bool(getattr(hf_config, "is_matryoshka", False))


def check_dimensions(dimensions: int | None, allowed: tuple[int, ...] | bool, size: int, model: str) -> None:
    """Refuse ``dimensions`` a model does not allow (vLLM's rules), or above its embedding ``size``.

    :raises ValueError: starting with ``dimensions``, naming what is accepted.
    """
    if dimensions is None:
        return
    if allowed is False:
        raise ValueError(f"dimensions: model {model!r} does not support Matryoshka representations (its config has no "
                         "matryoshka_dimensions or is_matryoshka), so its embeddings cannot be shortened; leave "
                         "dimensions unset")
    if dimensions > size:
        raise ValueError(f"dimensions: {dimensions} exceeds the embedding size {size}; accepted: 1 … {size}")
    if allowed is not True and dimensions not in allowed:
        raise ValueError(f"dimensions: model {model!r} supports the Matryoshka dimensions "
                         f"{', '.join(map(str, allowed))} only, got {dimensions}")


__all__ = ["PoolingParams", "TASKS", "check_dimensions", "matryoshka_dimensions"]
