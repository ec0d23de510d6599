"""A GGUF file read as a checkpoint, in place: config, tokenizer and tensors from the file itself.

The metadata and the tensor table are parsed by :mod:`~modelrunner.loading.gguf_metadata` (no tensor data is
touched); each tensor is read from the file when the loader asks for it, so loading never holds
more than the model's own storage and one tensor of the file.
:meth:`GGUFCheckpoint.iter_weights` yields them under Hugging Face names, undoing llama.cpp's layout
changes (its row permutation of Llama's query/key projections):
float tensors as float tensors, quantized ones as :class:`~modelrunner.quantization.blocks.GGMLBlocks`,
which a quantization method keeps as stored and any other layer dequantizes exactly.

Architectures read natively: ``llama`` (Llama 2/3, SmolLM2; ``mistral`` files name themselves so too),
``mistral`` and ``qwen2``. Others go through transformers' own GGUF conversion (``quantization="none"``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import mmap
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelSourceError
from .gguf_config import GGUFLlamaConfig, config_values
from .gguf_metadata import read_metadata, read_tensor_table
from .gguf_tokenizer import GGUFTokenizer
from ..quantization.blocks import FLOAT_TYPES, GGML_BLOCK, GGMLBlocks, ggml_type_name

logger = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""GGUF ``general.architecture`` → the transformers architecture it is read as."""

_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


_STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")
"""The metadata's string arrays a tokenizer needs in full."""
_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                   "pad_token": "padding_token_id"}
"""A tokenizer's special-token argument → the metadata key (``tokenizer.ggml.…``) of its id."""


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama-family GGUF tensor (None for one the model does not use)."""
    if gguf_name in _TOP:
        return _TOP[gguf_name]
    match = _BLOCK_NAME.match(gguf_name)
    if match is None or match[2] not in _BLOCK:
        return None
    return f"model.layers.{match[1]}.{_BLOCK[match[2]]}.{match[3]}"


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's permutation of a query/key projection with ``heads`` heads."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


def _save_tokenizer(tokenizer: Any, where: Path) -> bool:
    """Save ``tokenizer`` as the directory ``where``, whole or not at all (written beside it, then
    renamed); a cache that cannot be written is only logged. Whether ``where`` holds a saved tokenizer."""
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=where.parent))
        try:
            tokenizer.save_pretrained(str(staging))
            os.replace(staging, where)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:  # read-only or full cache, or another process saved it first
        logger.debug("tokenizer not cached in %s: %s", where, e)
    return (where / "tokenizer.json").is_file()


def _tensor_types(path: Path) -> list[tuple[str, int]]:
    """``(name, ggml type)`` of a file's tensors by the ``gguf`` package's reader, which knows more
    types than transformers' (to name the tensor its reader refused); empty if it cannot read them."""
    try:
        from gguf import GGUFReader

        return [(t.name, int(t.tensor_type)) for t in GGUFReader(str(path)).tensors]
    except Exception:  # noqa: BLE001 - a damaged file: the caller reports the first error
        return []


def _read_at(handle: Any, offset: int, size: int) -> torch.Tensor:
    """``size`` bytes of the open file ``handle`` from ``offset``, as a uint8 tensor of their own."""
    out = torch.empty(size, dtype=torch.uint8)
    _read_into(handle, offset, out)
    return out


