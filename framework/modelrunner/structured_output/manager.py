"""The engine's side of structured outputs: picking a backend per request, compiling off the step
path with a cache, and the token masks of each step (vLLM's ``StructuredOutputManager``).

Nothing a grammar does may hold the step of the requests beside it:

- **Compiling** runs on ``compile_threads`` threads plus one that takes only small constraints, so a
  ``choice`` never waits behind two huge schemas. At most ``max_queued_compiles`` grammars (and as
  many small ones) wait for a thread; one more is refused at once (:class:`GrammarPoolBusy`, naming
  the busy pool). A grammar
  may take ``compile_timeout_s`` counted from when its compilation starts (or as long to get a thread).
- **Masks** are computed off the step as well: after a step appends a constrained sequence's tokens,
  a mask thread advances its matcher and fills the next token's mask into a row of its own
  (:class:`GrammarCursor`). The next step waits a moment for fast grammars' masks; a sequence whose
  mask is not ready sits that step out (keeping its KV blocks), and a grammar that took longer than
  :data:`SLOW_MASK_S` moves to threads of its own, never waited for. One mask may take
  ``mask_timeout_s``: past it, that request fails, naming its grammar.
- **The cache** of compiled grammars is bounded by an estimate of their memory (``cache_bytes``;
  a backend may report each grammar's size), dropping the least recently used.

The kernel ships no backend: they are plugins (:data:`~.backend.GRAMMAR_PACKAGES` names the
distributions of this project's), and a request for one that is not installed is refused naming the
package to install (:func:`missing_backend_message`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch

from ..errors import StructuredOutputError, UnknownNameError
from ..registry import split_choice
from .backend import (GRAMMAR_PACKAGES, GrammarBackend, GrammarContext, GrammarMatcher, GrammarSpec, apply_bitmask,
                      bitmask_words)

logger = logging.getLogger(__name__)

CACHE_SIZE = 512
"""Most compiled grammars kept, whatever their size (least recently used dropped first)."""
SMALL_SPEC_CHARS = 1024
"""Constraints up to this many characters (a few choices, a short regex or schema) may compile on the
thread kept for small ones."""
SLOW_MASK_S = 0.02
"""A grammar whose mask took longer than this (or is still computing after it) is slow: its masks run
on threads of their own, steps do not wait for them, and its sequence does not speculate."""
STEP_MASK_WAIT_S = 0.02
"""Longest a step waits for fast grammars' masks before running without the sequences still waiting."""
IDLE_WAIT_S = 0.05
"""With nothing else to run, how long a step waits for a compilation or a mask before returning."""
BACKGROUND_NICENESS = 10
"""Niceness (Linux, per thread) of the compile threads and the slow grammars' mask threads: on a
machine with few cores their work would otherwise take cores from the engine's forward, which every
request waits for; niced, it runs in what the forward leaves."""
FALLBACK_GRAMMAR_BYTES = 1 << 20
"""The memory assumed for a compiled grammar whose backend reports none (at least 64 bytes per
character of its constraint)."""


def missing_backend_message(name: str, plugins: Any) -> str:
    """Why grammar backend ``name`` (``"plugin:name"`` allowed) is not among ``plugins``' and what to do:
    for a backend of :data:`~.backend.GRAMMAR_PACKAGES`, the package to install (or, where that package
    is installed, that its plugin was blocked or failed to load); for any other name, the registry's
    message listing the installed backends."""
    import importlib.metadata

    bare = split_choice(name)[1]
    registry = plugins.registry
    broken = getattr(plugins, "broken", {})
    installed = ", ".join(registry.names("grammar_backends")) or "none"
    package = GRAMMAR_PACKAGES.get(bare)
    if package is None:
        return registry.unknown("grammar_backends", bare, broken)
    try:
        importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return (f"grammar backend {bare!r} is not installed: it comes with the {package} package "
                f"(pip install {package}); installed grammar backends: {installed}")
    why = "; ".join(f"{p}: {e}" for p, e in sorted(broken.items())) or \
        "it is blocked ($MODELRUNNER_BLOCK_PLUGINS) or not allowed ($MODELRUNNER_PLUGINS)"
    return (f"grammar backend {bare!r} is not loaded: its package {package} is installed but its plugin did not "
            f"load ({why}); installed grammar backends: {installed}")


