"""The ``modelrunner`` command: ``generate`` and ``plugins``, and the subcommands installed distributions
declare (entry-point group ``modelrunner.subcommands``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from importlib.metadata import entry_points
from typing import Any

from .engine.input_processor import check_unicode
from .errors import DEBUG_ENV, error_line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelrunner", description="Run LLMs through pluggable adapters.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--model", default="smollm2", help="HF directory, .gguf file or 'smollm2' (default)")
    gen.add_argument("--max-tokens", type=int, default=64, help="most new tokens (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    gen.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest (default off)")
    gen.add_argument("--seed", type=int, default=None, help="seed for sampling")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--image", action="append", default=[], metavar="PATH",
                     help="an image for the prompt's next image placeholder (e.g. <image>); repeatable, in order")
    gen.add_argument("--stats", action="store_true", help="print KV-cache statistics to stderr afterwards")
    gen.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="any config key (e.g. --set kv_allocator=contiguous --set dtype=float32)")

    plugins = sub.add_parser("plugins", help="list installed plugins, their hooks and names")
    plugins.add_argument("--json", action="store_true", help="machine-readable output")
    plugins.add_argument("--check", action="store_true",
                         help="exit with status 1 when a plugin is broken or two plugins claim one name (for CI)")
    plugins.add_argument("--matrix", action="store_true",
                         help="what every name supports (devices, dtypes, sliding windows, prefix caching, parallelism, "
                              "quantization), one table per kind")
    return parser


def parse_value(raw: str) -> Any:
    """A ``--set`` value: JSON when it parses as JSON (numbers, booleans, lists, dicts), else the string."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def config_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["key=value", ...]`` (repeated ``--set`` options) as a flat config dict.

    :raises ValueError: an entry without ``=``.
    """
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects KEY=VALUE, got {pair!r}")
        out[key] = parse_value(value)
    return out


def _open_images(paths: list[str]) -> list[Any]:
    """The ``--image`` files as PIL images, read in full now so a bad file fails before the model loads."""
    if not paths:
        return []
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as e:
        raise ValueError("--image needs Pillow; run: pip install pillow") from e
    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                image.load()
                images.append(image.copy())
        except UnidentifiedImageError:
            raise ValueError(f"--image {path}: not an image file (Pillow recognises no image format in it)") from None
        except OSError as e:
            raise ValueError(f"--image {path}: cannot read it as an image ({e})") from None
    return images


def _generate(args: argparse.Namespace) -> int:
    from .engine.sampling_params import SamplingParams  # lazy: torch (the CLI's help and plugins need none)
    from .llm import LLM  # lazy: torch

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    check_unicode("the prompt", args.prompt)
    images = _open_images(args.image)
    llm = LLM(model=args.model, **config_overrides(args.set))
    summary = llm.stats().get("quantization", {}).get("summary")
    if summary:  # what a GGUF file's tensors became (as stored, or dequantized to what)
        print(f"modelrunner: {args.model}: {summary}", file=sys.stderr, flush=True)
    request: Any = {"prompt": args.prompt}
    if args.chat:
        request = llm.chat_prompt([{"role": "user", "content": args.prompt}])
    if images:
        request["images"] = images
    for delta in llm.generate_stream(request, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        _print_stats(llm)
    return 0


def _print_stats(llm: Any) -> None:
    """KV-cache statistics, then the runner's (weights, quantization kernels, compile), to stderr."""
    stats = dict(llm.memory_stats())
    for section, values in llm.runner.stats().items():
        if isinstance(values, dict):
            stats.update(_flatten(values, section))
    width = max(len(k) for k in stats)
    for key, value in stats.items():
        shown = f"{value:.4f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}", file=sys.stderr)


def _flatten(values: dict, prefix: str) -> dict:
    out: dict = {}
    for key, value in values.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict) and value:
            out.update(_flatten(value, name))
        else:
            out[name] = value
    return out


