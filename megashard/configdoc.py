"""Generate the config reference (docs/config.md) from the config dataclasses and their field docstrings."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Iterable

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
        rows.append(f"| `{f.name}` | `{typ}` | `{default}` | {doc} |")
    return "\n".join(rows)


def sections() -> Iterable[tuple[str, type]]:
    """The config sections documented in docs/config.md: (YAML section name, dataclass)."""
    from megashard.config import ParallelConfig

    yield "parallel", ParallelConfig
    try:  # the training job's sections, when present
        from megashard.train.config import CONFIG_SECTIONS  # type: ignore[import-not-found]
    except ImportError:
        return
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
