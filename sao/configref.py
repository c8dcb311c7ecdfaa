"""The configuration reference of docs/configuration.md, generated from the config dataclasses of
every `sao` subcommand (field, flag, `SAO_*` variable, default, the field's docstring).

    python -m sao.configref            # rewrite the section of docs/configuration.md between the markers
    python -m sao.configref --check    # exit 1 if it differs (tests/test_readme.py)

Defaults are the fields' own, except where the source computes one per machine or process (a home
folder, the environment): there the source expression is shown.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
import textwrap
import typing
from pathlib import Path

from sao.cli import COMMANDS

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
_PER_MACHINE = ("home", "getpid", "gethostname", "environ", "cpu_count", "passthrough_settings")


def _class_fields(cls: type) -> dict[str, tuple[str, str | None, str]]:
    """field -> (annotation source, default source or None, docstring) over the class and its bases."""
    out: dict = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        src = textwrap.dedent(inspect.getsource(klass))
        body = ast.parse(src).body[0].body
        for i, node in enumerate(body):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                nxt = body[i + 1] if i + 1 < len(body) else None
                doc = (nxt.value.value if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                       and isinstance(nxt.value.value, str) else "")
                default = ast.get_source_segment(src, node.value) if node.value else None
                out[node.target.id] = (ast.get_source_segment(src, node.annotation), default,
                                       " ".join(doc.split()))
    return out


def _default(value, default_src: str | None) -> str:
    if default_src and any(w in default_src for w in _PER_MACHINE):
        return f"`{default_src}`"
    if isinstance(value, Path):
        value = str(value)
    return f"`{value!r}`" if not isinstance(value, str) else (f"`{value}`" if value else '`""`')


def _value(f: dataclasses.Field, instance):
    """The default: the field's own (never an instance's, whose __post_init__ may fill in
    per-process values), or the instance's where a parent's factory built a different one."""
    if instance is not None:
        return getattr(instance, f.name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def rows(cls: type, instance=None, prefix: str = "") -> list[str]:
    """One markdown table row per leaf field; KafkaConfig is documented once, on its own."""
    from schemas.kafka import KafkaConfig

    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = []
    for name, (ann, default_src, doc) in _class_fields(cls).items():
        f, path = fields[name], f"{prefix}{name}"
        if dataclasses.is_dataclass(hints[name]):
            if hints[name] is KafkaConfig:
                out.append(f"| `--{path}.*` | `SAO_{path.upper()}_*` | | see *Kafka (every service)* |")
            else:  # a factory other than the class itself sets its own defaults (BrokerConfig(port=0))
                own = f.default_factory is hints[name] and instance is None
                out += rows(hints[name], None if own else _value(f, instance), path + ".")
            continue
        flag = path.upper() if "Positional" in ann else f"--{path.replace('_', '-')}"
        env = f"SAO_{path.replace('.', '_').upper()}"
        doc = doc.replace("|", "\\|")
        out.append(f"| `{flag}` | `{env}` | {_default(_value(f, instance), default_src)} | {doc} |")
    return out


def _table(cls: type, instance=None, prefix: str = "") -> list[str]:
    return ["| flag | variable | default | meaning |", "| --- | --- | --- | --- |", *rows(cls, instance, prefix)]


def reference() -> str:
    from schemas.kafka import KafkaConfig

    parts = [START, "", "### Kafka (every service)", "", *_table(KafkaConfig, None, "kafka."), ""]
    for command, (module_name, config_name, help_) in COMMANDS.items():
        cls = getattr(importlib.import_module(module_name), config_name)
        parts += [f"### `sao {command}`", "", help_, "", *_table(cls), ""]
    return "\n".join([*parts, END])


def render(doc: str) -> str:
    head, sep, rest = doc.partition(START)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise SystemExit(f"{REFERENCE} lacks the markers {START} ... {END}")
    return head + reference() + tail


def main() -> None:
    text = REFERENCE.read_text()
    new = render(text)
    if "--check" in sys.argv[1:]:
        if new != text:
            raise SystemExit(f"{REFERENCE}'s configuration reference is out of date: run `python -m sao.configref`")
        return
    REFERENCE.write_text(new)


if __name__ == "__main__":
    main()
