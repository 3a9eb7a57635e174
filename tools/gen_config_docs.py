"""Regenerate the tables of docs/config.md from the config dataclasses and their field docstrings.

    python tools/gen_config_docs.py          # from the repository root; tests/test_docs.py checks the result

A tool, not part of the library: it reads the example job's schema (megashard.train.sections) as well as
megashard.config.ParallelConfig.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import pathlib
import sys
import textwrap
from typing import Iterable

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BEGIN = "<!-- BEGIN GENERATED: {name} -->"
END = "<!-- END GENERATED: {name} -->"


def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the docstring written right under it in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def table(cls: type, section: str) -> str:
    """A markdown table of ``cls``'s fields: key, type, default, meaning and constraint."""
    docs = field_docs(cls)
    rows = [f"| key (`{section}.`) | type | default | meaning and constraint |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "required"
        typ = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        doc = docs.get(f.name, "").replace("|", "\\|")
        typ = typ.replace("|", "\\|")
        rows.append(f"| `{f.metadata.get('yaml', f.name)}` | `{typ}` | `{default}` | {doc} |")
    return "\n".join(rows)


def sections() -> Iterable[tuple[str, type]]:
    """The config sections documented in docs/config.md: (YAML section name, dataclass)."""
    from megashard.config import ParallelConfig
    from megashard.train.sections import CONFIG_SECTIONS

    yield "parallel", ParallelConfig
    yield from CONFIG_SECTIONS


def render_into(text: str) -> str:
    """Replace every generated block in ``text`` with the current tables (blocks are created if missing)."""
    for name, cls in sections():
        begin, end = BEGIN.format(name=name), END.format(name=name)
        block = f"{begin}\n{table(cls, name)}\n{end}"
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            _, tail = rest.split(end, 1)
            text = head + block + tail
        else:
            text = text.rstrip("\n") + f"\n\n## `{name}`\n\n{block}\n"
    return text


def main() -> None:
    path = ROOT / "docs" / "config.md"
    path.write_text(render_into(path.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
