"""Tiny random-weight checkpoints for the conformance suites, and the references they are checked against.

:func:`tiny_checkpoint` writes a transformers checkpoint of a few layers for an architecture name (or
a given config), with random but non-trivial weights and a small self-contained word-level tokenizer
(``t0`` … ``t255``), so ``LLM`` runs it from text or token ids with no network. :func:`make_llm`
builds an ``LLM`` routed through a chosen :class:`~modelrunner.plugins.Plugins`;
:func:`reference_model` and :func:`reference_greedy` give transformers' own answers.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

VOCAB_SIZE = 256
"""Tokens of every tiny checkpoint (``t0`` … ``t255``)."""
MAX_POSITION = 256
"""``max_position_embeddings`` of every tiny checkpoint."""
BOS, EOS, UNK = 1, 2, 0
"""Special token ids of the tiny tokenizer (``t1``, ``t2``, ``t0``)."""

_DENSE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _known_config(architecture: str, overrides: dict[str, Any] | None = None) -> Any | None:
    """The tiny config of an architecture the suites know by heart, with ``overrides`` given to its
    constructor (so fields derived from them, like Qwen2's ``layer_types``, follow); None: any other."""
    import transformers as tf

    common = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_POSITION, bos_token_id=BOS, eos_token_id=EOS,
                  pad_token_id=UNK)
    known = {
        "LlamaForCausalLM": (tf.LlamaConfig, dict(**_DENSE, **common, tie_word_embeddings=False)),
        "MistralForCausalLM": (tf.MistralConfig, dict(**_DENSE, **common, sliding_window=8, tie_word_embeddings=False)),
        "Qwen2ForCausalLM": (tf.Qwen2Config, dict(**_DENSE, **common, tie_word_embeddings=False)),
        # Every layer sparse, top-2 of 4, renormalised.
        "MixtralForCausalLM": (tf.MixtralConfig, dict(**_MOE, **common, intermediate_size=96, num_local_experts=4,
                                                      num_experts_per_tok=2, tie_word_embeddings=False)),
        # Layer 0 dense, layer 1 sparse with the gated shared expert; not renormalised.
        "Qwen2MoeForCausalLM": (tf.Qwen2MoeConfig, dict(
            **_MOE, **common, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
            tie_word_embeddings=False)),
        # 3 layers, layer 1 dense; q/k norms; renormalised top-2 of 8; tied embeddings.
        "Qwen3MoeForCausalLM": (tf.Qwen3MoeConfig, dict(
            **{**_MOE, "num_hidden_layers": 3}, **common, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
            num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
            tie_word_embeddings=True)),
    }
    if architecture not in known:
        return None
    config_class, kwargs = known[architecture]
    return config_class(**{**kwargs, **(overrides or {})})


_SCALED = {"hidden_size": 64, "n_embd": 64, "d_model": 64, "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128,
           "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "num_attention_heads": 4, "n_head": 4,
           "num_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB_SIZE,
           "max_position_embeddings": MAX_POSITION, "n_positions": MAX_POSITION, "n_ctx": MAX_POSITION,
           "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": UNK}
"""Config fields a generic architecture is scaled down with, where its config has them."""


def _generic_config(architecture: str, overrides: dict[str, Any] | None = None) -> Any:
    """``AutoConfig.for_model`` of the model type whose causal-LM class is ``architecture``, scaled down
    (``overrides`` given to the constructor, and kept)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = next((t for t, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if cls == architecture), None)
    if model_type is None:
        raise ValueError(f"no tiny checkpoint for architecture {architecture!r}: transformers has no causal LM of "
                         "that name; declare the checkpoints' model_type (registry.architectures(..., "
                         "model_type='llama')), or give the suite config= / checkpoint= (modelrunner check "
                         "--config / --checkpoint)")
    config = AutoConfig.for_model(model_type, **(overrides or {}))
    for key, value in _SCALED.items():
        if key in (overrides or {}):
            continue
        if key in config.to_dict() or hasattr(config, key):
            if key == "num_key_value_heads" and getattr(config, key, None) is None:
                continue  # a model without grouped-query attention keeps it unset
            setattr(config, key, value)
    return config


def causal_lm_class(model_type: str) -> str | None:
    """transformers' causal-LM class name for a config ``model_type`` (``gpt_neox`` → ``GPTNeoXForCausalLM``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)


