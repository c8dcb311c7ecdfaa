"""Every document the repository cites is in the repository: a markdown file (and its `§N`) named in
code, configuration or docs resolves to a file here, from the repository root or the citing file's
folder, and its section exists; nothing points outside the repository (`../`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r"(?<![\w/.:*>-])((?:\.\./)*(?:[\w.-]+/)*[\w-]+\.md)(?: §(\d+(?:\.\d+)?))?")
NOT_CITATIONS = {"OUT.md", "notes.md"}  # a bench's `--out OUT` placeholder, a test's scratch file
TEXT = (".py", ".md", ".yml", ".yaml", ".toml", ".sh", ".txt", ".cfg", "Makefile", "Dockerfile", "Dockerfile.gpu",
        ".example")


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / f for f in out.split() if f.endswith(TEXT) and (ROOT / f).is_file()]


def _sections(doc: Path) -> set[str]:
    """The numbers of a doc's numbered headings: `## 3. Title` -> 3, `### 4.2 Title` -> 4.2."""
    return set(re.findall(r"^#{2,4} (\d+(?:\.\d+)?)\.? ", doc.read_text(), re.M))


def citations(path: Path) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in CITED.finditer(path.read_text(errors="replace"))
            if m.group(1) not in NOT_CITATIONS]


def broken(path: Path, tracked: list[Path] = ()) -> list[str]:
    """What `path` cites that the repository lacks. A bare name (a link's text, a file a script
    writes) may be any tracked file of that name."""
    found = []
    for name, section in citations(path):
        named = [p for p in tracked if p.name == name] if "/" not in name else []
        target = next((p for p in (ROOT / name, path.parent / name, *named) if p.is_file()), None)
        if target is None or not target.resolve().is_relative_to(ROOT):
            found.append(f"{name}: no such file in the repository")
        elif section and section not in _sections(target):
            found.append(f"{name} §{section}: no such section")
    return found


def test_every_cited_document_and_section_is_in_the_repository():
    tracked = _tracked()
    problems = {str(p.relative_to(ROOT)): b for p in tracked if (b := broken(p, tracked))}
    assert problems == {}


def test_the_check_fails_on_a_citation_of_a_file_the_repository_lacks(tmp_path):
    md, outside = ".md", "/".join(("..", "shared"))  # assembled, so that this file names nothing it lacks
    page = ROOT / "docs" / ".citation-probe.py"
    try:
        page.write_text(f'"""See docs/algorithm{md} §4, SAO{md} §3, docs/vllm{md} §9 and {outside}/STYLE{md}."""\n')
        assert broken(page) == [f"SAO{md}: no such file in the repository", f"docs/vllm{md} §9: no such section",
                                f"{outside}/STYLE{md}: no such file in the repository"]
    finally:
        page.unlink()
