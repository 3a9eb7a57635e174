"""The advisor's inputs: sizes with units (and what a bare number means), and the Python API refusing what the CLI
refuses, with the same one-line messages (docs/advisor.md, docs/cli.md)."""
from __future__ import annotations

import os

import pytest

from megashard.cli import main
from megashard.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
GIB, MIB = 1 << 30, 1 << 20


@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * GIB), ("80gib", 80 * GIB), ("80 GiB", 80 * GIB), ("80Gi", 80 * GIB),
    ("80GB", 80 * 10**9), ("80G", 80 * 10**9), ("80gb", 80 * 10**9), ("141GB", 141 * 10**9),
    ("81920MiB", 80 * GIB), ("1MiB", MIB), ("1500MB", 1500 * 10**6), ("1.5TiB", 3 * (1 << 39)),
    ("85899345920", 80 * GIB), ("1048576", MIB), ("2097152B", 2 * MIB),
])
def test_sizes_with_units(text, expected):
    from megashard.advisor.units import parse_bytes

    assert parse_bytes(text, "--device-memory") == expected


@pytest.mark.parametrize("value,message", [
    ("80", "--device-memory '80': a size without a unit is bytes, and 80 bytes is less than 1 MiB; give the unit, "
           "e.g. 80GiB"),
    ("1048575", "1,048,575 bytes is less than 1 MiB"),
    # with a unit the unit is not blamed (before: "a size without a unit is bytes" from the re-check of the bytes)
    ("512KiB", "--device-memory '512KiB': 524,288 bytes is less than 1 MiB, less than any device has"),
    ("0.5MB", "--device-memory '0.5MB': 500,000 bytes is less than 1 MiB"),
    ("80 parsecs", "--device-memory '80 parsecs': give a size such as 80GiB"),
    ("GiB", "give a size such as"),
    ("0GiB", "--device-memory '0GiB': must be more than 0 bytes"),
    ("-5GiB", "must be more than 0 bytes"),
    ("", "give a size such as"),
])
def test_bad_sizes_name_the_flag_and_the_unit(value, message):
    from megashard.advisor.units import parse_bytes

    with pytest.raises(ConfigError) as e:
        parse_bytes(value, "--device-memory")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_cli_bare_number_is_refused_before_any_layout(capsys):
    """The report of the issue: `--device-memory 80` took 80 bytes and listed 160 layouts that 'need 0.00 GiB >
    0.00 GiB'. Now one line and exit 2; a bare number of bytes >= 1 MiB and sizes with units are accepted."""
    code = main(["plan", DEFAULT, "--suggest", "-w", "8", "--device-memory", "80"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--device-memory '80': a size without a unit is bytes" in err and "80GiB" in err
    for size in ("80G", "80GB", "80GiB", "81920MiB", str(80 * GIB)):
        code = main(["plan", DEFAULT, "--suggest", "-w", "8", "--device-memory", size, "--format", "json", "--trace", "0"])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert f'"device_memory": {80 * GIB if "i" in size or size.isdigit() else 80 * 10**9}' in out


def _job():
    from megashard.train.config import JobConfig

    return JobConfig.from_yaml(DEFAULT)


@pytest.mark.parametrize("kwargs,message", [
    ({"world_size": 0}, "world_size=0: must be in 1..65,536 (the advisor enumerates layouts of up to 65,536 ranks)"),
    ({"world_size": -4}, "world_size=-4: must be in 1..65,536"),
    ({"world_size": 1 << 17}, "world_size=131072: must be in 1..65,536"),
    ({"world_size": "8"}, "world_size='8': must be an integer in 1..65,536"),
    ({"world_size": True}, "world_size=True: must be an integer"),
    ({"device_memory": -1}, "device_memory=-1: must be more than 0 bytes"),
    ({"device_memory": 0}, "device_memory=0: must be more than 0 bytes"),
    ({"device_memory": 80}, "device_memory=80: a size without a unit is bytes, and 80 bytes is less than 1 MiB"),
    ({"device_memory": "80 parsecs"}, "device_memory='80 parsecs': give a size such as 80GiB"),
    ({"device_memory": None}, "device_memory=None: give a size as bytes (an int) or text such as 80GiB"),
    ({"device_memory": float("nan")}, "device_memory=nan: must be a finite number of bytes"),
    ({"ranks_per_node": 0}, "ranks_per_node=0: must be a positive integer"),
    ({"hardware": "h100"}, "hardware='h100': must be a megashard.advisor.cost.Hardware"),
])
def test_python_api_refuses_what_the_cli_refuses(kwargs, message):
    from megashard.advisor.search import suggest

    args = {"world_size": 8, "device_memory": 80 * GIB, **kwargs}
    with pytest.raises(ConfigError) as e:
        suggest(_job(), **args)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_python_api_and_cli_say_the_same_words(capsys):
    """The CLI's line for a bad size or world is the API's with the flag's name instead of the argument's."""
    from megashard.advisor.search import suggest

    for flag_args, kwargs in ((["-w", "0", "--device-memory", "80GiB"], {"world_size": 0, "device_memory": "80GiB"}),
                              (["-w", "8", "--device-memory", "80"], {"world_size": 8, "device_memory": "80"})):
        assert main(["plan", DEFAULT, "--suggest", *flag_args]) == 2
        cli = capsys.readouterr().err.strip().split(": ", 2)[-1]
        with pytest.raises(ConfigError) as e:
            suggest(_job(), **kwargs)
        api = str(e.value)
        assert api.split(": ", 1)[1] == cli.split(": ", 1)[1], (api, cli)


def test_python_api_accepts_sizes_with_units_and_bytes():
    from megashard.advisor.search import suggest

    assert suggest(_job(), 8, "80GiB").device_memory == 80 * GIB
    assert suggest(_job(), 8, 80 * GIB).device_memory == 80 * GIB
    assert suggest(_job(), 8, "80G").device_memory == 80 * 10**9


@pytest.mark.parametrize("field,value,rule", [("mfu", 2.0, "in (0, 1]"), ("tflops", 0, "a positive number"),
                                               ("inter_gbps", float("inf"), "a positive number"),
                                               ("latency_us", -1.0, "a positive number")])
def test_hardware_checks_its_numbers(field, value, rule):
    from megashard.advisor.cost import Hardware

    with pytest.raises(ConfigError) as e:
        Hardware(**{field: value})
    assert str(e.value) == f"Hardware.{field}={value!r}: must be {rule}"
