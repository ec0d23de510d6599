"""One forward over a step's scheduled sequences, with each request run alone when the batch fails.

A step is atomic for every request in it: if the batched forward raises, each request runs alone once,
so that only the one(s) that fail again are finished with ``finish_reason="error"`` (their KV slots
are rewritten identically by the retry, so the others are unaffected).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ..errors import FatalError
from .batch_builder import LogitsRowOwner, build_forward_batch
from .pooling import EnginePooler
from .scheduler import ScheduledSequence, SchedulerOutput
from .sequence import Request

logger = logging.getLogger(__name__)


class BatchForward:
    """Runs the model over a step's batch (:meth:`run`).

    :param executor: what runs the model.
    :param allocator: the KV block allocator (block tables, prefix-cache bookkeeping).
    :param pooler: embedding requests: the rows each step keeps.
    """

    def __init__(self, executor: Any, allocator: Any, pooler: EnginePooler) -> None:
        self.executor = executor
        """What runs the model."""
        self.allocator = allocator
        """The KV block allocator."""
        self.pooler = pooler
        """Embedding requests' pooling."""

    def run(self, out: SchedulerOutput, fail: Callable[[Request, str], None]
            ) -> tuple[torch.Tensor, list[LogitsRowOwner], list[ScheduledSequence]] | None:
        """One forward over the whole batch; if it raises, each request alone, ``fail`` called for each
        that fails again. The failed step's blocks leave the prefix cache first: a later prompt must
        not reuse KV that was never written. A request that hit, in this step, blocks of one that then
        fails alone computes those blocks itself.

        :returns: logits, who owns each logits row, and the scheduled sequences that ran; None when none did.
        :raises FatalError: the executor cannot go on (no retry).
        """
        scheduled = out.scheduled
        try:
            return (*self.forward(scheduled, out.finished_seq_ids), scheduled)
        except FatalError:
            raise
        except Exception as exc:  # noqa: BLE001 - isolated below, reported per request
            logger.warning("step of %d requests failed (%s: %s); running each alone", len(scheduled),
                           type(exc).__name__, exc)
        # The step's new KV was not (fully) written: its blocks must not serve prefix-cache hits.
        for item in scheduled:
            self.allocator.forget_uncomputed(item.seq.seq_id, item.start)
        requests = list(dict.fromkeys(item.seq.request for item in scheduled))
        kept: list[ScheduledSequence] = []
        parts: list[torch.Tensor] = []
        unwritten: set[int] = set()  # blocks whose new KV a failed request never wrote
        for request in requests:
            mine = [self._recompute_unwritten(item, unwritten) for item in scheduled if item.seq.request is request]
            try:
                logits, _ = self.forward(mine, out.finished_seq_ids)
            except FatalError:
                raise
            except Exception as exc:  # noqa: BLE001
                for item in mine:  # before fail frees them
                    unwritten.update(self._blocks_written_by(item))
                fail(request, f"model forward failed: {type(exc).__name__}: {exc}")
                continue
            kept += mine
            parts.append(logits)
        if not kept:
            return None
        return torch.cat(parts), build_forward_batch(kept, self.allocator)[1], kept

    def forward(self, scheduled: list[ScheduledSequence],
                finished_seq_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[LogitsRowOwner]]:
        """One forward over ``scheduled``: its logits and who owns each row; the final hidden states the
        step's pooling requests keep are stored with them.

        :raises ValueError: the adapter returned no hidden states for pooling requests.
        """
        batch, owners = build_forward_batch(scheduled, self.allocator, finished_seq_ids)
        batch, pooled = self.pooler.ask(batch, scheduled)
        out = self.executor.execute_model(batch)
        self.pooler.collect(out, pooled, self.executor.loaded.adapter)
        return out.logits, owners

    def _blocks_written_by(self, item: ScheduledSequence) -> list[int]:
        """The cache blocks holding the tokens ``item`` computes."""
        size = self.allocator.block_size
        table = self.allocator.block_table(item.seq.seq_id)
        return table[item.start // size:-(-(item.start + item.num_new_tokens) // size)]

    def _recompute_unwritten(self, item: ScheduledSequence, unwritten: set[int]) -> ScheduledSequence:
        """``item``, starting earlier if its cached prefix includes a block in ``unwritten``: a
        prefix-cache hit, in this step, on blocks of a request that then failed alone. Recomputing
        from that block writes the same keys/values the failed request would have (same tokens,
        same positions) instead of reading slots nobody wrote."""
        if not unwritten:
            return item
        size = self.allocator.block_size
        table = self.allocator.block_table(item.seq.seq_id)
        for index in range(-(-item.start // size)):
            if table[index] in unwritten:
                start = index * size
                return ScheduledSequence(item.seq, start, item.num_new_tokens + item.start - start)
        return item


__all__ = ["BatchForward"]