def _read_into(handle: Any, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous uint8 tensor ``out`` with the bytes of the open file ``handle`` from ``offset``
    (the reads release the GIL)."""
    view, got, size = memoryview(out.detach().numpy()).cast("B"), 0, out.numel()
    handle.seek(offset)
    while got < size:
        n = handle.readinto(view[got:])
        if not n:
            raise ModelSourceError(f"{handle.name}: the file ended while reading it (was it truncated meanwhile?)")
        got += n


def _reader(path: Path, offset: int) -> Callable[[torch.Tensor, int], None]:
    """Reads the bytes of the tensor at ``offset`` of ``path``, from its byte ``start`` on, into a given
    tensor (opening the file for it, so that it can run after the iteration that made it)."""
    def read(out: torch.Tensor, start: int) -> None:
        with open(path, "rb", buffering=0) as handle:
            _read_into(handle, offset + start, out)
    return read


def _mapped(blob: mmap.mmap, offset: int, size: int) -> Callable[[], torch.Tensor]:
    """``size`` bytes of the mapping ``blob`` from ``offset``, as a uint8 tensor of their own that keeps
    the mapping open (a copy-on-write mapping: writable, never written back)."""
    return lambda: torch.frombuffer(blob, dtype=torch.uint8, count=size, offset=offset)


class GGUFCheckpoint:
    """One ``.gguf`` file: its metadata, config, tokenizer and tensors.

    :raises ModelSourceError: the file is not a readable GGUF file (truncated, empty, wrong magic),
        a tensor runs past the end of the file, or a tensor has a type nobody can read — naming the
        file and the tensor.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        """The file."""
        size = self.path.stat().st_size
        if size == 0:
            raise ModelSourceError(f"{self.path}: the file is empty, not a GGUF checkpoint")
        try:
            self.metadata = read_metadata(self.path)
            self.header = read_tensor_table(self.path)
        except Exception as e:  # struct, numpy and ValueError from a damaged header
            self._refuse_unsupported(_tensor_types(self.path))
            raise ModelSourceError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
        self._refuse_unsupported((info.name, info.ggml_type) for info in self.header.tensors)
        for info in self.header.tensors:
            end = self.header.data_start + info.offset + info.nbytes
            if end > size:
                raise ModelSourceError(f"{self.path}: tensor {info.name!r} ({ggml_type_name(info.ggml_type)}) ends at "
                                       f"byte {end:,} but the file has {size:,} bytes: the file is truncated")
        self.architecture = self.metadata.get("general.architecture")
        """The file's ``general.architecture`` (``llama``, ``qwen2`` …)."""

    def _refuse_unsupported(self, tensors: Any) -> None:
        for name, ggml_type in tensors:
            if ggml_type not in FLOAT_TYPES and ggml_type not in GGML_BLOCK:
                supported = ", ".join(sorted({ggml_type_name(t) for t in (*FLOAT_TYPES, *GGML_BLOCK)}))
                raise ModelSourceError(f"{self.path}: tensor {name!r} has ggml type {ggml_type_name(ggml_type)} "
                                       f"({ggml_type}), which no installed reader supports (supported: {supported})")

    @property
    def native(self) -> bool:
        """Whether modelrunner reads this architecture's tensors itself (else transformers converts it)."""
        return self.architecture in ARCHITECTURES

    # -- config and tokenizer ----------------------------------------------------------------------

    def hf_config(self) -> Any:
        """The config the metadata describes: for a ``llama`` file a :class:`~.gguf_config.GGUFLlamaConfig`
        (no transformers import), for the others transformers' own config class."""
        values = self.config_values()
        if self.architecture == "llama":
            config: Any = GGUFLlamaConfig(**values)
        else:
            from transformers import AutoConfig

            config = AutoConfig.for_model(self.architecture, **values)
        config.architectures = [ARCHITECTURES[self.architecture]]
        config._name_or_path = str(self.path)
        return config

    def config_values(self) -> dict[str, Any]:
        """The config fields the metadata gives (:func:`~.gguf_config.config_values`).

        :raises ModelSourceError: an architecture not read natively."""
        if self.architecture not in ARCHITECTURES:
            raise ModelSourceError(f"{self.path}: GGUF architecture {self.architecture!r} is not read natively "
                                   f"(supported: {', '.join(sorted(ARCHITECTURES))}); load it with quantization='none'")
        return config_values(self.metadata, self.architecture, {info.name for info in self.header.tensors})

    def tokenizer(self, cache_dir: str | Path | None = None) -> GGUFTokenizer | None:
        """The tokenizer the metadata describes (vocabulary, merges, special tokens, chat template) as a
        :class:`~.gguf_tokenizer.GGUFTokenizer`; None when the file has no vocabulary.

        The vocabulary is turned into a tokenizer by transformers' GGUF converters. With ``cache_dir``, that
        tokenizer is saved under ``cache_dir/tokenizers/``, named by a digest of the file's metadata, and later
        loads read the saved files without transformers (a tenth of the time: converting a 128k-token
        vocabulary and importing transformers take most of a second). A saved copy that cannot be read is
        rebuilt; a cache that cannot be written is skipped."""
        if "tokenizer.ggml.tokens" not in self.metadata:
            return None
        saved = Path(cache_dir) / "tokenizers" / self._metadata_digest() if cache_dir is not None else None
        if saved is not None and (saved / "tokenizer.json").is_file():
            try:
                return GGUFTokenizer.from_directory(saved, str(self.path))
            except Exception as e:  # noqa: BLE001 - a damaged copy: build it again
                logger.warning("%s: the saved tokenizer in %s cannot be read (%s: %s); building it again",
                               self.path, saved, type(e).__name__, e)
                shutil.rmtree(saved, ignore_errors=True)
        tokenizer = self._convert_tokenizer()
        if saved is not None and _save_tokenizer(tokenizer, saved):
            return GGUFTokenizer.from_directory(saved, str(self.path))
        return GGUFTokenizer.from_transformers(tokenizer, str(self.path))

    def _metadata_digest(self) -> str:
        """A digest of everything before the tensor data (metadata and tensor table) and of the
        transformers version that builds the saved tokenizer."""
        digest = hashlib.sha256(f"gguf-tokenizer-1 {importlib.metadata.version('transformers')}\n".encode())
        with open(self.path, "rb") as f:
            digest.update(f.read(self.header.data_start))
        return digest.hexdigest()[:32]

    def _convert_tokenizer(self) -> Any:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf import convert_gguf_tokenizer

        try:
            tokenizer_dict, tokenizer_config = self.tokenizer_fields()
            backend, extra = convert_gguf_tokenizer(self.architecture, tokenizer_dict)
        except Exception as e:  # noqa: BLE001 - an unknown tokenizer model, a damaged vocabulary
            raise ModelSourceError(f"{self.path}: cannot build the tokenizer its metadata describes "
                                   f"({type(e).__name__}: {e})") from e
        return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)

    def tokenizer_fields(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(tokenizer_dict, tokenizer_config)`` as transformers' ``get_gguf_tokenizer`` returns them
        (its key mapping, its defaults for ``add_bos_token``), from this reader's metadata: the
        vocabulary and merges read once, with :func:`~modelrunner.loading.gguf_metadata.read_metadata`."""
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

        full = read_metadata(self.path, _STRING_ARRAYS)  # every key, the string arrays in full
        tokenizer, config = ({name: full[f"tokenizer.{key}"] for key, name in renames.items()
                              if f"tokenizer.{key}" in full}
                             for renames in (GGUF_TOKENIZER_MAPPING["tokenizer"],
                                             GGUF_TOKENIZER_MAPPING["tokenizer_config"]))
        kind = tokenizer.get("tokenizer_type")
        if kind == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
            config.setdefault("add_bos_token", True)
        elif kind == "gemma4":  # its chat template writes <bos> itself
            config["add_bos_token"] = False
        for name, key in _SPECIAL_TOKENS.items():
            token_id = full.get(f"tokenizer.ggml.{key}")
            config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
        return tokenizer, config

    # -- tensors -----------------------------------------------------------------------------------

    def weight_types(self) -> dict[str, int]:
        """Hugging Face tensor name → ggml type, for the tensors the model uses."""
        return {name: info.ggml_type for info in self.header.tensors if (name := hf_name(info.name))}

    def iter_weights(self) -> Iterator[tuple[str, Any]]:
        """``(hf_name, tensor)`` for every tensor: float tensors (views of the file when float32) or
        :class:`GGMLBlocks`; query/key rows put back in Hugging Face's order.

        :raises ModelSourceError: a tensor name the architecture does not have.
        """
        config = self.metadata
        arch = self.architecture
        heads = config.get(f"{arch}.attention.head_count")
        kv_heads = config.get(f"{arch}.attention.head_count_kv", heads)
        with open(self.path, "rb", buffering=0) as handle:
            try:
                blob: mmap.mmap | None = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            except (OSError, ValueError):  # a file system that cannot map it: every tensor is read
                blob = None
            yield from self._read_weights(handle, blob, arch, heads, kv_heads)

    def _read_weights(self, handle: Any, blob: mmap.mmap | None, arch: str, heads: Any, kv_heads: Any
                      ) -> Iterator[tuple[str, Any]]:
        for info in self.header.tensors:
            name = hf_name(info.name)
            if name is None:
                if "rope" in info.name:
                    continue  # precomputed rotary tables: the model computes its own
                raise ModelSourceError(f"{self.path}: tensor {info.name!r} has no place in a {arch} model")
            # Float tensors are read on their own: once the loader has converted them into the model's
            # storage, their bytes are freed. Blocks are read when the loader asks, straight into the
            # storage where it keeps them as stored — or, where that storage is the whole tensor as the
            # file stores it, mapped (a view of a copy-on-write mapping that keeps `blob` open).
            offset = self.header.data_start + info.offset
            if info.ggml_type in FLOAT_TYPES:
                raw = _read_at(handle, offset, info.nbytes)
                tensor: Any = raw.view(FLOAT_TYPES[info.ggml_type]).reshape(info.shape)
            else:
                rows, cols = info.shape if len(info.shape) == 2 else (1, info.shape[0])
                tensor = GGMLBlocks.deferred(_reader(self.path, offset), info.ggml_type, (rows, cols), info.name,
                                             None if blob is None else _mapped(blob, offset, info.nbytes))
            if arch in ("llama", "mistral") and info.name.endswith(("attn_q.weight", "attn_k.weight")):
                n = heads if "attn_q" in info.name else kv_heads
                index = _unpermute_rows(info.shape[0], n)
                tensor = tensor.permute_rows(index) if isinstance(tensor, GGMLBlocks) else tensor.index_select(0, index)
            yield name, tensor

    def close(self) -> None:
        """Nothing is kept open between reads (each :meth:`iter_weights` opens the file itself)."""

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self.iter_weights()

    def file_of(self, name: str) -> Path:
        """The file every tensor comes from (named in loading errors)."""
        return self.path


