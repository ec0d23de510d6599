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


SERVER = "http://127.0.0.1:8000"
"""The address the pages' client code calls (``modelrunner serve``'s default)."""


def run_pages(pages: list[dict], results_path: Path, server_file: Path | None = None) -> None:
    """Run each page's blocks in order in a namespace of the page's own, in this interpreter; write
    ``{page: {"ok": bool, "seconds": float, "error": traceback or None}}`` to ``results_path``.

    :param pages: ``{"page": path, "blocks": [{"line": n, "code": text}, ...]}`` each.
    :param server_file: where the address of a server started alongside will be written; a page that
        calls :data:`SERVER` waits for it and calls that address instead.
    """
    import json
    import sys
    import time
    import traceback
    import types

    results = {}
    for page in pages:
        # A module of its own, as ``__main__`` (what running the page as a script gives it), so that
        # pydantic and pickling find the classes a page defines.
        module = types.ModuleType("__main__")
        sys.modules["__main__"] = module
        namespace = module.__dict__
        start = time.monotonic()
        error = None
        try:
            server = _server_address(server_file) if any(SERVER in b["code"] for b in page["blocks"]) else SERVER
            for block in page["blocks"]:
                # Blank lines first, so a traceback's line numbers are the page's.
                code = "\n" * block["line"] + block["code"].replace(SERVER, server)
                exec(compile(code, page["page"], "exec", dont_inherit=True), namespace)  # noqa: S102 - the docs' own examples
        except BaseException:  # noqa: BLE001 - reported per page
            error = traceback.format_exc()
        results[page["page"]] = {"ok": error is None, "seconds": time.monotonic() - start, "error": error}
        results_path.write_text(json.dumps(results))
        print(f"docs example {page['page']}: {'ok' if error is None else 'FAILED'} "
              f"({time.monotonic() - start:.1f} s)", flush=True)


def _server_address(server_file: Path | None, timeout: float = 300) -> str:
    """The address written to ``server_file`` (waiting for it), or :data:`SERVER` without one."""
    import time

    if server_file is None:
        return SERVER
    deadline = time.monotonic() + timeout
    while not server_file.is_file() or not server_file.read_text().strip():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no server address in {server_file} within {timeout} s")
        time.sleep(0.2)
    address = server_file.read_text().strip()
    if not address.startswith("http"):
        raise RuntimeError(f"the server did not start: {address}")
    return address


if __name__ == "__main__":
    import json
    import sys

    run_pages(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]),
              Path(sys.argv[3]) if len(sys.argv) > 3 else None)
