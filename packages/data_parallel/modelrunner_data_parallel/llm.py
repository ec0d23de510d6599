"""``LLM(model, data_parallel_size=N)``: :class:`DataParallelLLM`, the offline API over ``N`` engine
replicas in processes of their own. The kernel's ``LLM`` builds it through the ``modelrunner.data_parallel``
entry point this distribution declares."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from modelrunner import LLM, ModelRunnerError, RequestOutput, RunnerConfig, SamplingParams
# How LLM.generate reads its arguments: one prompt or a list, one parameter set or one per prompt
# (internal: modelrunner.llm).
from modelrunner.llm import _as_prompt_list, _per_prompt_loras, _per_prompt_params

from .front import FrontEngine
from .launch import start_replicas
from .router import DataParallelRouter


class DataParallelLLM(LLM):
    """An :class:`~modelrunner.LLM` whose engine runs as ``data_parallel_size`` replicas in processes
    of their own (each a ``tensor_parallel_size × pipeline_parallel_size`` group).

    Replicas load the process's default plugins (``plugins`` is not passed to them). Available:
    ``generate``, ``chat``, ``stats``, ``memory_stats``, ``reset_prefix_cache``, ``shutdown`` and
    ``add_lora`` / ``remove_lora`` (every replica reads an adapter itself, also the first time a
    request uses it); what needs one engine in this process (``generate_stream``, ``beam_search``,
    ``embed`` / ``encode``, ``llm_engine``, ``runner``) raises :class:`~modelrunner.errors.ModelRunnerError` saying so.
    """

    def __init__(self, model: str = "smollm2", *, plugins: Any = None, **config: Any) -> None:
        cfg = RunnerConfig.from_dict({"model": model, **config})
        replicas = start_replicas(cfg)
        self.router = DataParallelRouter(replicas, cfg.cache.block_size)
        """Routes requests over the replicas (the server's engine loop)."""
        self._finalizer = weakref.finalize(self, self.router.kill)
        info = replicas[0].info
        self.info = info
        """What replica 0 reported when ready (tokenizer, sizes, sampling defaults, pid, host)."""
        self.engine = FrontEngine(cfg, info["vocab_size"], info["max_model_len"], info["tokenizer"])  # type: ignore[assignment]
        self._ids = iter(range(1 << 62))
        self._ids_lock = threading.Lock()

    @property
    def config(self) -> RunnerConfig:
        """The deployment's configuration."""
        return self.engine.config

    @property
    def max_num_seqs(self) -> int:
        """Requests all replicas run at once."""
        return sum(r.info["max_num_seqs"] for r in self.router.replicas)

    def get_tokenizer(self) -> Any:
        """Replica 0's tokenizer."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """Sampling parameters from the checkpoint's ``generation_config.json`` (as :class:`LLM`)."""
        return SamplingParams(**self.info["defaults"])

    @property
    def llm_engine(self) -> Any:  # noqa: D102 - see the class docstring
        raise _one_engine("llm_engine")

    @property
    def runner(self) -> Any:  # noqa: D102
        raise _one_engine("runner")

    def beam_search(self, prompts: Any, params: Any) -> Any:  # noqa: D102
        raise _one_engine("beam_search")

    def generate_stream(self, prompt: Any, sampling_params: Any = None) -> Iterator[str]:  # noqa: D102
        raise _one_engine("generate_stream")

    def encode(self, prompts: Any, pooling_params: Any = None, **kwargs: Any) -> Any:  # noqa: D102
        raise _one_engine("encode")

    def embed(self, prompts: Any, **kwargs: Any) -> Any:  # noqa: D102
        raise _one_engine("embed")

    def _each(self, name: str) -> list[Any]:
        return [r.call(name).result() for r in self.router.replicas if r.alive]

    def stats(self) -> dict[str, Any]:
        """``data_parallel``: each live replica's :meth:`LLM.stats` with its rank and pid, and the
        failed ones' errors."""
        replicas = [{"rank": r.rank, "pid": r.pid, "host": r.info["host"], "served": r.served,
                     **r.call("stats").result()} for r in self.router.replicas if r.alive]
        return {"data_parallel": {"size": len(self.router.replicas), "replicas": replicas,
                                  "failed": [str(e) for e in self.router.failures]}}

    def memory_stats(self) -> dict[str, Any]:
        """Each live replica's :meth:`LLM.memory_stats`, by rank."""
        return {"data_parallel": self._each("memory_stats")}

    def reset_prefix_cache(self) -> bool:
        """Reset every live replica's prefix cache; False if any holds blocks (see :meth:`LLM.reset_prefix_cache`)."""
        return all(self._each("reset_prefix_cache"))

    def shutdown(self) -> None:
        """Stop every replica (also happens at exit)."""
        self.router.stop(0.0)
        self._finalizer.detach()

    def add_lora(self, lora_request: Any) -> None:
        """Read an adapter on every replica now (else each reads it when a request first uses it).

        :raises ValueError: naming what is wrong with the adapter.
        """
        self.router.add_lora(lora_request).result()

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter on every replica; whether any had it."""
        return self.router.remove_lora(lora_int_id).result()

    def generate(self, prompts: Any, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: Any = None) -> list[RequestOutput]:
        """As :meth:`LLM.generate`: the prompts spread over the replicas, the outputs in the prompts' order;
        ``lora_request`` as there (the adapters are read on each replica that runs one of their prompts).

        :raises ValueError: a replica refused prompt ``i`` (nothing else runs then).
        :raises ReplicaFailedError: a replica failed while running some of them.
        """
        batch = _as_prompt_list(prompts)
        params = _per_prompt_params(sampling_params, len(batch))
        loras = _per_prompt_loras(lora_request, len(batch))
        done: dict[str, RequestOutput] = {}
        finished = threading.Condition()
        bar = None
        if use_tqdm and len(batch) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(batch), desc="Generating", unit="prompt", dynamic_ncols=True)

        def collect(output: RequestOutput) -> None:
            if output.finished:
                with finished:
                    done[output.request_id] = output
                    finished.notify_all()
                if bar is not None:
                    bar.update(1)

        ids: list[str] = []
        try:
            futures = []
            for prompt, p, lora in zip(batch, params, loras):
                with self._ids_lock:
                    rid = f"dp-{next(self._ids)}"
                futures.append(self.router.add_request(rid, prompt, p, on_output=collect, lora_request=lora))
                ids.append(rid)
            for i, future in enumerate(futures):
                try:
                    future.result()
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from exc
            with finished:
                finished.wait_for(lambda: len(done) == len(ids))
        except BaseException:
            for rid in ids:
                self.router.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = [done[rid] for rid in ids]
        failed = self.router.failures
        if failed and any(o.error for o in outputs):
            raise failed[0]
        return outputs


def _one_engine(name: str) -> ModelRunnerError:
    return ModelRunnerError(f"{name} needs the engine in this process; with data_parallel_size > 1 the engines "
                            "run in replica processes (use generate or chat, or data_parallel_size=1)")
