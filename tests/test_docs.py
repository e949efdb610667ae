"""The manuals hold together: every relative link and #anchor resolves, and README.md stays short.

Anchors are computed as GitHub renders them (the heading's text lower-cased, punctuation other
than `-` and `_` removed, spaces turned into `-`, a `-N` suffix for repeated headings).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
DOCS = [
    "README.md",
    "deploy/README.md",
    "engine/sim/README.md",
    "gateway/README.md",
    "tests/README.md",
    "tests/perf/README.md",
]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub generates for the headings of the markdown file at `path`."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def links(path: Path) -> list[str]:
    """The link targets of the markdown file at `path`, outside code blocks and code spans."""
    targets = []
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        targets += LINK.findall(re.sub(r"`[^`]*`", "", line))
    return targets


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_and_anchors_resolve(doc: str) -> None:
    """Every relative link of a manual names an existing file, and every #anchor a heading there."""
    source = ROOT / doc
    broken = []
    for target in links(source):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (source.parent / file_part).resolve() if file_part else source
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc}: " + "; ".join(broken)


def test_readme_is_short_and_starts_with_the_two_commands() -> None:
    """README.md stays under 450 lines and opens with the demo and the CI commands."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) < 450
    head = "\n".join(text.splitlines()[:10])
    assert "python3 -m pip install . && qwen38-gateway demo" in head
    assert "./.ci/run" in head
    assert (ROOT / ".ci/run").exists()


def test_retries_docs_say_count_tokens_ignores_idempotency_keys() -> None:
    """Both READMEs scope ``Idempotency-Key`` to the generating APIs and say ``count_tokens``
    does not read it (tests/test_retries.py proves it does not), never "every API"."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    (sentence,) = [s for s in readme.split(". ") if "send `Idempotency-Key" in s]
    assert "every generating API" in sentence and "`count_tokens`" in sentence
    gateway = (ROOT / "gateway/README.md").read_text(encoding="utf-8")
    (row,) = [line for line in gateway.splitlines() if line.startswith("| `Idempotency-Key`")]
    assert "generating APIs" in row and "count_tokens` never reads it" in row
    for text in (sentence, row):
        assert "every API" not in text and "any API" not in text
