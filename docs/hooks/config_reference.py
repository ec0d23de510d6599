"""mkdocs hook: writes the configuration reference's tables from the attrs config classes.

A page holding ``<!-- config-reference -->`` gets, in its place, one table per config section: each
flat key ``LLM(**config)`` accepts, its default and the field's docstring — read from
``modelrunner.config`` at build time, so the reference cannot fall behind the code.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from typing import Any

import attrs

MARKER = "<!-- config-reference -->"


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


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """mkdocs' hook: fill the marker on the page that has it."""
    return markdown.replace(MARKER, render()) if MARKER in markdown else markdown