def tiny_config(architecture: str, model_type: str | None = None, overrides: dict[str, Any] | None = None) -> Any:
    """The tiny transformers config :func:`tiny_checkpoint` writes for ``architecture`` (``architectures`` set).

    :param model_type: the config ``model_type`` of an architecture transformers has no class of that
        name for (an adapter's own name for, say, a Llama-shaped model): the tiny config of that type.
    :param overrides: config fields set on top (``{"use_parallel_residual": False}``).
    :raises ValueError: transformers knows no causal LM of that name (or of ``model_type``), or an
        override names a field the config does not have.
    """
    base = architecture
    if model_type is not None and _known_config(architecture) is None and causal_lm_class(model_type) != architecture:
        base = causal_lm_class(model_type)
        if base is None:
            raise ValueError(f"no tiny checkpoint for architecture {architecture!r}: transformers has no causal LM "
                             f"for model_type {model_type!r}")
    overrides = dict(overrides or {})
    if overrides:
        default = _known_config(base) or _generic_config(base)
        unknown = [key for key in overrides if not has_field(default, key)]
        if unknown:
            raise UnknownConfigField(default, unknown[0], overrides[unknown[0]])
    config = _known_config(base, overrides) or _generic_config(base, overrides)
    config.architectures = [architecture]
    return config


def has_field(config: Any, key: str) -> bool:
    """Whether a transformers config has the field ``key`` (one it serialises, or an attribute)."""
    return key in config.to_dict() or hasattr(config, key)


class UnknownConfigField(ValueError):
    """A config override names a field the config class does not have; the message names it, the
    closest fields and every field of the config's own (beyond ``PretrainedConfig``'s common ones).

    :param config: the config the override was for.
    :param key: the unknown field.
    :param value: what it was to be set to.
    """

    def __init__(self, config: Any, key: str, value: Any) -> None:
        import difflib

        from transformers import PretrainedConfig

        own = sorted(set(config.to_dict()) - set(PretrainedConfig().to_dict()))
        close = difflib.get_close_matches(key, own, n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        super().__init__(f"{type(config).__name__} has no field {key!r} to set to {value!r}{hint}; its fields: "
                         f"{', '.join(own)}")
        self.key = key
        """The unknown field."""


def load_config(path: str | Path) -> Any:
    """The transformers config in a JSON file, or in a checkpoint folder's ``config.json``.

    :raises ValueError: no such file, or no ``model_type`` in it.
    """
    from transformers import AutoConfig

    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"no transformers config at {path} (a config JSON file or a folder with config.json)")
    if "model_type" not in json.loads(file.read_text()):
        raise ValueError(f"{file} has no model_type: transformers cannot tell which config class it is")
    return AutoConfig.from_pretrained(str(file))


_SCRATCH: list[Path] = []


def scratch_root() -> Path:
    """This process's own folder for tiny checkpoints (made on first use, removed when the process
    exits), so concurrent checks never share or race on one."""
    if not _SCRATCH:
        import atexit
        import shutil
        import tempfile

        _SCRATCH.append(Path(tempfile.mkdtemp(prefix="modelrunner-conformance-")))
        atexit.register(shutil.rmtree, _SCRATCH[0], True)
    return _SCRATCH[0]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "model"


