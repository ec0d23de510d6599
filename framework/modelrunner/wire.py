"""What crosses a socket between modelrunner processes: data, never pickles.

:func:`encode` / :func:`decode` turn a message into msgpack bytes and back. A message is built from
``None``, booleans, numbers, strings, bytes, lists, tuples, dicts, CPU tensors (dtype, shape and raw
bytes) and instances of the classes registered with :func:`register` (attrs classes, dataclasses and
enums, rebuilt through their constructors, so their validators run on what arrives). Decoding never
imports a module or calls anything a peer names: an unregistered type name is refused. A class that
is neither (a tokenizer, say) registers a pair of functions to and from plain data.

Registration is by name, so both ends agree without pickling classes. Plugins whose objects ride in
step messages (``ForwardBatch.extra``) or request parameters register them the same way.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import attrs
import msgpack
import torch

_TENSOR, _TUPLE, _OBJECT, _ENUM, _CUSTOM, _SET, _DTYPE = range(1, 8)


class WireError(ValueError):
    """A message that cannot be encoded (a type nobody registered, a callable) or decoded (malformed,
    or naming an unregistered type)."""


@attrs.frozen
class _Entry:
    cls: type
    to_data: Callable[[Any], Any] | None = None
    from_data: Callable[[Any], Any] | None = None


_BY_NAME: dict[str, _Entry] = {}
_NAME_OF: dict[type, str] = {}


def register(cls: type, name: str | None = None, *, to_data: Callable[[Any], Any] | None = None,
             from_data: Callable[[Any], Any] | None = None) -> type:
    """Allow instances of ``cls`` in messages (usable as a class decorator).

    :param name: the name both ends know it by (default ``module.QualName``).
    :param to_data: for a class that is not an attrs class, dataclass or enum: the instance as plain
        data (what :func:`encode` takes); ``from_data`` rebuilds it.
    :returns: ``cls``.
    :raises ValueError: another class already has the name, or ``cls`` needs ``to_data``/``from_data``.
    """
    key = name or f"{cls.__module__}.{cls.__qualname__}"
    if (to_data is None) != (from_data is None):
        raise ValueError(f"register({cls.__name__}): give both to_data and from_data, or neither")
    if to_data is None and not (attrs.has(cls) or dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
        raise ValueError(f"register({cls.__name__}): not an attrs class, dataclass or enum; pass to_data and from_data")
    known = _BY_NAME.get(key)
    if known is not None and known.cls is not cls:
        raise ValueError(f"wire name {key!r} is taken by {known.cls!r}")
    _BY_NAME[key] = _Entry(cls, to_data, from_data)
    _NAME_OF[cls] = key
    return cls


def _fields(obj: Any) -> dict[str, Any]:
    if attrs.has(type(obj)):
        return {f.alias: getattr(obj, f.name) for f in attrs.fields(type(obj)) if f.init}
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.init}


def _default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            obj = obj.cpu()
        data = obj.detach().contiguous()
        raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return msgpack.ExtType(_TENSOR, _pack([str(data.dtype).removeprefix("torch."), list(data.shape), raw]))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if isinstance(obj, (set, frozenset)):
        return msgpack.ExtType(_SET, _pack(sorted(obj, key=repr)))
    if isinstance(obj, torch.dtype):
        return msgpack.ExtType(_DTYPE, str(obj).removeprefix("torch.").encode())
    name = _NAME_OF.get(type(obj))
    if name is None:
        what = "a function or other callable" if callable(obj) else f"a {type(obj).__module__}.{type(obj).__qualname__}"
        raise WireError(f"cannot send {what} to another process (only data and registered types: "
                        "modelrunner.wire.register)")
    entry = _BY_NAME[name]
    if entry.to_data is not None:
        return msgpack.ExtType(_CUSTOM, _pack([name, entry.to_data(obj)]))
    if isinstance(obj, enum.Enum):
        return msgpack.ExtType(_ENUM, _pack([name, obj.value]))
    return msgpack.ExtType(_OBJECT, _pack([name, _fields(obj)]))


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True, strict_types=True)


def _entry(name: Any) -> _Entry:
    entry = _BY_NAME.get(name) if isinstance(name, str) else None
    if entry is None:
        raise WireError(f"a message names the type {name!r}, which is not registered for the wire")
    return entry


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _DTYPE:
        dtype = getattr(torch, data.decode(), None)
        if not isinstance(dtype, torch.dtype):
            raise WireError(f"a message names the dtype {data!r}")
        return dtype
    value = _unpack(data)
    if code == _TUPLE:
        return tuple(value)
    if code == _SET:
        return set(value)
    if code == _TENSOR:
        dtype_name, shape, raw = value
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype) or not isinstance(raw, bytes):
            raise WireError(f"a message holds a tensor of dtype {dtype_name!r}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        try:
            return flat.view(dtype).reshape(shape)
        except RuntimeError as e:
            raise WireError(f"a message holds a malformed tensor ({e})") from None
    if code in (_OBJECT, _ENUM, _CUSTOM):
        name, payload = value
        entry = _entry(name)
        if code == _CUSTOM and entry.from_data is not None:
            return entry.from_data(payload)
        if code == _ENUM and issubclass(entry.cls, enum.Enum):
            return entry.cls(payload)
        if code == _OBJECT and entry.to_data is None and not issubclass(entry.cls, enum.Enum):
            if not isinstance(payload, dict):
                raise WireError(f"a message holds a malformed {name}")
            return entry.cls(**payload)
        raise WireError(f"a message holds a malformed {name}")
    raise WireError(f"a message holds an unknown extension type {code}")


def _unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=True)


def encode(message: Any) -> bytes:
    """``message`` as bytes.

    :raises WireError: it holds something that is not data nor a registered type (named).
    """
    try:
        return _pack(message)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot send this message to another process: {e}") from None


def decode(data: bytes) -> Any:
    """The message :func:`encode` made of ``data``.

    :raises WireError: malformed bytes, or a type that is not registered (nothing is imported or run).
    """
    try:
        return _unpack(data)
    except WireError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack's and constructors' errors on hostile input
        raise WireError(f"a malformed message ({type(e).__name__}: {e})") from None


__all__ = ["WireError", "decode", "encode", "register"]
