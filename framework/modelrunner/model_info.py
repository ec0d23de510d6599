"""What a loaded model tells the code that serves it, without that code reaching into the runner.

The HTTP server (``modelrunner-serve``) describes the model it serves with it, and a data-parallel
replica sends it to its front (which serves without a model of its own); both sit above the kernel.
"""

from __future__ import annotations

from typing import Any

import attrs

from .llm import generation_defaults


@attrs.frozen
class ModelInfo:
    """A loaded model as a front end sees it."""

    tokenizer: Any
    """The checkpoint's tokenizer."""
    max_model_len: int
    """Longest sequence (prompt + output)."""
    root: str
    """Where the checkpoint lives."""
    defaults: dict[str, Any]
    """Sampling defaults from the checkpoint's ``generation_config.json``."""
    image_token: str | None
    """The text of the image placeholder token (None: the model takes no images)."""


def describe_model(llm: Any) -> ModelInfo:
    """Describe a freshly loaded :class:`~modelrunner.LLM`."""
    runner = getattr(llm.runner, "runner", None)
    source = getattr(runner, "source", None)
    tokenizer = llm.get_tokenizer()
    hf_config = getattr(llm.runner.loaded, "hf_config", None)
    image_id = getattr(hf_config, "image_token_index", None)
    if image_id is None:
        image_id = getattr(hf_config, "image_token_id", None)
    image_token = tokenizer.convert_ids_to_tokens(int(image_id)) if image_id is not None and tokenizer else None
    return ModelInfo(tokenizer=tokenizer, max_model_len=llm.engine.max_model_len,
                     root=str(source.path) if source is not None else str(llm.engine.config.model.model),
                     defaults=generation_defaults(source), image_token=image_token)


__all__ = ["ModelInfo", "describe_model"]
