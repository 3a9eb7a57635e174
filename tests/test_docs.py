"""The docs stay true: the config reference matches the dataclasses, the README's commands match CI."""
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _gen_config_docs():
    """tools/gen_config_docs.py as a module (a tool, not part of the package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "tools" / "gen_config_docs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_config_reference_is_generated_from_dataclasses():
    import dataclasses

    gen = _gen_config_docs()
    render_into, sections = gen.render_into, gen.sections

    text = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert render_into(text) == text, "docs/config.md is stale: run python tools/gen_config_docs.py"
    for name, cls in sections():
        for f in dataclasses.fields(cls):
            assert f"| `{f.metadata.get('yaml', f.name)}` |" in text, (name, f.name)  # the YAML key


def test_every_config_field_is_documented_where_declared():
    import dataclasses

    gen = _gen_config_docs()
    field_docs, sections = gen.field_docs, gen.sections

    for name, cls in sections():
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    cmd = "bash tools/setup.sh && .venv/bin/python -m pytest -q tests"
    assert cmd in readme
    assert cmd in ci.splitlines()
    # ... and the files where interpreters differ under the python3 of a clean PATH (what a new user gets), in its
    # own venv.
    assert "env -i PATH=/usr/local/bin:/usr/bin:/bin sh -c 'command -v python3'" in ci
    assert 'PYTHON="$sys_py" VENV=.venv-sys bash tools/setup.sh && .venv-sys/bin/python -m pytest -q --long $INTERP_TESTS' in ci
    # ... and the long end-to-end tests the README's command leaves out (issue 40: that command stays within 12 min)
    assert ".venv/bin/python -m pytest -q tests -m long --long" in ci.splitlines()
    assert "`.venv/bin/python -m pytest -q tests --long`" in readme


def _ci_list(ci: str, name: str) -> list[str]:
    import re

    m = re.search(rf'^{name}="([^"]*)"', ci, re.M)
    assert m, f".ci/run defines no {name}"
    return m.group(1).split()


def test_ci_reruns_real_files_on_the_system_python_and_the_oldest_and_newest_torch():
    """The lists CI runs again name test files that exist (pytest would stop at a missing one, after the long first
    step), once each; the second torch steps are setup.py's oldest and newest supported releases."""
    import re

    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for name in ("INTERP_TESTS", "TORCH_TESTS"):
        files = _ci_list(ci, name)
        assert files and len(set(files)) == len(files), (name, files)
        assert [f for f in files if not (ROOT / f.split("::")[0]).is_file()] == [], name
        for f in files:  # a single test named by its node id: the test exists in that file
            if "::" in f:
                path, test = f.split("::", 1)
                assert re.search(rf"^def {re.escape(test)}\(", (ROOT / path).read_text(encoding="utf-8"), re.M), f
    assert "tests/test_checkpoint_unpickle.py" in _ci_list(ci, "INTERP_TESTS")  # what 3.11.2 pickles differently
    assert {"tests/test_checkpoint_async.py", "tests/test_pipeline.py", "tests/test_state_gloo.py",
            "tests/test_members_only_groups.py", "tests/test_uneven_dcp.py"} <= set(_ci_list(ci, "TORCH_TESTS"))
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    low, major, high = re.search(r'"torch>=(\d+\.\d+),<(\d+)\.(\d+)"', setup).groups()
    newest = f"{major}.{int(high) - 1}"
    assert f"second_torch {low}.0 .venv-torch{low.replace('.', '')} 4" in ci.splitlines()
    assert f"second_torch {newest}.0 .venv-torch{newest.replace('.', '')} 5" in ci.splitlines()


def test_setup_installs_what_the_promised_outputs_need():
    """The README promises a loss curve (matplotlib: the plot extra) and says which torch build comes."""
    setup = (ROOT / "tools" / "setup.sh").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'pip_ install -e ".[dev,plot,data,hf,hf-test,tensorboard,wandb]"' in setup
    assert ("import torch, yaml, pytest, matplotlib, tokenizers, safetensors, transformers, tensorboard, wandb, "
            "megashard") in setup
    assert "https://download.pytorch.org/whl/cpu" in setup and "https://download.pytorch.org/whl/cpu" in readme
    assert "4.7 GB" in setup and "4.7 GB" in readme
    assert "PYTHON=" in readme and "VENV=" in readme


def test_the_readme_suite_leaves_out_the_long_tests_and_says_so():
    """Issue 40: the README's command leaves out the tests marked ``long`` (CI runs them with --long) and says how
    many at its end; --long (or MEGASHARD_LONG_TESTS=1) keeps them. Collection only, in a subprocess."""
    import re
    import subprocess
    import sys

    files = ["tests/test_elastic.py", "tests/test_host_overhead.py"]

    def collect(*extra: str, env: dict | None = None) -> str:
        proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               *extra, *files], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, **(env or {})})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc.stdout

    short = collect(env={"MEGASHARD_LONG_TESTS": ""})
    everything = collect("--long")
    assert "tests/test_elastic.py::" not in short and "tests/test_elastic.py::" in everything
    assert "test_split_cache_equals_definition[4096]" in everything and "test_split_cache_equals_definition" not in short
    assert "tests/test_host_overhead.py::test_split_cache_over_consecutive_batches_and_epochs" in short
    m = re.search(r"megashard: (\d+) long end-to-end tests \(in 2 files\) were not run: `pytest tests --long`", short)
    assert m, short[-1500:]
    n_short = len([line for line in short.splitlines() if "::" in line])
    n_all = len([line for line in everything.splitlines() if "::" in line])
    assert n_all - n_short == int(m.group(1)) > 0, (n_all, n_short, m.group(1))
    assert collect(env={"MEGASHARD_LONG_TESTS": "1"}).count("::") == everything.count("::")
