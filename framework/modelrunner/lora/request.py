"""The request for a LoRA adapter (vLLM's ``LoRARequest``): which adapter a prompt runs with."""

from __future__ import annotations

from pathlib import Path

import attrs
from ..wire import register as _wire_type


def _name(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"LoRARequest.{attribute.name} must be a non-empty string, got {value!r}")


def _int_id(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"LoRARequest.lora_int_id must be a positive integer (0 is the base model), got {value!r}")


def _path(value: object) -> str:
    if isinstance(value, Path):
        return str(value)
    if not isinstance(value, str) or not value:
        raise ValueError(f"LoRARequest.lora_path must be a directory path, got {value!r}")
    return value


@_wire_type
@attrs.frozen
class LoRARequest:
    """One LoRA adapter, named and numbered by the caller (``LoRARequest("sql", 1, "/adapters/sql")``).

    Requests with the same ``lora_int_id`` share the loaded adapter; an id names one path for the life
    of the engine (reusing it with another path is refused).
    """

    lora_name: str = attrs.field(validator=_name)
    """A readable name (the server's ``model`` field selects an adapter by it)."""
    lora_int_id: int = attrs.field(validator=_int_id)
    """A positive integer identifying the adapter (0 is the base model)."""
    lora_path: str = attrs.field(converter=_path)
    """A PEFT checkpoint directory: ``adapter_config.json`` and ``adapter_model.safetensors``."""
