"""The fenced code blocks of the docs pages, as the tests that run them read them.

The convention (docs/recipes.md, "Code examples in the docs"): a block whose fence names a file
(```` ```python title="pkg/module.py" ````) is a file of an example distribution, which that example's
own test writes out; a ``python`` block without a title runs, all of a page's blocks in order in one
interpreter; a ``<!-- not-run: reason -->`` comment on the line before a block leaves it out, with
the reason.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)(?P<info>[^`]*)$")
"""A fence's opening line: indentation, the backticks, the language and the rest of its info string."""
NOT_RUN = re.compile(r"^\s*<!--\s*not-run:\s*(?P<reason>.*?)\s*-->\s*$")
"""The comment that leaves the next block out of the runs."""
TITLE = re.compile(r"""title=["'](?P<title>[^"']+)["']""")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: Path
    """The page it is on."""
    line: int
    """The line of its opening fence (1-based)."""
    language: str
    """The fence's language (``python``, ``toml``, ``sh`` …; empty when none)."""
    title: str | None
    """The file it stands for (``title="…"``), or None."""
    code: str
    """Its text, dedented to the fence's indentation."""
    not_run: str | None
    """Why it is left out of the runs (``<!-- not-run: reason -->``), or None."""

    @property
    def where(self) -> str:
        """``page:line`` for messages."""
        return f"{self.page}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page`` in order.

    :raises ValueError: a fence that is never closed, or a not-run comment without a reason.
    """
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if closing.match(lines[j])), None)
        if end is None:
            raise ValueError(f"{page}:{i + 1}: a {fence} fence that is never closed")
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        skip = NOT_RUN.match(previous)
        if skip and not skip["reason"]:
            raise ValueError(f"{page}:{i}: a not-run comment gives no reason")
        title = TITLE.search(opening["info"])
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                         for line in lines[i + 1:end])
        blocks.append(Block(page, i + 1, opening["lang"], title["title"] if title else None,
                            textwrap.dedent(body) + "\n", skip["reason"] if skip else None))
        i = end + 1
    return blocks


def write_files(blocks: list[Block], prefix: str, root: Path) -> list[Path]:
    """Write the blocks titled ``prefix…`` under ``root`` (at their titles' paths); returns the paths."""
    written = []
    for block in blocks:
        if block.title and block.title.startswith(prefix):
            path = root / block.title
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.code)
            written.append(path)
    return written