def tiny_checkpoint(architecture_or_config: Any, root: str | Path, seed: int = 0) -> Path:
    """Write a tiny random-weight transformers checkpoint under ``root``; its directory.

    :param architecture_or_config: an architecture name (``LlamaForCausalLM``, ``MistralForCausalLM``
        with a sliding window of 8, ``Qwen2ForCausalLM``, ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``,
        ``Qwen3MoeForCausalLM``; any other causal LM transformers knows, scaled down) or a transformers
        config (used as it is; its ``architectures`` should name the class).
    :param root: the directory the checkpoint's own directory is made in (an existing complete
        checkpoint of the same name and seed is reused).
    :returns: the checkpoint directory (``config.json``, safetensors weights, tokenizer files).

    Weights are random and non-trivial: norms near 1, every other tensor ``0.1 · randn``. The tokenizer
    is a word-level vocabulary ``t0`` … ``t{vocab-1}`` split on whitespace (``t1`` BOS, ``t2`` EOS,
    ``t0`` unknown and padding).
    """
    import torch
    from transformers import AutoModelForCausalLM

    if isinstance(architecture_or_config, str):
        config = tiny_config(architecture_or_config)
        name = architecture_or_config
    else:
        config = architecture_or_config
        name = (getattr(config, "architectures", None) or [config.model_type])[0]
        name = f"{name}-{hashlib.sha1(config.to_json_string().encode()).hexdigest()[:8]}"
    path = Path(root) / f"{_slug(name)}-seed{seed}"
    wanted = list(getattr(config, "architectures", None) or [])
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        if not wanted or checkpoint_config(path).get("architectures") == wanted:
            return path
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            norm = "norm" in pname or re.search(r"(^|\.)ln_", pname) is not None
            p.copy_(1 + 0.1 * torch.randn_like(p) if norm and p.dim() == 1 and pname.endswith("weight")
                    else 0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    # save_pretrained names the transformers class; keep the architecture asked for (an adapter's
    # own name for a transformers model_type, as a new-plugin adapter skeleton declares).
    saved = json.loads((path / "config.json").read_text())
    if wanted and saved.get("architectures") != wanted:
        saved["architectures"] = wanted
        (path / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    text = getattr(config, "get_text_config", lambda: config)()
    tiny_tokenizer(int(text.vocab_size)).save_pretrained(str(path))
    return path


def tiny_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over ``t0`` … ``t{vocab_size-1}``, split on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=f"t{UNK}"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=f"t{BOS}", eos_token=f"t{EOS}",
                                   unk_token=f"t{UNK}", pad_token=f"t{UNK}", model_max_length=MAX_POSITION)


BYTE_MERGES = (("{", '"'), ('"', ":"), ('"', ","), ("t", "r"), ("tr", "u"), ("tru", "e"), ("n", "o"), ("Ġ", '"'))
"""The merges of :func:`byte_tokenizer` (multi-character tokens, so masks are checked across them)."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (what a byte-level BPE vocabulary is written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer() -> Any:
    """A small byte-level BPE ``PreTrainedTokenizerFast`` (GPT-2 style, like SmolLM2's): ids 0–255 are
    the bytes, then one token per :data:`BYTE_MERGES` entry, then ``<eos>`` and ``<bos>``. Any text
    encodes, so grammar backends can be checked on real JSON without a real vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    for left, right in BYTE_MERGES:
        vocab[left + right] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(BYTE_MERGES)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=MAX_POSITION)
    tokenizer.add_special_tokens({"eos_token": "<eos>", "bos_token": "<bos>"})
    return tokenizer


def reference_model(path: str | Path) -> Any:
    """transformers' own model on the checkpoint at ``path``, float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def reference_logits(model: Any, tokens: list[int]) -> Any:
    """Every position's logits of transformers' ``model`` on one sequence (``[len(tokens), vocab]``)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def reference_greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' model's greedy continuation of ``prompt``, ``max_new_tokens`` tokens (EOS does not
    stop it): argmax of a full forward per token, so no generation config can change it."""
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def make_llm(model: str | Path, plugins: Any = None, **config: Any) -> Any:
    """``LLM(model, **config)`` whose runner routes through ``plugins`` (None: the process's plugins)."""
    from modelrunner import LLM

    return LLM(str(model), plugins=plugins, **config)


def checkpoint_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a checkpoint directory, as a dict."""
    return json.loads((Path(path) / "config.json").read_text())


__all__ = ["BOS", "EOS", "MAX_POSITION", "UNK", "UnknownConfigField", "VOCAB_SIZE", "causal_lm_class",
           "checkpoint_config", "has_field", "load_config", "make_llm", "reference_greedy", "reference_logits",
           "reference_model", "scratch_root", "tiny_checkpoint", "tiny_config", "tiny_tokenizer"]
