"""What ``modelrunner serve`` was asked to do: one frozen, validated settings object."""

from __future__ import annotations

from typing import Any

import attrs

DEFAULT_MAX_WAITING_REQUESTS = 1024
"""Requests that may wait beyond the ``max_num_seqs`` the engine runs at once."""
DEFAULT_MAX_BODY_BYTES = 32 << 20
"""Largest request body accepted (images travel inside it as data: URLs)."""
DEFAULT_MAX_STREAM_BUFFER = 1024
"""Outputs (engine steps) per prompt that may wait for a streaming client to read them; a client
further behind has stopped reading, and its request is aborted (a few MiB at most per stream)."""
DEFAULT_MAX_INPUT_ITEMS = 10_000
"""Most items in a ``/v1/responses`` request's ``input`` (each renders to at least one token, and
checking them costs time before the model runs)."""
DEFAULT_GRACE_PERIOD_S = 20.0
"""How long in-flight requests may run on after SIGTERM/SIGINT (below Kubernetes' 30 s default)."""
LOG_LEVELS = ("debug", "info", "warning", "error")
"""Accepted ``log_level`` values (``info`` and ``debug`` include uvicorn's access log)."""


def _non_negative_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name.replace('_', '-')} must be an integer >= 0, got {value!r}")


def _positive_int(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name.replace('_', '-')} must be an integer >= 1, got {value!r}")


