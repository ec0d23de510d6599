"""The ``eager`` compile backend: run the model as it was built, plain torch modules called the
ordinary way.

Nothing is traced, compiled, timed, prepacked or rebound: a quantized linear layer still computes
through its quantization scheme (the method's registered kernel), everything else is torch's own
ops. It is what ``compile=False`` / ``enforce_eager=True`` run, the reference every other backend
is checked against, and the default where no backend is preferred for the device (see
:meth:`modelrunner.config.CompileConfig.backend_for`). It takes no ``compile_options``.
"""

from __future__ import annotations

from typing import Any, Callable

from ..hookspecs import hookimpl


class EagerModel:
    """The model itself, called as is.

    :param model: the loaded (and parallelized) model.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        """The model the forward hook runs."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def stats(self) -> dict[str, Any]:
        """``{"backend": "eager"}`` for ``ModelRunner.stats()["compile"]``."""
        return {"backend": "eager"}


@hookimpl
def register(registry: Any) -> None:
    """Declare the ``eager`` backend."""
    registry.compile_backends("eager", devices=("cpu", "cuda"), tensor_parallel=True, pipeline_parallel=True)


def eager_model(loaded: Any, options: dict[str, Any] | None = None) -> EagerModel:
    """The eager backend's callable for ``loaded``: its model, untouched. A compile backend that only
    wraps the model (to count, trace or time calls) builds on this.

    :raises ValueError: ``options`` is not empty (the eager backend has none).
    """
    if options:
        raise ValueError(f"the eager backend has no option {sorted(options)[0]!r} (it takes no compile_options)")
    return EagerModel(loaded.model)


@hookimpl
def compile(loaded: Any, config: Any) -> Callable[..., Any]:
    """:func:`eager_model` with the config's ``compile_options``."""
    return eager_model(loaded, getattr(config, "options", None))
