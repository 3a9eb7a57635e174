"""YAML files and dotted command-line overrides (``parallel.tp=2``): how a config file becomes a mapping.

:func:`load_yaml` is the one place a config file is read and parsed (once per process: ``megashard plan``,
``megashard run`` and every worker each call it once), :func:`apply_overrides` applies ``key=value`` items to the
parsed mapping; :func:`reject_unknown_keys` (in :mod:`megashard.config.keys`, re-exported) names misspelled keys
of a section.

Every YAML text megashard reads (config files, override values, the NCCL options file) goes through
:func:`parse_yaml`: safe tags only, no duplicate keys, at most :data:`MAX_DEPTH` levels of nesting (deeper
documents would exhaust Python's recursion) and at most :data:`MAX_NODES` values once aliases are expanded
(an "alias bomb" of a few lines expands to millions) — both checked on the node graph, before any Python object
is built.
"""
from __future__ import annotations

import copy
import os
import re
from typing import Any, Iterable

import yaml

from megashard.config.keys import reject_unknown_keys, yaml_key, yaml_keys  # noqa: F401 - re-exported (their old home)
from megashard.errors import ConfigError

#: Deepest nesting of lists and mappings a config may have (a job config needs 4: section, key, list, pair).
MAX_DEPTH = 50
#: Most values (scalars, lists, mappings) a YAML document may hold once its aliases are expanded.
MAX_NODES = 100_000


# How a plain (unquoted) scalar is read: YAML 1.2's core schema, so that every value means what it looks like
# (docs/config.md, "How values are read"). YAML 1.1 (PyYAML's default) reads 0100 as octal 64, 1:30 as 90 (base 60),
# yes/no/on/off as booleans and 2024-01-02 as a date; here they are 100, the text "1:30", the text "yes" (a true/false
# field takes yes/on/no/off, see megashard.config.keys.BOOL_WORDS) and the text "2024-01-02".
_DIGITS = r"[0-9]+(?:_[0-9]+)*"  # digits, grouped by single underscores as in Python (1_000)
_BOOL = re.compile(r"true|True|TRUE|false|False|FALSE")
#: decimal (leading zeros are decimal: 0100 = 100), 0x hex, 0o octal
_INT = re.compile(rf"[-+]?{_DIGITS}|0x[0-9a-fA-F]+(?:_[0-9a-fA-F]+)*|0o[0-7]+(?:_[0-7]+)*")
_FLOAT = re.compile(rf"[-+]?(?:\.{_DIGITS}|{_DIGITS}(?:\.(?:{_DIGITS})?)?)(?:[eE][-+]?[0-9]+)?"
                    r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)")
_NULL = re.compile(r"~|null|Null|NULL|")


def _implicit_resolvers() -> dict:
    """The implicit resolvers of the core schema above (first character -> [(tag, regexp)]), merge keys kept."""
    table: dict = {}
    for tag, rx, first in (("bool", _BOOL, "tTfF"), ("int", _INT, "-+0123456789"),
                           ("float", _FLOAT, "-+0123456789."), ("null", _NULL, "~nN")):
        for ch in first:
            table.setdefault(ch, []).append(("tag:yaml.org,2002:" + tag, re.compile(rf"^(?:{rx.pattern})$")))
    table[""] = [("tag:yaml.org,2002:null", re.compile(r"^$"))]
    table["<"] = list(yaml.SafeLoader.yaml_implicit_resolvers["<"])
    return table


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping key given twice (plain YAML keeps the last one silently), nesting
    deeper than :data:`MAX_DEPTH` and documents of more than :data:`MAX_NODES` values with aliases expanded, and reads
    plain scalars as YAML 1.2's core schema does (``0100`` = 100, ``1:2``, ``yes`` and ``2024-01-02`` are text)."""

    _depth = 0
    yaml_implicit_resolvers = _implicit_resolvers()

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        text = str(self.construct_scalar(node)).replace("_", "")
        sign = -1 if text.startswith("-") else 1
        body = text.lstrip("+-").lower()
        try:
            if body.startswith("0x"):
                return sign * int(body[2:], 16)
            if body.startswith("0o"):
                return sign * int(body[2:], 8)
            return sign * int(body, 10)  # leading zeros are decimal: 00000010 is 10 (a step_00000010 directory)
        except ValueError as e:  # an explicit !!int of text, or more digits than Python converts (sys.int_info)
            raise yaml.constructor.ConstructorError(None, None, f"{self.construct_scalar(node)[:40]!r} is not an "
                                                    f"integer megashard can read ({str(e).split(':')[0]})",
                                                    node.start_mark) from None

    def compose_node(self, parent: Any, index: Any) -> Any:
        # Composition recurses once per level: stop far before Python's recursion limit.
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise ConfigError(f"{self.name}: nesting deeper than {MAX_DEPTH} levels at line {mark.line + 1}, "
                                  f"column {mark.column + 1}; a config nests a few levels (section, key, list)")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        _check_expanded_size(node, self.name)  # before construction: aliases are still shared nodes here
        return self.construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges are not duplicates
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
                seen[key] = line
            except TypeError:  # an unhashable key: SafeLoader reports it below
                continue
            if first is not None:
                where = f"twice on line {line}" if first == line else f"on lines {first} and {line}"
                raise ConfigError(
                    f"{self.name}: duplicate key {key!r} {where} (YAML would silently keep only the last one); "
                    "keep one of them"
                )
        return super().construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", UniqueKeyLoader.construct_yaml_int)