def _yield_to_the_engine() -> None:
    """Lower the calling thread's priority by :data:`BACKGROUND_NICENESS` where the OS allows it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not permitted: run at the usual priority
        pass


class GrammarFailed(Exception):
    """A grammar backend raised, or filled a mask that allows nothing, while a step ran; the message
    names the backend (the engine fails only the requests involved)."""


class GrammarPoolBusy(StructuredOutputError):
    """Too many grammars wait for a compile thread (or one waited too long for one): the server is busy,
    not the request wrong (a server answers 503 with Retry-After). The message says how busy."""


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
        self.submitted = time.monotonic()
        """When it was queued for a compile thread."""
        self.started: float | None = None
        """When a compile thread started it (None while it waits for one)."""
        self.size = 0
        """Estimated bytes of the compiled form (0 until done)."""
        self.small = len(spec.value) <= SMALL_SPEC_CHARS
        """Whether it may compile on the thread kept for small constraints."""

    @property
    def ready(self) -> bool:
        """True once compiling finished (or failed)."""
        return self.future.done()

    @property
    def error(self) -> str | None:
        """Why compiling failed, once it did."""
        if not self.future.done() or self.future.cancelled() or self.future.exception() is None:
            return "its compilation was given up" if self.future.cancelled() else None
        exc = self.future.exception()
        return str(exc) if isinstance(exc, StructuredOutputError) else \
            f"grammar backend {self.backend.name!r} failed to compile {self.spec.describe()}: {type(exc).__name__}: {exc}"

    def new_matcher(self) -> GrammarMatcher:
        """A matcher at the grammar's start (compiling must be done)."""
        return self.backend.matcher(self.future.result())


class _CompilePool:
    """``threads`` threads taking any grammar (small ones first) plus one taking only small ones; at
    most ``max_queued`` small and as many other grammars waiting."""

    def __init__(self, threads: int, max_queued: int, run: Any) -> None:
        self.threads = threads
        self.max_queued = max_queued
        self._run = run
        self._cond = threading.Condition()
        self._small: collections.deque[CompiledGrammar] = collections.deque()
        self._large: collections.deque[CompiledGrammar] = collections.deque()
        self._workers: list[threading.Thread] = []
        self.compiling = 0
        """Grammars being compiled now."""
        self._closed = False

    @property
    def queued(self) -> int:
        """Grammars waiting for a thread."""
        return len(self._small) + len(self._large)

    def describe(self) -> str:
        """How busy the pool is, for messages."""
        return (f"the grammar compile pool is busy with {self.compiling + self.queued} other grammars ("
                f"{self.compiling} compiling, {self.queued} waiting; structured_outputs_compile_threads "
                f"{self.threads}, structured_outputs_max_queued_compiles {self.max_queued})")

    def submit(self, compiled: CompiledGrammar) -> None:
        """Queue ``compiled``.

        :raises GrammarPoolBusy: :attr:`max_queued` grammars wait already.
        """
        with self._cond:
            lane = self._small if compiled.small else self._large
            if len(lane) >= self.max_queued:
                raise GrammarPoolBusy(f"{self.describe()}; retry shortly", feature=compiled.spec.kind,
                                      backend=compiled.backend.name)
            lane.append(compiled)
            if not self._workers:
                for index in range(self.threads + 1):
                    worker = threading.Thread(target=self._work, args=(index == 0,), daemon=True,
                                              name=f"grammar-compile-{'small' if index == 0 else index}")
                    worker.start()
                    self._workers.append(worker)
            self._cond.notify_all()

    def cancel(self, compiled: CompiledGrammar) -> bool:
        """Take ``compiled`` out of the queue if no thread started it; True if it was."""
        with self._cond:
            for queue in (self._small, self._large):
                if compiled in queue:
                    queue.remove(compiled)
                    return True
        return False

    def _next(self, small_only: bool) -> CompiledGrammar | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._small:
                    found = self._small.popleft()
                elif self._large and not small_only:
                    found = self._large.popleft()
                else:
                    self._cond.wait()
                    continue
                if found.future.set_running_or_notify_cancel():
                    found.started = time.monotonic()
                    self.compiling += 1
                    return found

    def _work(self, small_only: bool) -> None:
        _yield_to_the_engine()
        while True:
            compiled = self._next(small_only)
            if compiled is None:
                return
            try:
                self._run(compiled)
            finally:
                with self._cond:
                    self.compiling -= 1
                del compiled  # an idle thread must not keep the grammar alive after the cache dropped it

    def shutdown(self) -> None:
        """Let the threads end once their compilations are done; drop what waits."""
        with self._cond:
            self._closed = True
            for queue in (self._small, self._large):
                for compiled in queue:
                    compiled.future.cancel()
                queue.clear()
            self._cond.notify_all()


