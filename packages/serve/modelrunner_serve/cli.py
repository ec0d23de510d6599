"""``modelrunner serve``: the command line of the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from .settings import (DEFAULT_GRACE_PERIOD_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_INPUT_ITEMS,
                       DEFAULT_MAX_STREAM_BUFFER, DEFAULT_MAX_WAITING_REQUESTS, LOG_LEVELS)

if TYPE_CHECKING:
    from .settings import ServeSettings

API_KEY_ENV = "MODELRUNNER_API_KEY"
"""Environment variable read when ``--api-key`` is not given (other users can read a command line
in ``ps``, not the environment)."""
VLLM_API_KEY_ENV = "VLLM_API_KEY"
"""vLLM's variable for the same, read when neither ``--api-key`` nor :data:`API_KEY_ENV` is set."""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand and its options."""
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
                    "/v1/responses, /v1/models, /tokenize, /detokenize, /health, /metrics) until SIGINT/SIGTERM.")
    p.add_argument("--model", default="smollm2", help="HF directory, .gguf file or 'smollm2' (default)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, /docs and "
                        f"/openapi.json (default: ${API_KEY_ENV}, else ${VLLM_API_KEY_ENV}; prefer those: "
                        "other users see a command line in ps)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) clients use as 'model' (default: --model); the first is reported")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any config key (e.g. --set max_model_len=4096 --set max_num_seqs=64)")
    p.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS, metavar="N",
                   help="requests that may wait beyond the max_num_seqs running; more get 503 with Retry-After "
                        f"(default {DEFAULT_MAX_WAITING_REQUESTS})")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--max-input-items", type=int, default=DEFAULT_MAX_INPUT_ITEMS, metavar="N",
                   help="most items in a /v1/responses input; more get 400 before anything is tokenized "
                        f"(default {DEFAULT_MAX_INPUT_ITEMS})")
    p.add_argument("--max-stream-buffer", type=int, default=DEFAULT_MAX_STREAM_BUFFER, metavar="N",
                   help="outputs per prompt a streaming client may leave unread before its request is aborted "
                        f"(default {DEFAULT_MAX_STREAM_BUFFER})")
    p.add_argument("--grace-period", type=float, default=DEFAULT_GRACE_PERIOD_S, metavar="SECONDS",
                   help="after SIGINT/SIGTERM, how long in-flight requests may finish before they are aborted "
                        f"(default {DEFAULT_GRACE_PERIOD_S:g})")
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (or a file holding one) instead of the tokenizer's")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat_template (refused by default)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning",
                   help="server log verbosity (info adds the access log; default warning)")
    dp = p.add_argument_group("data parallelism (vLLM's options; docs/guide/scaling.md)")
    dp.add_argument("--data-parallel-size", "-dp", type=int, default=None, metavar="N",
                    help="engine replicas, each a process of its own (and each a tensor x pipeline group), behind "
                         "this one API (default 1)")
    dp.add_argument("--data-parallel-size-local", "-dpl", type=int, default=None, metavar="N",
                    help="replicas this machine runs (default: all); the others join with --headless")
    dp.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=None, metavar="RANK",
                    help="data-parallel rank of this machine's first replica (on --headless machines)")
    dp.add_argument("--data-parallel-address", "-dpa", default=None, metavar="HOST",
                    help="address the front listens on for its replicas (default 127.0.0.1: this machine only)")
    dp.add_argument("--data-parallel-rpc-port", "-dpp", type=int, default=None, metavar="PORT",
                    help="port the front listens on for its replicas (default: a free one, this machine only)")
    dp.add_argument("--headless", action="store_true",
                    help="serve no API: run this machine's replicas for the front at --data-parallel-address")
    cors = p.add_argument_group("CORS (vLLM's options and defaults)")
    cors.add_argument("--allowed-origins", type=string_list, default=["*"], metavar="JSON_LIST",
                      help='origins whose pages may call the API, e.g. \'["https://app.example"]\' (default ["*"])')
    cors.add_argument("--allowed-methods", type=string_list, default=["*"], metavar="JSON_LIST",
                      help='HTTP methods allowed cross-origin (default ["*"])')
    cors.add_argument("--allowed-headers", type=string_list, default=["*"], metavar="JSON_LIST",
                      help='request headers allowed cross-origin (default ["*"])')
    cors.add_argument("--allow-credentials", action="store_true",
                      help="let browsers send cookies and HTTP authentication cross-origin (default off; needs "
                           "--allowed-origins listing the origins: refused with '*')")
    p.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' (see docs/guide/speculative.md)')
    tools = p.add_argument_group("tool calling (vLLM's options)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='serve tool_choice "auto" (the default with tools): the model\'s own text is parsed '
                            'for calls by --tool-call-parser; "required" and named functions work without it')
    tools.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="the tool-call parser for the model's format: hermes (Qwen, Hermes), llama3_json, "
                            "mistral, or a plugin's (modelrunner plugins lists them)")
    lora = p.add_argument_group("LoRA adapters (vLLM's options)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters over the base model")
    lora.add_argument("--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=PATH",
                      help='adapters served from the start: name=path, or vLLM\'s JSON form '
                           '\'{"name": ..., "path": ...}\'; a request\'s "model": NAME selects one')
    lora.add_argument("--max-loras", type=int, default=None, metavar="N", help="most adapters in one step (default 1)")
    lora.add_argument("--max-lora-rank", type=int, default=None, metavar="R", help="highest adapter rank (default 16)")
    lora.add_argument("--max-cpu-loras", type=int, default=None, metavar="N",
                      help="adapters kept read in memory (default --max-loras)")
    lora.add_argument("--allow-runtime-lora-updating", action="store_true",
                      help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default)")
    return p


