"""The YAML keys of config dataclasses, without YAML: which key names which field, and unknown keys refused.

Apart from :mod:`megashard.config.yamlfile` so that building a config from a mapping
(``ParallelConfig.from_dict``, e.g. in ``initialize_model_parallel``) does not import ``yaml`` (~20 ms).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from megashard.errors import ConfigError, unknown_names

__all__ = ["yaml_key", "yaml_keys", "reject_unknown_keys", "BOOL_WORDS", "yaml_bool"]

#: YAML 1.1's other spellings of true and false. megashard's YAML reads them as text (a string field gets the word
#: as written); a true/false field of a YAML file, an override or a mapping takes them as the boolean they spell.
#: (A Python argument must be a real bool.)
BOOL_WORDS = {w: True for w in ("yes", "Yes", "YES", "on", "On", "ON")}
BOOL_WORDS.update({w: False for w in ("no", "No", "NO", "off", "Off", "OFF")})


def yaml_bool(value: Any) -> Any:
    """``value``, or the boolean a YAML 1.1 word (``yes``, ``off``, ...) spells."""
    return BOOL_WORDS.get(value, value) if isinstance(value, str) else value



def yaml_key(f: dataclasses.Field) -> str:
    """The YAML key of a config field: its name, or ``metadata["yaml"]`` when the key is a Python keyword
    (``checkpoint.async`` is the field ``async_save``)."""
    return f.metadata.get("yaml", f.name)


def yaml_keys(cls: type) -> dict[str, str]:
    """YAML key -> field name of every field of dataclass ``cls``."""
    return {yaml_key(f): f.name for f in dataclasses.fields(cls)}


def reject_unknown_keys(cls: type, data: Mapping[str, Any], section: str) -> None:
    """Raise ConfigError naming every key of ``data`` that is not a field of dataclass ``cls``, with a "did you mean"."""
    names = list(yaml_keys(cls))
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(f"unknown config key(s): {unknown_names(unknown, names, prefix=section + '.')}; valid keys of "
                          f"'{section}': {', '.join(names)}")