class _DaemonPool:
    """``threads`` daemon threads running submitted calls in order: a grammar stuck in a backend's
    native code must not keep the process from exiting, as a ``ThreadPoolExecutor``'s threads would."""

    def __init__(self, threads: int, name: str, background: bool = False) -> None:
        self.threads = threads
        self.name = name
        self.background = background
        """Its threads run at a lower priority (:func:`_yield_to_the_engine`)."""
        self._jobs: collections.deque[tuple[concurrent.futures.Future, Any, tuple]] = collections.deque()
        self._cond = threading.Condition()
        self._started = 0
        self._idle = 0
        self._closed = False

    def submit(self, fn: Any, *args: Any) -> concurrent.futures.Future:
        """``fn(*args)`` on a pool thread; its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._jobs.append((future, fn, args))
            if self._idle == 0 and self._started < self.threads:
                self._started += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self._started}", daemon=True).start()
            self._cond.notify()
        return future

    def _work(self) -> None:
        if self.background:
            _yield_to_the_engine()
        while True:
            with self._cond:
                self._idle += 1
                while not self._jobs and not self._closed:
                    self._cond.wait()
                self._idle -= 1
                if self._closed:
                    return
                future, fn, args = self._jobs.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                    future.set_exception(exc)
            del future, fn, args

    def shutdown(self) -> None:
        """Cancel what waits; threads end after their current call."""
        with self._cond:
            self._closed = True
            for future, _, _ in self._jobs:
                future.cancel()
            self._jobs.clear()
            self._cond.notify_all()


class GrammarCursor:
    """One constrained sequence's place in its grammar, and the mask of its next token, computed by a
    mask thread (:meth:`StructuredOutputManager.advance`) while the engine runs other sequences.

    :param grammar: the compiled grammar; ``matcher``: a fresh matcher of it; ``words``: bitmask width.
    """

    def __init__(self, grammar: CompiledGrammar, matcher: GrammarMatcher, words: int) -> None:
        self.grammar = grammar
        """The compiled grammar."""
        self.matcher = matcher
        """Where the sequence is in it (touched by one thread at a time: the job's, else the engine's)."""
        self.mask = torch.zeros(1, words, dtype=torch.int32)
        """The next token's mask (valid while :attr:`ready`)."""
        self.job: concurrent.futures.Future | None = None
        """The mask thread's work under way (None: the mask is ready)."""
        self.submitted = 0.0
        """When :attr:`job` was queued."""
        self.started: float | None = None
        """When a mask thread started :attr:`job`."""
        self.seconds = 0.0
        """How long the latest job ran."""
        self.slow = False
        """The grammar's masks take longer than :data:`SLOW_MASK_S` (see the module docstring)."""
        self.terminated = False
        """The grammar is complete: nothing but its end may follow (the sequence ends with ``stop``)."""
        self.failure: str | None = None
        """Why this sequence cannot go on (the backend raised, refused a token its mask allowed, or
        allowed nothing), once known."""
        self.owner: Any = None
        """What the cursor belongs to (the engine's sequence)."""

    @property
    def ready(self) -> bool:
        """True when no job runs (the mask, or :attr:`terminated` / :attr:`failure`, is current)."""
        return self.job is None

    @torch.inference_mode()  # the mask tensor was made in the engine's step, in inference mode
    def _advance(self, tokens: tuple[int, ...]) -> None:
        """Accept ``tokens`` and fill the next mask (in a mask thread)."""
        self.started = time.monotonic()
        backend = self.grammar.backend
        try:
            if tokens and not self.matcher.accept_tokens(tokens):
                self.failure = (f"grammar backend {backend.name!r} refused token(s) {list(tokens)}, which its own "
                                "mask allowed")
            elif self.matcher.is_terminated():
                self.terminated = True
            else:
                backend.fill_bitmasks([self.matcher], self.mask, [0])
                if not bool(self.mask.any()):
                    self.failure = f"grammar backend {backend.name!r} allows no token at all for " \
                                   f"{self.grammar.spec.describe()}"
        except Exception as exc:  # noqa: BLE001 - a backend bug fails its request only
            self.failure = f"grammar backend {backend.name!r} failed to advance {self.grammar.spec.describe()}: " \
                           f"{type(exc).__name__}: {exc}"
        self.seconds = time.monotonic() - self.started


