"""The callable the ``inductor`` backend hands the runner: the model under ``torch.compile``.

Three compiled entry points share the model:

- decode steps (one token per sequence) with unfrozen weights are padded to a bucket of rows (see
  :mod:`.buckets`) and compiled with that row count fixed, one graph per bucket, so a new batch
  size never recompiles and every graph can be stored in inductor's FX graph cache;
- decode steps with frozen weights (see :attr:`.InductorOptions.freezing`) run one graph with a
  dynamic row count: inductor prepacks the weights for oneDNN, whose kernels take any row count,
  and frozen graphs cannot be cached anyway, so one graph is cheaper than one per bucket;
- every other step (prefills, chunked prefills mixed with decodes) runs a graph with dynamic token
  and sequence counts; a mixed step whose attention would be mostly padding (decodes beside a long
  prompt chunk) runs as two steps instead, its decodes through the decode graphs.

In all of them the block-table width and the sequence lengths are dynamic, so growing sequences
never recompile either.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import attrs
import torch
import torch._dynamo
import torch.fx.experimental._config

from modelrunner.api import ForwardBatch, onednn_in_compiled_graphs

from . import lowerings
from .buckets import bucket_for, drop_padding, normalize_key_length, pad_decode_batch, pad_rows
from .cache import CompileCache
from .options import InductorOptions

_MIN_RECOMPILE_LIMIT = 64  # torch's default of 8 graphs per frame is fewer than the decode buckets

SPLIT_MIN_PADDING = 256
"""A mixed step whose padded attention queries exceed its tokens by at least this many (and by more
than its token count) runs its decodes and its other sequences as two steps."""


def _decode_step(model: Any, batch: ForwardBatch, kv_caches: list[torch.Tensor], kwargs: dict[str, Any]) -> Any:
    return model(batch, kv_caches, **kwargs)


def _frozen_decode_step(model: Any, batch: ForwardBatch, kv_caches: list[torch.Tensor],
                        kwargs: dict[str, Any]) -> Any:
    return model(batch, kv_caches, **kwargs)


def _general_step(model: Any, batch: ForwardBatch, kv_caches: list[torch.Tensor], kwargs: dict[str, Any]) -> Any:
    return model(batch, kv_caches, **kwargs)


class InductorModel:
    """Runs ``model(batch, kv_caches, **kwargs)`` through ``torch.compile``.

    :param model: the loaded module (its forward takes the runner's arguments).
    :param options: mode, freezing and buckets.
    :param cache: the persistent cache directory inductor compiles into.
    """

    def __init__(self, model: torch.nn.Module, options: InductorOptions, cache: CompileCache) -> None:
        self.model = model
        """The eager module."""
        self.options = options
        """How graphs are compiled."""
        self.cache = cache
        """Where compiled artifacts persist."""
        lowerings.install()
        # Static by default (constants such as the block size stay constants in the kernels); what
        # varies is marked dynamic explicitly on every call.
        self._decode = torch.compile(_decode_step, backend=self._backend)
        self._frozen_decode = torch.compile(_frozen_decode_step, backend=self._backend)
        self._general = torch.compile(_general_step, backend=self._backend)
        self._shape = "prefill"  # the step being run, for the backend
        self._freeze = False  # whether the step being run has frozen weights
        self._compiles: collections.Counter[str] = collections.Counter()
        self._steps: collections.Counter[str] = collections.Counter()
        self._fx_cache = collections.Counter()
        self._compile_seconds = 0.0
        self._padded_rows = 0
        self._split_steps = 0
        self._from_cache = 0
        self._checked = False
        self._cleared = False
        self._dirty = False

    # -- running -------------------------------------------------------------------------------

    def __call__(self, batch: ForwardBatch, kv_caches: list[torch.Tensor], **kwargs: Any) -> Any:
        """The model's output for this step, computed by the graph for its shape."""
        if not self._checked:
            self.cache.check()
            self._checked = True
        for cache in kv_caches:
            torch._dynamo.mark_static(cache)
        # Graphs guard on whether inputs are inference tensors: make them all so, whoever built them.
        with torch.inference_mode():
            batch = attrs.evolve(batch, **{f.name: _inference_tensors(getattr(batch, f.name))
                                           for f in attrs.fields(ForwardBatch)
                                           if isinstance(getattr(batch, f.name), torch.Tensor)})
            kwargs = _inference_tensors(kwargs)
            out = self._run(batch, kv_caches, kwargs)
        if self._dirty:
            self.cache.record()
            self._dirty = False
        return out

    def _run(self, batch: ForwardBatch, kv_caches: list[torch.Tensor], kwargs: dict[str, Any]) -> Any:
        if batch.is_decode_only:
            return self._run_decode(batch, kv_caches, kwargs)
        parts = self._split(batch, kwargs)
        if parts is not None:
            self._split_steps += 1
            outs = [(rows, self._run(part, kv_caches, {})) for rows, part in parts]
            return _merge_rows(outs, batch.num_tokens)
        batch = normalize_key_length(batch)
        self._mark_rows(batch, torch._dynamo.maybe_mark_dynamic)
        kind = "prefill" if batch.num_seqs == 1 else "mixed"
        return self._call(self._general, kind, self.options.freeze(None), batch, kv_caches, kwargs,
                          dynamic_ints=("max_seq_len", "max_query_len"))

    @staticmethod
    def _split(batch: ForwardBatch, kwargs: dict[str, Any]) -> list[tuple[torch.Tensor, ForwardBatch]] | None:
        """``(token rows, step)`` of the decodes and of the other sequences of a mixed step, when
        running them as two steps saves more than it costs; else None.

        A graph's attention pads every sequence's queries to the longest (48 decodes beside an
        1800-token prompt attend as 49 × 1800 queries); two steps read the weights twice instead.
        Steps carrying adapter inputs (``kwargs``, ``batch.extra``) are not split.
        """
        if kwargs or batch.extra:
            return None
        padding = batch.num_seqs * batch.max_query_len - batch.num_tokens
        if padding < SPLIT_MIN_PADDING or padding <= batch.num_tokens:
            return None
        return batch.split_decodes()

    def _run_decode(self, batch: ForwardBatch, kv_caches: list[torch.Tensor], kwargs: dict[str, Any]) -> Any:
        rows = batch.num_seqs
        if self.options.freeze(rows):
            batch = normalize_key_length(batch)
            self._mark_rows(batch, torch._dynamo.maybe_mark_dynamic)
            kind = "decode[1,frozen]" if rows == 1 else "decode[2+,frozen]"
            return self._call(self._frozen_decode, kind, True, batch, kv_caches, kwargs,
                              dynamic_ints=("max_seq_len",))
        bucket = bucket_for(rows, self.options.batch_buckets)
        padded = normalize_key_length(pad_decode_batch(batch, bucket))
        if bucket != rows:
            kwargs = pad_rows(kwargs, rows, bucket - rows)
            self._padded_rows += bucket - rows
        self._mark_rows(padded, torch._dynamo.mark_static)
        out = self._call(self._decode, f"decode[{bucket}]", False, padded, kv_caches, kwargs,
                         dynamic_ints=("max_seq_len",))
        return drop_padding(out, rows, bucket) if bucket != rows else out

    @staticmethod
    def _mark_rows(batch: ForwardBatch, mark: Any) -> None:
        """Mark the token and sequence dimensions with ``mark`` (static or dynamic); the block-table
        width is always dynamic."""
        for tensor in (batch.input_ids, batch.positions, batch.slot_mapping, batch.seq_lens,
                       batch.context_lens, batch.query_start_loc, batch.logits_indices, batch.block_tables):
            mark(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(batch.block_tables, 1)

    def _call(self, fn: Any, shape: str, freeze: bool, batch: ForwardBatch, kv_caches: list[torch.Tensor],
              kwargs: dict[str, Any], dynamic_ints: tuple[str, ...]) -> Any:
        self._shape, self._freeze = shape, freeze
        self._steps[shape] += 1
        limit = max(torch._dynamo.config.recompile_limit, _MIN_RECOMPILE_LIMIT, len(self.options.batch_buckets) + 8)
        # The batch's varying integers are symbols from the first graph on (not specialized, then
        # recompiled); no duck sizing: sizes equal once are not assumed equal forever. Freezing is
        # read while dynamo traces (weights become graph constants), so it is set for the call.
        sources = ",".join(f"L['batch'].{name}" for name in dynamic_ints)
        with self.cache.active(), torch._dynamo.config.patch(recompile_limit=limit), \
                torch.compiler.config.patch(dynamic_sources=sources), \
                torch.fx.experimental._config.patch(use_duck_shape=False), \
                torch._inductor.config.patch(freezing=freeze), onednn_in_compiled_graphs(not freeze):
            return fn(self.model, batch, kv_caches, kwargs)

    # -- compiling -----------------------------------------------------------------------------

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The torch.compile backend: inductor with this step's settings, counted."""
        from torch._dynamo.utils import counters
        from torch._inductor.compile_fx import compile_fx

        settings = self.options.inductor_settings(self._freeze)
        before = {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")}
        start = time.perf_counter()
        try:
            compiled = compile_fx(gm, example_inputs, config_patches=settings)
        except torch._dynamo.exc.TorchDynamoException:
            raise  # dynamo's own control flow (e.g. restart analysis), not a failure
        except Exception as e:
            # Entries from an earlier process that inductor could not use: start the namespace afresh, once.
            if not self.cache.had_entries or self._cleared:
                raise
            self._cleared = True
            self.cache.warn(f"compiling with the cache at {self.cache.path} failed ({type(e).__name__}: {e}); "
                            "cleared it and compiling again")
            self.cache.clear()
            compiled = compile_fx(gm, example_inputs, config_patches=settings)
        self._compile_seconds += time.perf_counter() - start
        delta = {k: counters["inductor"][f"fxgraph_cache_{k}"] - v for k, v in before.items()}
        self._fx_cache.update(delta)
        self._from_cache += delta["hit"] > 0
        self._compiles[self._shape] += 1
        self._dirty = True
        return compiled

    # -- statistics ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Compiles and recompiles by step shape, FX-graph-cache hits, padding, and the cache's state.

        ``graphs_from_cache`` were loaded from inductor's FX graph cache (``compile_cache_dir``),
        ``graphs_from_scratch`` were not. Step shapes are ``decode[rows]`` (a padded decode bucket),
        ``decode[2+,frozen]`` (frozen decode graph, any row count; ``decode[1,frozen]`` for one row),
        ``prefill`` (one sequence's new tokens) and ``mixed`` (several sequences, some with more than
        one new token). ``recompiles`` counts graphs compiled for a shape that already had one: zero
        when bucketing and dynamic shapes work as intended. ``split_steps`` counts mixed steps run as
        their decodes and their other sequences apart (their parts count under their own shapes).
        """
        return {
            "backend": "inductor",
            "mode": self.options.mode,
            "freezing": self.options.freezing,
            "batch_buckets": list(self.options.batch_buckets),
            "compiles": sum(self._compiles.values()),
            "graphs_from_cache": self._from_cache,
            "graphs_from_scratch": sum(self._compiles.values()) - self._from_cache,
            "recompiles": sum(n - 1 for n in self._compiles.values() if n > 1),
            "compiles_by_shape": dict(self._compiles),
            "steps_by_shape": dict(self._steps),
            "padded_rows": self._padded_rows,
            "split_steps": self._split_steps,
            "compile_seconds": round(self._compile_seconds, 3),
            "fx_graph_cache": {"hits": self._fx_cache["hit"], "misses": self._fx_cache["miss"],
                               "bypasses": self._fx_cache["bypass"]},
            "cache_dir": str(self.cache.path) if self.cache.path else None,
            "cache_files_removed": self.cache.removed_files,
            "cache_warnings": list(self.cache.warnings),
        }


def _merge_rows(parts: list[tuple[torch.Tensor, Any]], num_tokens: int) -> Any:
    """One step's per-token output (a tensor, or a dict of them) from its parts' ``(token rows, output)``."""
    first = parts[0][1]
    if isinstance(first, dict):
        return {key: _merge_rows([(rows, out[key]) for rows, out in parts], num_tokens) for key in first}
    merged = first.new_empty((num_tokens, *first.shape[1:]))
    for rows, out in parts:
        merged.index_copy_(0, rows, out)
    return merged


def _inference_tensors(value: Any) -> Any:
    """``value`` (a tensor, or a tuple/list/dict of them) with every tensor an inference tensor (copied if not)."""
    if isinstance(value, torch.Tensor):
        return value if value.is_inference() else value.clone()
    if type(value) in (tuple, list):
        return type(value)(_inference_tensors(v) for v in value)
    if type(value) is dict:
        return {k: _inference_tensors(v) for k, v in value.items()}
    return value
