"""``modelrunner check PLUGIN [--json]``: every conformance suite that applies to one installed plugin."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_parser(subparsers: Any) -> None:
    """Add ``check`` to the CLI."""
    parser = subparsers.add_parser(
        "check", help="run the conformance suites of one installed plugin (every name it registered)")
    parser.add_argument("plugin", help="the plugin's entry-point name (as `modelrunner plugins` lists it)")
    parser.add_argument("--json", action="store_true", help="machine-readable results on stdout")
    parser.add_argument("--kind", action="append", default=None,
                        help="only these kinds (architectures, attention_backends, allocators, compile_backends, "
                             "quantization_methods, logits_processors, matmul_kernels); repeatable")


def run(args: argparse.Namespace) -> int:
    """Run the suites; exit status 1 when a check failed or the plugin registered nothing checkable."""
    from . import SUITES, suites_for_plugin

    if args.kind:
        unknown = [k for k in args.kind if k not in SUITES]
        if unknown:
            raise ValueError(f"unknown kind {unknown[0]!r}; kinds: {', '.join(SUITES)}")
    suites = [s for s in suites_for_plugin(args.plugin) if not args.kind or s.kind in args.kind]
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


def format_results(results: list[Any]) -> str:
    """A Markdown pass/fail table: suite, check, status, seconds, message."""
    lines = ["| suite | check | status | s | message |", "|---|---|---|---:|---|"]
    for r in results:
        status = "**FAILED**" if r.status == "failed" else r.status
        message = r.message.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.suite} | {r.check} | {status} | {r.seconds:.2f} | {message} |")
    return "\n".join(lines)
