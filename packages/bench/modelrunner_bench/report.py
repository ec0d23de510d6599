"""How results are shown: a Markdown table (stdout), the JSON report, a PNG chart."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MIN_REPEATS_FOR_INTERVALS = 5
"""Below this many repetitions an interval is little more than the range of the rounds: say so."""


def format_value(metric: str, value: float | None) -> str:
    """A metric's value with its unit: rates as ``123.4/s``, times in ms or s, counts as integers."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if metric.endswith("_per_s"):
        return f"{value:,.1f}/s"
    if metric.endswith("_s"):
        return f"{value * 1e3:,.2f} ms" if abs(value) < 1 else f"{value:,.3f} s"
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.4g}"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def workload_line(measure: str, workload: dict[str, Any]) -> str:
    """One line saying what ran: prompts, lengths, source."""
    n = workload.get("num_prompts")
    if workload.get("dataset"):
        what = f"{n} prompts from {workload['dataset']} ({workload.get('prompt_tokens')} prompt tokens)"
    else:
        what = f"{n} prompts × {workload.get('input_len')} tokens (synthetic, seed {workload.get('seed')})"
    if measure == "latency":
        what = f"one batch of {what}"
    total = workload.get("output_tokens")
    new = f"{total} new tokens in all" if total is not None else f"{workload.get('output_len')} new tokens each"
    constrained = workload.get("constrained_prompts")
    if constrained:
        return (f"{what} → up to {new}, greedy; {constrained} constrained by structured_outputs (ending where "
                "their grammar ends), EOS ignored by the others")
    return f"{what} → {new}, greedy, EOS ignored"


def machine_line(result: dict[str, Any]) -> str:
    """CPU, cores, threads and the load average before → after."""
    m = result["machine"]
    before, after = m.get("load_average_before"), m.get("load_average_after")
    load = f"load average {before[0]:.2f} → {after[0]:.2f}" if before and after else "load average unknown"
    v = result["versions"]
    threads = m["threads"] if m["threads"] is not None else "?"
    return (f"{m['cpu_model']}, {m['usable_cores']} usable cores, {threads} thread(s) per run; {load}; "
            f"modelrunner {v['modelrunner']}, torch {v['torch']}, {v['os']}")


def _noise_lines(result: dict[str, Any]) -> list[str]:
    if not result["noisy"]:
        return []
    return ["", "**NOISY MACHINE** — treat these numbers with suspicion:",
            *[f"- {reason}" for reason in result["noise_reasons"]]]


def markdown_single(result: dict[str, Any]) -> str:
    """The report of ``bench latency`` / ``bench throughput`` as Markdown."""
    s = result["settings"]
    lines = [
        f"## bench {result['command']}: {result['model']}",
        "",
        workload_line(result["command"], result["workload"]),
        f"{s['repeat']} repetition(s) after {s['warmup']} warm-up(s); {machine_line(result)}",
        (f"attention {result['resolved']['attention_backend']}, compile {result['resolved']['compile_backend']}, "
         f"allocator {result['resolved']['kv_allocator']}, {result['resolved']['dtype']}; loaded in "
         f"{result['load_s']:.1f} s"),
        "",
        "| metric | median | min | max | spread |",
        "|---|---:|---:|---:|---:|",
    ]
    for metric, summary in result["summary"].items():
        lines.append(f"| {metric} | {format_value(metric, summary['median'])} | {format_value(metric, summary['min'])} "
                     f"| {format_value(metric, summary['max'])} | {summary['spread']:.1%} |")
    if not result["outputs"]["stable_across_repetitions"]:
        lines += ["", "**Outputs changed between repetitions** (greedy decoding should repeat exactly)."]
    return "\n".join(lines + _noise_lines(result)) + "\n"


def _ratio_cell(entry: dict[str, Any]) -> tuple[str, str]:
    ratio = entry["speed_ratio"]
    if ratio["verdict"] == "baseline":
        return "1.00× (baseline)", "baseline"
    if ratio["low"] is None:
        return f"{ratio['ratio']:.2f}×", ratio["verdict"]
    return f"{ratio['ratio']:.2f}× [{ratio['low']:.2f}, {ratio['high']:.2f}]", ratio["verdict"]


def _outputs_cell(entry: dict[str, Any]) -> str:
    out = entry["outputs"]
    if entry["speed_ratio"]["verdict"] == "baseline":
        return "baseline" if out["stable_across_repetitions"] else "**baseline changes between repetitions**"
    if not out["comparable"]:
        return f"not comparable: {out['reason']}"
    agreement = f"{out['token_agreement']:.1%} of tokens ({out['identical_prompts']}/{out['num_prompts']} prompts identical)"
    if out["same_as_baseline"]:
        return f"same: {agreement}"
    if not out["stable_across_repetitions"]:
        agreement += "; changes between repetitions"
    return f"**OUTPUTS DIFFER**: {agreement}"


