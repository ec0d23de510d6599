"""``modelrunner bench latency | throughput | compare | serve``: the command line of the benchmarks.

Results go to stdout (a Markdown table) and, with ``--output-json FILE``, to a JSON report;
progress goes to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from modelrunner import ModelRunnerError

DEFAULTS = {"batch_size": 8, "num_prompts": 64, "input_len": 32, "output_len": 32}
"""Workload sizes when the options are not given (small: the machine is assumed to be a CPU)."""


def positive_int(text: str) -> int:
    """argparse type: an integer above 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """argparse type: an integer of 0 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every measuring command takes: model, config keys, repetitions, seed, threads, JSON."""
    parser.add_argument("--model", default="smollm2", help="HF directory, .gguf file or 'smollm2' (default)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any config key, repeatable (e.g. --set kv_allocator=contiguous --set dtype=float32)")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="unrecorded runs first (default 1)")
    parser.add_argument("--repeat", type=positive_int, default=5, help="recorded repetitions (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts (default 0)")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch CPU threads for the measured process (default: torch's own choice)")
    parser.add_argument("--output-json", metavar="FILE", default=None,
                        help="write the full report (config, machine, versions, every repetition) as JSON")


def _workload_arguments(parser: argparse.ArgumentParser, latency: bool, throughput: bool) -> None:
    if latency:
        parser.add_argument("--batch-size", type=positive_int, default=None,
                            help=f"prompts in the batch (default {DEFAULTS['batch_size']})")
    if throughput:
        parser.add_argument("--num-prompts", type=positive_int, default=None,
                            help=f"prompts (default {DEFAULTS['num_prompts']}; with --dataset: its first N, "
                                 "default all)")
        parser.add_argument("--dataset", metavar="FILE.jsonl", default=None,
                            help="prompts from a JSONL file: one {\"prompt\": text} or {\"prompt_token_ids\": [...]} "
                                 "per line, optionally with \"output_len\"")
    parser.add_argument("--input-len", type=positive_int, default=None,
                        help=f"tokens per synthetic prompt (default {DEFAULTS['input_len']})")
    parser.add_argument("--output-len", type=positive_int, default=None,
                        help=f"new tokens per prompt (default {DEFAULTS['output_len']})")


class _BenchParser(argparse.ArgumentParser):
    """The parser of ``bench``'s sub-commands; one made with ``pass_through=True`` parses nothing and
    keeps every argument in ``delegate_args``, for a delegate that defines its own options."""

    def __init__(self, *args: Any, pass_through: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pass_through = pass_through

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if not self.pass_through:
            return super().parse_known_args(args, namespace)
        namespace = namespace if namespace is not None else argparse.Namespace()
        namespace.delegate_args = list(sys.argv[1:] if args is None else args)
        return namespace, []


def add_parser(subparsers: Any) -> None:
    """Add ``bench`` and its sub-commands to the ``modelrunner`` parser."""
    bench = subparsers.add_parser("bench", help="measure and compare configurations on this machine",
                                  description="Measure latency or throughput of a configuration, or compare "
                                              "configurations (speed with confidence intervals, and outputs).")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="{latency,throughput,compare,serve}",
                               parser_class=_BenchParser)

    latency = sub.add_parser("latency", help="one batch: prefill time and per-step decode time",
                             description="One batch of synthetic prompts through the engine, step by step.")
    add_common_arguments(latency)
    _workload_arguments(latency, latency=True, throughput=False)

    throughput = sub.add_parser("throughput", help="offline throughput: output and total tokens/s",
                                description="Every prompt given to the engine at once; tokens per second.")
    add_common_arguments(throughput)
    _workload_arguments(throughput, latency=False, throughput=True)

    compare = sub.add_parser(
        "compare", help="compare configurations: speed ratios with 95%% intervals, and output agreement",
        description="Run the Cartesian product of the --vary settings, each configuration in its own process, "
                    "repetitions interleaved; report speed against the first configuration and whether the "
                    "greedy outputs match it.")
    add_common_arguments(compare)
    compare.add_argument("--vary", action="append", required=True, metavar="KEY=V1,V2[,...]",
                         help="a config key and the values to try, repeatable (the product of all is run)")
    compare.add_argument("--measure", choices=("throughput", "latency"), default="throughput",
                         help="what to measure per configuration (default throughput)")
    _workload_arguments(compare, latency=True, throughput=True)
    compare.add_argument("--plot", metavar="FILE.png", default=None,
                         help="write a chart of output tokens/s per configuration with its interval")
    compare.add_argument("--require-same-output", action="store_true",
                         help="exit with status 1 when any configuration's outputs differ from the baseline's")

    # The load generator's options are its own: they are parsed only once it is imported (bench serve).
    sub.add_parser("serve", pass_through=True, add_help=False,
                   help="load-test the HTTP server (delegates to modelrunner_serve.loadgen; see its --help)")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    # --set parses as the kernel CLI's own option does (internal: modelrunner.cli).
    from modelrunner.cli import config_overrides

    overrides = config_overrides(args.set)
    if "model" in overrides:
        raise ValueError("give the model with --model, not --set model=...")
    return overrides


def _workload(args: argparse.Namespace, measure: str) -> Any:
    from .workload import WorkloadSpec

    given = {name: getattr(args, name, None) for name in ("batch_size", "num_prompts", "dataset")}
    if measure == "latency":
        for name in ("num_prompts", "dataset"):
            if given[name] is not None:
                raise ValueError(f"--{name.replace('_', '-')} applies to throughput; latency runs one batch of "
                                 "--batch-size synthetic prompts")
        count = given["batch_size"] or DEFAULTS["batch_size"]
    else:
        if given["batch_size"] is not None:
            raise ValueError("--batch-size applies to latency; throughput takes --num-prompts")
        count = given["num_prompts"] or (None if given["dataset"] else DEFAULTS["num_prompts"])
    dataset = given["dataset"]
    if dataset and args.input_len is not None:
        raise ValueError("--input-len sets synthetic prompts' length; it does not apply with --dataset")
    input_len = None if dataset else args.input_len or DEFAULTS["input_len"]
    return WorkloadSpec(num_prompts=count, input_len=input_len,
                        output_len=args.output_len or DEFAULTS["output_len"], dataset=dataset, seed=args.seed)


def _spec(args: argparse.Namespace, measure: str) -> Any:
    from .session import BenchSpec

    return BenchSpec(measure=measure, model=args.model, config=_overrides(args), workload=_workload(args, measure),
                     threads=args.threads)


def _emit(result: dict[str, Any], markdown: str, args: argparse.Namespace) -> None:
    from .report import write_json

    sys.stdout.write(markdown)
    sys.stdout.flush()
    if args.output_json:
        write_json(args.output_json, result)


def _single(args: argparse.Namespace) -> int:
    from .report import markdown_single
    from .single import run_single

    result = run_single(_spec(args, args.bench_command), args.warmup, args.repeat)
    _emit(result, markdown_single(result), args)
    return 0


def _compare(args: argparse.Namespace) -> int:
    from .compare import run_compare
    from .report import markdown_compare, plot_compare
    from .vary import check_config_keys, parse_vary

    vary = parse_vary(args.vary)
    spec = _spec(args, args.measure)
    check_config_keys(list(spec.config), "--set")
    result = run_compare(spec, vary, args.warmup, args.repeat)
    _emit(result, markdown_compare(result), args)
    if args.plot:
        if result["baseline"] is None:
            print(f"modelrunner: no configuration ran, so no chart was written to {args.plot}", file=sys.stderr)
        else:
            plot_compare(result, args.plot)
    failed = bool(result["failed"]) or (args.require_same_output and bool(result["outputs_differ"]))
    return 1 if failed else 0


LOADGEN_MODULE = "modelrunner_serve.loadgen"
"""Where ``bench serve`` finds the load generator (``add_arguments(parser)``, ``run(args) -> int``): the
``modelrunner-serve`` distribution, imported by name only when it runs."""


def _serve(args: argparse.Namespace) -> int:
    try:
        loadgen = importlib.import_module(LOADGEN_MODULE)
    except ModuleNotFoundError as e:
        if e.name not in ("modelrunner_serve", LOADGEN_MODULE):
            raise  # the load generator is there but something it imports is not: show that
        raise ModelRunnerError(f"bench serve needs the HTTP server's load generator ({LOADGEN_MODULE}): pip install "
                               "modelrunner-serve; bench latency and bench throughput measure the engine offline"
                               ) from None
    parser = argparse.ArgumentParser(prog="modelrunner bench serve", description=loadgen.__doc__)
    loadgen.add_arguments(parser)
    return loadgen.run(parser.parse_args(args.delegate_args))


def run(args: argparse.Namespace) -> int:
    """Run the ``bench`` sub-command ``args`` selects; its exit status."""
    handlers = {"latency": _single, "throughput": _single, "compare": _compare, "serve": _serve}
    return handlers[args.bench_command](args)
