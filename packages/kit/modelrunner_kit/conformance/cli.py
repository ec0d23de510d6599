"""``modelrunner check PLUGIN [--json] [--config KEY=VALUE|PATH] [--checkpoint DIR] [--device DEVICE]``:
every conformance suite that applies to one installed plugin."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Add ``check`` to the CLI."""
    parser = subparsers.add_parser(
        "check", help="run the conformance suites of one installed plugin (every name it registered)")
    parser.add_argument("plugin", help="the plugin's entry-point name (as `modelrunner plugins` lists it)")
    parser.add_argument("--json", action="store_true", help="machine-readable results on stdout")
    parser.add_argument("--config", action="append", default=None, metavar="KEY=VALUE|PATH",
                        help="the adapter suite's model config: KEY=VALUE overrides the suite's tiny config "
                             "(use_parallel_residual=false; values are JSON, else strings), PATH a transformers "
                             "config JSON (or a folder with config.json) to build the tiny checkpoint from; "
                             "repeatable")
    parser.add_argument("--checkpoint", default=None, metavar="DIR",
                        help="a real checkpoint on disk (an HF folder, or a .gguf file for a quantization method) "
                             "to run the adapter and quantization suites on instead of tiny ones")
    parser.add_argument("--device", default=None, metavar="DEVICE",
                        help="where the adapter, attention-backend and compile-backend suites run (cpu, cuda, "
                             "cuda:N; default cpu); the other suites run on the CPU")
    parser.add_argument("--kind", action="append", default=None,
                        help="only these kinds (architectures, attention_backends, allocators, compile_backends, "
                             "quantization_methods, logits_processors, matmul_kernels, grammar_backends, tool_parsers, proposers, lora_kernels, executors, "
                             "pooling_methods); repeatable")


def run(args: argparse.Namespace) -> int:
    """Run the suites; exit status 1 when a check failed or the plugin registered nothing checkable.

    :raises ValueError: a usage error (an unknown kind, a ``--config`` field the config lacks, a missing
        ``--checkpoint``, a bad ``--device``): the CLI prints it as one line and exits 2.
    """
    from . import SUITES, suites_for_plugin
    from .models import UnknownConfigField

    if args.kind:
        unknown = [k for k in args.kind if k not in SUITES]
        if unknown:
            raise ValueError(f"unknown kind {unknown[0]!r}; kinds: {', '.join(SUITES)}")
    options: dict[str, Any] = {}
    if args.config:
        options["config"] = parse_config(args.config)
    if args.checkpoint:
        if not Path(args.checkpoint).exists():
            raise ValueError(f"--checkpoint {args.checkpoint}: no such file or folder")
        options["checkpoint"] = args.checkpoint
    if args.device:
        import torch

        if not (args.device in ("cpu", "cuda") or (args.device.startswith("cuda:") and args.device[5:].isdigit())):
            raise ValueError(f"--device {args.device!r}: expected cpu, cuda or cuda:N")
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {args.device}: this torch has no CUDA device (torch.cuda.is_available() is False)")
        options["device"] = str(device)
    suites = [s for s in suites_for_plugin(args.plugin, **options) if not args.kind or s.kind in args.kind]
    for checked in suites:
        check_overrides = getattr(checked, "check_config", None)
        if callable(check_overrides):
            try:
                check_overrides()  # an unknown --config field is a usage error, not a failure of every check
            except UnknownConfigField as exc:
                raise ValueError(f"--config {exc.key}=...: {exc}") from None
    if not suites:
        print(f"modelrunner: plugin {args.plugin!r} registers no name a conformance suite checks", file=sys.stderr)
        return 1
    results = []
    for suite in suites:
        print(f"checking {suite.title} …", file=sys.stderr)
        results += suite.run(progress=lambda r: print(f"  {r.status:<7} {r.check}", file=sys.stderr))
    failed = [r for r in results if r.status == "failed"]
    if args.json:
        print(json.dumps({"plugin": args.plugin, "passed": not failed, "results": [r.as_dict() for r in results]},
                         indent=2))
    else:
        print(format_results(results))
        counts = {s: sum(r.status == s for r in results) for s in ("passed", "failed", "skipped")}
        print(f"{args.plugin}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    return 1 if failed else 0


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return {"True": True, "False": False, "None": None}.get(text, text)


def parse_config(values: list[str]) -> Any:
    """``--config`` values → what the adapter suite takes as ``config=``: a dict of overrides, a path,
    or (a path and overrides) the config read from the path with the overrides set.

    :raises ValueError: two paths, an override without a name, or a field the config lacks.
    """
    overrides = {}
    paths = []
    for value in values:
        key, sep, text = value.partition("=")
        if sep and key.strip().isidentifier():
            overrides[key.strip()] = _value(text.strip())
        elif sep:
            raise ValueError(f"--config {value!r}: expected KEY=VALUE with a config field name, or a path")
        else:
            paths.append(value)
    if len(paths) > 1:
        raise ValueError(f"--config names two config files ({paths[0]}, {paths[1]}); give one")
    if not paths:
        return overrides
    if not overrides:
        return paths[0]
    from .models import UnknownConfigField, has_field, load_config

    config = load_config(paths[0])
    for key, value in overrides.items():
        if not has_field(config, key):
            raise ValueError(f"--config {key}={value!r}: {UnknownConfigField(config, key, value)}")
        setattr(config, key, value)
    return config


def format_results(results: list[Any]) -> str:
    """A Markdown pass/fail table: suite, check, status, seconds, message."""
    lines = ["| suite | check | status | s | message |", "|---|---|---|---:|---|"]
    for r in results:
        status = "**FAILED**" if r.status == "failed" else r.status
        message = r.message.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.suite} | {r.check} | {status} | {r.seconds:.2f} | {message} |")
    return "\n".join(lines)
