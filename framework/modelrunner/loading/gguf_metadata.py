"""A GGUF file's metadata section and tensor table, read fast enough for a cold start.

transformers' reader slices a numpy memory map once per string: reading SmolLM2's vocabulary and
merge table (99,000 strings) costs it about half a second. This reader slices an :mod:`mmap`, whose
slices are plain ``bytes``, and reads the same values in a tenth of that. The tensor table
(:func:`read_tensor_table`) is read here too, for every ggml type the ``gguf`` package knows
(transformers' reader refuses some, such as Q5_0).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Container
from pathlib import Path
from typing import Any, NamedTuple

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
_U64 = struct.Struct("<Q")


def read_metadata(path: str | Path, string_arrays: Container[str] = ()) -> dict[str, Any]:
    """Every metadata key of the GGUF file at ``path`` and its value.

    Numbers, booleans and strings are read as Python values, arrays of numbers as lists. An array of
    strings is read in full only when its key is in ``string_arrays`` (a vocabulary, a merge table);
    otherwise its value is its length, as with transformers' reader.

    :raises ValueError: the file is not GGUF v2/v3, or holds a value type GGUF does not define —
        naming the file and the key.
    """
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        _tensors, count = _header(blob, path)
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(count):
            key, pos = _string(blob, pos)
            (kind,) = struct.unpack_from("<I", blob, pos)
            metadata[key], pos = _value(blob, pos + 4, kind, key in string_arrays, path, key)
        return metadata


class TensorInfo(NamedTuple):
    """One entry of a GGUF file's tensor table."""

    name: str
    """The tensor's name in the file (``blk.0.attn_q.weight``)."""
    shape: tuple[int, ...]
    """Its logical shape, outermost first (``[rows, cols]`` for a matrix: ggml's dimensions reversed)."""
    ggml_type: int
    """Its ggml type id (0 = F32, 12 = Q4_K …)."""
    offset: int
    """Where its data starts, relative to the data section."""
    nbytes: int
    """How many bytes its data takes (-1 for a type the ``gguf`` package does not know)."""


class TensorTable(NamedTuple):
    """A GGUF file's tensors and where their data section starts."""

    tensors: list[TensorInfo]
    """The tensors, in file order."""
    data_start: int
    """Absolute offset of the data section (aligned to ``general.alignment``)."""


def read_tensor_table(path: str | Path) -> TensorTable:
    """The tensor table of the GGUF file at ``path`` (metadata values skipped, not decoded).

    :raises ValueError: not a GGUF v2/v3 file, or a damaged table.
    """
    from gguf import GGML_QUANT_SIZES

    sizes = {int(t): size for t, size in GGML_QUANT_SIZES.items()}
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        count, keys = _header(blob, path)
        pos, alignment = 24, 32
        for _ in range(keys):
            key, pos = _string(blob, pos)
            (kind,) = struct.unpack_from("<I", blob, pos)
            value, pos = _value(blob, pos + 4, kind, False, path, key)
            if key == "general.alignment":
                alignment = int(value)
        tensors = []
        for _ in range(count):
            name, pos = _string(blob, pos)
            (dims,) = struct.unpack_from("<I", blob, pos)
            if dims > 8:
                raise ValueError(f"{path}: tensor {name!r} claims {dims} dimensions")
            shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
            pos += 4 + 8 * dims + 12
            elements = 1
            for d in shape:
                elements *= d
            per_block, block_bytes = sizes.get(ggml_type, (0, 0))
            nbytes = elements // per_block * block_bytes if per_block and elements % per_block == 0 else -1
            tensors.append(TensorInfo(name, tuple(reversed(shape)), ggml_type, offset, nbytes))
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment is {alignment}, not a power of two")
        return TensorTable(tensors, -(-pos // alignment) * alignment)


def _header(blob: mmap.mmap, path: Any) -> tuple[int, int]:
    """``(tensors, metadata keys)`` of a GGUF file's header.

    :raises ValueError: not a GGUF file, or a version this reader does not read.
    """
    if blob[:4] != b"GGUF":
        raise ValueError(f"{path} does not start with the GGUF magic bytes: not a GGUF file")
    version, tensors, keys = struct.unpack_from("<IQQ", blob, 4)
    if version not in _VERSIONS:
        raise ValueError(f"{path} is GGUF v{version}; readable: v{' and v'.join(map(str, _VERSIONS))}")
    return tensors, keys


def _string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(blob, pos)
    end = pos + 8 + length
    return blob[pos + 8:end].decode("utf-8"), end


def _value(blob: mmap.mmap, pos: int, kind: int, keep: bool, path: Any, key: str) -> tuple[Any, int]:
    if kind in _SCALAR:
        fmt = _SCALAR[kind]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        raise ValueError(f"{path}: metadata key {key!r} has value type {kind}, which GGUF does not define")
    element, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if element in _SCALAR:
        fmt = _SCALAR[element]
        width = struct.calcsize(fmt)
        return list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)), pos + count * width
    if element != _STRING:
        raise ValueError(f"{path}: metadata key {key!r} is an array of type {element}, which this reader cannot read")
    unpack = _U64.unpack_from
    if not keep:
        for _ in range(count):
            pos += 8 + unpack(blob, pos)[0]
        return count, pos
    values = []
    append = values.append
    for _ in range(count):
        (length,) = unpack(blob, pos)
        start = pos + 8
        pos = start + length
        append(blob[start:pos].decode("utf-8"))
    return values, pos