class StructuredOutputManager:
    """Grammar backends for one engine, created on first use; compiled grammars, cached by
    ``(backend, spec)``; the mask work of each constrained sequence.

    :param plugins: where backends are looked up (``registry.grammar_backends``).
    :param config: the engine's :class:`~modelrunner.config.StructuredOutputsConfig`.
    :param context: tokenizer, logits width and EOS ids given to each backend.
    :raises UnknownNameError: the configured backend is not installed (the message names the package
        that provides it, or lists the installed backends).
    :raises ValueError: it cannot run here (its library is missing).
    """

    def __init__(self, plugins: Any, config: Any, context: GrammarContext) -> None:
        self.plugins = plugins
        self.config = config
        """Backend choice, whitespace default, threads, bounds."""
        self.context = context
        """What backends know of the model."""
        self._backends: dict[str, GrammarBackend] = {}
        self._cache: collections.OrderedDict[tuple[str, GrammarSpec], CompiledGrammar] = collections.OrderedDict()
        self._cache_bytes = 0
        self._pool = _CompilePool(config.compile_threads, config.max_queued_compiles, self._compile)
        self._mask_pools: dict[bool, _DaemonPool] = {}
        self._lock = threading.Lock()
        self._bitmask = torch.zeros(0, bitmask_words(context.vocab_size), dtype=torch.int32)
        self.num_compiled = 0
        """Grammars compiled so far."""
        self.num_cache_hits = 0
        """Requests whose grammar was already compiled (or compiling)."""
        self.num_evicted = 0
        """Compiled grammars dropped from the cache to stay within ``cache_bytes``."""
        self.compile_seconds = 0.0
        """Time spent compiling, summed over the compile threads."""
        self.num_mask_timeouts = 0
        """Requests failed because one mask took longer than ``mask_timeout_s``."""
        self._apply_failed: set[str] = set()
        if config.backend != "auto":
            self._class(config.backend)

    # -- backends ------------------------------------------------------------------------------

    def _class(self, name: str) -> type:
        try:
            cls = self.plugins.grammar_backend_class(name)
        except UnknownNameError as e:
            raise UnknownNameError(missing_backend_message(name, self.plugins)) from e
        reason = cls.unavailable_reason()
        if reason is not None:
            raise ValueError(f"grammar backend {name!r} cannot run here: {reason}")
        return cls

    def backend(self, name: str) -> GrammarBackend:
        """The backend instance ``name`` (``"plugin:name"`` picks a plugin's), made once."""
        with self._lock:
            if name not in self._backends:
                # Backends get transformers' tokenizer (GrammarContext's contract): a GGUF file's tokenizer
                # makes it when the first backend is made.
                to_transformers = getattr(self.context.tokenizer, "to_transformers", None)
                context = self.context if to_transformers is None else \
                    attrs.evolve(self.context, tokenizer=to_transformers())
                self._backends[name] = self._class(name)(context)
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

    # -- compiling -----------------------------------------------------------------------------

    def prepare(self, params: Any) -> CompiledGrammar:
        """Check one request's :class:`~modelrunner.sampling.StructuredOutputsParams` against the
        configured backend (with ``auto``, the first in :meth:`auto_order` that accepts it) and start
        compiling it, or find it compiled. Safe to call from any thread (a server checks a request
        this way before handing it to the engine's loop; the add then finds it in the cache).

        :raises StructuredOutputError: no tokenizer, or the backend(s) refuse a feature (the message
            names it), or its earlier compilation failed; :class:`GrammarPoolBusy` when it would have
            to wait behind ``max_queued_compiles`` others.
        """
        if self.context.tokenizer is None:
            raise StructuredOutputError("structured_outputs needs the model's tokenizer; this checkpoint has none",
                                        feature="structured_outputs")
        params.validate()
        spec = GrammarSpec.of(params, any_whitespace=not self.config.disable_any_whitespace)
        wanted = getattr(params, "backend", None) or self.config.backend  # GuidedDecodingParams(backend=...)
        names = self.auto_order() if wanted == "auto" else [wanted]
        if not names:
            packages = " or ".join(GRAMMAR_PACKAGES.values())
            raise StructuredOutputError(f"no grammar backend is installed for backend='auto': pip install {packages}",
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
            try:
                backend = self.backend(name)
            except UnknownNameError as e:  # a request's own backend (GuidedDecodingParams(backend=...))
                raise StructuredOutputError(str(e), feature=f"grammar backend {name!r}", backend=name) from None
            try:
                backend.check(spec)
            except StructuredOutputError as e:
                refusals.append(e)
                continue
            if cached is not None and not cached.future.cancelled():  # compiled and failed: it cannot compile
                refusals.append(StructuredOutputError(cached.error or "", feature=spec.kind, backend=name))
                continue
            return self._submit(name, backend, spec)
        if len(refusals) == 1:
            raise refusals[0]
        raise StructuredOutputError("no grammar backend accepts this request: " + "; ".join(map(str, refusals)),
                                    feature=refusals[0].feature, backend=refusals[0].backend)

    def _submit(self, name: str, backend: GrammarBackend, spec: GrammarSpec) -> CompiledGrammar:
        compiled = CompiledGrammar(backend, spec, concurrent.futures.Future())
        self._pool.submit(compiled)
        with self._lock:
            self._cache[(name, spec)] = compiled
            self._evict()
        return compiled

    def _compile(self, compiled: CompiledGrammar) -> None:
        start = time.perf_counter()
        error: BaseException | None = None
        result = None
        try:
            result = compiled.backend.compile(compiled.spec)
            compiled.size = self._estimate_bytes(compiled, result)
        except BaseException as e:  # noqa: BLE001 - reported to the requests waiting for it
            error = e
        compiled.seconds = time.perf_counter() - start
        with self._lock:  # accounted before anyone waiting sees it done
            self.num_compiled += 1
            self.compile_seconds += compiled.seconds
            if self._cache.get((compiled.backend.name, compiled.spec)) is compiled:
                self._cache_bytes += compiled.size
            self._evict()
        if error is None:
            compiled.future.set_result(result)
        else:
            compiled.future.set_exception(error)
        del result, error

    @staticmethod
    def _estimate_bytes(compiled: CompiledGrammar, result: Any) -> int:
        """What ``result`` takes in memory: the backend's ``compiled_size(result)`` when it has one,
        the result's own ``memory_size_bytes`` (an int attribute), else :data:`FALLBACK_GRAMMAR_BYTES`
        (at least 64 bytes per character of the constraint)."""
        size = getattr(compiled.backend, "compiled_size", None)
        if callable(size):
            try:
                return max(0, int(size(result)))
            except Exception:  # noqa: BLE001 - a broken estimate falls back to ours
                pass
        reported = getattr(result, "memory_size_bytes", None)
        if isinstance(reported, int) and reported >= 0:
            return reported
        return max(FALLBACK_GRAMMAR_BYTES, 64 * len(compiled.spec.value))

    def _evict(self) -> None:
        """Drop the least recently used compiled grammars past ``cache_bytes`` or :data:`CACHE_SIZE` (the
        newest stays, whatever its size; those still compiling are kept). Call with the lock held."""
        for key in list(self._cache):
            if self._cache_bytes <= self.config.cache_bytes and len(self._cache) <= CACHE_SIZE:
                return
            if len(self._cache) == 1:
                return
            compiled = self._cache[key]
            if not compiled.ready:
                continue
            del self._cache[key]
            self._cache_bytes -= compiled.size
            self.num_evicted += 1

    def overdue(self, compiled: CompiledGrammar) -> StructuredOutputError | None:
        """Why requests must stop waiting for ``compiled``: it waited ``compile_timeout_s`` for a thread
        (:class:`GrammarPoolBusy`), or has compiled that long; None while it may go on."""
        if compiled.ready:
            return None
        limit = self.config.compile_timeout_s
        started, now = compiled.started, time.monotonic()
        if started is None and now - compiled.submitted > limit:
            self._pool.cancel(compiled)
            return GrammarPoolBusy(f"{compiled.spec.describe()} waited {now - compiled.submitted:.1f} s for a compile "
                                   f"thread (structured_outputs_compile_timeout_s {limit:g}): {self._pool.describe()}",
                                   feature=compiled.spec.kind, backend=compiled.backend.name)
        if started is not None and now - started > limit:
            return StructuredOutputError(
                f"grammar backend {compiled.backend.name!r} did not compile {compiled.spec.describe()} within "
                f"{limit:g} s of starting (structured_outputs_compile_timeout_s); simplify it",
                feature=compiled.spec.kind, backend=compiled.backend.name)
        return None

    def wait_compiled(self, compiled: CompiledGrammar) -> None:
        """Block until ``compiled`` compiled (call it off the engine's and the server's event loop).

        :raises GrammarPoolBusy: it waited ``compile_timeout_s`` for a compile thread.
        :raises StructuredOutputError: it failed to compile, or took ``compile_timeout_s`` from its start.
        """
        limit = self.config.compile_timeout_s
        while not compiled.ready:
            problem = self.overdue(compiled)
            if problem is not None:
                raise problem
            since = compiled.started if compiled.started is not None else compiled.submitted
            left = since + limit - time.monotonic()
            concurrent.futures.wait([compiled.future], timeout=min(max(left, 0.0) + 0.01, 0.25))
        if compiled.error is not None:
            exc = None if compiled.future.cancelled() else compiled.future.exception()
            known = isinstance(exc, StructuredOutputError)
            raise StructuredOutputError(compiled.error, feature=exc.feature if known else None,
                                        backend=exc.backend if known else compiled.backend.name)

    def wait(self, grammars: Sequence[CompiledGrammar], timeout: float) -> None:
        """Block until one of ``grammars`` finished compiling, or ``timeout`` seconds passed."""
        concurrent.futures.wait([g.future for g in grammars], timeout=timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)

    # -- masks ---------------------------------------------------------------------------------

    def start(self, compiled: CompiledGrammar) -> GrammarCursor:
        """A cursor at the start of ``compiled`` (compiling must be done), its first mask being computed.

        :raises Exception: the backend could not start a matcher.
        """
        cursor = GrammarCursor(compiled, compiled.new_matcher(), self._bitmask.shape[1])
        self.advance(cursor, ())
        return cursor

    def fork(self, cursor: GrammarCursor) -> GrammarCursor:
        """A cursor for a sibling completion forked before ``cursor`` accepted any token: a fresh
        matcher (the same state) and a copy of the ready first mask."""
        twin = GrammarCursor(cursor.grammar, cursor.grammar.new_matcher(), self._bitmask.shape[1])
        twin.mask.copy_(cursor.mask)
        twin.slow, twin.seconds = cursor.slow, cursor.seconds
        return twin

    def advance(self, cursor: GrammarCursor, tokens: Iterable[int]) -> None:
        """Have a mask thread accept ``tokens`` (the sequence's newly appended ones) and fill the next
        mask; the cursor is not :attr:`~GrammarCursor.ready` until it did."""
        tokens = tuple(int(t) for t in tokens)
        pool = self._mask_pool(cursor.slow)
        cursor.submitted, cursor.started = time.monotonic(), None
        cursor.job = pool.submit(cursor._advance, tokens)

    def _mask_pool(self, slow: bool) -> _DaemonPool:
        with self._lock:
            pool = self._mask_pools.get(slow)
            if pool is None:
                pool = self._mask_pools[slow] = _DaemonPool(self.config.mask_threads,
                                                            f"grammar-mask{'-slow' if slow else ''}", background=slow)
            return pool

    def collect(self, cursors: Sequence[GrammarCursor], idle: bool) -> list[tuple[GrammarCursor, str]]:
        """Before a step: wait up to :data:`STEP_MASK_WAIT_S` for the masks of fast grammars (with
        ``idle`` — nothing else could run — up to :data:`IDLE_WAIT_S` for any one mask), take in the
        jobs that finished, and say which cursors' requests must fail: a backend failure, or a mask
        that took longer than ``mask_timeout_s``. Cursors still not :attr:`~GrammarCursor.ready`
        sit the step out."""
        pending = [c for c in cursors if c.job is not None]
        if pending:
            fast = [c.job for c in pending if not c.slow]
            if fast:
                concurrent.futures.wait(fast, timeout=STEP_MASK_WAIT_S)
            if idle and all(c.job is not None and not c.job.done() for c in pending):
                concurrent.futures.wait([c.job for c in pending], timeout=IDLE_WAIT_S,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
        failed: list[tuple[GrammarCursor, str]] = []
        now = time.monotonic()
        limit = self.config.mask_timeout_s
        for cursor in pending:
            job = cursor.job
            if job.done():
                cursor.job = None
                cursor.slow = cursor.seconds > SLOW_MASK_S
                if cursor.failure is not None:
                    failed.append((cursor, cursor.failure))
                continue
            started = cursor.started
            if started is not None and now - started > SLOW_MASK_S:
                cursor.slow = True  # still computing: the next steps do not wait for it
            describe = cursor.grammar.spec.describe()
            backend = cursor.grammar.backend.name
            if started is not None and now - started > limit:
                self.num_mask_timeouts += 1
                failed.append((cursor, f"grammar backend {backend!r} took more than {limit:g} s to compute the "
                                       f"next token's mask for {describe} (structured_outputs_mask_timeout_s); "
                                       "the request is stopped"))
            elif started is None and now - cursor.submitted > limit:
                self.num_mask_timeouts += 1
                failed.append((cursor, f"{describe} waited more than {limit:g} s for a mask thread: they are busy "
                                       f"with slow grammars (structured_outputs_mask_threads "
                                       f"{self.config.mask_threads}); the request is stopped"))
        return failed

    def apply_masks(self, logits: torch.Tensor, cursors: Sequence[GrammarCursor | None]) -> None:
        """Mask, in place, every logits row whose cursor is not None to its ready mask."""
        rows = [r for r, c in enumerate(cursors) if c is not None]
        if not rows:
            return
        bitmask = self._rows(len(cursors), logits.shape[1])
        for r in rows:
            bitmask[r] = cursors[r].mask[0]
        self._apply(cursors[rows[0]].grammar.backend, logits, bitmask, rows)

    def _apply(self, backend: GrammarBackend, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Mask with ``backend``'s kernel (any backend's will do: the layout is shared); where it raises,
        with the kernel's torch :func:`~.backend.apply_bitmask` (masking twice is harmless), once logged."""
        try:
            backend.apply_bitmask(logits, bitmask, rows)
        except Exception as e:  # noqa: BLE001 - a backend's kernel must not fail the step
            if backend.name not in self._apply_failed:
                self._apply_failed.add(backend.name)
                logger.warning("grammar backend %r failed to apply a token mask (%s: %s); masking with torch",
                               backend.name, type(e).__name__, e)
            apply_bitmask(logits, bitmask, rows)

    def _rows(self, count: int, width: int) -> torch.Tensor:
        words = bitmask_words(width)
        if self._bitmask.shape[0] < count or self._bitmask.shape[1] != words:
            self._bitmask = torch.zeros(max(count, 2 * self._bitmask.shape[0]), words, dtype=torch.int32)
        return self._bitmask[:count]

    def apply_bitmasks(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None],
                       grammars: Sequence[CompiledGrammar | None]) -> None:
        """Mask, in place, every logits row whose matcher is not None to the tokens its grammar allows
        next, filling the masks now (speculative decoding's positions after the first): one bitmask
        for the whole batch, each backend filling its rows in one call.

        :raises GrammarFailed: a backend raised, or left a row allowing nothing (naming the backend
            and the rows).
        """
        rows = [r for r, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        bitmask = self._rows(len(matchers), logits.shape[1])  # row r masks logits row r; free rows are left alone
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
        self._apply(grammars[rows[0]].backend, logits, bitmask, rows)

    # -- reporting -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Grammars compiled, cache hits, entries, estimated bytes and evictions, total compile seconds,
        the compile pool's load, mask timeouts, backends in use."""
        return {"num_compiled": self.num_compiled, "num_cache_hits": self.num_cache_hits,
                "cached_grammars": len(self._cache), "cached_bytes": self._cache_bytes,
                "num_evicted": self.num_evicted, "compile_seconds": round(self.compile_seconds, 4),
                "compiling": self._pool.compiling, "compile_queued": self._pool.queued,
                "num_mask_timeouts": self.num_mask_timeouts, "backends": sorted(self._backends)}

    @property
    def used(self) -> bool:
        """True once any request asked for structured outputs."""
        return bool(self._backends)

    def shutdown(self) -> None:
        """Stop the compile and mask threads (work under way finishes first)."""
        self._pool.shutdown()
        with self._lock:
            pools, self._mask_pools = list(self._mask_pools.values()), {}
        for pool in pools:
            pool.shutdown()


__all__ = ["CACHE_SIZE", "CompiledGrammar", "GrammarCursor", "GrammarFailed", "GrammarPoolBusy",
           "StructuredOutputManager", "missing_backend_message"]
