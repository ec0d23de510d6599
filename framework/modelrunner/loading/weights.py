"""Reading Hugging Face safetensors checkpoints into models built from :mod:`modelrunner.layers`.

The pattern (vLLM's): build the model on the ``meta`` device, :func:`materialize` it once on the
target device and dtype, then :func:`load_weights` streams the checkpoint tensor by tensor (memory
mapped, never the whole checkpoint at once) into each parameter's ``weight_loader``, which keeps
only this tensor-parallel rank's slice.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ..errors import ModelRunnerError
from ..layers.linear import default_weight_loader
from ..quantization.blocks import GGMLBlocks

INDEX_FILE = "model.safetensors.index.json"
"""The index of a sharded checkpoint (``weight_map``: tensor name → file)."""
SINGLE_FILE = "model.safetensors"
"""The weight file of an unsharded checkpoint."""
FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz") if hasattr(torch, name))
"""fp8 tensor types: quantized storage that needs its scales."""


class CheckpointError(ModelRunnerError, ValueError):
    """A checkpoint that does not fit the model: missing file, wrong shape, missing tensors.

    The message names the file and tensor at fault.
    """


class SafetensorsCheckpoint:
    """The ``(name, tensor)`` pairs of an HF directory's safetensors files, read lazily.

    Handles a single ``model.safetensors``, a sharded checkpoint with ``model.safetensors.index.json``,
    or any other ``*.safetensors`` files in the directory. Tensors come memory-mapped through
    ``safe_open``, one at a time.

    :raises CheckpointError: the directory has no weight files, or the index names a missing one.
    """

    def __init__(self, path: str | Path, renames: Sequence[tuple[str, str]] = ()) -> None:
        self.path = Path(path)
        """The checkpoint directory."""
        self.files = self._find_files()
        """The weight files, in reading order."""
        self.renames = tuple(renames)
        """``(prefix, replacement)`` pairs: when given, only tensors under a prefix are read, renamed
        (first match wins), e.g. one part of a composite checkpoint; empty: every tensor as stored."""
        self._file_of: dict[str, Path] = {}

    def rename(self, name: str) -> str | None:
        """The name a stored tensor is yielded under, or None when :attr:`renames` leave it out."""
        if not self.renames:
            return name
        for prefix, replacement in self.renames:
            if name.startswith(prefix):
                return replacement + name[len(prefix):]
        return None

    def _find_files(self) -> list[Path]:
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index with a 'weight_map' ({e})") from e
            files = [self.path / f for f in dict.fromkeys(weight_map.values())]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index} names weight file(s) that do not exist: {', '.join(missing)}")
            return files
        single = self.path / SINGLE_FILE
        if single.is_file():
            return [single]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"{self.path}: no weight file ({SINGLE_FILE}, {INDEX_FILE} or *.safetensors) in the checkpoint directory"
            )
        return files

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for file in self.files:
            try:
                handle = safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{file}: cannot read as safetensors ({e})") from e
            with handle as f:
                for stored in f.keys():
                    name = self.rename(stored)
                    if name is None:
                        continue
                    self._file_of[name] = file
                    yield name, f.get_tensor(stored)

    def file_of(self, name: str) -> Path | None:
        """The file a tensor already yielded came from."""
        return self._file_of.get(name)


def iter_weights(path: str | Path, renames: Sequence[tuple[str, str]] = ()) -> SafetensorsCheckpoint:
    """Iterate ``(name, tensor)`` over an HF directory's safetensors weights (see :class:`SafetensorsCheckpoint`).

    :param renames: ``(prefix, replacement)`` pairs selecting and renaming one part of a composite
        checkpoint (``[("language_model.", "")]`` reads a LLaVA checkpoint's language model).
    """
    return SafetensorsCheckpoint(path, renames)


def materialize(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Give a model built on ``meta`` real (uninitialised) storage on ``device``, once, in ``dtype``.

    Floating-point parameters and buffers take ``dtype``; others keep theirs, and so does quantized
    storage that sets ``keep_dtype = True``. Parameter attributes (``weight_loader``) and tied
    parameters survive. Modules with a ``reset_buffers()`` method are then asked to recompute their
    buffers (e.g. the rotary cos/sin table; a buffer nothing writes is reported by :func:`unset_buffers`,
    and the kernel refuses such a model when it loads), and modules with a ``compute_dtype``
    attribute get ``dtype`` there (a quantized embedding returns its rows in it: it has no float
    parameter to take it from).

    :raises ValueError: quantized storage (a parameter with a ``quant_loader``, or ``loaded_with`` a
        sibling) of a floating-point dtype other than ``dtype`` that does not say whether it keeps it
        (``keep_dtype`` unset): casting fp8 or float16 storage would silently change what it stores.
    """
    device = torch.device(device)
    for module_name, module in model.named_modules():
        for key, param in module.named_parameters(recurse=False):
            storage = getattr(param, "quant_loader", None) is not None or getattr(param, "loaded_with", None)
            if (storage and param.is_floating_point() and param.dtype != dtype
                    and getattr(param, "keep_dtype", None) is None):
                name = f"{module_name}.{key}" if module_name else key
                raise ValueError(
                    f"quantized storage {name!r} is {str(param.dtype).removeprefix('torch.')} but does not set "
                    f"keep_dtype, so loading would cast it to the model's {str(dtype).removeprefix('torch.')}: set "
                    f"param.keep_dtype = True where the quantization method creates it (False to cast on purpose)")

    def empty(t: torch.Tensor) -> torch.Tensor:
        # Quantized storage (``keep_dtype``) keeps its own types: its float16 scales are not weights.
        cast = t.is_floating_point() and not getattr(t, "keep_dtype", False)
        return torch.empty(t.shape, device=device, dtype=dtype if cast else t.dtype)

    new_params: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module.named_parameters(recurse=False)):
            if id(param) not in new_params:
                fresh = nn.Parameter(empty(param), requires_grad=False)
                fresh.__dict__.update(param.__dict__)
                new_params[id(param)] = fresh
            setattr(module, key, new_params[id(param)])
        for key, buf in list(module.named_buffers(recurse=False)):
            setattr(module, key, _unset(empty(buf)))
    for module in model.modules():
        if hasattr(module, "compute_dtype") and dtype.is_floating_point:
            module.compute_dtype = dtype
    for module in model.modules():
        if callable(getattr(module, "reset_buffers", None)):
            module.reset_buffers()
    return model


