"""How one request is sampled and when it stops: vLLM's ``SamplingParams``, field for field.

Fields can be set after construction (``sp = SamplingParams(); sp.max_tokens = 64``); each is
checked when set, and the whole is checked again (:meth:`SamplingParams.validate`) when the request
is added, so a bad value raises ``ValueError`` naming the field either way. The engine keeps its
own copy of a request's parameters, so changing an object afterwards never affects a running request.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from .structured import StructuredOutputsParams, as_structured_outputs
from ..wire import register as _wire_type

SAMPLING_EPS = 1e-5
"""Temperatures below this are greedy (as in vLLM): dividing logits by them overflows float32."""
MAX_LOGPROBS = 20
"""Most top log-probabilities a request may ask for per position (OpenAI's limit)."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""Seeds torch's generators accept."""


def _int_at_least(low: int, *, allow_none: bool = False, high: int | None = None):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value is None and allow_none:
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            accepted = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
            accepted += " or None" if allow_none else ""
            raise ValueError(f"{attribute.name} must be {accepted}, got {value!r}")

    return check


def _number_in(low: float, high: float, *, low_open: bool = False, what: str = ""):
    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        ok = (not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
              and (low < value if low_open else low <= value) and value <= high)
        if not ok:
            interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
            raise ValueError(f"{attribute.name} must be a number in {interval}{what}, got {value!r}")

    return check


def _repetition_penalty(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value < float("inf"):
        raise ValueError(f"repetition_penalty must be a finite number > 0 (1 turns it off; above 1 discourages "
                         f"repeating, below 1 encourages it), got {value!r}")


def _temperature(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0 (below {SAMPLING_EPS:g} means greedy), "
                         f"got {value!r}")


def _top_k(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"top_k must be a positive integer, or -1 or 0 to turn it off; got {value!r}")


def _to_tuple(value: Any) -> Any:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple, set, frozenset)):
        return tuple(value)
    return value


def _stop(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {value!r}")


def _token_ids(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None and attribute.name == "allowed_token_ids":
        return
    if not isinstance(value, tuple) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in value):
        raise ValueError(f"{attribute.name} must be a list of token ids (integers >= 0), got {value!r}")
    if attribute.name == "allowed_token_ids" and not value:
        raise ValueError("allowed_token_ids must name at least one token id (None allows all)")


def _optional_ids(value: Any) -> Any:
    return None if value is None else _to_tuple(value)


def _bool(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


def _seed(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1] or None, got {value!r}")


def _logprobs(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{attribute.name} must be an integer in [0, {MAX_LOGPROBS}] (how many top "
                         f"log-probabilities besides the chosen token's) or None, got {value!r}")


def _logit_bias(value: Any) -> Any:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        out = {}
        for key, bias in value.items():
            try:  # JSON bodies key token ids by strings
                out[int(key)] = bias
            except (TypeError, ValueError):
                out[key] = bias
        return out
    return value


def _check_logit_bias(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
    for token, bias in value.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias[{token}] must be a number in [-100, 100], got {bias!r}")


def _bad_words(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(w, str) and w.strip() for w in value):
        raise ValueError(f"bad_words must be a list of non-empty strings, got {value!r}")


ProcessorSpec = tuple[str, tuple[tuple[str, Any], ...]]
"""A logits processor a request names: ``(name, sorted (argument, value) pairs)``."""


def _to_processor_specs(value: Any) -> Any:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        return value
    out: list[Any] = []
    for item in value:
        if isinstance(item, str):
            out.append((item, ()))
        elif isinstance(item, Mapping) and "name" in item:
            args = item.get("args") or {}
            out.append((item["name"], tuple(sorted(dict(args).items())) if isinstance(args, Mapping) else args))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Mapping):
            out.append((item[0], tuple(sorted(item[1].items()))))
        else:
            out.append(item)
    return tuple(out)


def _processor_specs(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple):
        raise ValueError(f"logits_processors must be a list, got {value!r}")
    for item in value:
        if callable(item):
            continue  # vLLM 0.x style: fn(output_token_ids, logits) -> logits, applied row by row
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and item[0]
                and isinstance(item[1], tuple)):
            raise ValueError("logits_processors entries must be a processor name, (name, {args}), "
                             f"{{'name': name, 'args': {{...}}}} or a callable; got {item!r}")


def _structured_outputs(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, StructuredOutputsParams):
        raise ValueError(f"{attribute.name} must be a StructuredOutputsParams (or a dict of its fields: json, regex, "
                         f"choice, grammar, json_object, ...) or None, got {value!r:.120}")


def _extra_args(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"extra_args must be a dict or None, got {value!r}")


_FIELD = attrs.field  # the attrs validators also run on every assignment (attrs.define's default)

REQUEST = "request"
"""Field metadata key: False for a field HTTP requests do not set under its own name (``max_tokens`` and
``logprobs`` have each endpoint's names, ``structured_outputs`` its own fields); every other field is a
request field of the same name (``modelrunner_serve.protocol`` derives them)."""
REQUEST_TYPE = "request_type"
"""Field metadata key: the JSON type a request gives the field, where the one derived from its Python
type (tuples as lists, dicts keyed by strings) is not it."""
GENERATION_CONFIG = "generation_config"
"""Field metadata key: the ``generation_config.json`` key whose value is the field's default for a
checkpoint (for ``LLM.get_default_sampling_params()`` and the server's requests)."""
_NOT_IN_REQUESTS = {REQUEST: False}


@_wire_type
@attrs.define(kw_only=True, eq=True)
class SamplingParams:
    """Per-request sampling and stopping rules (vLLM's fields, names and defaults)."""

    n: int = _FIELD(default=1, validator=_int_at_least(1))
    """Completions to generate from the prompt (they share the prompt's KV-cache blocks)."""
    max_tokens: int | None = _FIELD(default=16, validator=_int_at_least(1, allow_none=True),
                                    metadata={**_NOT_IN_REQUESTS, GENERATION_CONFIG: "max_new_tokens"})
    """Most tokens to generate per completion; None: until ``max_model_len``. A request is never
    rejected because prompt + ``max_tokens`` exceeds ``max_model_len``: it ends there with
    ``finish_reason == "length"``."""
    min_tokens: int = _FIELD(default=0, validator=_int_at_least(0))
    """EOS and ``stop_token_ids`` cannot be sampled until this many tokens were generated."""
    temperature: float = _FIELD(default=1.0, validator=_temperature, metadata={GENERATION_CONFIG: "temperature"})
    """Softmax temperature; below :data:`SAMPLING_EPS` (0 included) the most likely token is taken."""
    top_k: int = _FIELD(default=0, validator=_top_k, metadata={GENERATION_CONFIG: "top_k"})
    """Sample among the ``top_k`` most likely tokens; 0 or -1: all tokens (values above the
    vocabulary size mean all tokens too)."""
    top_p: float = _FIELD(default=1.0, validator=_number_in(0.0, 1.0, low_open=True, what=" (1 turns it off)"),
                          metadata={GENERATION_CONFIG: "top_p"})
    """Sample among the smallest set of tokens whose probability reaches ``top_p``; 1: all tokens."""
    min_p: float = _FIELD(default=0.0, validator=_number_in(0.0, 1.0, what=" (0 turns it off)"),
                          metadata={GENERATION_CONFIG: "min_p"})
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    presence_penalty: float = _FIELD(default=0.0, validator=_number_in(-2.0, 2.0))
    """Subtracted from the logit of every token that appeared in the output so far."""
    frequency_penalty: float = _FIELD(default=0.0, validator=_number_in(-2.0, 2.0))
    """Subtracted from a token's logit once per time it appeared in the output so far."""
    repetition_penalty: float = _FIELD(default=1.0, validator=_repetition_penalty,
                                       metadata={GENERATION_CONFIG: "repetition_penalty"})
    """Divides the positive (multiplies the negative) logits of tokens in the prompt or output so far."""
    logit_bias: dict[int, float] = _FIELD(factory=dict, converter=_logit_bias, validator=_check_logit_bias)
    """Token id → bias added to its logit (OpenAI's range: -100 … 100)."""
    allowed_token_ids: tuple[int, ...] | None = _FIELD(default=None, converter=_optional_ids, validator=_token_ids)
    """Only these token ids can be sampled (None: all)."""
    bad_words: tuple[str, ...] = _FIELD(default=(), converter=_to_tuple, validator=_bad_words)
    """Words never generated: their last token is banned wherever the tokens before it were just generated."""
    seed: int | None = _FIELD(default=None, validator=_seed)
    """Seed of this request's own random generator: the same seed gives the same text whatever
    else is in the batch. None: the engine's shared generator (seeded by the runner config)."""
    stop: tuple[str, ...] = _FIELD(default=(), converter=_to_tuple, validator=_stop,
                                   metadata={REQUEST_TYPE: str | list[str]})
    """Strings that end a completion (a single string is accepted); the text is cut before it
    (unless ``include_stop_str_in_output``) and ``finish_reason`` is ``"stop"``."""
    stop_token_ids: tuple[int, ...] = _FIELD(default=(), converter=_to_tuple, validator=_token_ids)
    """Token ids that end a completion (kept in ``token_ids``, not in the text), ``finish_reason == "stop"``."""
    include_stop_str_in_output: bool = _FIELD(default=False, validator=_bool)
    """Keep the stop string that ended a completion in its text."""
    ignore_eos: bool = _FIELD(default=False, validator=_bool)
    """Keep generating past the tokenizer's EOS token."""
    skip_special_tokens: bool = _FIELD(default=True, validator=_bool)
    """Leave special tokens out of the detokenized text."""
    detokenize: bool = _FIELD(default=True, validator=_bool, metadata=_NOT_IN_REQUESTS)
    """Produce text; False returns token ids only (stop strings then cannot apply)."""
    logprobs: int | None = _FIELD(default=None, validator=_logprobs, metadata=_NOT_IN_REQUESTS)
    """Return, per generated token, the log-probabilities of the ``logprobs`` most likely tokens plus
    the chosen one's (computed from the model's raw logits); None: none."""
    prompt_logprobs: int | None = _FIELD(default=None, validator=_logprobs)
    """Return, per prompt token after the first, its log-probability and the ``prompt_logprobs`` most
    likely tokens at that position; None: none."""
    truncate_prompt_tokens: int | None = _FIELD(default=None, validator=_int_at_least(1, allow_none=True))
    """Keep only the last this many prompt tokens (None: the whole prompt)."""
    logits_processors: tuple[Any, ...] = _FIELD(factory=tuple, converter=_to_processor_specs,
                                               validator=_processor_specs)
    """Logits processors this request uses, by registered name (``"name"``, ``("name", {args})`` or
    ``{"name": ..., "args": {...}}``), applied once per step to all rows that use them. A callable
    ``fn(output_token_ids, logits_row) -> logits_row`` (vLLM 0.x style) is also accepted; it runs
    row by row."""
    extra_args: dict[str, Any] | None = _FIELD(default=None, validator=_extra_args)
    """Free-form arguments for plugins (vLLM's ``extra_args``); not interpreted by the kernel."""
    structured_outputs: StructuredOutputsParams | None = _FIELD(default=None, converter=as_structured_outputs,
                                                                validator=_structured_outputs,
                                                                metadata=_NOT_IN_REQUESTS)
    """Constrain the completion to a JSON schema, a regex, a choice of strings, a grammar or any JSON
    object (:class:`~.structured.StructuredOutputsParams`, or a dict of its fields); it ends with
    ``finish_reason="stop"`` when the constraint is complete. None: unconstrained."""
    guided_decoding: StructuredOutputsParams | None = _FIELD(default=None, converter=as_structured_outputs,
                                                             validator=_structured_outputs,
                                                             metadata=_NOT_IN_REQUESTS)
    """Deprecated: vLLM's older name of :attr:`structured_outputs`; a value given here moves there (with a
    ``DeprecationWarning``) and this field reads None."""

    def __attrs_post_init__(self) -> None:
        self.validate()

    def _move_guided_decoding(self) -> None:
        if self.guided_decoding is None:
            return
        warnings.warn("SamplingParams(guided_decoding=...) is deprecated; use structured_outputs=... (same "
                      "parameters, StructuredOutputsParams)", DeprecationWarning, stacklevel=5)
        if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
            raise ValueError("structured_outputs and guided_decoding (its deprecated name) are both set; keep one")
        self.structured_outputs, self.guided_decoding = self.guided_decoding, None

    def validate(self) -> SamplingParams:
        """Check every field and the rules between them; returns ``self``.

        :raises ValueError: naming the field and what it accepts.
        """
        self._move_guided_decoding()
        for field in attrs.fields(type(self)):
            if field.validator is not None:
                field.validator(self, field, getattr(self, field.name))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are matched in the text)")
        return self

    @property
    def greedy(self) -> bool:
        """True when the most likely token is always taken (``temperature`` below :data:`SAMPLING_EPS`)."""
        return self.temperature < SAMPLING_EPS

    def clone(self) -> SamplingParams:
        """A validated copy that later changes to this object do not affect."""
        return attrs.evolve(self, logit_bias=dict(self.logit_bias),
                            extra_args=None if self.extra_args is None else dict(self.extra_args))

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


LegacyProcessor = Callable[[list[int], Any], Any]
"""A vLLM 0.x per-row logits processor: ``fn(output_token_ids, logits_row) -> logits_row``."""
