"""Every `megashard ...` example of README.md, docs/*.md, the CLI epilogs and the configs' comments runs as written.

Examples are the lines of ```bash blocks and ``$ ``-prefixed lines of other (non-Python) blocks, the
``  megashard ...`` (and ``  mkdir -p ...``) lines of every ``--help`` epilog and the ``#   megashard ...`` lines
of configs/*.yaml (``mkdir -p DIR && megashard ...`` too). Cheap ones run in this process from a scratch directory
holding ``configs/``, ``README.md``, ``docs/``, a checkpoint made here (``out/ckpt``, ``out/checkpoints``, each with
``step_00000100``), the default job trained here for one step on two ranks (``runs/default``: its checkpoints, what
``ckpt export-hf`` exports, and its hang-doctor records), the user's inputs the data examples name (``notes.txt``,
``web.jsonl``, ``books/**/*.txt``) and a corpus prepared from them (``data/corpus``): ``plan``, ``run --dry-run``,
``ckpt``, ``data``, ``--help``. An example followed by a documented ``megashard X: error: ...`` line must fail with
exit code 2 and that message. Training examples are not run here (test_train_launch.py trains the
README's job, shortened; the fresh-clone check runs it whole): they are validated with ``--dry-run``.
Examples that cannot run on this machine (CUDA, Slurm, the set-up and the test suite) are listed in SKIPPED.
"""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CKPT_ENV = "MEGASHARD_TEST_DOCS_CKPT"
#: Why an example (or a part of an `a && b` line) is not run here; every skipped example must have one.
SKIPPED = {
    "setup": "installs ./.venv (bash tools/setup.sh): run by .ci/run and the fresh-clone check",
    "suite": "the test suite itself: run by .ci/run",
    "cuda": "needs CUDA GPUs (parallel.device=cuda); validated with --dry-run where CUDA is present",
    "slurm": "needs a Slurm allocation (srun)",
    "tokenizers": "needs the optional Hugging Face tokenizers package (pip install 'megashard[data]')",
    "gpu-check": "sets up and runs the GPU check (tools/gpu-check.sh): tests/test_gpu_check.py runs it here",
    "safetensors": "needs the optional safetensors package (pip install 'megashard[hf]')",
    "same-plan": "the same `megashard plan` command as an example run earlier (plan writes nothing: one run checks both)",
}


@dataclasses.dataclass
class Example:
    where: str            # file:line or "megashard plan --help"
    argv: list[str]       # after "megashard"
    error: str | None     # documented error line (expected exit 2), else None (exit 0)


def _markdown_commands(path: str) -> list[tuple[str, str, str | None]]:
    """(where, command line, documented error line or None) of a Markdown file."""
    out = []
    lines = open(path, encoding="utf-8").read().splitlines()
    lang = None
    for i, line in enumerate(lines):
        if line.startswith("```"):
            lang = None if lang is not None else (line[3:].strip() or "text")
            continue
        if lang is None or lang == "python":
            continue
        where = f"{os.path.relpath(path, ROOT)}:{i + 1}"
        if line.startswith("$ "):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            out.append((where, line[2:], nxt if re.match(r"^megashard [a-z ]+: error: ", nxt) else None))
        elif lang == "bash" and line.strip() and not line.lstrip().startswith("#"):
            out.append((where, line, None))
    return out


def _epilog_commands() -> list[tuple[str, str, None]]:
    import argparse

    from megashard.cli import build_parser

    out = []
    todo = [build_parser()]
    while todo:
        p = todo.pop()
        for line in (p.epilog or "").splitlines():
            if line.startswith(("  megashard ", "  mkdir -p ")):
                out.append((f"{p.prog} --help", line.strip(), None))
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += list(action.choices.values())
    return out


def _config_commands() -> list[tuple[str, str, None]]:
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))):
        for i, line in enumerate(open(path, encoding="utf-8")):
            m = re.match(r"^#\s{2,}((?:srun .*|mkdir -p \S+ && )?megashard .*)$", line.rstrip())
            if m:
                out.append((f"configs/{os.path.basename(path)}:{i + 1}", m.group(1), None))
    return out