def _unset(t: torch.Tensor) -> torch.Tensor:
    """Mark a buffer :func:`materialize` allocated, so :func:`unset_buffers` can tell whether anything
    wrote it since (its version counter moves on an in-place write; a buffer reassigned is a new tensor)."""
    try:
        t._materialized_version = t._version  # type: ignore[attr-defined]
    except RuntimeError:  # an inference tensor keeps no version counter: not tracked
        pass
    return t


def unset_buffers(model: nn.Module) -> list[str]:
    """The buffers (``module.path.name``) still holding the uninitialised storage :func:`materialize`
    gave them: never recomputed (``reset_buffers()``) nor written by loading. A value computed in
    ``__init__`` is lost on ``meta``, so such a buffer holds garbage."""
    unset = []
    for module_name, module in model.named_modules():
        for key, buf in module.named_buffers(recurse=False):
            marked = getattr(buf, "_materialized_version", None)
            if marked is not None and buf._version == marked:
                unset.append(f"{module_name}.{key}" if module_name else key)
    return unset


def unset_buffers_message(model: nn.Module, names: Sequence[str], who: str) -> str:
    """What to tell the author of a model whose buffers :func:`unset_buffers` found (``who``: the adapter)."""
    modules = dict(model.named_modules())
    owners = sorted({type(modules[n.rpartition(".")[0]]).__name__ for n in names})
    shown = ", ".join(names[:4]) + (f" … ({len(names)} in all)" if len(names) > 4 else "")
    return (f"{who} left {'a buffer' if len(names) == 1 else 'buffers'} without a value after building the model "
            f"on the meta device: {shown} (of {', '.join(owners)}). A buffer computed in __init__ is lost there: "
            "__init__ runs on 'meta', where tensors hold no data, and materialize() gives each buffer new, "
            "uninitialised storage (the model would compute with garbage, e.g. NaN logits). Compute it in a "
            f"reset_buffers(self) method of {' / '.join(owners)}, which materialize() calls once the module has "
            "real storage (as modelrunner.layers.RotaryEmbedding does); loading reads parameters only, so "
            "registering it persistent does not help")


