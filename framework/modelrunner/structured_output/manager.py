"""The engine's side of structured outputs: picking a backend per request, compiling off the step
path with a cache, and masking a whole batch's logits at once (vLLM's ``StructuredOutputManager``)."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import StructuredOutputError
from .backend import GrammarBackend, GrammarContext, GrammarMatcher, GrammarSpec, apply_bitmask, bitmask_words

CACHE_SIZE = 512
"""Compiled grammars kept (least recently used dropped first)."""


class GrammarFailed(Exception):
    """A grammar backend raised, or filled a mask that allows nothing, while a step ran; the message
    names the backend (the engine fails only the requests involved)."""


class CompiledGrammar:
    """One constraint compiled (or compiling) by one backend: what requests with that constraint share.

    :param backend: the backend compiling it; ``spec``: the constraint.
    """

    def __init__(self, backend: GrammarBackend, spec: GrammarSpec, future: concurrent.futures.Future) -> None:
        self.backend = backend
        """The backend that compiles it and fills its masks."""
        self.spec = spec
        """The constraint."""
        self.future = future
        """Resolves to the backend's compiled form."""
        self.seconds: float | None = None
        """How long compiling took (None until done)."""

    @property
    def ready(self) -> bool:
        """True once compiling finished (or failed)."""
        return self.future.done()

    @property
    def error(self) -> str | None:
        """Why compiling failed, once it did."""
        if not self.future.done() or self.future.exception() is None:
            return None
        exc = self.future.exception()
        return str(exc) if isinstance(exc, StructuredOutputError) else \
            f"grammar backend {self.backend.name!r} failed to compile {self.spec.describe()}: {type(exc).__name__}: {exc}"

    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start (compiling must be done)."""
        return self.backend.matcher(self.future.result())


class StructuredOutputManager:
    """Grammar backends for one engine, created on first use; compiled grammars, cached by
    ``(backend, spec)``; the token bitmask of each step.

    :param plugins: where backends are looked up (``registry.grammar_backends``).
    :param config: the engine's :class:`~modelrunner.config.StructuredOutputsConfig`.
    :param context: tokenizer, logits width and EOS ids given to each backend.
    :raises UnknownNameError: the configured backend is not installed (the message lists those that are).
    :raises ValueError: it cannot run here (its library is missing).
    """

    def __init__(self, plugins: Any, config: Any, context: GrammarContext) -> None:
        self.plugins = plugins
        self.config = config
        """Backend choice, whitespace default, compile threads."""
        self.context = context
        """What backends know of the model."""
        self._backends: dict[str, GrammarBackend] = {}
        self._cache: collections.OrderedDict[tuple[str, GrammarSpec], CompiledGrammar] = collections.OrderedDict()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._bitmask = torch.zeros(0, bitmask_words(context.vocab_size), dtype=torch.int32)
        self.num_compiled = 0
        """Grammars compiled so far."""
        self.num_cache_hits = 0
        """Requests whose grammar was already compiled (or compiling)."""
        self.compile_seconds = 0.0
        """Time spent compiling, summed over the compile threads."""
        if config.backend != "auto":
            self._class(config.backend)

    # -- backends ------------------------------------------------------------------------------

    def _class(self, name: str) -> type:
        cls = self.plugins.grammar_backend_class(name)
        reason = cls.unavailable_reason()
        if reason is not None:
            raise ValueError(f"grammar backend {name!r} cannot run here: {reason}")
        return cls

    def backend(self, name: str) -> GrammarBackend:
        """The backend instance ``name`` (``"plugin:name"`` picks a plugin's), made once."""
        with self._lock:
            if name not in self._backends:
                self._backends[name] = self._class(name)(self.context)
            return self._backends[name]

    def auto_order(self) -> list[str]:
        """The backends ``auto`` tries, in order: installed, available, with an ``auto_order``."""
        registry = self.plugins.registry
        found = []
        for name in registry.names("grammar_backends"):
            cls = self.plugins.grammar_backend_class(name)
            if cls.auto_order is not None and cls.unavailable_reason() is None:
                found.append((cls.auto_order, name))
        return [name for _, name in sorted(found)]

    # -- requests ------------------------------------------------------------------------------

    def prepare(self, params: Any) -> CompiledGrammar:
        """Check one request's :class:`~modelrunner.sampling.StructuredOutputsParams` against the
        configured backend (with ``auto``, the first in :meth:`auto_order` that accepts it) and start
        compiling it, or find it compiled. Safe to call from any thread (a server checks a request
        this way before handing it to the engine's loop; the add then finds it in the cache).

        :raises StructuredOutputError: no tokenizer, or the backend(s) refuse a feature (the message
            names it), or its earlier compilation failed.
        """
        if self.context.tokenizer is None:
            raise StructuredOutputError("structured_outputs needs the model's tokenizer; this checkpoint has none",
                                        feature="structured_outputs")
        params.validate()
        spec = GrammarSpec.of(params, any_whitespace=not self.config.disable_any_whitespace)
        wanted = getattr(params, "backend", None) or self.config.backend  # GuidedDecodingParams(backend=...)
        names = self.auto_order() if wanted == "auto" else [wanted]
        if not names:
            raise StructuredOutputError("no grammar backend is installed for backend='auto' (pip install xgrammar)",
                                        feature="structured_outputs")
        refusals: list[StructuredOutputError] = []
        for name in names:
            with self._lock:
                cached = self._cache.get((name, spec))
                if cached is not None:
                    self._cache.move_to_end((name, spec))
            if cached is not None and cached.error is None:
                self.num_cache_hits += 1
                return cached
            backend = self.backend(name)
            try:
                backend.check(spec)
            except StructuredOutputError as e:
                refusals.append(e)
                continue
            if cached is not None:  # compiled and failed: its check passes but it cannot compile
                refusals.append(StructuredOutputError(cached.error or "", feature=spec.kind, backend=name))
                continue
            return self._submit(name, backend, spec)
        if len(refusals) == 1:
            raise refusals[0]
        raise StructuredOutputError("no grammar backend accepts this request: " + "; ".join(map(str, refusals)),
                                    feature=refusals[0].feature, backend=refusals[0].backend)

    def _submit(self, name: str, backend: GrammarBackend, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.config.compile_threads,
                                                                   thread_name_prefix="grammar-compile")
            future: concurrent.futures.Future = concurrent.futures.Future()
            compiled = CompiledGrammar(backend, spec, future)
            self._cache[(name, spec)] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        self._pool.submit(self._compile, compiled)
        return compiled

    def _compile(self, compiled: CompiledGrammar) -> None:
        start = time.perf_counter()
        try:
            result = compiled.backend.compile(compiled.spec)
        except BaseException as e:  # noqa: BLE001 - reported to the requests waiting for it
            compiled.future.set_exception(e)
        else:
            compiled.future.set_result(result)
        compiled.seconds = time.perf_counter() - start
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += compiled.seconds

    @staticmethod
    def wait(grammars: Sequence[CompiledGrammar], timeout: float) -> None:
        """Block until one of ``grammars`` finished compiling, or ``timeout`` seconds passed."""
        concurrent.futures.wait([g.future for g in grammars], timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    # -- the step ------------------------------------------------------------------------------

    def apply_bitmasks(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None],
                       grammars: Sequence[CompiledGrammar | None]) -> None:
        """Mask, in place, every logits row whose matcher is not None to the tokens its grammar allows
        next: one bitmask for the whole batch, each backend filling its rows in one call.

        :raises GrammarFailed: a backend raised, or left a row allowing nothing (naming the backend
            and the rows).
        """
        rows = [r for r, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        words = bitmask_words(logits.shape[1])
        if self._bitmask.shape[0] < len(matchers) or self._bitmask.shape[1] != words:
            self._bitmask = torch.zeros(max(len(matchers), 2 * self._bitmask.shape[0]), words, dtype=torch.int32)
        bitmask = self._bitmask[:len(matchers)]  # row r masks logits row r; free rows are left alone
        bitmask[rows] = 0
        by_backend: dict[int, tuple[GrammarBackend, list[GrammarMatcher], list[int]]] = {}
        for r in rows:
            backend = grammars[r].backend
            entry = by_backend.setdefault(id(backend), (backend, [], []))
            entry[1].append(matchers[r])
            entry[2].append(r)
        for backend, mine, slots in by_backend.values():
            try:
                backend.fill_bitmasks(mine, self._bitmask, slots)
            except Exception as e:  # noqa: BLE001 - reported against the rows it was filling
                raise GrammarFailed(f"grammar backend {backend.name!r} failed to fill the token mask: "
                                    f"{type(e).__name__}: {e}") from e
        empty = ~bitmask[rows].any(1)
        if bool(empty.any()):
            r = rows[int(empty.nonzero()[0])]
            raise GrammarFailed(f"grammar backend {grammars[r].backend.name!r} allows no token at all for "
                                f"{grammars[r].spec.describe()}")
        apply_bitmask(logits, bitmask, rows)

    def stats(self) -> dict[str, Any]:
        """Grammars compiled, cache hits and entries, total compile seconds, backends in use."""
        return {"num_compiled": self.num_compiled, "num_cache_hits": self.num_cache_hits,
                "cached_grammars": len(self._cache), "compile_seconds": round(self.compile_seconds, 4),
                "backends": sorted(self._backends)}

    @property
    def used(self) -> bool:
        """True once any request asked for structured outputs."""
        return bool(self._backends)

    def shutdown(self) -> None:
        """Stop the compile threads (compilations under way finish first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


__all__ = ["CACHE_SIZE", "CompiledGrammar", "GrammarFailed", "StructuredOutputManager"]
