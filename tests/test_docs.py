"""README.md and docs/ stay usable from a clone: every evidence file parses, every link lands in the repository.

- every `docs/*.json` is exactly one JSON document (`json.load`), and every evidence file (`docs/*.json`,
  `docs/*.png`) is linked from README.md or a docs page, so no figure's file lies there unnamed;
- every relative markdown link (`[text](path)`, `![alt](path)`, `path#anchor`, `#anchor`) in README.md and
  docs/*.md names a file of the repository, and its anchor, if any, a heading of that file (GitHub's slugs);
- no link leaves the repository (`../shared/...` is the team's notes, not part of a clone);
- README.md stays short (at most 220 lines): the reference lives in docs/.

Pure file reading: no process, no network.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 220

PAGES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
# [text](target) and ![alt](target); the target ends at the first space (a title may follow) or ")"
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code (a link in code is not a link)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(path: Path) -> List[str]:
    return LINK.findall(_prose(path.read_text()))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> Set[str]:
    """Every heading's anchor in `path`, with GitHub's -1, -2 ... for repeated headings."""
    seen: Dict[str, int] = {}
    out: Set[str] = set()
    for _, title in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links() -> Iterator[Tuple[Path, str]]:
    for page in PAGES:
        for target in links(page):
            if not EXTERNAL.match(target):
                yield page, target


def _resolve(page: Path, target: str) -> Tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return ((page.parent / path).resolve() if path else page.resolve()), anchor


# ------------------------------------------------------------------------------------------------ the checker
def test_the_link_checker_finds_links_and_anchors_as_github_does(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Stage 3 and uneven work\n## ZeRO++: `hpZ`\n## Stage 3 and uneven work\n"
                    "see [a](a.md#x), ![img](b.png \"t\") and `[no](code.md)`\n"
                    "```\n[no](block.md)\n```\n[web](https://example.com) [here](#zero-hpz)\n")
    assert links(page) == ["a.md#x", "b.png", "https://example.com", "#zero-hpz"]
    assert anchors(page) == {"stage-3-and-uneven-work", "zero-hpz", "stage-3-and-uneven-work-1"}
    assert slug("Checkpoints, crash safety and the Hub") == "checkpoints-crash-safety-and-the-hub"


# ------------------------------------------------------------------------------------------------ evidence files
@pytest.mark.parametrize("path", sorted(DOCS.glob("*.json")), ids=lambda p: p.name)
def test_every_evidence_json_is_one_json_document(path):
    with open(path) as f:
        data = json.load(f)  # "Extra data" when a file holds two documents
    assert isinstance(data, dict) and data, f"{path.name}: expected one JSON object"


def test_every_evidence_file_is_named_by_a_page():
    linked = {_resolve(page, target)[0] for page, target in relative_links()}
    unnamed = [p.name for p in sorted(DOCS.glob("*.json")) + sorted(DOCS.glob("*.png")) if p.resolve() not in linked]
    assert not unnamed, f"evidence files no page links to (name each beside its figure): {unnamed}"


# ------------------------------------------------------------------------------------------------ links
def test_every_relative_link_resolves_inside_the_repository():
    broken, outside, bad_anchor = [], [], []
    cache: Dict[Path, Set[str]] = {}
    for page, target in relative_links():
        where = f"{page.relative_to(ROOT)}: ({target})"
        path, anchor = _resolve(page, target)
        if not path.is_relative_to(ROOT):
            outside.append(where)
            continue
        if not path.exists():
            broken.append(where)
            continue
        if anchor and path.suffix == ".md":
            if anchor not in cache.setdefault(path, anchors(path)):
                bad_anchor.append(where)
    assert not outside, f"links that leave the repository (a clone does not have them): {outside}"
    assert not broken, f"links to files that do not exist: {broken}"
    assert not bad_anchor, f"links to headings that do not exist: {bad_anchor}"


def test_no_page_points_outside_the_repository():
    for page in PAGES:
        assert "../shared" not in page.read_text(), f"{page.relative_to(ROOT)} points at ../shared"


def test_readme_is_short_and_docs_index_lists_every_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move reference " \
                                      f"to docs/"
    index = DOCS / "index.md"
    assert index.is_file(), "docs/index.md lists the docs pages"
    listed = {_resolve(index, t)[0] for t in links(index) if not EXTERNAL.match(t)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.name != "index.md" and p.resolve() not in listed]
    assert not missing, f"docs pages docs/index.md does not list: {missing}"
