"""mkdocs hook: writes the reference tables of attrs classes from the classes themselves.

A page holding ``<!-- config-reference -->`` gets, in its place, one table per config section: each
flat key ``LLM(**config)`` accepts, its default and the field's docstring — read from
``modelrunner.config`` at build time, so the reference cannot fall behind the code. A page holding
``<!-- sampling-params -->`` gets the table of every ``SamplingParams`` field the same way (so a new
sampling parameter is documented by its own docstring).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from typing import Any

import attrs

MARKER = "<!-- config-reference -->"
SAMPLING_MARKER = "<!-- sampling-params -->"


def field_docs(cls: type) -> dict[str, str]:
    """Field name → the docstring written under it in ``cls``'s source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(field: attrs.Attribute) -> str:
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        default = default.factory()
    if attrs.has(type(default)):
        return "(section)"
    return f"`{default!r}`"


def _cell(text: str) -> str:
    # Sphinx roles (:meth:`~x.y`) read as code here.
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("|", "\\|")


def render() -> str:
    """The reference's tables, as Markdown."""
    from modelrunner import config

    sections: dict[str, list[tuple[str, attrs.Attribute]]] = {}
    for flat, (section, name) in config.FLAT_KEYS.items():
        cls = config._SECTIONS[section]
        sections.setdefault(section, []).append((flat, attrs.fields_dict(cls)[name]))
    out = []
    for section, entries in sections.items():
        cls = config._SECTIONS[section]
        docs = field_docs(cls)
        out += [f"### `{cls.__name__}`", "", " ".join((cls.__doc__ or "").split()), "",
                "| key | field | default | meaning |", "|---|---|---|---|"]
        for flat, field in entries:
            out.append(f"| `{flat}` | `{field.name}` | {_cell(_default(field))} | {_cell(docs.get(field.name, ''))} |")
        out.append("")
    runner_docs = field_docs(config.RunnerConfig)
    top = [f for f in attrs.fields(config.RunnerConfig) if f.name not in config._SECTIONS]
    if top:
        out += ["### `RunnerConfig`", "", "| key | default | meaning |", "|---|---|---|"]
        out += [f"| `{f.name}` | {_cell(_default(f))} | {_cell(runner_docs.get(f.name, ''))} |" for f in top]
        out.append("")
    return "\n".join(out)


def render_sampling_params() -> str:
    """The ``SamplingParams`` table (field, default, its docstring), as Markdown."""
    from modelrunner.sampling.params import SamplingParams

    docs = field_docs(SamplingParams)
    rows = [f"| `{f.name}` | {_cell(_default(f))} | {_cell(docs.get(f.name, ''))} |" for f in attrs.fields(SamplingParams)]
    return "\n".join(["| field | default | meaning |", "|---|---|---|", *rows])


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs' hook: fill the markers on the pages that have them."""
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, render())
    if SAMPLING_MARKER in markdown:
        markdown = markdown.replace(SAMPLING_MARKER, render_sampling_params())
    return markdown