def _plugins(args: argparse.Namespace) -> int:
    from .plugins import get_plugins  # lazy: torch (plugins imports it; `modelrunner --help` needs none)

    plugins = get_plugins()
    infos = plugins.list()
    problems = plugins.problems()
    if args.matrix:
        from .capabilities import capability_matrix, format_matrix  # lazy: torch

        matrix = capability_matrix(plugins)
        print(json.dumps(matrix, indent=2) if args.json else format_matrix(matrix), end="" if not args.json else "\n")
    elif args.json:
        print(json.dumps([i.as_dict() for i in infos], indent=2))
    else:
        for info in infos:
            status = f"BROKEN: {info.error}" if info.error else ", ".join(info.hooks)
            print(f"{info.name}  ({info.distribution} {info.version})  hooks: {status}")
            for kind, names in info.provides.items():
                print(f"    {kind}: {', '.join(names)}")
        for kind, name, owners in plugins.registry.conflicts():
            what = kind.rstrip("s").replace("_", " ")
            choose = "adapter=<plugin>" if kind == "architectures" else f"'<plugin>:{name}'"
            print(f"CONFLICT: {what} {name!r} is provided by {', '.join(owners)}; choose with {choose}")
    if args.check and problems:
        for line in problems:
            print(f"modelrunner: check failed: {line}", file=sys.stderr)
        return 1
    return 0


SUBCOMMAND_GROUP = "modelrunner.subcommands"
"""Entry-point group of the subcommands that live in modules of their own (``serve`` from
``modelrunner-serve``, ``bench`` from ``modelrunner-bench``, ``check`` and ``new-plugin`` from
``modelrunner-kit``): each names a module with ``add_parser(subparsers)`` and ``run(args) -> int``."""

ELSEWHERE = {"serve": "modelrunner-serve", "bench": "modelrunner-bench", "check": "modelrunner-kit",
             "new-plugin": "modelrunner-kit"}
"""Subcommands other distributions provide, with the distribution: when it is not installed, the
command says what to install instead of being unknown."""


def _subcommands() -> dict[str, Any]:
    """The installed subcommands by name: their modules, or the error that stopped one importing."""
    import importlib

    modules: dict[str, Any] = {}
    for ep in sorted(entry_points(group=SUBCOMMAND_GROUP), key=lambda ep: ep.name):
        if ep.name in modules:
            continue  # the first distribution to declare a name keeps it
        try:
            modules[ep.name] = importlib.import_module(ep.value)
        except Exception as e:  # noqa: BLE001 - reported when that command runs, the others still work
            dist = getattr(ep.dist, "name", None) or "its distribution"
            modules[ep.name] = _Broken(ep.name, f"{dist} installs it, but {ep.value} failed to import: "
                                                f"{type(e).__name__}: {e}", f"broken ({dist}): run it to see why")
    return modules


class _Broken:
    """A subcommand that cannot run here: running it, with any arguments, prints why."""

    def __init__(self, name: str, message: str, summary: str) -> None:
        self.name, self.message, self.summary = name, message, summary

    def add_parser(self, subparsers: argparse._SubParsersAction) -> None:
        """Add ``name`` (its arguments, ``--help`` included, end up unparsed: see :func:`main`)."""
        subparsers.add_parser(self.name, help=self.summary, add_help=False)

    def run(self, args: argparse.Namespace) -> int:
        """Say why the command cannot run; exit status 2."""
        print(f"modelrunner: error: {self.message}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``modelrunner`` console script: every error is one line on stderr, exit 2
    (``MODELRUNNER_DEBUG=1`` adds the traceback)."""
    parser = _parser()
    modules = _subcommands()
    for name, dist in ELSEWHERE.items():
        if name not in modules:
            modules[name] = _Broken(name, f"'modelrunner {name}' needs the {dist} distribution: "
                                          f"pip install {dist}", f"not installed: pip install {dist}")
    commands = {"generate": _generate, "plugins": _plugins}
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, module in modules.items():
        module.add_parser(subparsers)
        commands[name] = module.run
    args, unparsed = parser.parse_known_args(argv)
    if unparsed and not isinstance(modules.get(args.command), _Broken):
        parser.error(f"unrecognized arguments: {' '.join(unparsed)}")  # what parse_args would say
    if os.environ.get(DEBUG_ENV):
        logging.basicConfig(level=logging.INFO, format="modelrunner: %(name)s: %(message)s")
    try:
        return commands[args.command](args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - the CLI's contract: one line, never a raw traceback
        if os.environ.get(DEBUG_ENV):
            traceback.print_exc()
        print(f"modelrunner: error: {error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