def speculative_config(text: str) -> dict:
    """``--speculative-config``: a JSON object, checked as ``LLM(speculative_config=...)`` checks it.

    :raises argparse.ArgumentTypeError: not a JSON object, or a key or value the config refuses.
    """
    import json

    from modelrunner.config import SpeculativeConfig

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}); e.g. '{{\"method\": \"ngram\", "
                                         "\"num_speculative_tokens\": 4}'") from None
    try:
        SpeculativeConfig.from_dict(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value
def lora_module(text: str) -> tuple[str, str]:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON ``{"name": ..., "path": ...}``.

    :raises argparse.ArgumentTypeError: neither form.
    """
    import json

    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object ({e}); accepted: name=path or "
                                             '\'{"name": "sql", "path": "/adapters/sql"}\'') from None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(
                value.get("path"), str) or not value["name"] or not value["path"]:
            raise argparse.ArgumentTypeError(f"a JSON lora module needs string 'name' and 'path', got {text!r}")
        return value["name"], value["path"]
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected name=path (or vLLM's JSON form), got {text!r}")
    return name.strip(), path.strip()


def string_list(text: str) -> list[str]:
    """A CORS option's value: a JSON list of strings as vLLM takes it (``'["*"]'``), or one bare value
    or a comma-separated list (``*``, ``GET,POST``).

    :raises argparse.ArgumentTypeError: for JSON that is not a list of strings.
    """
    import json

    if text.lstrip().startswith("["):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not a JSON list ({e}); accepted: e.g. '[\"*\"]' or "
                                             "'[\"https://a.example\", \"https://b.example\"]'") from None
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise argparse.ArgumentTypeError(f"expected a JSON list of non-empty strings, got {text!r}")
        return value
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a JSON list of strings such as '[\"*\"]', got an empty value")
    return items


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """The :class:`~.settings.ServeSettings` the command line asks for.

    :raises ValueError: a bad option value or config key (one line, naming it).
    """
    from modelrunner.cli import config_overrides
    from modelrunner.config import RunnerConfig
    from .settings import ServeSettings

    config = config_overrides(args.set)
    if args.speculative_config is not None:
        config["speculative_config"] = args.speculative_config
    if args.enable_lora:
        config["enable_lora"] = True
    for key in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    for flag in DATA_PARALLEL_FLAGS:
        if getattr(args, flag, None) is not None:
            config[flag] = getattr(args, flag)
    RunnerConfig.from_dict({"model": args.model, **config})  # a bad --set fails now, before binding
    template = args.chat_template
    if template is not None and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            template = f.read()
    return ServeSettings(
        model=args.model, config=config, host=args.host, port=args.port,
        api_key=api_key_from(args.api_key),
        served_model_names=tuple(args.served_model_name or ()), max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_body_bytes, max_input_items=args.max_input_items,
        max_stream_buffer=args.max_stream_buffer,
        grace_period_s=args.grace_period, chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template, log_level=args.log_level,
        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, allow_credentials=args.allow_credentials,
        enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
        lora_modules=tuple(args.lora_modules), allow_runtime_lora_updating=args.allow_runtime_lora_updating)


DATA_PARALLEL_FLAGS = ("data_parallel_size", "data_parallel_size_local", "data_parallel_start_rank",
                       "data_parallel_address", "data_parallel_rpc_port")
"""The ``--data-parallel-*`` options: each sets the config key of its name."""


def api_key_from(option: str | None) -> str | None:
    """The server's key: ``--api-key``, else ``$MODELRUNNER_API_KEY``, else ``$VLLM_API_KEY`` (None: no key)."""
    if option is not None:
        return option
    return os.environ.get(API_KEY_ENV) or os.environ.get(VLLM_API_KEY_ENV) or None


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM: 0 after a clean shutdown, 2 when the model cannot be loaded."""
    import sys

    from .server import serve

    if args.headless:
        from modelrunner.config import RunnerConfig
        from modelrunner_data_parallel import run_headless

        settings = settings_from_args(args)
        return run_headless(RunnerConfig.from_dict({"model": settings.model, **settings.config}))
    if args.api_key is not None:
        print(f"modelrunner: warning: --api-key is visible to other users of this machine (ps); set "
              f"${API_KEY_ENV} instead", file=sys.stderr, flush=True)
    return serve(settings_from_args(args))