def _resolve(
    name: str, params: Mapping[str, nn.Parameter], packed: Mapping[str, Sequence[str]]
) -> tuple[str | None, int | None]:
    """The model parameter a checkpoint tensor feeds, and its shard index inside a packed parameter."""
    if name in params:
        return name, None
    parts = name.split(".")
    for packed_name, members in packed.items():
        for shard_id, member in enumerate(members):
            if member in parts:
                candidate = ".".join(packed_name if p == member else p for p in parts)
                if candidate in params:
                    return candidate, shard_id
    return None, None


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed_modules_mapping: Mapping[str, Sequence[str]] | None = None,
    ignore: Sequence[str] = (),
    name: str | None = None,
) -> set[str]:
    """Copy checkpoint tensors into the model through each parameter's ``weight_loader``.

    :param model: a materialised model whose parameter names follow the checkpoint's.
    :param weights: ``(name, tensor)`` pairs, e.g. :func:`iter_weights`.
    :param packed_modules_mapping: fused parameter → the checkpoint projections packed into it, in
        order (``{"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}``);
        the projection's index is passed as ``shard_id``.
    :param ignore: checkpoint name suffixes to skip (``rotary_emb.inv_freq``, a tied ``lm_head.weight``).
    :param name: how to call the checkpoint in errors (default: the directory of ``weights``).
    :returns: the names of the checkpoint tensors that were loaded.
    :raises CheckpointError: a tensor has the wrong shape (naming file, tensor, expected and actual
        shape), or the checkpoint lacks tensors the model needs (naming them).
    """
    packed = dict(packed_modules_mapping or {})
    params = dict(model.named_parameters())
    where = name or str(getattr(weights, "path", "checkpoint"))
    file_of = getattr(weights, "file_of", lambda n: None)
    loaded: dict[str, set[int | None]] = {}
    used, unexpected = set(), []
    for tensor_name, tensor in weights:
        if any(tensor_name.endswith(suffix) for suffix in ignore):
            continue
        target, shard_id = _resolve(tensor_name, params, packed)
        if target is None:
            unexpected.append(tensor_name)
            continue
        param = params[target]
        if isinstance(tensor, GGMLBlocks) and getattr(param, "quant_loader", None) is None:
            tensor = tensor.dequantize(param.dtype)  # blocks carry their scales: exact, not a bare cast
        if isinstance(tensor, GGMLBlocks):
            pass  # quantized storage takes the blocks as they are
        elif param.is_floating_point() and (not tensor.is_floating_point() or tensor.dtype in FP8_DTYPES):
            source = file_of(tensor_name) or where
            raise CheckpointError(
                f"{source}: tensor {tensor_name!r} is stored as {str(tensor.dtype).removeprefix('torch.')}, a "
                "quantized form; modelrunner never casts integer or fp8 weights to float without their scales. "
                "Load the checkpoint with a quantization method that reads it (`modelrunner plugins` lists them)")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ValueError as e:
            source = file_of(tensor_name) or where
            raise CheckpointError(f"{source}: tensor {tensor_name!r} (for parameter {target!r}): {e}") from e
        loaded.setdefault(target, set()).add(shard_id)
        used.add(tensor_name)

    missing = []
    for param_name in params:
        if getattr(params[param_name], "loaded_with", None):  # filled with a sibling (quantization scales)
            continue
        got = loaded.get(param_name, set())
        parts = param_name.split(".")
        packed_name = next((p for p in packed if p in parts), None)
        if packed_name is None or None in got:  # not packed, or the checkpoint stores it already fused
            if not got:
                missing.append(param_name)
            continue
        missing += [".".join(member if p == packed_name else p for p in parts)
                    for i, member in enumerate(packed[packed_name]) if i not in got]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise CheckpointError(f"{where}: checkpoint lacks {len(missing)} tensor(s) the model needs: {shown}")
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else "")
        warnings.warn(f"{where}: ignored {len(unexpected)} tensor(s) the model does not use: {shown}", stacklevel=2)
    return used
