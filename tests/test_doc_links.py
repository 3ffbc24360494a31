"""Every relative link of the README, docs/*.md and samples/README.md points to a file that exists,
and its #anchor to a heading of that file (GitHub's anchors)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from markdown_it import MarkdownIt          # rich's Markdown parser: links in code blocks are no links

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "samples" / "README.md"]


def _tokens(path: Path):
    for token in MarkdownIt("commonmark").enable("table").parse(path.read_text(encoding="utf-8")):
        yield token
        yield from token.children or ()


def github_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path``: the heading's text lower-cased, every
    character but letters, digits, ``_``, ``-`` and spaces dropped, spaces made ``-``; a repeated
    anchor gets ``-1``, ``-2`` … (github-slugger)."""
    anchors, counts = set(), {}
    tokens = list(MarkdownIt("commonmark").parse(path.read_text(encoding="utf-8")))
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type != "heading_open":
            continue
        text = "".join(c.content for c in inline.children if c.type in ("text", "code_inline"))
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = counts[slug] = counts.get(slug, -1) + 1
        anchors.add(f"{slug}-{n}" if n else slug)
    return anchors


def relative_links(path: Path) -> list[str]:
    """The link and image targets of ``path`` that are neither absolute URLs nor mail addresses."""
    targets = [t.attrGet("href") if t.type == "link_open" else t.attrGet("src")
               for t in _tokens(path) if t.type in ("link_open", "image")]
    return [t for t in targets if t and not urlsplit(t).scheme]


def broken_links(page: Path, links: list[str] | None = None) -> list[str]:
    """The relative links of ``page`` (or ``links``, read from there) to no file, or to no heading
    of a Markdown file, with why."""
    broken = []
    for link in relative_links(page) if links is None else links:
        parts = urlsplit(link)
        target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
        if not target.exists():
            broken.append(f"{link}: no such file")
        elif parts.fragment and target.suffix == ".md" and parts.fragment not in github_anchors(target):
            broken.append(f"{link}: {target.name} has no heading #{parts.fragment}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_the_build_notes_that_error_messages_point_to_exist():
    from llamatrace.peers import LLAMACPP_BUILD
    assert broken_links(ROOT / "README.md", [LLAMACPP_BUILD]) == []         # a path from the root


def test_the_anchor_rule_and_the_checker_catch_what_they_should(tmp_path):
    # the anchors GitHub shows for these headings (as rendered on github.com)
    page = tmp_path / "page.md"
    page.write_text("# Tracing and diagrams\n\n## The interactive page: `llamatrace diagram -o run.html`\n\n"
                    "## Options and conventions\n\n## Options and conventions\n\n"
                    "```\n# not a heading\n```\n\n[a](page.md#nope) [b](missing.md) [c](#tracing-and-diagrams)\n")
    assert github_anchors(page) == {"tracing-and-diagrams", "the-interactive-page-llamatrace-diagram--o-runhtml",
                                    "options-and-conventions", "options-and-conventions-1"}
    assert relative_links(page) == ["page.md#nope", "missing.md", "#tracing-and-diagrams"]
    assert broken_links(page) == ["page.md#nope: page.md has no heading #nope", "missing.md: no such file"]
