"""Regenerate the tables of docs/config.md from the config dataclasses: python tools/gen_config_docs.py"""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from megashard.configdoc import render_into  # noqa: E402

path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "config.md"
path.write_text(render_into(path.read_text(encoding="utf-8")), encoding="utf-8")
print(f"wrote {path}")