def _classify(where: str, line: str, error: str | None) -> list[tuple[Example | None, str | None]]:
    """Each `&&` part of a line: (Example to run, None) or (None, skip reason key)."""
    out = []
    for part in line.split("&&"):
        argv = shlex.split(part, comments=True)
        if "|" in argv:  # `... | jq .groups`: the megashard part
            argv = argv[: argv.index("|")]
        while argv and re.match(r"^[A-Z_]+=", argv[0]):  # `GPU_CHECK_VENV=.venv bash ...`: the command after the env
            argv = argv[1:]
        if argv[:2] == ["bash", "tools/gpu-check.sh"]:
            out.append((None, "gpu-check"))
        elif argv[:2] == ["bash", "tools/setup.sh"]:
            out.append((None, "setup"))
        elif "pytest" in argv:
            out.append((None, "suite"))
        elif argv and argv[0] == "srun":
            out.append((None, "slurm"))
        elif argv and argv[0] == "mkdir":  # a directory an example writes into: made in the scratch directory
            out.append((Example(where, argv, error), None))
        elif argv and argv[0] in ("torchrun", ".venv/bin/torchrun"):  # a script of examples/ under torchrun
            out.append((Example(where, ["torchrun", *argv[1:]], error), None))
        elif argv and argv[0] in ("megashard", ".venv/bin/megashard"):
            out.append((Example(where, argv[1:], error), None))
        elif argv[1:3] == ["-m", "megashard"]:
            out.append((Example(where, argv[3:], error), None))
        else:
            raise AssertionError(f"{where}: an example that is not a megashard command: {line!r}")
    return out


def _all_examples() -> tuple[list[Example], list[tuple[str, str]]]:
    lines = []
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        lines += _markdown_commands(path)
    lines += _epilog_commands() + _config_commands()
    run, skipped, plans = [], [], set()
    for where, line, error in lines:
        for ex, reason in _classify(where, line, error):
            if ex is None:
                skipped.append((where, reason))
            elif ex.argv[0] == "plan" and (tuple(ex.argv), ex.error) in plans:  # e.g. llama-1b's --suggest, 3 places
                skipped.append((where, "same-plan"))
            else:
                plans.update([(tuple(ex.argv), ex.error)] if ex.argv[0] == "plan" else [])
                run.append(ex)
    return run, skipped


EXAMPLES, SKIPS = _all_examples()


def _needs_cuda(ex: Example) -> bool:
    from megashard.train.config import JobConfig

    if ex.argv[0] != "run":
        return False
    args = [a for a in ex.argv[1:] if not a.startswith("-")]
    return JobConfig.from_yaml(os.path.join(ROOT, args[0]), args[1:]).parallel.device == "cuda"


#: The user's own files the data examples name (docs/data.md, `megashard data --help`): a little text each.
_TEXT = ("Megatron-LM lays out tensor, pipeline and data parallel ranks in a fixed order. "
         "A memory-mapped dataset is read sample by sample; nothing is loaded whole.\n")
INPUTS = {
    "notes.txt": _TEXT * 20,
    "web.jsonl": "".join(json.dumps({"text": f"page {i}: {_TEXT}"}) + "\n" for i in range(20)),
    "books/fiction/a.txt": _TEXT * 10,
    "books/fiction/old/b.txt": _TEXT.upper() * 10,
    "books/poetry/c.txt": _TEXT[::-1] * 10,
}


def _needs_tokenizers(ex: Example) -> bool:
    if ex.argv[:2] != ["data", "prepare"] or ex.error:
        return False
    if "--train-tokenizer" in ex.argv:
        return True
    return "--tokenizer" in ex.argv and ex.argv[ex.argv.index("--tokenizer") + 1] != "byte"


def check_save_step_100(rank, world_size):
    import torch

    import megashard
    from megashard import checkpoint
    from megashard.config import ParallelConfig

    megashard.initialize(ParallelConfig())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    checkpoint.save(os.environ[CKPT_ENV], 100, model, opt, consumed_samples=1600)
    megashard.destroy()


def check_train_default_one_step(rank, world_size):
    """The default job, two ranks (tp=2), one step: a checkpoint with the job's config (``ckpt export-hf`` reads it)
    and the hang doctor's records (``megashard doctor runs/default`` reads them; a job of one rank has none)."""
    import contextlib
    import io

    from megashard.train.config import JobConfig
    from megashard.train.loop import train

    job = JobConfig.from_yaml(os.path.join(ROOT, "configs", "default.yaml"), [
        "parallel.tp=2", "parallel.dp_shard=1", "launch.nproc_per_node=2", "train.steps=1", "train.progress=false", "train.plot=false",
        f"train.out_dir={os.environ[CKPT_ENV]}"])
    with contextlib.redirect_stderr(io.StringIO()):
        train(job)


