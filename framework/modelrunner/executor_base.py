"""The executor interface: what the engine drives to run the model, whatever the number of processes.

Executors are a plugin kind (``registry.executors(Cls)``, chosen by ``distributed_executor_backend``);
the kernel's own are in :mod:`modelrunner.executor`. This module holds only the interface, so the
registry can name it without importing what runs models.
"""

from __future__ import annotations

import abc
import functools
from typing import Any

import torch

from .config import RunnerConfig
from .forward_batch import ForwardBatch, ForwardOutput
from .kv_cache.spec import KVCacheSpec
from .loaded_model import LoadedModel
from .scratch import ScratchSequences, no_engine_error


class Executor(abc.ABC):
    """The engine's interface to the model, whatever the number of processes.

    Each executor has a :class:`~modelrunner.runner.ModelRunner` for this process's shard
    (:attr:`runner`); what does not depend on the other ranks (tokenizer, block count, sizes) is
    read from it. ``forward(input_ids)`` and ``generate(input_ids)`` run on every rank through
    :meth:`execute_model` and the attached engine, as the runner's do.
    """

    runner: Any
    """This process's runner (rank 0's shard under parallelism)."""

    name: str = ""
    """The name it is registered and chosen by (``distributed_executor_backend``); a plugin sets it."""
    parallel: bool = False
    """Capability: runs ``tensor_parallel_size × pipeline_parallel_size`` > 1 (ranks in other processes)."""
    launched_externally: bool = False
    """Capability: its ranks are processes a launcher started (torchrun), not processes it starts itself."""

    _engine: Any = None

    @classmethod
    def create(cls, config: RunnerConfig, plugins: Any = None) -> Executor:
        """The executor for ``config``, not yet loaded (the kernel calls this; override it when building
        one takes more than ``cls(config, plugins)``: starting processes, joining a launcher's group).

        :raises ValueError: ``config`` asks for something this executor cannot run.
        """
        if config.parallel.world_size > 1 and not cls.parallel:
            raise ValueError(f"distributed_executor_backend {cls.name!r} runs one process; tensor_parallel_size × "
                             f"pipeline_parallel_size = {config.parallel.world_size} needs one that runs several")
        return cls(config, plugins)  # type: ignore[call-arg]

    @abc.abstractmethod
    def load_model(self) -> LoadedModel:
        """Load the model on every rank and allocate the KV caches (same block count everywhere). Idempotent."""

    @abc.abstractmethod
    def execute_model(self, batch: ForwardBatch) -> ForwardOutput:
        """Run one step on every rank; the last stage's float32 logits on the CPU."""

    @abc.abstractmethod
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks ``src → dst`` on every rank before the next step."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the other ranks, if any. Idempotent; also runs at exit."""

    def check_health(self) -> None:
        """Raise if the executor can no longer run steps (a worker process died); cheap, call it often.

        :raises WorkerFailedError: naming the rank and how it ended.
        """

    # -- read from this process's runner ------------------------------------------------------------

    @property
    def config(self) -> RunnerConfig:
        """The whole configuration."""
        return self.runner.config

    @property
    def plugins(self) -> Any:
        """The plugins this process routes through."""
        return self.runner.plugins

    @property
    def loaded(self) -> LoadedModel | None:
        """This process's loaded model (None before :meth:`load_model`)."""
        return self.runner.loaded

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks every rank holds."""
        return self.runner.num_blocks

    @property
    def block_size(self) -> int:
        """Token slots per KV-cache block."""
        return self.runner.block_size

    @property
    def max_model_len(self) -> int:
        """Longest sequence (prompt + output) served."""
        return self.runner.max_model_len

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (None for a checkpoint without one)."""
        return self.runner.tokenizer

    @property
    def kv_cache_spec(self) -> KVCacheSpec | None:
        """This rank's KV-cache layout (None: the model keeps its own cache)."""
        return self.runner.kv_cache_spec

    @property
    def kv_cache_bytes(self) -> int:
        """Bytes of this rank's KV-cache tensors."""
        return self.runner.kv_cache_bytes

    def process_inputs(self, prompt_text: str | None, token_ids: list[int],
                       extra: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        """A request as the model runs it (see :meth:`ModelRunner.process_inputs`)."""
        return self.runner.process_inputs(prompt_text, token_ids, extra)

    def stats(self) -> dict[str, Any]:
        """This process's runner statistics (``model``, ``compile``)."""
        return self.runner.stats()

    def add_lora(self, request: Any) -> None:
        """Read and check a LoRA adapter here; other ranks read it from the first step that uses it
        (:attr:`ForwardBatch.loras <modelrunner.forward_batch.ForwardBatch.loras>`)."""
        self.runner.add_lora(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter here (other ranks replace it when the id comes back with another path)."""
        return self.runner.remove_lora(lora_int_id)

    # -- forward and generate (the article's API) ---------------------------------------------------

    @functools.cached_property
    def scratch(self) -> ScratchSequences:
        """Runs :meth:`forward`'s scratch sequences through :meth:`execute_model` (made on first use, so
        that a subclass need not call this class's ``__init__``)."""
        return ScratchSequences(self)

    def forward(self, input_ids: torch.Tensor | list, return_router_logits: bool = False
                ) -> torch.Tensor | dict[str, Any]:
        """Logits for every position of ``input_ids`` (see :meth:`ModelRunner.forward
        <modelrunner.runner.ModelRunner.forward>`), computed on every rank."""
        return self.scratch.forward(input_ids, return_router_logits)

    def scratch_allocator(self) -> Any:
        """The block allocator scratch sequences use: the one an engine lent, else the executor's own."""
        return self.scratch.allocator()

    def lend_allocator(self, allocator: Any) -> None:
        """Use ``allocator`` (an engine's) for scratch sequences from now on; the engine owns it."""
        self.scratch.lend(allocator)

    def attach_engine(self, engine: Any) -> None:
        """Run :meth:`generate` through ``engine`` and scratch sequences through its allocator (an
        :class:`~modelrunner.engine.LLMEngine` calls this on the executor it runs)."""
        self._engine = engine
        self.lend_allocator(engine.allocator)

    def engine(self) -> Any:
        """The :class:`~modelrunner.engine.LLMEngine` that runs this executor.

        :raises ModelRunnerError: none does yet (build one: ``LLMEngine(executor)``).
        """
        if self._engine is None:
            raise no_engine_error(self)
        return self._engine

    def generate(self, input_ids: torch.Tensor | list, max_new_tokens: int = 16,
                 **sampling: Any) -> torch.Tensor | list[torch.Tensor]:
        """Generate up to ``max_new_tokens`` after ``input_ids`` on the :meth:`engine` (see
        :meth:`ModelRunner.generate <modelrunner.runner.ModelRunner.generate>`)."""
        return self.scratch.generate(self.engine, input_ids, max_new_tokens, **sampling)

    def _require_loaded(self) -> LoadedModel:
        return self.runner._require_loaded()


__all__ = ["Executor"]
