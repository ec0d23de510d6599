"""The kernel's executor and how one is chosen: what the engine drives — load the model, run a step,
copy KV blocks, shut down.

:func:`create_executor` builds the registered executor :func:`executor_name` picks. The kernel's own
is :class:`UniprocExecutor` (one process, one :class:`~modelrunner.runner.ModelRunner`), the choice when
``tensor_parallel_size × pipeline_parallel_size`` is 1. Larger groups run on an executor plugin:
``mp`` (worker processes this process starts) and ``torchrun`` (the processes torchrun started) come
with the ``modelrunner-executor-mp`` distribution, ``ray`` with ``modelrunner-executor-ray``.
"""

from __future__ import annotations

from typing import Any

from .config import RunnerConfig
from .distributed import LaunchInfo
from .errors import FatalError
from .executor_base import Executor
from .forward_batch import ForwardBatch, ForwardOutput
from .loaded_model import LoadedModel
from .plugins import Plugins, get_plugins
from .runner import ModelRunner


class WorkerFailedError(FatalError):
    """A rank of the parallel group died, raised or hung; the group has been shut down.

    :param rank: the rank at fault (None when it cannot be told, e.g. a torchrun peer that vanished).
    :param phase: what the group was doing (``"loading the model"``, ``"running a step"``).
    """

    def __init__(self, message: str, rank: int | None = None, phase: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        """The rank at fault, when known."""
        self.phase = phase
        """What the group was doing."""


class UniprocExecutor(Executor):
    """Everything in this process: a :class:`ModelRunner` driven directly.

    :param runner: the runner (not yet loaded), or build one from ``config``.
    """

    name = "uni"

    def __init__(self, config: RunnerConfig | dict[str, Any] | None = None, plugins: Plugins | None = None,
                 runner: ModelRunner | None = None) -> None:
        if runner is None:
            if config is None:
                raise ValueError("UniprocExecutor needs a config or a runner")
            runner = ModelRunner(config, plugins=plugins)
        self.runner = runner

    def load_model(self) -> LoadedModel:
        """Load the runner's model and allocate its KV cache."""
        return self.runner.load_model()

    def attach_engine(self, engine: Any) -> None:
        """Also attach ``engine`` to the runner, so that the runner's own ``generate`` and ``forward``
        share the engine's KV blocks rather than making an allocator of their own over the same cache."""
        super().attach_engine(engine)
        self.runner.attach_engine(engine)

    def execute_model(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one step in this process."""
        return self.runner.execute_model(batch)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks in this process."""
        self.runner.copy_blocks(copies)

    def shutdown(self) -> None:
        """Nothing to stop."""


VLLM_EXECUTOR_NAMES = {"external_launcher": "torchrun"}
"""vLLM's ``distributed_executor_backend`` values that are another executor's name here."""


def executor_name(config: RunnerConfig) -> str:
    """The executor ``config`` runs on: ``distributed_executor_backend`` (vLLM's names mapped), else
    ``uni`` for one process, ``torchrun`` inside processes torchrun started, ``mp`` otherwise."""
    chosen = config.parallel.distributed_executor_backend
    if chosen is not None:
        return VLLM_EXECUTOR_NAMES.get(chosen, chosen)
    if config.parallel.world_size == 1:
        return "uni"
    return "torchrun" if LaunchInfo.from_env() is not None else "mp"


def create_executor(config: RunnerConfig | dict[str, Any], plugins: Plugins | None = None) -> Executor:
    """The executor for ``config``, not yet loaded (call ``load_model()``): the registered executor
    :func:`executor_name` picks (see ``modelrunner plugins``), built by its :meth:`Executor.create`.

    The kernel's is ``uni`` (:class:`UniprocExecutor`); ``mp`` and ``torchrun`` come with
    ``modelrunner-executor-mp`` (under torchrun, on ranks other than 0 this call loads that rank's shard,
    serves steps until rank 0 shuts down, and then exits the process).

    :raises UnknownNameError: no executor of that name is registered (the message lists those that are, and
        which distribution to install for ``mp``, ``torchrun`` or ``ray``).
    :raises ValueError: the executor cannot run ``config`` (e.g. ``uni`` with tensor_parallel_size 2), or
        torchrun started a different number of processes than the sizes multiply to.
    """

    config = RunnerConfig.from_dict(config) if isinstance(config, dict) else config
    registry = plugins if plugins is not None else get_plugins()
    cls = registry.executor_class(executor_name(config))
    return cls.create(config, plugins)
