"""How one request is sampled and when it stops (vLLM's ``SamplingParams``)."""

from __future__ import annotations

from typing import Any

import attrs


def _int_at_least(low: int, *, allow_none: bool = False):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            accepted = f"an integer >= {low}" + (" or None" if allow_none else "")
            raise ValueError(f"{attribute.name} must be {accepted}, got {value!r}")

    return check


def _number(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{attribute.name} must be a number, got {value!r}")


def _temperature(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    _number(instance, attribute, value)
    if not 0.0 <= value < float("inf"):
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {value!r}")


def _top_p(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    _number(instance, attribute, value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 turns it off), got {value!r}")


def _top_k(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"top_k must be a positive integer, or -1 or 0 to turn it off; got {value!r}")


def _to_stop_list(value: Any) -> Any:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return value


def _stop(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {value!r}")


def _to_id_tuple(value: Any) -> Any:
    if value is None:
        return ()
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(value)
    return value


def _stop_token_ids(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {value!r}")


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


def _seed(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"seed must be an integer or None, got {value!r}")


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Per-request sampling and stopping rules; invalid values raise ``ValueError`` on construction."""

    n: int = attrs.field(default=1, validator=_int_at_least(1))
    """Completions to generate from the prompt (they share the prompt's KV-cache blocks)."""
    max_tokens: int | None = attrs.field(default=16, validator=_int_at_least(1, allow_none=True))
    """Most tokens to generate per completion; None: until ``max_model_len``. A request is never
    rejected because prompt + ``max_tokens`` exceeds ``max_model_len``: it ends there with
    ``finish_reason == "length"``."""
    min_tokens: int = attrs.field(default=0, validator=_int_at_least(0))
    """EOS and ``stop_token_ids`` are suppressed until this many tokens were generated."""
    temperature: float = attrs.field(default=1.0, validator=_temperature)
    """Softmax temperature; 0 picks the most likely token (greedy)."""
    top_k: int = attrs.field(default=-1, validator=_top_k)
    """Sample among the ``top_k`` most likely tokens; -1 or 0: all tokens."""
    top_p: float = attrs.field(default=1.0, validator=_top_p)
    """Sample among the smallest set of tokens whose probability reaches ``top_p``; 1: all tokens."""
    seed: int | None = attrs.field(default=None, validator=_seed)
    """Seed of this request's own random generator: the same seed gives the same text whatever
    else is in the batch. None: the engine's shared generator (seeded by the runner config)."""
    stop: tuple[str, ...] = attrs.field(default=(), converter=_to_stop_list, validator=_stop)
    """Strings that end a completion (a single string is accepted); the text is cut before it and
    ``finish_reason`` is ``"stop"``."""
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_to_id_tuple, validator=_stop_token_ids)
    """Token ids that end a completion (kept in ``token_ids``, not in the text), ``finish_reason == "stop"``."""
    ignore_eos: bool = attrs.field(default=False, validator=_bool)
    """Keep generating past the tokenizer's EOS token."""
    skip_special_tokens: bool = attrs.field(default=True, validator=_bool)
    """Leave special tokens out of the detokenized text."""

    def __attrs_post_init__(self) -> None:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken."""
        return self.temperature == 0.0

    @classmethod
    def from_optional(cls, params: SamplingParams | dict | None) -> SamplingParams:
        """``params`` itself, the defaults for None, or a SamplingParams built from a dict."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if isinstance(params, dict):
            unknown = set(params) - {f.name for f in attrs.fields(cls)}
            if unknown:
                known = ", ".join(f.name for f in attrs.fields(cls))
                raise ValueError(f"unknown sampling parameter(s) {sorted(unknown)}; known: {known}")
            return cls(**params)
        raise ValueError(f"sampling_params must be a SamplingParams, a dict or None, got {type(params).__name__}")
