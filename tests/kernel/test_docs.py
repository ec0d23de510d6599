"""The documentation's shape: a README that fits on a screen and holds no measurements, the pages the
docs promise, and every page reachable from the site's nav. `make test` builds the site itself
(`mkdocs build --strict`: links and anchors); these checks need no mkdocs."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from modelrunner_kit.scaffold import KINDS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"

README_MAX_LINES = 250

PAGES = [
    "index.md",
    "guide/install.md",
    "guide/offline.md",
    "guide/serving.md",
    "guide/quantization.md",
    "guide/scaling.md",
    "guide/cli.md",
    "guide/configuration.md",
    "plugins/index.md",
    "architecture.md",
    "recipes.md",
    "benchmarks.md",
    "changelog.md",
]
"""Pages other docs, the README and other issues link to by name."""

MEASUREMENT = re.compile(
    r"\d[\d.,]*\s*(?:tok/s|tokens/s|µs|us per|ms a step|GB/s)"  # a speed or a time
    r"|\d(?:\.\d+)?(?:–\d+(?:\.\d+)?)?×"                          # a ratio such as 1.32× or 1.10–1.46×
    r"|\d[\d,.]*/s\b"                                            # a table cell such as 146.6/s
)
"""What a measured figure looks like; the README points at the benchmarks page instead."""


class _IgnoreTags(yaml.SafeLoader):
    """A safe loader that reads tags it does not know (``!!python/name:…``, ``!ENV``) as plain values."""


_IgnoreTags.add_multi_constructor("", lambda loader, suffix, node: None)
_IgnoreTags.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def _mkdocs() -> dict:
    return yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_IgnoreTags)


def _nav_pages(nav: object) -> list[str]:
    """Every page path in a mkdocs ``nav`` (lists of pages, ``{title: page}`` and ``{title: [...]}``)."""
    if isinstance(nav, str):
        return [] if "://" in nav else [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_readme_fits_on_a_screen():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail into docs/ and link to it")


def test_readme_holds_no_measurements():
    found = [f"README.md:{n}: {line.strip()}" for n, line in enumerate(README.read_text().splitlines(), 1)
             if MEASUREMENT.search(line)]
    assert not found, "measured figures belong on docs/benchmarks.md (with date, CPU and commit):\n" + "\n".join(found)


def test_readme_links_into_the_docs_resolve():
    targets = re.findall(r"\]\(((?:docs/|CHANGELOG)[^)#\s]*)", README.read_text())
    assert targets, "the README links into docs/"
    missing = sorted({t for t in targets if not (ROOT / t).is_file()})
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_the_named_pages_exist():
    missing = [page for page in PAGES if not (DOCS / page).is_file()]
    assert not missing, f"docs pages missing: {missing}"


def test_every_plugin_kind_has_a_page():
    """``modelrunner new-plugin KIND`` ↔ ``docs/plugins/KIND.md``: a new kind comes with its page."""
    missing = [f"docs/plugins/{kind}.md" for kind in KINDS if not (DOCS / "plugins" / f"{kind}.md").is_file()]
    assert not missing, f"plugin kinds without a page: {missing}"


def test_the_guide_lists_every_registry_kind_linking_to_its_page():
    """The plugin guide's index has a row for each kind the registry knows, calling
    ``registry.KIND(...)`` and linking to a page that exists: a new registry kind must be listed."""
    from modelrunner.registry import KINDS as REGISTRY_KINDS

    index = DOCS / "plugins" / "index.md"
    section = index.read_text().split("\n## The kinds\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    problems = []
    for kind in REGISTRY_KINDS:
        row = next((r for r in rows if f"`registry.{kind}(" in r), None)
        if row is None:
            problems.append(f"{kind}: no row calling registry.{kind}(...)")
            continue
        links = re.findall(r"\]\(([\w-]+\.md)\)", row)
        if not links or not (index.parent / links[-1]).is_file():
            problems.append(f"{kind}: its row links to no existing page ({links})")
    assert not problems, f"docs/plugins/index.md, 'The kinds': {problems}"
    assert len(rows) - 2 == len(REGISTRY_KINDS)  # header and rule, then one row per kind


def test_mkdocs_builds_docs_strictly():
    config = _mkdocs()
    assert config["site_name"] == "modelrunner"
    assert config["docs_dir"] == "docs"
    assert config["strict"] is True
    theme = config["theme"]
    assert (theme["name"] if isinstance(theme, dict) else theme) == "material"


def test_every_page_is_in_the_nav():
    nav = _nav_pages(_mkdocs()["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == sorted(nav), f"pages listed twice in the nav: {sorted({p for p in nav if nav.count(p) > 1})}"
    assert not set(pages) - set(nav), f"pages missing from mkdocs.yml's nav: {sorted(set(pages) - set(nav))}"
    assert not set(nav) - set(pages), f"nav entries without a page: {sorted(set(nav) - set(pages))}"


def test_every_benchmark_section_says_when_and_where():
    """Each measured section of the benchmarks page names the commit it was recorded at."""
    text = (DOCS / "benchmarks.md").read_text()
    sections = re.split(r"(?m)^## ", text)[1:]
    assert sections, "docs/benchmarks.md has no sections"
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(r"`[0-9a-f]{7,40}`", section), f"benchmarks section {title!r} names no commit"
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", section), f"benchmarks section {title!r} gives no date"
