"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``, streaming and chat."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .config import RunnerConfig
from .engine.llm_engine import LLMEngine
from .engine.outputs import RequestOutput
from .engine.sampling_params import SamplingParams


class LLM:
    """A loaded model with a continuous-batching engine behind it (vLLM's offline ``LLM``).

    ``LLM(model="smollm2", dtype="float32", max_num_seqs=64, ...)``: every keyword is a flat
    config key of :meth:`RunnerConfig.from_dict` (unknown keys raise ``ValueError``).
    """

    def __init__(self, model: str = "smollm2", **config: Any) -> None:
        from .executor import create_executor

        # A ModelRunner, or with tensor/pipeline_parallel_size > 1 a ParallelExecutor driving the other ranks.
        self.runner = create_executor(RunnerConfig.from_dict({"model": model, **config}))
        """The model runner (device, dtype, KV cache)."""
        self.runner.load_model()
        self.engine = LLMEngine(self.runner)
        """The engine; use its ``add_request`` / ``step`` to interleave requests yourself."""

    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer."""
        return self.runner.tokenizer

    def memory_stats(self) -> dict[str, Any]:
        """KV-cache statistics (blocks used/free/cached, peak, prefix hits) and queue lengths."""
        return self.engine.memory_stats()

    def generate(
        self,
        prompts: str | list[int] | dict[str, Any] | Sequence[str | list[int] | dict[str, Any]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt, batched continuously; one finished output per prompt, in order.

        :param prompts: a string, a list of token ids, a dict (``{"prompt": ...}`` or
            ``{"prompt_token_ids": ...}``; other keys such as ``"images"`` go to the model as extra
            inputs), or a list of those.
        :param sampling_params: one for all prompts, or one per prompt (default: SamplingParams()).
        :param use_tqdm: show a progress bar when there is more than one prompt.
        :raises ValueError: a prompt or its parameters are invalid (the message names its index);
            nothing runs then.
        """
        batch = _as_prompt_list(prompts)
        params = _per_prompt_params(sampling_params, len(batch))
        ids = self._add_all(batch, params)
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Generating", unit="prompt", dynamic_ncols=True)
        try:
            done = self.engine.run_until_finished(ids, on_finished=(lambda _: bar.update(1)) if bar else None)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in ids]

    def _add_all(self, prompts: list[Any], params: list[SamplingParams]) -> list[str]:
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = self.engine.new_request_id()
                try:
                    self.engine.add_request(rid, prompt, p)
                except ValueError as exc:
                    raise ValueError(f"prompt {i}: {exc}") from exc
                ids.append(rid)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return ids

    def generate_stream(
        self, prompt: str | list[int] | dict[str, Any], sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield the text of one completion piece by piece as tokens arrive.

        Text is released once it is final: an incomplete UTF-8 character, or a tail that could
        still turn into a stop string, waits for the next token. The pieces joined equal the
        ``text`` :meth:`generate` returns. Only completion 0 is streamed when ``n > 1``. Closing the
        iterator early aborts the request.
        """
        rid = self.engine.new_request_id()
        self.engine.add_request(rid, prompt, sampling_params)
        finished = False
        try:
            while not finished:
                for output in self.engine.step():
                    if output.request_id != rid:
                        continue
                    if output.error:
                        raise RuntimeError(f"generation failed: {output.error}")
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
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the tokenizer's chat template.

        :param messages: ``[{"role": "user", "content": ...}, ...]`` or a list of such conversations.
        :returns: one output per conversation.
        """
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts (or a list of them)")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False, **(chat_template_kwargs or {})
            )
            # The template already holds any BOS: encode without adding special tokens again.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


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


def _per_prompt_params(params: Any, count: int) -> list[SamplingParams]:
    if isinstance(params, (list, tuple)):
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling_params for {count} prompts; give one, or one per prompt")
        return [SamplingParams.from_optional(p) for p in params]
    return [SamplingParams.from_optional(params)] * count
