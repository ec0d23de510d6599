"""The ``eager`` compile backend: run the model as it is, with its linear weights prepacked.

Nothing is traced or compiled. On CPU with float32 weights the backend attaches a oneDNN-packed
copy to every weight the model's layers declare in ``DENSE_WEIGHTS`` (see
:func:`modelrunner.layers.dense.prepack_weights`): faster matmuls at decode batch sizes,
for one extra copy of those weights' memory. Turn it off with the backend option
``compile_options={"prepack_weights": False}``.
"""

from __future__ import annotations

from typing import Any, Callable

from ..hookspecs import hookimpl
from ..layers.dense import prepack_weights

PREPACK_OPTION = "prepack_weights"
"""The ``compile_options`` key that turns weight prepacking on (default) or off."""


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
        """``{"backend": "eager", "prepacked_weight_bytes": ...}`` for ``ModelRunner.stats()["compile"]``."""
        return {"backend": "eager", "prepacked_weight_bytes": self.prepacked_bytes}


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``eager`` backend."""
    registry.compile_backends("eager")


def eager_model(loaded: Any, options: dict[str, Any] | None = None) -> EagerModel:
    """The eager backend's callable for ``loaded``: its model, with float32 CPU linear weights prepacked
    unless ``options["prepack_weights"]`` is False. A compile backend that only wraps the model (to
    count, trace or time calls) builds on this to keep the prepacked weights.

    :raises ValueError: ``prepack_weights`` is not a bool.
    """
    options = options or {}
    prepack = options.get(PREPACK_OPTION, True)
    if not isinstance(prepack, bool):
        raise ValueError(f"compile option {PREPACK_OPTION!r} must be true or false, got {prepack!r}")
    model = loaded.model
    return EagerModel(model, prepack_weights(model) if prepack and hasattr(model, "modules") else 0)


@hookimpl
def compile(loaded: Any, config: Any) -> Callable[..., Any]:
    """:func:`eager_model` with the config's ``compile_options``."""
    return eager_model(loaded, getattr(config, "options", None))
