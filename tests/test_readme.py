"""The README is a short front door whose process table matches the code, every document it points
at exists, and docs/configuration.md's reference is the one the config dataclasses generate today."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

from sao import configref
from sao.cli import COMMANDS
from schemas import topics as T

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TOPICS = {t.name(): name for name, t in vars(T).items() if isinstance(t, T.Topic) and t in T.ALL}  # sao.prompts -> PROMPTS


def test_configuration_reference_matches_the_config_classes():
    text = configref.REFERENCE.read_text()
    assert configref.render(text) == text, (
        "docs/configuration.md's reference differs from the config dataclasses: run "
        "`make readme` (python -m sao.configref) and commit docs/configuration.md")


def test_readme_is_short_starts_with_the_two_commands_and_keeps_its_sections():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    assert text.index("make run") < text.index("## The processes")
    for heading in ("```mermaid", "## The two commands", "## The processes", "## Guarantees", "## Plugging in your own",
                    "## Deploying", "## Results", "## What has and has not been run", "## Layout"):
        assert heading in text, heading


def test_every_file_the_readme_and_docs_link_exists():
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#]+)\)", doc.read_text()):
            if not target.startswith("http"):
                assert (doc.parent / target).exists(), f"{doc.name} links to {target}, which does not exist"


def _sources(module: str) -> str:
    """The module's source and that of the modules of ours it imports (one level): where a process
    names the topics it reads and writes."""
    path = Path(importlib.util.find_spec(module).origin)
    text = path.read_text()
    ours = {n.module for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom) and n.module
            and n.module.split(".")[0] in ("producers", "consumers", "learner", "sao", "schemas")
            and n.module != "schemas.topics"}
    return text + "".join(Path(importlib.util.find_spec(m).origin).read_text() for m in sorted(ours))


def test_the_process_table_names_real_commands_their_modules_and_the_topics_they_use():
    text = README.read_text()
    table = text[text.index("## The processes"):text.index("## Guarantees")]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("| ") and not line.startswith("| process") and "---" not in line]
    assert len(rows) >= 9
    for process, command, module, reads, writes in rows:
        name = command.strip("`").removeprefix("sao ")
        assert name in COMMANDS, f"{process}: `sao {name}` is not a command"
        assert module.strip("`") == COMMANDS[name][0], f"{process}: `sao {name}` runs {COMMANDS[name][0]}"
        source = _sources(module.strip("`"))
        for topic in re.findall(r"sao\.[a-z.]+[a-z]", reads + " " + writes):
            assert topic in TOPICS, f"{process}: {topic} is not a topic"
            assert f"T.{TOPICS[topic]}" in source, f"{process}: {module} never names {topic}"
