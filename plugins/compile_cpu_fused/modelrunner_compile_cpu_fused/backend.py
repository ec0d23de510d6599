"""What the ``cpu_fused`` backend does to a loaded model, and the callable it returns.

In order: the float32 linear weights (and bfloat16 ones where oneDNN computes bfloat16) get the
matmul path timed fastest on this machine, prepacked for oneDNN where that wins
(:func:`modelrunner.layers.dense.prepack_weights`); the kernel's layers
get fused forwards (:mod:`.fused_ops`); a kernel decoder replays decode steps from recorded graphs
(:mod:`.decode_graphs`); every module's calls skip ``nn.Module.__call__`` while unhooked
(:mod:`.unhooked`). Each step has a ``compile_options`` switch, on by default, so one can be
measured against the model without it.
"""

from __future__ import annotations

from typing import Any

from modelrunner.api import DENSE_PATHS as PATHS, plan_summary, prepack_weights

from .decode_graphs import bind_decode_graphs
from .fused_ops import bind_fused_ops
from .unhooked import skip_call_machinery

SWITCHES = ("prepack_weights", "fused_ops", "decode_graphs", "unhooked_calls")
"""The ``compile_options`` that turn one rewrite on (default) or off."""
PATH_OPTION = "dense_path"
"""The ``compile_options`` key that picks the dense matmul path: ``auto`` (timed per shape,
default), ``mkl``, ``onednn`` or ``onednn_packed`` (every weight)."""


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the defaults filled in.

    :raises ValueError: an unknown option, a switch that is not a bool, or a ``dense_path`` not a path.
    """
    known = (*SWITCHES, PATH_OPTION)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"the cpu_fused backend has no option {unknown[0]!r} (options: {', '.join(known)})")
    out: dict[str, Any] = {name: True for name in SWITCHES} | {PATH_OPTION: "auto"} | dict(options)
    for name in SWITCHES:
        if not isinstance(out[name], bool):
            raise ValueError(f"compile option {name!r} must be true or false, got {out[name]!r}")
    if out[PATH_OPTION] != "auto" and out[PATH_OPTION] not in PATHS:
        raise ValueError(f"compile option {PATH_OPTION!r} must be 'auto' or one of {', '.join(PATHS)}, "
                         f"got {out[PATH_OPTION]!r}")
    return out


class FusedModel:
    """The rewritten model, called as is; ``stats()`` reports what the backend did to it.

    :param model: the loaded (and parallelized) model, rewritten in place.
    :param options: the checked ``compile_options`` (see :func:`check_options`).
    """

    def __init__(self, model: Any, options: dict[str, Any]) -> None:
        self.model = model
        """The model the forward hook runs."""
        modules = hasattr(model, "modules")
        self.prepacked_bytes = (prepack_weights(model, path=options[PATH_OPTION])
                                if options["prepack_weights"] and modules else 0)
        """Bytes of weights packed for oneDNN (the extra memory the packed copies take)."""
        self.fused = bind_fused_ops(model) if options["fused_ops"] and modules else {}
        """Layer kind → instances given a fused forward."""
        self.graphs = bind_decode_graphs(model) if options["decode_graphs"] else None
        """The recorded decode graphs (None: decode steps run the layers)."""
        self.unhooked = skip_call_machinery(model) if options["unhooked_calls"] and modules else 0
        """Modules whose calls skip ``nn.Module.__call__`` while unhooked."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def stats(self) -> dict[str, Any]:
        """``{"backend": "cpu_fused", "prepacked_weight_bytes", "dense": {"paths", "released_plain_bytes"},
        "fused": {layer kind: count}, "unhooked_modules", "decode_graphs": {...}}`` for
        ``ModelRunner.stats()["compile"]`` (``decode_graphs`` only where they are on)."""
        out: dict[str, Any] = {"backend": "cpu_fused", "prepacked_weight_bytes": self.prepacked_bytes,
                               "fused": dict(self.fused), "unhooked_modules": self.unhooked}
        if hasattr(self.model, "modules"):
            out["dense"] = plan_summary(self.model)
        if self.graphs is not None:
            out["decode_graphs"] = self.graphs.stats()
        return out


__all__ = ["PATH_OPTION", "SWITCHES", "FusedModel", "check_options"]
