"""The README's configuration reference is the one the config dataclasses generate today, and the
README keeps the sections others point at."""

from __future__ import annotations

from pathlib import Path

from sao import configref

README = Path(__file__).resolve().parents[1] / "README.md"


def test_configuration_reference_matches_the_config_classes():
    text = README.read_text()
    assert configref.render(text) == text, (
        "README.md's configuration reference differs from the config dataclasses: run "
        "`make readme` (python -m sao.configref) and commit README.md")


def test_readme_starts_with_the_two_commands_and_keeps_its_sections():
    text = README.read_text()
    assert text.index("make run") < text.index("## Architecture")
    for heading in ("## The two commands", "## Delivery guarantees", "## Configuration", "### Configuration reference",
                    "## Docker Compose", "## What was and was not run", "```mermaid"):
        assert heading in text, heading