def markdown_compare(result: dict[str, Any]) -> str:
    """The report of ``bench compare`` as Markdown: one row per configuration."""
    s = result["settings"]
    primary = result["primary_metric"]
    direction = "higher" if primary["higher_is_better"] else "lower"
    base = result["baseline"]
    lines = [
        f"## bench compare ({result['measure']}): {result['model']}",
        "",
        workload_line(result["measure"], result["workload"]),
        (f"{s['repeat']} repetition(s) per configuration after {s['warmup']} warm-up(s), interleaved round by "
         "round, each configuration in its own process"),
        machine_line(result),
        "",
        (f"| # | configuration | status | {primary['name']} (median) | spread | "
         f"speed vs #{base if base is not None else '–'} (95% CI) | verdict | outputs vs baseline |"),
        "|---:|---|---|---:|---:|---|---|---|",
    ]
    for e in result["configurations"]:
        if e["status"] != "ok":
            lines.append(f"| {e['index']} | {_cell(e['label'])} | **failed** ({e['failed_during']}): {_cell(e['error'])} "
                         "| – | – | – | – | – |")
            continue
        summary = e["summary"][primary["name"]]
        ratio, verdict = _ratio_cell(e)
        lines.append(f"| {e['index']} | {_cell(e['label'])} | ok | {format_value(primary['name'], summary['median'])} | "
                     f"{summary['spread']:.1%} | {ratio} | {verdict} | {_cell(_outputs_cell(e))} |")
    lines += ["", (f"Speed is the ratio of {primary['name']} ({direction} is better) to the baseline's, round by "
                   "round (> 1: faster); the interval is a paired bootstrap over rounds. An interval containing 1 is "
                   "\"no measurable difference\".")]
    if s["repeat"] < MIN_REPEATS_FOR_INTERVALS:
        few = "there is no interval" if s["repeat"] == 1 else "the interval is about the range of the rounds"
        lines.append(f"With {s['repeat']} repetition(s) {few}: use --repeat {MIN_REPEATS_FOR_INTERVALS} or more "
                     "for a real confidence interval.")
    differ = [e for e in result["configurations"] if e["index"] in result["outputs_differ"]]
    if differ:
        names = ", ".join(f"#{e['index']} ({e['label']})" for e in differ)
        lines += ["", f"**Outputs differ from the baseline** for {names}: its speed is not a like-for-like win."]
    return "\n".join(lines + _noise_lines(result)) + "\n"


def write_json(path: str | Path, result: dict[str, Any]) -> None:
    """Write the report as indented JSON (non-finite numbers as null, so any JSON reader accepts it)."""
    Path(path).write_text(json.dumps(_finite(result), indent=2) + "\n", encoding="utf-8")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def plot_compare(result: dict[str, Any], path: str | Path, metric: str = "output_tokens_per_s") -> None:
    """A PNG bar chart: each configuration's median ``metric`` with its 95% bootstrap interval, its
    speed ratio written above it; configurations whose outputs differ are hatched and red, failed
    ones marked as such.

    :raises ValueError: matplotlib is missing (``pip install matplotlib``).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install matplotlib (or modelrunner-bench[plot])") from e
    entries = result["configurations"]
    fig, ax = plt.subplots(figsize=(max(6.0, 2.0 * len(entries)), 4.8))
    top = 0.0
    for x, e in enumerate(entries):
        if e["status"] != "ok":
            ax.text(x, 0, f"failed\n({e['failed_during']})", ha="center", va="bottom", color="gray")
            continue
        median = e["summary"][metric]["median"]
        interval = e["median_interval"].get(metric)
        low, high = interval if interval else (median, median)
        differs = e["index"] in result["outputs_differ"]
        ax.bar(x, median, color="tab:red" if differs else "tab:blue", hatch="//" if differs else None,
               yerr=[[median - low], [high - median]], capsize=6)
        ratio, _ = _ratio_cell(e)
        note = ratio + ("\noutputs differ" if differs else "")
        ax.text(x, high, note, ha="center", va="bottom", fontsize=8)
        top = max(top, high)
    ax.set_ylim(0, top * 1.25 if top else 1)
    ax.set_xlim(-0.6, len(entries) - 0.4)
    values = ["\n".join(v if isinstance(v, str) else json.dumps(v) for v in e["overrides"].values()) for e in entries]
    ax.set_xticks(range(len(entries)), [f"#{e['index']}\n{v}" for e, v in zip(entries, values)], fontsize=8)
    ax.set_xlabel(" / ".join(result["vary"]))
    ax.set_ylabel(f"{metric.removesuffix('_per_s').replace('_', ' ')}/s (median, 95% interval)")
    ax.set_title(f"bench compare ({result['measure']}): {Path(str(result['model'])).name}, "
                 f"{result['settings']['repeat']} repetitions")
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)
