"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``, streaming and chat; with
``data_parallel_size`` > 1, the ``LLM`` subclass the ``modelrunner-data-parallel`` distribution declares
(replicas in processes of their own), found through an entry point: the kernel never imports it. Also
the article's lower-level :class:`ModelRunner`, whose ``generate`` builds an engine of its own."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from .config import RunnerConfig
from .engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from .engine.llm_engine import LLMEngine
from .engine.outputs import RequestOutput
from .errors import ModelRunnerError, StructuredOutputError
from .executor import Executor, create_executor
from .plugins import feature_class
from .pooling.outputs import EmbeddingRequestOutput, PoolingRequestOutput
from .pooling.params import PoolingParams
from .runner import ModelRunner as KernelModelRunner
from .sampling.params import GENERATION_CONFIG, SamplingParams


class LLM:
    """A loaded model with a continuous-batching engine behind it (vLLM's offline ``LLM``).

    ``LLM(model="smollm2", dtype="float32", max_num_seqs=64, ...)``: every keyword is a flat
    config key of :meth:`RunnerConfig.from_dict` (unknown keys raise ``ValueError``).

    :param plugins: the loaded plugins to route through (default: the process's; worker processes of
        a parallel configuration load the process's default plugins whatever this is).
    """

    def __new__(cls, model: str = "smollm2", *, plugins: Any = None, **config: Any) -> LLM:
        if cls is LLM and config.get("data_parallel_size", 1) not in (1, None):
            return super().__new__(data_parallel_llm())  # replicas in processes of their own, one front here
        return super().__new__(cls)

    def __init__(self, model: str = "smollm2", *, plugins: Any = None, **config: Any) -> None:
        self._start(RunnerConfig.from_dict({"model": model, **config}), plugins)

    @classmethod
    def from_config(cls, config: RunnerConfig, plugins: Any = None) -> LLM:
        """An LLM for a whole :class:`RunnerConfig` (one engine: ``data_parallel_size`` is not looked at)."""
        llm = super().__new__(LLM)
        llm._start(config, plugins)
        return llm

    def _start(self, config: RunnerConfig, plugins: Any) -> None:
        # One process, or with tensor/pipeline_parallel_size > 1 rank 0 driving the other ranks.
        executor = create_executor(config, plugins)
        try:
            self.engine = LLMEngine(executor)
            """The engine; use its ``add_request`` / ``step`` to interleave requests yourself."""
        except BaseException:
            executor.shutdown()
            raise

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name for :attr:`engine`)."""
        return self.engine

    @property
    def runner(self) -> Executor:
        """The executor that runs the model (``forward(ids)`` gives every position's logits)."""
        return self.engine.executor

    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer (or the ``tokenizer`` config field's)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """Sampling parameters from the checkpoint's ``generation_config.json`` (``temperature``,
        ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_new_tokens`` as ``max_tokens``), as
        vLLM does; the library defaults where it has none. Change any field afterwards."""
        return SamplingParams(**generation_defaults(self.runner.runner.source))

    def beam_search(self, prompts: str | list[int] | dict[str, Any] | Sequence[Any],
                    params: BeamSearchParams, lora_request: Any = None) -> list[BeamSearchOutput]:
        """Beam search over each prompt (text, token ids, or ``{"prompt"...}``/``{"prompt_token_ids"...}``
        dicts); one :class:`BeamSearchOutput` per prompt, its ``beam_width`` sequences best first.

        Beams share the prompt's KV blocks through the allocator's fork (copy-on-write).

        :param lora_request: a :class:`~modelrunner.lora.LoRARequest` for every prompt, or a list of them
            (None entries: the base model). All prompts run in every step: at most ``max_loras`` distinct.
        :raises ValueError: a bad prompt or parameter, or a prompt too long for ``max_tokens`` more.
        """
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        token_prompts = []
        for i, prompt in enumerate(_as_prompt_list(prompts)):
            try:
                ids = self.engine.input_processor.process(f"beam-{i}", prompt, SamplingParams(max_tokens=1)).token_ids
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
            if len(ids) + params.max_tokens > self.engine.max_model_len:
                raise ValueError(f"prompt {i} has {len(ids)} tokens: with max_tokens={params.max_tokens} it exceeds "
                                 f"max_model_len={self.engine.max_model_len}")
            token_prompts.append(ids)
        loras = _per_prompt_loras(lora_request, len(token_prompts))
        distinct = {r.lora_int_id for r in loras if r is not None}
        if distinct:
            for r in dict.fromkeys(r for r in loras if r is not None):
                self.engine.add_lora(r)
            max_loras = self.engine.config.lora.max_loras
            if len(distinct) > max_loras:
                raise ValueError(f"beam search runs all prompts together, but they use {len(distinct)} LoRA adapters "
                                 f"and max_loras is {max_loras}; split the call or raise max_loras")
        return beam_search(self.engine, token_prompts, params, loras)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (e.g. after editing weights). False, changing nothing,
        while requests hold KV blocks."""
        return self.engine.allocator.reset_prefix_cache()

    def memory_stats(self) -> dict[str, Any]:
        """KV-cache statistics (blocks used/free/cached, peak, prefix hits) and queue lengths."""
        return self.engine.memory_stats()

    def stats(self) -> dict[str, Any]:
        """Every statistic: ``adapter`` (the plugin, distribution and architecture that serve the model),
        ``kv_cache``, ``model``, ``compile`` and (parallel) ``parallel``."""
        return self.engine.stats()

    def shutdown(self) -> None:
        """Stop the worker processes, if any, and the grammar compile threads (also happens at exit)."""
        self.engine.structured_outputs.shutdown()
        self.engine.executor.shutdown()

    def generate(
        self,
        prompts: str | list[int] | dict[str, Any] | Sequence[str | list[int] | dict[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched continuously; one finished output per prompt, in order.

        :param prompts: a string, a list of token ids, a dict (``{"prompt": ...}`` or
            ``{"prompt_token_ids": ...}``; other keys such as ``"images"`` go to the model as extra
            inputs), or a list of those.
        :param sampling_params: one for all prompts, or one per prompt (default: SamplingParams()).
        :param use_tqdm: show a progress bar when there is more than one prompt.
        :param lora_request: the LoRA adapter (a :class:`~modelrunner.lora.LoRARequest`) for every
            prompt, or a list with one per prompt (None entries: the base model); needs ``enable_lora``.
        :raises ValueError: a prompt or its parameters are invalid (the message names its index);
            nothing runs then. ``structured_outputs`` a grammar backend cannot serve raise
            :class:`~modelrunner.errors.StructuredOutputError` (a ValueError) naming the feature.
        """
        batch = _as_prompt_list(prompts)
        params = _per_prompt_params(sampling_params, len(batch))
        loras = _per_prompt_loras(lora_request, len(batch))
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(batch) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(batch), desc="Generating", unit="prompt", dynamic_ncols=True)

        def collect(output: RequestOutput) -> None:
            if output.finished:
                done[output.request_id] = output
                if bar is not None:
                    bar.update(1)

        ids = self._add_all(batch, params, collect, loras)
        try:
            while len(done) < len(ids):
                self.engine.advance()
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]

    def encode(
        self,
        prompts: str | list[int] | dict[str, Any] | Sequence[str | list[int] | dict[str, Any]],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: Any = None,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Run every prompt through the model without generating and pool its final hidden states
        (vLLM's ``encode``); one output per prompt, in order, ``outputs.data`` a float32 tensor.

        The pooling method is the model's (``pooling_type``: the checkpoint's sentence-transformers
        config, else ``last``); requests batch continuously with any others on the engine.

        :param prompts: as :meth:`generate`'s.
        :param pooling_params: one :class:`~modelrunner.pooling.PoolingParams` for all prompts, or one per
            prompt (default: ``PoolingParams()``: full size, the model's normalisation).
        :param truncate_prompt_tokens: keep only each prompt's last this many tokens (sets the params' field).
        :param use_tqdm: show a progress bar when there is more than one prompt.
        :param lora_request: as :meth:`generate`'s.
        :param pooling_task: ``embed`` (one vector per prompt; the default) or ``token_embed`` (one per
            prompt token); sets the params' ``task``.
        :raises ValueError: a prompt or its parameters are invalid (the message names its index, and
            the field, e.g. ``dimensions`` a model does not allow); nothing runs then.
        :raises PoolingError: a prompt could not be pooled (e.g. the model's adapter returns no hidden states).
        """
        batch = _as_prompt_list(prompts)
        if isinstance(pooling_params, (list, tuple)):
            if len(pooling_params) != len(batch):
                raise ValueError(f"got {len(pooling_params)} pooling_params for {len(batch)} prompts; give one, or "
                                 "one per prompt")
            params = list(pooling_params)
        else:
            params = [pooling_params or PoolingParams()] * len(batch)
        if not all(isinstance(p, PoolingParams) for p in params):
            bad = next(p for p in params if not isinstance(p, PoolingParams))
            raise ValueError(f"pooling_params must be PoolingParams, got {type(bad).__name__}")
        changes = {k: v for k, v in (("truncate_prompt_tokens", truncate_prompt_tokens), ("task", pooling_task))
                   if v is not None}
        params = [attrs.evolve(p, **changes) for p in params]
        done: dict[str, PoolingRequestOutput] = {}
        bar = None
        if use_tqdm and len(batch) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(batch), desc="Embedding", unit="prompt", dynamic_ncols=True)

        def collect(output: Any) -> None:
            if output.finished:
                done[output.request_id] = output
                if bar is not None:
                    bar.update(1)

        ids = self._add_all(batch, params, collect, _per_prompt_loras(lora_request, len(batch)))
        try:
            while len(done) < len(ids):
                self.engine.advance()
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        outputs = [done[rid] for rid in ids]
        for i, output in enumerate(outputs):
            data = getattr(getattr(output, "outputs", None), "data", None)
            if data is None:
                why = output.error or f"it ended with finish_reason={output.finish_reason!r}"
                raise PoolingError(f"prompt {i}: no embedding: {why}")
        return outputs

    def embed(
        self,
        prompts: str | list[int] | dict[str, Any] | Sequence[str | list[int] | dict[str, Any]],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: Any = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (vLLM's ``embed``): ``out.outputs.embedding`` is a list of floats.

        See :meth:`encode` for the arguments; ``PoolingParams(dimensions=256)`` shortens Matryoshka
        models' embeddings, ``PoolingParams(normalize=False)`` skips the L2 normalisation.
        """
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, lora_request=lora_request, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def _add_all(self, prompts: list[Any], params: list[SamplingParams] | list[PoolingParams], consumer: Any,
                 loras: list[Any] | None = None) -> list[str]:
        ids: list[str] = []
        loras = loras or [None] * len(prompts)
        try:
            for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras)):
                rid = self.engine.new_request_id()
                try:
                    self.engine.add_request(rid, prompt, p, on_output=consumer, lora_request=lora)
                except StructuredOutputError as exc:  # keeps its type: a server maps it to a 400
                    raise exc.with_prefix(f"prompt {i}: ") from exc
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from exc
                ids.append(rid)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return ids

    def generate_stream(
        self, prompt: str | list[int] | dict[str, Any], sampling_params: SamplingParams | None = None,
        lora_request: Any = None,
    ) -> Iterator[str]:
        """Yield the text of one completion piece by piece as tokens arrive.

        Text is released once it is final: an incomplete UTF-8 character, or a tail that could
        still turn into a stop string, waits for the next token. The pieces joined equal the
        ``text`` :meth:`generate` returns. Only completion 0 is streamed when ``n > 1``. Closing the
        iterator early aborts the request.
        """
        rid = self.engine.new_request_id()
        arrived: collections.deque[RequestOutput] = collections.deque()
        self.engine.add_request(rid, prompt, sampling_params, on_output=arrived.append, lora_request=lora_request)
        finished = False
        try:
            while not finished:
                if not arrived:
                    self.engine.advance()
                    continue
                output = arrived.popleft()
                if output.error:
                    raise GenerationError(output.error)
                piece = output.outputs[0].delta_text if output.outputs else ""
                if piece:
                    yield piece
                finished = output.finished
        finally:
            if not finished:
                self.engine.abort_request(rid)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through a chat template.

        :param messages: ``[{"role": "user", "content": ...}, ...]`` or a list of such conversations;
            ``content`` is a string or a list of ``{"type": "text", "text": ...}`` parts.
        :param chat_template: a Jinja template to use instead of the tokenizer's.
        :param add_generation_prompt: end the prompt with the assistant's turn header.
        :param continue_final_message: let the reply continue the last (assistant) message instead of
            starting a new turn (excludes ``add_generation_prompt``).
        :param chat_template_kwargs: extra variables for the template.
        :param lora_request: as :meth:`generate`'s (one per conversation when a list).
        :returns: one output per conversation.
        :raises ValueError: a malformed conversation (naming the message and field), or a model without a
            tokenizer or chat template.
        """
        conversations = _as_conversations(messages)
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False  # vLLM's rule: continuing a message adds no new turn
        prompts = [self.chat_prompt(c, chat_template, add_generation_prompt, continue_final_message,
                                    chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def chat_prompt(self, conversation: list[dict[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The prompt one conversation becomes (``{"prompt": text, "prompt_token_ids": ids}``), as
        :meth:`chat` builds it.

        :raises ValueError: a malformed conversation, no tokenizer or chat template, or a template error.
        """
        conversation = _as_conversations(conversation)[0]
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("this checkpoint ships no tokenizer, so it has no chat template; use generate() "
                             "with token ids")
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; pass chat_template=...")
        try:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False, **(chat_template_kwargs or {}))
        except Exception as e:  # jinja raises its own errors for templates and messages it cannot render
            raise ValueError(f"the chat template cannot render this conversation: {type(e).__name__}: {e}") from e
        # The template already holds any BOS: encode without adding special tokens again.
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _as_conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """One conversation or a list of them, each checked: a non-empty list of ``{"role", "content"}``
    dicts with string roles and string (or text-part) contents."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of them)")
    nested = isinstance(messages[0], (list, tuple))
    conversations = list(messages) if nested else [list(messages)]
    for c, conversation in enumerate(conversations):
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"conversation {c} must be a non-empty list of messages, got {conversation!r}")
        for m, message in enumerate(conversation):
            where = f"conversation {c}, message {m}" if len(conversations) > 1 else f"message {m}"
            if not isinstance(message, dict):
                raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
            for field in ("role", "content"):
                if field not in message:
                    raise ValueError(f"{where} has no {field!r} (keys: {sorted(message)})")
            if not isinstance(message["role"], str):
                raise ValueError(f"{where}: role must be a string, got {message['role']!r}")
            content = message["content"]
            if isinstance(content, list):
                if not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
                    raise ValueError(f"{where}: content parts must be dicts like {{'type': 'text', 'text': ...}}")
            elif not isinstance(content, str):
                raise ValueError(f"{where}: content must be a string or a list of parts, got "
                                 f"{type(content).__name__}")
    return conversations


GENERATION_KEYS = {field.metadata[GENERATION_CONFIG]: field.name for field in attrs.fields(SamplingParams)
                   if GENERATION_CONFIG in field.metadata}
"""``generation_config.json`` key → the SamplingParams field it sets (the fields' ``generation_config`` metadata)."""


def generation_defaults(source: Any) -> dict[str, Any]:
    """The SamplingParams fields a checkpoint's ``generation_config.json`` sets (empty without one)."""
    from transformers import GenerationConfig

    if source is None or not (source.path / "generation_config.json").is_file():
        return {}
    try:
        config = GenerationConfig.from_pretrained(str(source.path)).to_diff_dict()
    except Exception:  # noqa: BLE001 - a malformed file is ignored like a missing one (vLLM does the same)
        return {}
    return {field: config[key] for key, field in GENERATION_KEYS.items() if config.get(key) is not None}


class ModelRunner(KernelModelRunner):
    """One process's model (:class:`modelrunner.runner.ModelRunner`) whose ``generate`` works on its
    own: :meth:`engine` builds an :class:`~modelrunner.engine.LLMEngine` for it on first use."""

    def engine(self) -> LLMEngine:
        """The engine that runs this runner: the one attached (an ``LLMEngine`` built on it), else one
        built now (it loads the model if needed and attaches itself; its KV block allocator then also
        serves :meth:`forward`'s scratch sequences)."""
        if self._engine is None:
            LLMEngine(self)
        return self._engine


class GenerationError(ModelRunnerError):
    """A request failed while generating (its forward or sampling raised twice); the message says why."""


class PoolingError(ModelRunnerError):
    """A prompt could not be pooled into an embedding (its forward or pooling failed); the message says why."""


def _as_prompt_list(prompts: Any) -> list[Any]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt given as token ids
        return list(prompts)
    raise ValueError(
        f"prompts must be a string, a list of token ids, a dict, or a list of those; got {type(prompts).__name__}"
    )


def _per_prompt_loras(lora_request: Any, count: int) -> list[Any]:
    """One LoRA request (or None) per prompt, from one for all or a list of one per prompt."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != count:
            raise ValueError(f"got {len(lora_request)} lora_request entries for {count} prompts; give one, or one "
                             "per prompt")
        return list(lora_request)
    return [lora_request] * count


def _per_prompt_params(params: Any, count: int) -> list[SamplingParams]:
    if isinstance(params, (list, tuple)):
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling_params for {count} prompts; give one, or one per prompt")
        return [SamplingParams.from_optional(p) for p in params]
    return [SamplingParams.from_optional(params)] * count


DATA_PARALLEL_GROUP = "modelrunner.data_parallel"
"""Entry-point group of the ``LLM`` subclass that ``LLM(..., data_parallel_size=N)`` with ``N`` > 1 builds
(entry point ``llm``; ``modelrunner-data-parallel`` declares ``modelrunner_data_parallel.llm:DataParallelLLM``).
Its ``__init__`` takes ``LLM``'s arguments."""
DATA_PARALLEL_DIST = "modelrunner-data-parallel"
"""The distribution that provides data parallelism, named when it is missing."""


def data_parallel_llm() -> type[LLM]:
    """The ``LLM`` subclass that runs ``data_parallel_size`` > 1, from the :data:`DATA_PARALLEL_GROUP` entry point.

    :raises ModelRunnerError: no installed distribution declares it (saying what to install), or the one
        that does fails to import or names something that is not an ``LLM`` subclass.
    """
    return feature_class(DATA_PARALLEL_GROUP, "llm", DATA_PARALLEL_DIST, "data_parallel_size > 1", LLM)
