"""The logits processors of one engine: which a request uses, and applying them once per step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..errors import UnknownNameError
from ..layers.cpu_ops import broken_rows
from .builtin import BUILTIN_FIELDS
from .logits_processor import LogitsProcessor, LogitsRow, ProcessorContext
from .params import SamplingParams


class ProcessorFailed(Exception):
    """A logits processor raised, or returned logits of the wrong shape or dtype, or NaN / +inf.

    :param processor: its name; ``rows``: the batch rows it was applied to.
    """

    def __init__(self, processor: str, rows: list[int], message: str) -> None:
        super().__init__(f"logits processor {processor!r} failed: {message}")
        self.processor = processor
        self.rows = rows


class ProcessorPipeline:
    """The built-in processors plus any a request names, instantiated once per engine.

    :param plugins: where named processors are looked up (``registry.logits_processors``).
    :param context: vocabulary size, tokenizer and EOS ids given to each processor.
    """

    def __init__(self, plugins: Any, context: ProcessorContext) -> None:
        self.plugins = plugins
        self.context = context
        """What every processor knows of the model."""
        self._instances: dict[str, LogitsProcessor] = {}
        self.builtins: list[LogitsProcessor] = []
        """The processors that apply from SamplingParams fields, in order."""
        for name in plugins.registry.names("logits_processors"):
            cls = plugins.logits_processor_class(name)
            if cls.builtin:
                self.builtins.append(self._instance(name))
        self.builtins.sort(key=lambda p: (p.order, p.name))
        self.fields = {f for p in self.builtins for f in getattr(p, "fields", ())}
        """The SamplingParams fields the loaded built-ins implement."""

    def _instance(self, name: str) -> LogitsProcessor:
        if name not in self._instances:
            self._instances[name] = self.plugins.logits_processor_class(name)(self.context)
        return self._instances[name]

    def states_for(self, params: SamplingParams) -> dict[str, Any]:
        """Processor name → state, for every processor ``params`` uses (in the order they run).

        :raises ValueError: a field no loaded built-in implements is set, a named processor is
            unknown or a built-in, or a processor rejects the request.
        """
        defaults = SamplingParams()
        for field in BUILTIN_FIELDS - self.fields:
            if getattr(params, field) != getattr(defaults, field):
                raise ValueError(f"{field} is set but no loaded logits processor implements it (the kernel's "
                                 "default-sampling plugin is blocked?)")
        found: list[tuple[LogitsProcessor, Any]] = []
        for processor in self.builtins:
            state = processor.request_state(params, {})
            if state is not None:
                found.append((processor, state))
        for spec in params.logits_processors:
            if callable(spec):
                continue  # run by the built-in "callables" processor
            name, args = spec
            try:
                processor = self._instance(name)
            except UnknownNameError as e:
                raise ValueError(f"logits_processors: {e}") from None
            if processor.builtin:
                raise ValueError(f"logits_processors: {name!r} is built in; set its SamplingParams field instead")
            state = processor.request_state(params, dict(args))
            if state is not None:
                found.append((processor, state))
        found.sort(key=lambda ps: (ps[0].order, ps[0].name))
        return {p.name: state for p, state in found}

    def apply(self, logits: torch.Tensor, rows: Sequence[Any]) -> torch.Tensor:
        """Apply every processor the rows' requests use, each once over all its rows; edits ``logits``.

        :param rows: per logits row, its :class:`~modelrunner.engine.sequence.Sequence`.
        :raises ProcessorFailed: naming the processor and the rows it ran on.
        """
        users: dict[str, list[int]] = {}
        for r, seq in enumerate(rows):
            for name in seq.request.processor_states:
                users.setdefault(name, []).append(r)
        order = sorted(users, key=lambda n: (self._instances[n].order, n))
        for name in order:
            processor, mine = self._instances[name], users[name]
            infos = [LogitsRow(state=rows[r].request.processor_states[name], params=rows[r].params,
                               prompt_token_ids=rows[r].token_ids[:rows[r].prompt_len],
                               output_token_ids=rows[r].token_ids[rows[r].prompt_len:]) for r in mine]
            whole = len(mine) == logits.shape[0]
            index = None if whole else torch.tensor(mine, dtype=torch.long)
            part = logits if whole else logits.index_select(0, index)
            try:
                out = processor.apply(part, infos)
            except Exception as e:  # noqa: BLE001 - reported against the requests that use it
                raise ProcessorFailed(name, mine, f"{type(e).__name__}: {e}") from e
            problem = logits_problem(out, tuple(part.shape), part.dtype)
            if problem is not None:
                raise ProcessorFailed(name, mine, f"returned {problem}")
            bad = unsampleable_values(out)
            if bad is not None:
                row, what = bad
                raise ProcessorFailed(name, [mine[row]], f"returned {what} for request "
                                                         f"{rows[mine[row]].request.request_id!r}")
            if whole:
                logits = out if out is logits else logits.copy_(out)
            else:
                logits.index_copy_(0, index, out.to(logits.dtype))
        return logits


def logits_problem(logits: Any, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> str | None:
    """What is wrong with ``logits`` for a batch that expects ``shape`` (and ``dtype``; None: any
    floating-point dtype), as the end of a sentence (``"shape (2, 63), expected (2, 64)"``), or None.
    """
    if not isinstance(logits, torch.Tensor):
        return f"a {type(logits).__name__}, expected a tensor of shape {shape}"
    if tuple(logits.shape) != shape:
        return f"logits of shape {tuple(logits.shape)}, expected {shape} (rows, vocabulary size)"
    if dtype is not None and logits.dtype != dtype:
        return f"{str(logits.dtype).removeprefix('torch.')} logits, expected {str(dtype).removeprefix('torch.')}"
    if dtype is None and not logits.is_floating_point():
        return f"{str(logits.dtype).removeprefix('torch.')} logits, expected a floating-point dtype"
    return None


def unsampleable_values(logits: torch.Tensor) -> tuple[int, str] | None:
    """The first row of ``[rows, vocab]`` logits holding NaN or +inf (which make sampling pick an
    arbitrary token) and a description of what it holds, or None. One pass over the logits when
    they are fine; all -inf rows are left to the caller (they mean "everything is masked")."""
    broken = broken_rows(logits)
    if not bool(broken.any()):
        return None
    broken &= ~torch.isneginf(logits).all(1)
    if not bool(broken.any()):
        return None
    row = int(broken.nonzero()[0])
    nan, posinf = int(torch.isnan(logits[row]).sum()), int(torch.isposinf(logits[row]).sum())
    what = " and ".join(part for part in (f"NaN in {nan}" if nan else "", f"+inf in {posinf}" if posinf else "")
                        if part)
    return row, f"{what} of {logits.shape[1]} logits"
