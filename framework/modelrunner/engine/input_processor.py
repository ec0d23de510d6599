"""Turn what a caller gives ``add_request`` into a validated prompt, or a clear ``ValueError``."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import attrs
import torch

from ..config import RequestLimits
from ..sampling.params import SamplingParams


@attrs.frozen
class ProcessedPrompt:
    """A prompt ready to be queued."""

    text: str | None
    """The prompt text, when it was given as text."""
    token_ids: list[int]
    """The prompt's token ids (never empty)."""
    extra: dict[str, Any]
    """Adapter inputs (e.g. ``images``)."""
    extra_keys: tuple
    """A hashable content fingerprint of ``extra`` for the prefix cache."""
    params: SamplingParams
    """Validated sampling parameters (the engine's own copy)."""
    processor_states: dict[str, Any] = attrs.field(factory=dict)
    """Logits processor name → its state for this request."""


class InputProcessor:
    """Tokenizes and validates requests against the model and the engine's limits.

    Policy on length: a prompt must leave room for one generated token (at most
    ``max_model_len - 1`` tokens); prompt + ``max_tokens`` may exceed ``max_model_len``, and the
    completion then ends there with ``finish_reason="length"`` (as vLLM's offline API does).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, kv_capacity_tokens: int,
                 max_num_seqs: int, process_inputs: Callable[..., tuple[list[int], dict[str, Any]]] | None = None,
                 processor_states: Callable[[SamplingParams], dict[str, Any]] | None = None,
                 limits: RequestLimits | None = None) -> None:
        self.tokenizer = tokenizer
        """Encodes text prompts."""
        self.vocab_size = vocab_size
        """Valid token ids are ``0 … vocab_size - 1``."""
        self.max_model_len = max_model_len
        """Longest sequence (prompt + output)."""
        self.kv_capacity_tokens = kv_capacity_tokens
        """Token slots in the whole KV cache (a longer prompt could never be scheduled)."""
        self.max_num_seqs = max_num_seqs
        """Most sequences running at once (bounds ``n``)."""
        self.process_inputs = process_inputs
        """The model's own request transform (``ModelRunner.process_inputs``: image preprocessing,
        placeholder expansion), called with ``prompt_text``, ``token_ids`` and ``extra``; None: none."""
        self.processor_states = processor_states
        """Which logits processors a request uses (raises ``ValueError`` for a bad one); None: none."""
        self.limits = limits or RequestLimits()
        """Size limits on each request's sampling fields."""

    def process(self, request_id: str, prompt: Any, params: SamplingParams | dict | None,
                extra: dict[str, Any] | None = None, pooling: Any = None) -> ProcessedPrompt:
        """Validate one request.

        :param prompt: text, token ids, or ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``
            whose other keys (e.g. ``"images"``) join ``extra``; a ``"cache_salt"`` string (vLLM's)
            keeps its blocks apart in the prefix cache: only prompts with the same salt share them.
        :param pooling: an embedding request's :class:`~modelrunner.pooling.PoolingParams` (``params``
            is then ignored): its prompt may fill ``max_model_len``, as nothing is generated.
        :raises ValueError: empty or too long prompt, token ids outside the vocabulary, a text prompt
            for a model without a tokenizer, invalid sampling parameters (checked again here, as they
            may have been changed since construction), ``n`` above ``max_num_seqs``, a logits
            processor that rejects the request, extra inputs the model rejects (e.g. more images than
            image placeholders), a sampling field over its :class:`~modelrunner.config.RequestLimits` limit or
            naming a token id outside the vocabulary.
        """
        if pooling is not None:  # nothing is sampled: what the engine keeps is a one-token placeholder
            pooling.validate()
            params = SamplingParams(max_tokens=1, truncate_prompt_tokens=pooling.truncate_prompt_tokens)
        if not isinstance(params, SamplingParams) and not isinstance(params, (dict, type(None))):
            raise ValueError(f"sampling_params must be a SamplingParams, a dict or None, got {type(params).__name__}")
        params = SamplingParams.from_optional(params)
        check_limits(params, self.limits, self.vocab_size)  # sizes first: nothing below scales with them
        params = params.clone().validate()
        check_token_ranges(params, self.vocab_size)
        text, token_ids, prompt_extra = self._parse(prompt)
        salt = prompt_extra.pop("cache_salt", None)
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r:.80}")
        extra = {**prompt_extra, **(extra or {})}
        if params.truncate_prompt_tokens is not None and len(token_ids) > params.truncate_prompt_tokens:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
            text = None  # the text no longer matches the tokens
        if self.process_inputs is not None:
            try:
                token_ids, extra = self.process_inputs(prompt_text=text, token_ids=token_ids, extra=extra)
            except ValueError as e:
                raise ValueError(f"request {request_id!r}: {e}") from e
        self._check_lengths(request_id, token_ids, params, room=0 if pooling is not None else 1)
        states = self.processor_states(params) if self.processor_states is not None else {}
        keys = extra_keys(extra)
        if salt is not None:
            keys += (("cache_salt", salt),)
        if params.prompt_logprobs is not None:
            # Prompt log-probabilities need every prompt position computed: no prefix-cache hits.
            keys += (("prompt_logprobs", request_id),)
        return ProcessedPrompt(text, token_ids, extra, keys, params, states)

    def _parse(self, prompt: Any) -> tuple[str | None, list[int], dict[str, Any]]:
        extra: dict[str, Any] = {}
        if isinstance(prompt, dict):
            extra = {k: v for k, v in prompt.items() if k not in ("prompt", "prompt_token_ids")}
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_token_ids(prompt["prompt_token_ids"]), extra
            if "prompt" not in prompt:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one character or token id")
            if self.tokenizer is None:
                raise ValueError("this checkpoint ships no tokenizer, so prompts must be token ids "
                                 "({'prompt_token_ids': [...]} or a list of ints), not text")
            check_unicode("prompt", prompt)
            return prompt, list(self.tokenizer.encode(prompt)), extra
        if isinstance(prompt, (list, tuple, torch.Tensor)):
            return None, self._check_token_ids(prompt), extra
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict with 'prompt'/'prompt_token_ids', "
            f"got {type(prompt).__name__}"
        )

    def _check_token_ids(self, ids: Any) -> list[int]:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
        vocab = self.vocab_size
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is not in the vocabulary (accepted: 0 … {vocab - 1})")
        return list(ids)

    def _check_lengths(self, request_id: str, token_ids: list[int], params: SamplingParams, room: int = 1) -> None:
        if not token_ids:
            raise ValueError(f"request {request_id!r}: prompt is empty (0 tokens); give at least one token")
        if room == 0 and len(token_ids) > self.max_model_len:
            raise ValueError(f"request {request_id!r}: prompt has {len(token_ids)} tokens but max_model_len is "
                             f"{self.max_model_len}; accepted: at most {self.max_model_len} tokens (or set "
                             "truncate_prompt_tokens)")
        if room and len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt has {len(token_ids)} tokens but max_model_len is "
                f"{self.max_model_len}, which leaves no room for output; accepted: at most "
                f"{self.max_model_len - 1} prompt tokens"
            )
        if len(token_ids) > self.kv_capacity_tokens:
            raise ValueError(
                f"request {request_id!r}: prompt has {len(token_ids)} tokens but the KV cache holds only "
                f"{self.kv_capacity_tokens}; raise kv_cache_memory"
            )
        if params.n > self.max_num_seqs:
            raise ValueError(f"request {request_id!r}: n={params.n} exceeds max_num_seqs={self.max_num_seqs}")


