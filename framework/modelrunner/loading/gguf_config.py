"""The model config a GGUF file's metadata describes, and for ``llama`` files one built without transformers.

Importing any part of transformers runs its package ``__init__``, which scans the source of every model it ships:
about half a second on a 2-core machine, a quarter of loading a 1B file. A ``llama`` file (Llama 2/3, SmolLM2,
most GGUF downloads) therefore gets a :class:`GGUFLlamaConfig`: transformers' ``LlamaConfig`` fields and defaults
on a plain object, which is everything the kernel and the llama adapter read. Code that needs transformers' own
class calls :meth:`GGUFLlamaConfig.to_transformers`.
"""

from __future__ import annotations

import copy
import json
from typing import Any

GGUF_CONFIG_KEYS: dict[str, dict[str, str]] = {
    arch: {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
           "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
           "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
           "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
           "vocab_size": "vocab_size", **({} if arch == "qwen2" else {"rope.dimension_count": "head_dim"})}
    for arch in ("llama", "mistral", "qwen2")
}
"""Per architecture, metadata key (after ``<arch>.``) → config field: transformers' ``GGUF_CONFIG_MAPPING`` for
the architectures read natively (a test checks them equal)."""

LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
    "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
    "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_parameters": None,
    "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "head_dim": None,
}
"""transformers' ``LlamaConfig`` fields and their defaults (a test checks them against it)."""


class GGUFLlamaConfig:
    """transformers' ``LlamaConfig`` fields on a plain object (see the module's docstring for why).

    Read it as a ``LlamaConfig`` (attributes, :meth:`get_text_config`, :meth:`to_dict`); it pickles for
    worker processes. A field the config does not have raises ``AttributeError``, as for any config without it.
    """

    model_type = "llama"
    """What transformers' ``AutoConfig`` would call it."""
    is_encoder_decoder = False
    """A decoder-only model (a field every transformers config has)."""

    def __init__(self, **values: Any) -> None:
        fields = {**LLAMA_DEFAULTS, **values}
        if fields["head_dim"] is None:
            fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
        if fields["num_key_value_heads"] is None:
            fields["num_key_value_heads"] = fields["num_attention_heads"]
        if fields["rope_parameters"] is None:
            fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        self.architectures: list[str] | None = None
        """The transformers architectures the checkpoint is read as (``["LlamaForCausalLM"]``)."""
        self._name_or_path = ""
        self.__dict__.update(fields)

    @property
    def name_or_path(self) -> str:
        """The file the config was read from."""
        return self._name_or_path

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> GGUFLlamaConfig:
        """Itself: a text-only model's text config (as transformers' configs answer)."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """Every field, with ``model_type`` (a deep copy)."""
        fields = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return copy.deepcopy({**fields, "model_type": self.model_type})

    def to_json_string(self, use_diff: bool = True) -> str:
        """:meth:`to_dict` as sorted JSON (``use_diff`` is accepted for transformers' signature)."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def update(self, values: dict[str, Any]) -> None:
        """Set fields from a dict."""
        self.__dict__.update(values)

    def to_transformers(self) -> Any:
        """The same config as transformers' ``LlamaConfig`` (imports transformers)."""
        from transformers import LlamaConfig

        fields = {k: v for k, v in self.to_dict().items() if k not in ("model_type", "architectures")}
        config = LlamaConfig(**fields)
        config.architectures = self.architectures
        config._name_or_path = self._name_or_path
        return config

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    __hash__ = None  # type: ignore[assignment]  # mutable, like transformers' configs

    def __repr__(self) -> str:
        return f"GGUFLlamaConfig {self.to_json_string()}"


def config_values(metadata: dict[str, Any], arch: str, tensor_names: set[str]) -> dict[str, Any]:
    """The config fields a GGUF file's metadata gives for ``arch`` (one of :data:`GGUF_CONFIG_KEYS`): its keys
    renamed, the tokenizer's special ids, tied embeddings when the file has no ``output.weight``."""
    mapping = GGUF_CONFIG_KEYS[arch]
    values: dict[str, Any] = {}
    for key, value in metadata.items():
        prefix, _, rest = key.partition(".")
        if prefix == arch and rest in mapping:
            values[mapping[rest]] = value
    if "vocab_size" not in values:
        values["vocab_size"] = metadata.get("tokenizer.ggml.tokens")
    theta = values.pop("rope_theta", None)
    if theta is not None:
        values["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    for token in ("bos", "eos", "unknown", "padding"):
        value = metadata.get(f"tokenizer.ggml.{token}_token_id")
        if value is not None:
            values[{"unknown": "unk", "padding": "pad"}.get(token, token) + "_token_id"] = int(value)
    values["tie_word_embeddings"] = "output.weight" not in tensor_names
    if arch == "qwen2":
        values.setdefault("use_sliding_window", False)
    return values