def _port(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 65535:
        raise ValueError(f"port must be an integer in [0, 65535] (0 picks a free port), got {value!r}")


def _grace(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"grace-period must be a number of seconds >= 0, got {value!r}")


def _names(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not all(isinstance(n, str) and n.strip() for n in value):
        raise ValueError(f"served-model-name must be non-empty strings, got {list(value)!r}")


def _api_key(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError("api-key must be a non-empty string (or unset for no authentication)")


def _string_list(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not all(isinstance(item, str) and item for item in value):
        raise ValueError(f"{attribute.name.replace('_', '-')} must be a list of non-empty strings (a JSON list such "
                         f"as '[\"*\"]' on the command line), got {list(value)!r}")


def _lora_modules(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    names = [m[0] for m in value]
    if not all(isinstance(m, tuple) and len(m) == 2 and all(isinstance(v, str) and v for v in m) for m in value):
        raise ValueError(f"lora-modules must be name=path pairs, got {list(value)!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"lora-modules names must be unique, got {names}")


def _log_level(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in LOG_LEVELS:
        raise ValueError(f"log-level must be one of {', '.join(LOG_LEVELS)}, got {value!r}")


def _tool_call_parser(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    from modelrunner.plugins import get_plugins

    try:
        get_plugins().tool_parser_class(value)
    except ValueError as e:  # an unknown name: the message lists the known ones
        raise ValueError(f"tool-call-parser: {e}") from None


@attrs.frozen(kw_only=True)
class ServeSettings:
    """Everything ``modelrunner serve`` needs; each value is checked on construction.

    :raises ValueError: naming the option and what it accepts.
    """

    model: str = "smollm2"
    """What ``LLM(model)`` loads: a local HF directory, a .gguf file or ``"smollm2"``."""
    config: dict[str, Any] = attrs.field(factory=dict)
    """Flat config keys for ``LLM(model, **config)`` (``--set key=value``)."""
    host: str = "127.0.0.1"
    """Address to listen on (loopback unless told otherwise)."""
    port: int = attrs.field(default=8000, validator=_port)
    """Port to listen on; 0 picks a free one."""
    api_key: str | None = attrs.field(default=None, validator=_api_key, repr=False)
    """Bearer token required on ``/v1/*``, ``/tokenize`` and ``/detokenize`` (None: no authentication)."""
    served_model_names: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_names)
    """Names clients may put in ``model``; the first is the one reported (empty: ``model`` itself)."""
    max_waiting_requests: int = attrs.field(default=DEFAULT_MAX_WAITING_REQUESTS, validator=_non_negative_int)
    """Requests that may wait beyond what the engine runs at once; more get 503 with Retry-After."""
    max_body_bytes: int = attrs.field(default=DEFAULT_MAX_BODY_BYTES, validator=_positive_int)
    """Largest request body; a larger one gets 413."""
    max_input_items: int = attrs.field(default=DEFAULT_MAX_INPUT_ITEMS, validator=_positive_int)
    """Most items in a ``/v1/responses`` ``input``; more get 400 before anything is tokenized."""
    max_stream_buffer: int = attrs.field(default=DEFAULT_MAX_STREAM_BUFFER, validator=_positive_int)
    """Outputs per prompt a streaming client may leave unread; past that its request is aborted
    (its KV blocks freed) and the stream ends with ``finish_reason: "abort"``."""
    grace_period_s: float = attrs.field(default=DEFAULT_GRACE_PERIOD_S, validator=_grace)
    """Seconds in-flight requests may run on after a shutdown signal before they are aborted."""
    chat_template: str | None = None
    """A Jinja chat template used instead of the tokenizer's."""
    trust_request_chat_template: bool = False
    """Let requests bring their own ``chat_template`` (off: such requests get 400, as in vLLM)."""
    log_level: str = attrs.field(default="warning", validator=_log_level)
    """Server log verbosity."""
    allowed_origins: tuple[str, ...] = attrs.field(default=("*",), converter=tuple, validator=_string_list)
    """CORS: origins whose browser pages may call the API (``*``: any; vLLM's default)."""
    allowed_methods: tuple[str, ...] = attrs.field(default=("*",), converter=tuple, validator=_string_list)
    """CORS: HTTP methods allowed from those origins (``*``: any)."""
    allowed_headers: tuple[str, ...] = attrs.field(default=("*",), converter=tuple, validator=_string_list)
    """CORS: request headers allowed from those origins (``*``: any)."""
    allow_credentials: bool = False
    """CORS: let browsers send cookies and HTTP authentication with cross-origin requests; refused with
    the any-origin ``*`` (it would let every website read a logged-in user's answers): list the origins."""
    enable_auto_tool_choice: bool = False
    """Serve ``tool_choice="auto"`` (and requests with tools but no ``tool_choice``): the model's text
    is parsed for calls by :attr:`tool_call_parser`, which it needs (vLLM's flag)."""
    tool_call_parser: str | None = attrs.field(default=None, validator=_tool_call_parser)
    """The tool-call parser (``hermes``, ``llama3_json``, ``mistral`` or a plugin's) that finds calls in
    the model's text for ``tool_choice="auto"``; it also writes earlier calls into the history of
    templates without tool support."""

    lora_modules: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=tuple, validator=_lora_modules)
    """LoRA adapters served from the start, ``(name, path)``: a request's ``model: "<name>"`` runs one
    (they need ``enable_lora`` in :attr:`config`)."""
    allow_runtime_lora_updating: bool = False
    """Serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM gates them with
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; here an explicit flag)."""

    def __attrs_post_init__(self) -> None:
        lora_on = bool(self.config.get("enable_lora"))
        if (self.lora_modules or self.allow_runtime_lora_updating) and not lora_on:
            raise ValueError("lora-modules and allow-runtime-lora-updating need --enable-lora")
        clash = sorted({name for name, _ in self.lora_modules} & set(self.model_names))
        if clash:
            raise ValueError(f"lora-modules name {clash[0]!r} is also the base model's served name; rename one")
        if self.allow_credentials and "*" in self.allowed_origins:
            raise ValueError("--allow-credentials with --allowed-origins '[\"*\"]' (the default) would let every "
                             "website read the answers of a user whose browser holds a cookie or login for this "
                             "server; name the origins your pages are served from, e.g. --allowed-origins "
                             "'[\"https://app.example\"]', or leave --allow-credentials off (an API key in the "
                             "Authorization header needs no credentials mode)")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable-auto-tool-choice needs --tool-call-parser NAME (e.g. hermes, llama3_json, "
                             "mistral; `modelrunner plugins` lists the installed ones)")

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names a request's ``model`` may take (the first is reported)."""
        return self.served_model_names or (self.model,)

    @property
    def model_name(self) -> str:
        """The name responses report."""
        return self.model_names[0]
