"""The inductor backend's settings: ``compile_mode`` and ``compile_options``, validated up front."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from modelrunner.api import did_you_mean

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
"""Decode batch sizes compiled for; a step is padded up to the next one (at most 1.5× the rows above 4)."""

FREEZING_CHOICES = ("auto", True, False)
"""Accepted values of the ``freezing`` option."""

DEFAULT_FREEZE_MIN_BATCH = 8
"""With ``freezing="auto"``, decode steps of at least this many rows are frozen (see :class:`InductorOptions`)."""


def torch_compile_modes() -> dict[str, dict[str, Any]]:
    """torch.compile's modes (``default``, ``reduce-overhead``, ``max-autotune``, ...) → their inductor settings."""
    import torch._inductor

    return torch._inductor.list_mode_options()


@attrs.frozen
class InductorOptions:
    """How the ``inductor`` backend compiles; built from a :class:`~modelrunner.CompileConfig` by :meth:`from_config`.

    ``compile_options`` keys: ``freezing``, ``freeze_min_batch``, ``batch_buckets``, ``inductor``.
    """

    mode: str = "default"
    """torch.compile's mode; its inductor settings apply to every graph."""
    freezing: str | bool = "auto"
    """Constant-fold the weights into the graph and prepack them for MKL/oneDNN (inductor's freezing).
    Sound because the runner never changes weights after loading and runs under inference mode. It
    speeds up the matmuls, but torch cannot store graphs with prepacked weights in its FX graph
    cache, so a frozen graph is lowered again in every process. ``"auto"`` freezes decode steps of
    at least ``freeze_min_batch`` rows (one graph for all such row counts) and keeps the rest
    cacheable; True freezes every graph, False none."""
    freeze_min_batch: int = DEFAULT_FREEZE_MIN_BATCH
    """Fewest rows of a decode step frozen when ``freezing="auto"``."""
    batch_buckets: tuple[int, ...] = DEFAULT_BATCH_BUCKETS
    """Decode batch sizes (strictly increasing) of the unfrozen decode graphs; a decode step runs at
    the smallest bucket that holds it. Larger steps run at their own size (each compiles once)."""
    inductor: dict[str, Any] = attrs.field(factory=dict)
    """Extra ``torch._inductor.config`` settings (e.g. ``{"cpp.simdlen": 256}``), applied to every graph."""

    @classmethod
    def from_config(cls, mode: str, options: Mapping[str, Any]) -> InductorOptions:
        """Validate ``compile_mode`` and ``compile_options``.

        :raises ValueError: naming the bad key or value and what is accepted.
        """
        modes = torch_compile_modes()
        if mode not in modes:
            raise ValueError(f"compile_mode {mode!r} is not a torch.compile mode; choose one of {', '.join(modes)}")
        known = [f.name for f in attrs.fields(cls) if f.name != "mode"]
        for key in options:
            if key not in known:
                hint = did_you_mean(key, known)
                raise ValueError(f"unknown inductor compile option {key!r}{hint} (known: {', '.join(known)})")
        freezing = options.get("freezing", "auto")
        if freezing not in FREEZING_CHOICES or isinstance(freezing, int) and not isinstance(freezing, bool):
            raise ValueError(f"compile option freezing must be 'auto', True or False; got {freezing!r}")
        freeze_min_batch = options.get("freeze_min_batch", DEFAULT_FREEZE_MIN_BATCH)
        if isinstance(freeze_min_batch, bool) or not isinstance(freeze_min_batch, int) or freeze_min_batch < 1:
            raise ValueError(f"compile option freeze_min_batch must be a positive integer; got {freeze_min_batch!r}")
        buckets = _buckets(options.get("batch_buckets", DEFAULT_BATCH_BUCKETS))
        inductor = check_inductor_config(options.get("inductor", {}))
        return cls(mode=mode, freezing=freezing, freeze_min_batch=freeze_min_batch, batch_buckets=buckets,
                   inductor=inductor)

    def freeze(self, decode_rows: int | None) -> bool:
        """Whether a step is frozen: a decode step of ``decode_rows`` rows, or (None) any other step."""
        if self.freezing == "auto":
            return decode_rows is not None and decode_rows >= self.freeze_min_batch
        return bool(self.freezing)

    def inductor_settings(self, freeze: bool) -> dict[str, Any]:
        """The ``torch._inductor.config`` patch for one graph: the mode's settings, ``inductor``, freezing."""
        return {**torch_compile_modes()[self.mode], **self.inductor, "freezing": freeze}

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (for statistics and the cache key)."""
        return attrs.asdict(self)


def _buckets(value: Any) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"compile option batch_buckets must be a non-empty list of positive integers; got {value!r}")
    for size in value:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"compile option batch_buckets must hold positive integers; got {size!r} in {value!r}")
    if list(value) != sorted(set(value)):
        raise ValueError(f"compile option batch_buckets must be strictly increasing; got {list(value)!r}")
    return tuple(value)


def check_inductor_config(value: Any) -> dict[str, Any]:
    """``value`` checked as a dict of ``torch._inductor.config`` settings (the ``inductor`` compile option).

    :raises ValueError: naming a setting inductor does not have.
    """
    import torch._inductor.config as inductor_config

    if not isinstance(value, Mapping):
        raise ValueError(f"compile option inductor must be a dict of torch._inductor.config settings; got {value!r}")
    known = set(inductor_config.get_config_copy())
    for key in value:
        if key == "freezing":
            raise ValueError("set freezing through the compile option 'freezing', not through 'inductor'")
        if key not in known:
            hint = did_you_mean(key, known, n=3)
            raise ValueError(f"compile option inductor has {key!r}, which is not a torch._inductor.config "
                             f"setting{hint}")
    return dict(value)
