"""The LoRA adapters a server serves by name: ``--lora-modules`` at start, and, with
``--allow-runtime-lora-updating``, ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's routes).

A request's ``model`` selects an adapter by name. Unloading an adapter that unfinished requests use is
refused (400) until they finish; an adapter's name may be loaded again afterwards, with any path.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import Any

from ..lora import LoRARequest
from .errors import APIError, bad_request


class ServedAdapters:
    """Adapter name → :class:`~modelrunner.lora.LoRARequest` (ids handed out here, from 1)."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def start(self, add_lora: Callable[[LoRARequest], Any], modules: tuple[tuple[str, str], ...]) -> None:
        """Read the ``--lora-modules`` adapters before the server serves (a bad one fails the start).

        :param add_lora: reads one adapter, raising ``ValueError`` for a bad one: the engine's
            ``add_lora``, or the data-parallel LLM's (which reads it on every replica).
        :raises ValueError: naming the module and what is wrong with it.
        """
        for name, path in modules:
            request = LoRARequest(name, next(self._ids), path)
            try:
                add_lora(request)
            except ValueError as e:
                raise ValueError(f"--lora-modules {name}={path}: {e}") from None
            self._by_name[name] = request

    def get(self, name: str | None) -> LoRARequest | None:
        """The adapter served as ``name`` (None: no such adapter)."""
        return self._by_name.get(name) if name is not None else None

    def names(self) -> list[str]:
        """The served adapter names, in load order."""
        return list(self._by_name)

    def all(self) -> list[LoRARequest]:
        """The served adapters, in load order."""
        return list(self._by_name.values())

    async def load(self, engine: Any, name: Any, path: Any, reserved: tuple[str, ...]) -> LoRARequest:
        """Read a new adapter in the engine loop's thread and serve it as ``name``.

        :param engine: the server's :class:`~.async_engine.AsyncEngine`.
        :raises APIError: 400 for a bad body, a name in use, or an adapter the engine refuses.
        """
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise bad_request("lora_name and lora_path must be non-empty strings", param="lora_name")
        with self._lock:
            if name in self._by_name or name in reserved:
                raise bad_request(f"the model name {name!r} is already served; unload it first or choose another",
                                  param="lora_name", code="invalid_value")
            request = LoRARequest(name, next(self._ids), path)
        try:
            await asyncio.wrap_future(engine.loop.add_lora(request))
        except ValueError as e:
            raise bad_request(str(e), param="lora_path") from None
        with self._lock:
            self._by_name[name] = request
        return request

    async def unload(self, engine: Any, name: Any) -> None:
        """Stop serving ``name`` and forget its weights.

        :raises APIError: 404 for a name not served, 400 while unfinished requests use it.
        """
        request = self.get(name) if isinstance(name, str) else None
        if request is None:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded; loaded: "
                                f"{', '.join(map(repr, self._by_name)) or 'none'}", param="lora_name",
                           code="model_not_found")
        try:
            await asyncio.wrap_future(engine.loop.remove_lora(request.lora_int_id))
        except ValueError as e:
            raise bad_request(str(e), param="lora_name") from None
        with self._lock:
            self._by_name.pop(name, None)
