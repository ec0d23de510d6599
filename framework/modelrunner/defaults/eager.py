"""The ``eager`` compile backend: run the model as it is, with its linear weights prepacked.

Nothing is traced or compiled. On CPU with float32 weights the backend times the matmul paths
(MKL, oneDNN, oneDNN on a prepacked weight) for each weight shape the model's layers declare in
``DENSE_WEIGHTS`` and keeps the fastest (see :func:`modelrunner.layers.dense.prepack_weights`); a
weight whose packed path wins is kept only packed. Options: ``prepack_weights`` (default true;
false leaves every weight as loaded), ``dense_path`` (``auto``, or one path for every weight),
``decode_graphs`` (default true: a model that offers ``enable_decode_graphs()``, as the kernel's
decoder does, replays decode steps from recorded graphs, see :mod:`modelrunner.models.decode_graphs`).
"""

from __future__ import annotations

from typing import Any, Callable

from ..hookspecs import hookimpl
from ..layers.dense import PATHS, plan_summary, prepack_weights

PREPACK_OPTION = "prepack_weights"
"""The ``compile_options`` key that turns weight planning and prepacking on (default) or off."""
PATH_OPTION = "dense_path"
"""The ``compile_options`` key that picks the float32 matmul path: ``auto`` (timed per shape,
default), ``mkl``, ``onednn`` or ``onednn_packed`` (every weight)."""
GRAPHS_OPTION = "decode_graphs"
"""The ``compile_options`` key that turns recorded decode graphs on (default) or off."""


class EagerModel:
    """The model itself, called as is; ``stats()`` reports what the backend did to it.

    :param model: the loaded (and parallelized) model.
    :param prepacked_bytes: bytes of the weights that got a packed copy (0: none).
    """

    def __init__(self, model: Any, prepacked_bytes: int) -> None:
        self.model = model
        """The model the forward hook runs."""
        self.prepacked_bytes = prepacked_bytes
        """Bytes of weights packed for oneDNN (the extra memory the packed copies take)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def stats(self) -> dict[str, Any]:
        """``{"backend": "eager", "prepacked_weight_bytes": ..., "dense": {"paths": {shape: "decode / batch"},
        "released_plain_bytes": ...}}`` for ``ModelRunner.stats()["compile"]``."""
        out: dict[str, Any] = {"backend": "eager", "prepacked_weight_bytes": self.prepacked_bytes}
        if hasattr(self.model, "modules"):
            out["dense"] = plan_summary(self.model)
        graphs = getattr(self.model, "decode_graphs", None)  # None: decode steps run eagerly
        if graphs is not None:
            out["decode_graphs"] = graphs.stats()
        return out


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``eager`` backend."""
    registry.compile_backends("eager", devices=("cpu", "cuda"), tensor_parallel=True, pipeline_parallel=True)


def eager_model(loaded: Any, options: dict[str, Any] | None = None) -> EagerModel:
    """The eager backend's callable for ``loaded``: its model, with float32 CPU linear weights prepacked
    unless ``options["prepack_weights"]`` is False. A compile backend that only wraps the model (to
    count, trace or time calls) builds on this to keep the prepacked weights.

    :raises ValueError: ``prepack_weights`` or ``decode_graphs`` is not a bool, or ``dense_path`` not a path.
    """
    options = options or {}
    unknown = sorted(set(options) - {PREPACK_OPTION, PATH_OPTION, GRAPHS_OPTION})
    if unknown:
        raise ValueError(f"the eager backend has no option {unknown[0]!r} (options: {PREPACK_OPTION}, "
                         f"{PATH_OPTION}, {GRAPHS_OPTION})")
    for name in (PREPACK_OPTION, GRAPHS_OPTION):
        if not isinstance(options.get(name, True), bool):
            raise ValueError(f"compile option {name!r} must be true or false, got {options[name]!r}")
    prepack = options.get(PREPACK_OPTION, True)
    path = options.get(PATH_OPTION, "auto")
    if path != "auto" and path not in PATHS:
        raise ValueError(f"compile option {PATH_OPTION!r} must be 'auto' or one of {', '.join(PATHS)}, got {path!r}")
    model = loaded.model
    packed = prepack_weights(model, path=path) if prepack and hasattr(model, "modules") else 0
    if options.get(GRAPHS_OPTION, True) and callable(getattr(model, "enable_decode_graphs", None)):
        model.enable_decode_graphs()
    elif getattr(model, "decode_graphs", None) is not None:
        model.decode_graphs = None  # turned on by an earlier call: off means off
    return EagerModel(model, packed)


@hookimpl
def compile(loaded: Any, config: Any) -> Callable[..., Any]:
    """:func:`eager_model` with the config's ``compile_options``."""
    return eager_model(loaded, getattr(config, "options", None))
