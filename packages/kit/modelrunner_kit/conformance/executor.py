"""The executor suite: what the engine relies on when it hands an executor a configuration.

Chosen by name (``distributed_executor_backend``), the executor builds itself for the configuration
(:meth:`~modelrunner.api.Executor.create`) — with two ranks when it declares ``parallel`` — and
the engine on top of it generates exactly the greedy tokens of one plain process, in one batch of
several requests; ``stats()`` and ``check_health()`` answer; ``shutdown()`` may be called twice; an
executor that runs one process refuses a configuration of two ranks with a ``ValueError`` naming
itself. An executor whose ranks a launcher starts (``launched_externally``) is checked only inside
such a launch (e.g. ``torchrun --nproc-per-node 2 -m pytest``).
"""

from __future__ import annotations

import tempfile
from typing import Any

from .base import Check, NotApplicable, Suite, expect

PROMPTS = [[1, 5, 9, 13], [1, 7, 3], [1, 11, 22, 33, 44, 55]]
"""Token-id prompts of different lengths, generated in one batch."""
MAX_TOKENS = 5
"""Greedy tokens generated per prompt."""
CONFIG = dict(dtype="float32", compile=False, kv_cache_memory=8 << 20, max_model_len=64)
"""The tiny LLM's configuration (the same for the reference)."""


class ExecutorSuite(Suite):
    """Checks one executor by running a tiny checkpoint through it."""

    kind = "executors"

    def __init__(self, name: str, plugins: Any = None, plugin: str | None = None) -> None:
        super().__init__(name, plugins=plugins, plugin=plugin)
        self._state: dict[str, Any] = {}

    def executor_class(self) -> type:
        """The class under test."""
        return self.plugins.registry.get_class(self.kind, self.name, self.provider())

    def _checkpoint(self) -> str:
        if "dir" not in self._state:
            from .models import tiny_checkpoint

            self._state["dir"] = tempfile.TemporaryDirectory(prefix="modelrunner-conformance-")
            self._state["path"] = str(tiny_checkpoint("LlamaForCausalLM", self._state["dir"].name))
        return self._state["path"]

    def _world(self) -> int:
        cls = self.executor_class()
        if cls.launched_externally:
            from modelrunner.api import LaunchInfo

            if LaunchInfo.from_env() is None:
                raise NotApplicable(f"{self.name!r} joins processes a launcher started; run the suite under it "
                                    "(torchrun --nproc-per-node 2 -m pytest ...)")
            return LaunchInfo.from_env().world_size
        return 2 if cls.parallel else 1

    def _greedy(self, **config: Any) -> tuple[Any, list[list[int]]]:
        from modelrunner import LLM, SamplingParams

        llm = LLM(self._checkpoint(), plugins=self.plugins, **CONFIG, **config)
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                               use_tqdm=False)
        return llm, [list(o.outputs[0].token_ids) for o in outputs]

    def check_runs_like_one_process(self) -> str:
        """Chosen by name, it builds itself for the configuration and generates one process's greedy tokens."""
        world = self._world()
        _, expected = self._greedy(distributed_executor_backend="uni")
        llm, got = self._greedy(distributed_executor_backend=self.name, tensor_parallel_size=world)
        try:
            cls = self.executor_class()
            expect(isinstance(llm.runner, cls), f"distributed_executor_backend={self.name!r} built a "
                                                f"{type(llm.runner).__name__}, not the registered {cls.__name__}")
            expect(got == expected, f"greedy tokens {got} differ from one process's {expected}")
            stats = llm.stats()
            expect("kv_cache" in stats, f"stats() lacks kv_cache: {sorted(stats)}")
            llm.runner.check_health()
        finally:
            llm.shutdown()
            llm.shutdown()  # idempotent
        return f"{len(PROMPTS)} requests, tensor_parallel_size={world}"

    def check_refuses_what_it_cannot_run(self) -> str:
        """An executor of one process refuses two ranks with a ``ValueError`` naming it."""
        cls = self.executor_class()
        if cls.parallel:
            raise NotApplicable(f"{self.name!r} declares parallel = True")
        from modelrunner.api import RunnerConfig

        config = RunnerConfig.from_dict({"model": self._checkpoint(), "tensor_parallel_size": 2,
                                         "distributed_executor_backend": self.name, **CONFIG})
        try:
            cls.create(config, self.plugins)
        except ValueError as e:
            expect(self.name in str(e), f"the ValueError does not name the executor: {e}")
            return str(e)
        raise AssertionError(f"{self.name!r} accepted tensor_parallel_size=2 though it declares parallel = False")

    def checks(self) -> list[Check]:
        """Runs like one process; refuses what it cannot run."""
        return [Check("runs-like-one-process", self.check_runs_like_one_process),
                Check("refuses-what-it-cannot-run", self.check_refuses_what_it_cannot_run)]


__all__ = ["ExecutorSuite"]
