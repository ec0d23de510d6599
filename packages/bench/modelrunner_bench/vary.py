"""``--vary KEY=V1,V2[,...]``: parsing, checking the keys, and the Cartesian product of configurations."""

from __future__ import annotations

import itertools
import json
from typing import Any


def known_config_keys() -> set[str]:
    """Every key ``LLM(model, **config)`` accepts: the flat keys, ``device`` and vLLM's aliases."""
    # The flat config keys and their vLLM aliases (internal: modelrunner.config).
    from modelrunner.config import FLAT_KEYS, VLLM_ALIASES

    return {*FLAT_KEYS, "device", "enforce_eager", *VLLM_ALIASES}


def check_config_keys(keys: list[str], option: str) -> None:
    """:raises ValueError: a key ``LLM`` does not accept, naming the option it came from and the closest key."""
    from modelrunner.api import did_you_mean

    known = known_config_keys()
    for key in keys:
        if key not in known:
            raise ValueError(f"{option}: unknown config key {key!r}{did_you_mean(key, known)}")


def split_top_level(raw: str) -> list[str]:
    """``raw`` split at the commas that are outside brackets, braces and double quotes, so JSON
    lists and dicts can be values (``compile_options={"a":1,"b":2},{}``)."""
    parts, depth, quoted, current = [], 0, False, []
    escaped = False
    for ch in raw:
        if quoted:
            escaped = ch == "\\" and not escaped
            if ch == '"' and not escaped:
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts]


def parse_vary(items: list[str]) -> list[tuple[str, list[Any]]]:
    """``["KEY=V1,V2", ...]`` (repeated ``--vary``) as ``[(key, [values])]``, values parsed like
    ``--set``'s (JSON when they parse as JSON, else strings).

    :raises ValueError: a malformed entry, an unknown key, an empty or repeated value, a key given twice.
    """
    # A --set value parses as the kernel CLI's does (internal: modelrunner.cli).
    from modelrunner.cli import parse_value

    out: list[tuple[str, list[Any]]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or not raw.strip():
            raise ValueError(f"--vary expects KEY=V1,V2[,...], got {item!r}")
        check_config_keys([key], f"--vary {item}")
        if key in (k for k, _ in out):
            raise ValueError(f"--vary {key} is given twice; list all its values in one --vary")
        texts = split_top_level(raw)
        if "" in texts:
            raise ValueError(f"--vary {item!r}: empty value (values are separated by single commas)")
        values = [parse_value(t) for t in texts]
        if len({json.dumps(v, sort_keys=True) for v in values}) < len(values):
            raise ValueError(f"--vary {item!r}: a value is repeated")
        out.append((key, values))
    return out


def configurations(vary: list[tuple[str, list[Any]]]) -> list[dict[str, Any]]:
    """The Cartesian product of the varied settings, first key slowest, in the order given."""
    keys = [k for k, _ in vary]
    return [dict(zip(keys, combo)) for combo in itertools.product(*(values for _, values in vary))]


def label(overrides: dict[str, Any]) -> str:
    """``key=value key=value``: a configuration's varied settings."""
    return " ".join(f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in overrides.items())
