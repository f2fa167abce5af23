"""The README is the front door: short, and every document under ``docs/`` is reachable from
its index, every link it has resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_the_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= 250


def test_every_document_is_linked_from_the_readme() -> None:
    linked = {(ROOT / target).resolve() for target, _ in LINK.findall(README.read_text())}
    unlinked = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert unlinked == []


def test_every_relative_link_of_the_readme_and_the_docs_resolves() -> None:
    broken = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target, _ in LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []
