"""The kinds of bad input issue 19 found still getting through, each as real ``megashard`` processes.

Kinds: pipeline rules (interleaved / zbv with fewer microbatches than pp; fewer layers than pp·vpp, in ``plan`` as in
``run``), blend weights (non-finite, <= 0, of another scale), ``data prepare`` inputs and outputs (empty or binary
files, ``--train-tokenizer`` out of range, ``--out`` unwritable / under a file / a directory / an input), output
paths of ``ckpt consolidate`` and ``ckpt export-hf`` (a directory, under a file, unwritable, inside or holding the
checkpoint read), YAML (empty, 20,000 levels deep, alias bombs; in files and overrides), list-typed fields given
something else (``parallel.high_priority_stream_groups=dp``), and errors the workers used to find one by one (a text
file shorter than a sample, a validation split that leaves no training sample, token ids beyond the vocabulary).

Every case runs the CLI as a subprocess from an empty directory of its own and must give exit code 2, one stderr
line ``megashard <cmd>: error: ...`` naming the field or path and the value, no traceback, no process started
(a launch prints its ``megashard run: <job>: N processes`` line first and writes ``config.yaml``), and nothing
written: its own directory stays empty and the shared inputs are unchanged. The cases run a few at a time.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests._helpers import tree_snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "configs", "default.yaml")
RUN = ["run", DEFAULT, "train.steps=2"]  # a case that got through would train briefly and fail its checks
PLAN = ["plan", DEFAULT]
PREP = ["data", "prepare"]
BOMB = ("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefg", "bcdefgh")))  # 9^8 = 43 M values
FLOW_BOMB = "[" + ", ".join(["&a [x, x, x, x, x, x, x, x, x]"] + [
    f"&{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefg", "bcdefgh")]) + "]"
HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None

# (id, argv after `megashard` ({bad} = the shared inputs), text the one error line must contain)
CASES = [
    # pipeline rules, in run and in plan
    ("interleaved-microbatches", RUN + ["parallel.pp=2", "parallel.tp=1", "parallel.vpp=2", "model.layers=4",
                                        "train.pipeline_schedule=interleaved_1f1b", "train.microbatches=1"],
     "train.microbatches=1: interleaved_1f1b needs at least pp=2 microbatches"),
    ("zbv-microbatches", RUN + ["parallel.pp=2", "parallel.tp=1", "parallel.vpp=2", "model.layers=4",
                                "train.pipeline_schedule=zbv", "train.microbatches=1"],
     "train.microbatches=1: zbv needs at least pp=2 microbatches"),
    ("plan-layers-pp", PLAN + ["-w", "16", "parallel.pp=4"], "model.layers=2 cannot fill pp × vpp = 4 × 1 = 4"),
    ("plan-layers-vpp", PLAN + ["-w", "8", "parallel.pp=2", "parallel.vpp=2",
                                "train.pipeline_schedule=interleaved_1f1b"], "model.layers=2 cannot fill pp × vpp = 2 × 2 = 4"),
    ("plan-layers-flag", PLAN + ["-w", "16", "--pp", "4"], "model.layers=2 cannot fill pp × vpp = 4 × 1"),
    ("plan-interleaved-microbatches", PLAN + ["-w", "16", "parallel.pp=4", "parallel.vpp=2", "model.layers=8",
                                              "train.pipeline_schedule=interleaved_1f1b", "train.microbatches=2"],
     "train.microbatches=2: interleaved_1f1b needs at least pp=4 microbatches"),
    # blend weights
    ("blend-inf", RUN + ["data.source=indexed", "model.vocab_size=258", "data.blend=[[.inf,{bad}/c],[1,{bad}/c]]"],
     "data.blend weight inf of {bad}/c must be a finite number > 0"),
    ("blend-nan", RUN + ["data.source=indexed", "model.vocab_size=258", "data.blend=[[.nan,{bad}/c]]"],
     "data.blend weight nan of {bad}/c must be a finite number > 0"),
    ("blend-negative", RUN + ["data.source=indexed", "model.vocab_size=258", "data.blend=[[1,{bad}/c],[-1,{bad}/c]]"],
     "data.blend weight -1 of {bad}/c must be a finite number > 0"),
    ("blend-zero-sum", RUN + ["data.source=indexed", "model.vocab_size=258", "data.blend=[[0,{bad}/c],[0,{bad}/c]]"],
     "data.blend weight 0 of {bad}/c must be a finite number > 0"),
    ("blend-1e-30", RUN + ["data.source=indexed", "model.vocab_size=258", "data.blend=[[1,{bad}/c],[1e-30,{bad}/c]]"],
     "data.blend weight 1e-30 ({bad}/c) is 1e-30 of the total weight 1, below 1/65,536: that dataset would never be drawn"),
    ("blend-below-block", RUN + ["data.source=indexed", "model.vocab_size=258",
                                 "data.blend=[[1.0,{bad}/c],[0.00001,{bad}/c]]"], "below 1/65,536"),
    ("blend-unused-inf", RUN + ["data.blend=[[.inf,{bad}/c]]"], "data.blend weight inf of {bad}/c"),
    ("blend-string", RUN + ["data.source=indexed", "data.blend=heavy"], "data.blend='heavy' must be a list"),
    # data prepare: inputs and outputs
    ("prepare-empty", PREP + ["{bad}/empty.txt", "--out", "c"], "{bad}/empty.txt is empty (0 bytes)"),
    ("prepare-binary", PREP + ["{bad}/blob.dat", "--out", "c"], "{bad}/blob.dat is binary, not text (a NUL byte at offset 3)"),
    ("prepare-all-skipped", PREP + ["{bad}/nontext", "--out", "c"], "no text to tokenize: all 2 input file(s) are empty or binary"),
    ("prepare-vocab-0", PREP + ["{bad}/notes.txt", "--train-tokenizer", "0", "--out", "c"], "--train-tokenizer 0: a byte-level BPE"),
    ("prepare-vocab-negative", PREP + ["{bad}/notes.txt", "--train-tokenizer", "-5", "--out", "c"], "--train-tokenizer -5:"),
    ("prepare-vocab-257", PREP + ["{bad}/notes.txt", "--train-tokenizer", "257", "--out", "c"], "needs 258..16,777,216 ids"),
    ("prepare-out-unwritable", PREP + ["{bad}/notes.txt", "--out", "/proc/megashard/c"], "--out /proc/megashard/c: /proc is not writable"),
    ("prepare-out-under-file", PREP + ["{bad}/notes.txt", "--out", "{bad}/a_file/c"],
     "--out {bad}/a_file/c: cannot be written under {bad}/a_file, which is a file"),
    ("prepare-out-is-dir", PREP + ["{bad}/notes.txt", "--out", "{bad}/taken"], "--out {bad}/taken.bin: is a directory"),
    ("prepare-out-is-input", PREP + ["{bad}/in.bin", "--out", "{bad}/in"],
     "--out {bad}/in.bin: is {bad}/in.bin, which this command reads"),
    # output paths of ckpt consolidate / export-hf
    ("consolidate-out-dir", ["ckpt", "consolidate", "{bad}/ck/step_00000001", "{bad}/empty"], "OUT {bad}/empty: is a directory"),
    ("consolidate-under-file", ["ckpt", "consolidate", "{bad}/ck/step_00000001", "{bad}/a_file/full.pt"],
     "OUT {bad}/a_file/full.pt: cannot be written under {bad}/a_file, which is a file"),
    ("consolidate-own-file", ["ckpt", "consolidate", "{bad}/ck/step_00000001", "{bad}/ck/step_00000001/__0_0.distcp"],
     "lies inside {bad}/ck/step_00000001, which this command reads"),
    ("consolidate-own-dir-file", ["ckpt", "consolidate", "{bad}/ck/step_00000001", "{bad}/ck/step_00000001/full.pt"],
     "lies inside {bad}/ck/step_00000001"),
    ("consolidate-unwritable", ["ckpt", "consolidate", "{bad}/ck/step_00000001", "/proc/megashard.pt"],
     "OUT /proc/megashard.pt: /proc is not writable"),
    ("export-out-file", ["ckpt", "export-hf", "{bad}/ck/step_00000001", "{bad}/a_file"], "OUT {bad}/a_file: is an existing file"),
    ("export-under-file", ["ckpt", "export-hf", "{bad}/ck/step_00000001", "{bad}/a_file/hf"],
     "OUT {bad}/a_file/hf: cannot be written under {bad}/a_file"),
    ("export-holds-ckpt", ["ckpt", "export-hf", "{bad}/ck/step_00000001", "{bad}/ck", "--force"],
     "OUT {bad}/ck: holds {bad}/ck/step_00000001, which this command reads"),
    ("export-inside-ckpt", ["ckpt", "export-hf", "{bad}/ck/step_00000001", "{bad}/ck/step_00000001/hf"],
     "lies inside {bad}/ck/step_00000001"),
    ("svg-under-file", PLAN + ["--svg", "{bad}/a_file/x.svg"], "--svg {bad}/a_file/x.svg: cannot be written under"),
    # YAML
    ("yaml-empty", ["plan", "{bad}/empty.yaml", "-w", "4"], "config file '{bad}/empty.yaml' is empty"),
    ("yaml-comments-only", ["run", "{bad}/comment.yaml"], "config file '{bad}/comment.yaml' is empty"),
    ("yaml-deep-list", ["plan", "{bad}/deep.yaml", "-w", "4"], "{bad}/deep.yaml: nesting deeper than 50 levels at line 3"),
    ("yaml-deep-run", ["run", "{bad}/deep.yaml"], "nesting deeper than 50 levels"),
    ("yaml-deep-override", PLAN + ["model.layers=" + "[" * 20000 + "]" * 20000], "override model.layers: nesting deeper"),
    ("yaml-alias-bomb", ["plan", "{bad}/bomb.yaml", "-w", "4"], "{bad}/bomb.yaml: the YAML expands to more than 100,000 values"),
    ("yaml-alias-bomb-override", PLAN + ["model.layers=" + FLOW_BOMB], "override model.layers: the YAML expands to more"),
    # list-typed fields
    ("list-groups-string", PLAN + ["parallel.high_priority_stream_groups=dp"],
     "high_priority_stream_groups='dp' must be a list of strings such as [dp_cp, ep_dp]"),
    ("list-groups-ints", PLAN + ["parallel.high_priority_stream_groups=[1,2]"], "high_priority_stream_groups=[1, 2] must be a list of strings"),
    ("list-hcp-int", PLAN + ["parallel.hierarchical_context_parallel_sizes=2"],
     "hierarchical_context_parallel_sizes=2 must be a list of integers"),
    ("list-prepare-inputs", RUN + ["data.prepare_inputs=notes.txt"], "data.prepare_inputs='notes.txt' must be a list of strings"),
    # errors the workers used to find, one per rank and restart
    ("text-too-short", RUN + ["data.source=text", "data.path={bad}/notes.txt"],
     "{bad}/notes.txt: fewer than 65 tokens: not one sample of model.seq_len=64"),
    ("synthetic-split", RUN + ["data.num_sequences=1", "data.valid_fraction=0.5"],
     "synthetic data (data.num_sequences=1): 1 samples leave no training sample"),
    ("indexed-split", RUN + ["data.source=indexed", "data.path={bad}/c", "model.vocab_size=258",
                             "data.valid_fraction=0.99"], "leave no training sample after holding out"),
    ("flat-token-ids", RUN + ["data.source=indexed", "data.path={bad}/ids.u16"],
     "{bad}/ids.u16: token id 256 at token 256 is outside model.vocab_size=256"),
]


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> str:
    import torch

    from megashard.data.prepare import prepare

    d = tmp_path_factory.mktemp("kinds")
    (d / "a_file").write_text("not a directory\n")
    (d / "empty").mkdir()
    (d / "empty.txt").write_bytes(b"")
    (d / "blob.dat").write_bytes(b"PK\x03\x00\x14binary")
    (d / "nontext").mkdir()
    (d / "nontext" / "x.txt").write_bytes(b"")
    (d / "nontext" / "y.pyc").write_bytes(b"\x00\x01\x02")
    (d / "notes.txt").write_text("a few words of text\n")
    (d / "in.bin").write_text("a text file that happens to end in .bin\n")
    (d / "taken.bin").mkdir()
    (d / "empty.yaml").write_text("")
    (d / "comment.yaml").write_text("# nothing but a comment\n\n")
    (d / "deep.yaml").write_text("parallel: {}\nmodel: {}\nx: " + "[" * 20000 + "]" * 20000 + "\n")
    (d / "bomb.yaml").write_text(BOMB)
    (d / "corpus.txt").write_text("the corpus of the blend cases, long enough for a few samples of 64 tokens. " * 8)
    prepare([str(d / "corpus.txt")], str(d / "c"), progress=False)
    torch.arange(1000, dtype=torch.int16).numpy().tofile(str(d / "ids.u16"))
    step = d / "ck" / "step_00000001"  # a checkpoint as far as the path checks look (they come before any read)
    step.mkdir(parents=True)
    (step / "COMPLETE.json").write_text("{}\n")
    (step / "__0_0.distcp").write_bytes(b"\x00" * 64)
    return str(d)


def _cli(argv: list[str], cwd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    env.pop("SLURM_JOB_ID", None)
    return subprocess.run([sys.executable, "-m", "megashard", *argv], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def results(bad, tmp_path_factory):
    """Every case's process, run four at a time, each from an empty directory; the shared inputs' snapshot
    before and after."""
    before = tree_snapshot(bad)
    cases = {}
    for name, argv, _ in CASES:
        cwd = tmp_path_factory.mktemp(name)
        cases[name] = (str(cwd), [a.replace("{bad}", bad) for a in argv])
    with ThreadPoolExecutor(4) as pool:
        done = dict(zip(cases, pool.map(lambda c: _cli(c[1], c[0]), cases.values())))
    return {n: (cases[n][0], done[n]) for n in cases}, before, tree_snapshot(bad)


@pytest.mark.parametrize("name,argv,expect", CASES, ids=[c[0] for c in CASES])
def test_bad_input_kind_is_one_line_exit_2_nothing_started_or_written(name, argv, expect, bad, results):
    if argv[:2] == ["ckpt", "export-hf"] and not HAS_SAFETENSORS:
        pytest.skip("export-hf needs the optional safetensors package")
    runs, _, _ = results
    cwd, p = runs[name]
    cmd = " ".join(argv[:2]) if argv[0] in ("ckpt", "data") else argv[0]
    lines = p.stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {len(lines)}:\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert lines[0].startswith(f"megashard {cmd}: error: "), lines[0]
    assert expect.replace("{bad}", bad) in lines[0], lines[0]
    assert p.returncode == 2, p.returncode
    assert os.listdir(cwd) == [], os.listdir(cwd)  # no out_dir, config.yaml, corpus or output file


def test_the_cases_cover_every_kind_and_write_nothing_shared(bad, results):
    _, before, after = results
    assert before == after, sorted(set(before.items()) ^ set(after.items()))[:10]
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)
    for prefix in ("interleaved", "plan-layers", "blend-", "prepare-", "consolidate-", "export-", "yaml-empty",
                   "yaml-deep", "yaml-alias", "list-", "text-too-short", "synthetic-split", "flat-token-ids"):
        assert any(c[0].startswith(prefix) for c in CASES), prefix
