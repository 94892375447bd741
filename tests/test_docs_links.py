"""Every relative link in the README and docs/ resolves to a file or folder of the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(md: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", md.read_text(), flags=re.S)  # code blocks are not links
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:|^#", t)]


def test_every_relative_link_in_readme_and_docs_resolves():
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "recipes").rglob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in pages for target in relative_links(page)
              if not (page.parent / target.split("#")[0]).exists()]
    assert not broken, "broken relative links:\n" + "\n".join(broken)
    assert sum(len(relative_links(p)) for p in pages) > 20  # the check saw the docs' links