def check_limits(params: SamplingParams, limits: RequestLimits, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the field, its size and the limit when one of ``params``' list-valued
    fields is larger than ``limits`` allows. Looks at sizes only (and at the length of each string
    once the count is within its limit), so an oversized request costs nothing more to refuse.
    """
    def at_most(field: str, value: Any, limit: int | None, setting: str, what: str = "entries") -> None:
        bound = vocab_size if limit is None else limit
        size = len(value) if hasattr(value, "__len__") else 0
        if size > bound:
            source = f"{setting}={limit}" if limit is not None else f"{setting} (the vocabulary size, {vocab_size})"
            raise ValueError(f"{field} has {size} {what}; the limit is {source}")

    def chars_at_most(field: str, strings: Any, limit: int, setting: str) -> None:
        for i, text in enumerate(strings):
            if isinstance(text, str) and len(text) > limit:
                raise ValueError(f"{field}[{i}] has {len(text)} characters; the limit is {setting}={limit}")

    at_most("allowed_token_ids", params.allowed_token_ids or (), limits.max_allowed_token_ids, "max_allowed_token_ids")
    at_most("logit_bias", params.logit_bias, limits.max_logit_bias, "max_logit_bias")
    at_most("stop_token_ids", params.stop_token_ids, limits.max_stop_token_ids, "max_stop_token_ids")
    at_most("stop", params.stop, limits.max_stop_strings, "max_stop_strings", "strings")
    chars_at_most("stop", params.stop, limits.max_stop_string_chars, "max_stop_string_chars")
    at_most("bad_words", params.bad_words, limits.max_bad_words, "max_bad_words", "words")
    chars_at_most("bad_words", params.bad_words, limits.max_bad_word_chars, "max_bad_word_chars")
    at_most("logits_processors", params.logits_processors, limits.max_logits_processors, "max_logits_processors")


def check_token_ranges(params: SamplingParams, vocab_size: int) -> None:
    """Raise ``ValueError`` naming the field when a token id in ``params`` is outside the vocabulary."""
    for field, ids in (("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids or ()),
                       ("logit_bias", params.logit_bias)):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"{field} names token id {bad}, outside the vocabulary (accepted: 0 … {vocab_size - 1})")


def extra_keys(extra: dict[str, Any]) -> tuple:
    """A hashable fingerprint of a request's extra inputs (tensors by content), so the prefix cache
    never shares blocks between the same tokens with different images."""
    if not extra:
        return ()
    keys = []
    for name in sorted(extra):
        digest = hashlib.sha256()
        _fingerprint(extra[name], digest)
        keys.append((name, digest.hexdigest()))
    return tuple(keys)


def _fingerprint(value: Any, digest: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, (list, tuple)):
        digest.update(f"{type(value).__name__}{len(value)}".encode())
        for item in value:
            _fingerprint(item, digest)
    elif isinstance(value, dict):
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode())
            _fingerprint(value[key], digest)
    elif isinstance(value, (bytes, bytearray)):
        digest.update(bytes(value))
    elif hasattr(value, "tobytes"):  # numpy arrays, PIL images
        digest.update(value.tobytes())
    else:
        digest.update(repr(value).encode())


def check_unicode(what: str, text: str) -> None:
    """Raise ``ValueError`` naming ``what`` when ``text`` is not valid Unicode (a lone surrogate, such as
    Python makes of invalid UTF-8 bytes in a command line), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: character {e.start} is {text[e.start]!r} (a lone surrogate; "
                         "invalid UTF-8 bytes in a command-line argument become these)") from None