def _run_torchrun_example(ex: Example) -> None:
    """A script of examples/ under torchrun (as ``python -m torch.distributed.run``), from the repository root:
    exit 0, and the script's own check against a single process printed."""
    import subprocess
    import sys

    if "cuda" in ex.argv:
        import torch

        if not torch.cuda.is_available():
            pytest.skip(SKIPPED["cuda"])
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", *ex.argv[1:]], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{ex.where}: {' '.join(ex.argv)} exited {p.returncode}\n{p.stderr[-3000:]}"
    assert "on one process" in p.stdout and "disagree" not in p.stdout + p.stderr, (ex.where, p.stdout)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A directory to run the examples from: configs/, README.md, docs/, a step-100 checkpoint where the docs look,
    the input files the data examples name and the corpus ``data/corpus`` the run examples train on."""
    import shutil

    from megashard.data.prepare import prepare
    from tests._dist import spawn_checks

    d = tmp_path_factory.mktemp("examples")
    for name in ("configs", "README.md", "docs", "examples"):  # what the examples read (data prepare tokenizes
        # README.md docs/; megashard check rehearses examples/own_script.py)
        os.symlink(os.path.join(ROOT, name), d / name)
    os.environ[CKPT_ENV] = str(d / "out" / "ckpt")
    try:
        spawn_checks([check_save_step_100], world_size=1).assert_ok("check_save_step_100")
        os.environ[CKPT_ENV] = str(d / "runs" / "default")  # the README's path: the default job's checkpoints
        spawn_checks([check_train_default_one_step], world_size=2).assert_ok("check_train_default_one_step")
    finally:
        os.environ.pop(CKPT_ENV, None)
    shutil.copytree(d / "out" / "ckpt", d / "out" / "checkpoints")  # the epilogs' path
    for name, text in INPUTS.items():
        os.makedirs((d / name).parent, exist_ok=True)
        (d / name).write_text(text, encoding="utf-8")
    os.makedirs(d / "data")
    prepare([str(d / "notes.txt"), str(d / "web.jsonl")], str(d / "data" / "corpus"), progress=False)
    return d


def test_examples_were_found():
    where = {e.where.split(":")[0] for e in EXAMPLES}
    assert {"README.md", "docs/cli.md", "docs/train.md", "docs/checkpoint_io.md", "megashard plan --help",
            "megashard run --help", "megashard ckpt --help", "configs/default.yaml", "docs/data.md",
            "megashard data --help", "configs/text.yaml"} <= where, sorted(where)
    readme = [e.argv for e in EXAMPLES if e.where.startswith("README.md")]
    assert ["plan", "configs/default.yaml", "--world-size", "131072", "parallel.tp=8", "parallel.pp=4", "model.layers=4", "--rank",
            "77777", "--ranks-per-node", "8"] in readme
    assert ["ckpt", "inspect", "runs/default/checkpoints"] in readme
    assert len(EXAMPLES) >= 30


def test_skipped_examples_say_why():
    """The examples not run here, with the reason (printed with -rA / -s)."""
    for where, reason in SKIPS:
        assert reason in SKIPPED, (where, reason)
        print(f"skipped {where}: {SKIPPED[reason]}")
    assert {r for _, r in SKIPS} <= set(SKIPPED)
    assert ("README.md:14", "setup") in SKIPS and ("README.md:15", "suite") in SKIPS


@pytest.mark.parametrize("ex", EXAMPLES, ids=lambda e: f"{e.where} {' '.join(e.argv)}"[:120])
def test_example_runs_as_written(ex, scratch, monkeypatch, capsys):
    from megashard.cli import main

    argv = list(ex.argv)
    if argv[0] == "torchrun":
        _run_torchrun_example(ex)
        return
    if argv[0] == "mkdir":
        for path in argv[1:]:
            if not path.startswith("-"):
                os.makedirs(scratch / path, exist_ok=True)
        return
    if argv[0] == "run" and "--dry-run" not in argv and not ex.error:
        if _needs_cuda(ex):
            import torch

            if not torch.cuda.is_available():
                pytest.skip(SKIPPED["cuda"])
        argv.append("--dry-run")  # a training run: validated and its torchrun command built, not trained
    if _needs_tokenizers(ex):
        import importlib.util

        if importlib.util.find_spec("tokenizers") is None:
            pytest.skip(SKIPPED["tokenizers"])
    if argv[:2] == ["ckpt", "export-hf"]:
        import importlib.util

        if importlib.util.find_spec("safetensors") is None:
            pytest.skip(SKIPPED["safetensors"])
    monkeypatch.chdir(scratch)
    code = main(argv)
    out, err = capsys.readouterr()
    if ex.error:
        documented = ex.error.rstrip(".").rstrip()
        assert code == 2 and err.startswith(documented.replace(" ...", "")), (ex.where, documented, err)
    else:
        assert code == 0, f"{ex.where}: megashard {' '.join(ex.argv)} exited {code}\n{err[-3000:]}"
        assert out or err