def _check_expanded_size(root: yaml.Node, name: str) -> None:
    """ConfigError when the document under ``root`` holds more than MAX_NODES values with every alias expanded
    (counted once per distinct node, memoised: linear in the size of the text, whatever the expansion)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:  # depth is bounded by MAX_DEPTH (compose_node)
        got = sizes.get(id(node))
        if got is not None:
            return got
        n = 1
        if isinstance(node, yaml.SequenceNode):
            n += sum(size(c) for c in node.value)
        elif isinstance(node, yaml.MappingNode):
            n += sum(size(k) + size(v) for k, v in node.value)
        sizes[id(node)] = n = min(n, MAX_NODES + 1)  # saturate: the total is all that matters
        if n > MAX_NODES:
            raise ConfigError(f"{name}: the YAML expands to more than {MAX_NODES:,} values (aliases of aliases, "
                              f"from line {node.start_mark.line + 1}); a config holds far fewer: write the values "
                              "out or use fewer aliases")
        return n

    size(root)


def parse_yaml(text: str, name: str) -> Any:
    """Parse one YAML document (safe tags; duplicate keys, MAX_DEPTH and MAX_NODES checked); ``name`` is used in
    error messages. ConfigError (one line) for anything wrong."""
    loader = UniqueKeyLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise _yaml_error(name, e) from None
    except RecursionError:  # pragma: no cover - MAX_DEPTH stops composition long before
        raise ConfigError(f"{name}: the YAML nests too deeply") from None
    finally:
        loader.dispose()


def _yaml_error(path: str, e: yaml.YAMLError) -> ConfigError:
    """One line for a YAML syntax error: the problem and where it is (line:column, 1-based)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(e, "context", None)
    return ConfigError(f"{path}: not valid YAML{where}: {problem}" + (f" ({context})" if context else ""))


def existing_configs_hint(path: str) -> str:
    """``" (did you mean 'configs/default.yaml'?); configs in configs/: default.yaml, hsdp.yaml, ..."``: the YAML
    files next to a missing config ``path`` (else in ``./configs``), for its error line; "" when there are none."""
    from megashard.errors import did_you_mean

    folder = os.path.dirname(path)
    for where in ([folder] if folder else []) + ["configs", "."]:
        try:
            found = sorted(n for n in os.listdir(where or ".") if n.endswith((".yaml", ".yml")))
        except OSError:
            continue
        if found:
            shown = ", ".join(found[:12]) + (f" and {len(found) - 12} more" if len(found) > 12 else "")
            stems = {os.path.splitext(n)[0]: n for n in found}  # compared by stem: ".yaml" and the folder match always
            hint = did_you_mean(os.path.splitext(os.path.basename(path))[0], stems)
            if hint:
                close = stems[hint.split("'")[1]]
                hint = f" (did you mean '{os.path.join(where, close) if where != '.' else close}'?)"
            return f"{hint}; the configs in {where.rstrip('/') + '/' if where != '.' else './'} are: {shown}"
    return ""


def load_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping safely (no arbitrary Python objects); a duplicate key is an error.

    Raises ConfigError with one line for a path that is missing, a directory or not a regular file,
    unreadable, not UTF-8 text (naming the line and byte), not valid YAML (line and column), empty, nested too deeply
    or too large once aliases are expanded (:func:`parse_yaml`), or whose top level is not a mapping.
    """
    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r} does not exist{existing_configs_hint(path)}")
    if os.path.isdir(path):
        try:
            found = sorted(n for n in os.listdir(path) if n.endswith((".yaml", ".yml")))
        except OSError:
            found = []
        hint = f"one of its YAML files: {', '.join(found[:8])}" if found else "a YAML file"
        raise ConfigError(f"config file {path!r} is a directory; give {hint}")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} is not a regular file (a device, pipe or socket); give a YAML file")
    from megashard.readers import CONFIG, read_bytes

    # opened without blocking and checked again on the open file (a FIFO swapped in), at most CONFIG bytes read
    try:
        raw = read_bytes(path, "config file", limit=CONFIG, hint="give a YAML file")
    except ConfigError as e:  # worded as the checks above: "config file '<path>' is ..."
        raise ConfigError(str(e).replace(f"config file {path}: ", f"config file {path!r} ", 1)) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            f"config file {path!r} is not UTF-8 text: byte 0x{raw[e.start]:02x} at line {line} (byte offset {e.start}) "
            "is not valid UTF-8; save the file as UTF-8"
        ) from None
    doc = parse_yaml(text, path)
    if doc is None:
        raise ConfigError(f"config file {path!r} is empty (no YAML mapping); a job config holds sections such as "
                          "'parallel:' and 'model:' (see configs/default.yaml)")
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(doc).__name__}; a job YAML holds "
                          "sections such as 'parallel:' and 'model:'")
    return doc


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"parallel.tp=2"`` → (["parallel", "tp"], 2); the value is parsed as YAML (ints, floats, null, lists)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.sub=value (e.g. parallel.tp=2)")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {item!r} has an empty key part")
    try:
        value = parse_yaml(raw, f"override {key.strip()}") if raw.strip() else ""
    except ConfigError as e:
        if "not valid YAML" not in str(e):
            raise  # too deep or too large
        value = raw  # not YAML: the text itself (e.g. a path with ': ' in it)
    return parts, value


def apply_overrides(doc: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``doc`` with every ``a.b.c=value`` override applied (intermediate mappings created)."""
    out = copy.deepcopy(doc)
    for item in overrides:
        parts, value = parse_override(item)
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: '{p}' is {nxt!r}, not a mapping")
            node = nxt
        node[parts[-1]] = value
    return out

