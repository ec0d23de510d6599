"""The LoRA adapters a server serves by name: ``--lora-modules`` at start, and, with
``--allow-runtime-lora-updating``, ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's routes).

A request's ``model`` selects an adapter by name. Unloading an adapter that unfinished requests use is
refused (400) until they finish; an adapter's name may be loaded again afterwards, with any path.

Loading a name already served (or being loaded) from another path is refused (400); from the same path
it succeeds without reading the adapter again, also while the first load is still reading it. Each
load gets an id of its own, never reused: a request that named an adapter which was then unloaded
(and perhaps loaded again from elsewhere) before the request reached the engine is refused (409),
never run with the adapter it no longer names. The refusal is decided where the engine's commands
are queued, in one order with the unload's own command, so no request slips between them.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import Any

from modelrunner.lora import LoRARequest
from .errors import APIError, bad_request


class ServedAdapters:
    """Adapter name → :class:`~modelrunner.lora.LoRARequest` (ids handed out here, from 1)."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._loading: dict[str, tuple[LoRARequest, asyncio.Future]] = {}
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
        """Read a new adapter in the engine loop's thread and serve it as ``name`` (the adapter already
        served, or being read, as ``name`` when ``path`` is the same).

        :param engine: the server's :class:`~.async_engine.AsyncEngine`.
        :raises APIError: 400 for a bad body, a name served (or being loaded) from another path or the
            base model's, or an adapter the engine refuses.
        """
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise bad_request("lora_name and lora_path must be non-empty strings", param="lora_name")
        with self._lock:
            if name in reserved:
                raise bad_request(f"the model name {name!r} is already served (the base model's); choose another",
                                  param="lora_name", code="invalid_value")
            served = self._by_name.get(name)
            pending = self._loading.get(name)
            if served is None and pending is None:
                request = LoRARequest(name, next(self._ids), path)
                loading = self._loading[name] = (request, asyncio.get_running_loop().create_future())
        if served is not None or pending is not None:
            known = served if served is not None else pending[0]
            if known.lora_path != path:
                state = "already served" if served is not None else "already being loaded"
                raise bad_request(f"the model name {name!r} is {state} from {known.lora_path!r}, not {path!r}; "
                                  "unload it first or choose another name", param="lora_name",
                                  code="invalid_value")
            if served is not None:
                return served
            await asyncio.shield(pending[1])  # the first load's outcome (its error, re-raised) is ours
            return pending[0]
        try:
            await asyncio.wrap_future(engine.loop.add_lora(request))
        except ValueError as e:
            error = bad_request(str(e), param="lora_path")
            self._loaded(name, loading, error)
            raise error from None
        except BaseException as e:
            self._loaded(name, loading, e)
            raise
        with self._lock:
            self._by_name[name] = request
        self._loaded(name, loading, None)
        return request

    def _loaded(self, name: str, loading: tuple[LoRARequest, asyncio.Future], error: BaseException | None) -> None:
        """The load of ``name`` ended: wake the identical loads that wait for it."""
        with self._lock:
            if self._loading.get(name) is loading:
                del self._loading[name]
        future = loading[1]
        if not future.done():
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
                future.exception()  # retrieved: nobody may be waiting

    async def unload(self, engine: Any, name: Any) -> None:
        """Stop serving ``name`` and forget its weights. From the moment this is called, requests that
        named the adapter and have not reached the engine yet are refused (409), until the unload is
        itself refused (the adapter then serves again).

        :raises APIError: 404 for a name not served, 400 while unfinished requests use it.
        """
        request = self.get(name) if isinstance(name, str) else None
        if request is None:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded; loaded: "
                                f"{', '.join(map(repr, self._by_name)) or 'none'}", param="lora_name",
                           code="model_not_found")
        engine.retire_lora(request)  # queued before the removal: nothing naming it is added after it
        try:
            await asyncio.wrap_future(engine.loop.remove_lora(request.lora_int_id))
        except ValueError as e:
            engine.restore_lora(request)
            raise bad_request(str(e), param="lora_name") from None
        except BaseException:
            engine.restore_lora(request)
            raise
        with self._lock:
            if self._by_name.get(name) is request:
                del self._by_name[name]
