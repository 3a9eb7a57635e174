"""`megashard run configs/text.yaml` as a fresh clone runs it: the launcher prepares the missing corpus (the
Python standard library, byte-tokenized) with a one-line note before any worker starts, then 4 gloo processes
train the Llama-style model on it with validation losses; `data.blend=[[1.0, PREFIX]]` points the same
config at another prepared corpus."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import sysconfig

import pytest

# a long end-to-end file: `pytest tests --long` (CI) runs it, the README's command does not
pytestmark = pytest.mark.long


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _megashard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megashard", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("textjob")
    corpus = str(tmp / "data" / "stdlib")
    p = _megashard("run", "configs/text.yaml", "train.steps=4", "train.eval_interval=2", "checkpoint.interval=0",
                   "train.plot=false", f"train.out_dir={tmp}/run", f"data.path={corpus}")
    return tmp, corpus, p


def _explain(p: subprocess.CompletedProcess) -> str:
    return f"exit {p.returncode}\n--- stderr ---\n{p.stderr[-5000:]}"


def test_launcher_prepares_the_missing_corpus_then_trains(text_run):
    from megashard.data.indexed import IndexedDataset
    from megashard.train.metrics import read_metrics

    tmp, corpus, p = text_run
    assert p.returncode == 0, _explain(p)
    lines = p.stderr.splitlines()
    notes = [i for i, line in enumerate(lines) if "has no corpus yet: preparing it from {stdlib}/*.py" in line]
    start = [i for i, line in enumerate(lines) if "text: 4 processes (1 node(s) × 4), tp=2, dp_shard=2" in line]
    assert len(notes) == 1 and len(start) == 1 and notes[0] < start[0], _explain(p)  # once, before the workers
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    # each real file once: a distribution's stdlib may hold links to its own files (Debian's _sysconfigdata__*)
    real = {os.path.realpath(f) for f in files}
    if len(real) < len(files):
        assert "led to a file already taken and were not read again" in p.stderr, _explain(p)
    meta = json.load(open(corpus + ".meta.json"))
    assert meta["documents"] == len(real) and meta["vocab_size"] == 257 and meta["tokenizer"] == "byte"
    ds = IndexedDataset(corpus)
    with open(files[0], "rb") as f:
        assert ds.document(0).tolist() == list(f.read()) + [256]
    records = read_metrics(os.path.join(tmp, "run", "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["step"] for r in records if "valid_loss" in r] == [2, 4]
    assert records[-1]["valid_loss"] < records[1]["valid_loss"] < 6.0
    assert p.stderr.count("megashard run: step 4: validation loss") == 1


def test_corpus_is_prepared_only_once(text_run, capsys):
    from megashard.train.config import JobConfig
    from megashard.train.data import ensure_corpus

    _, corpus, p = text_run
    assert p.returncode == 0, _explain(p)
    job = JobConfig.from_yaml(os.path.join(ROOT, "configs", "text.yaml"), [f"data.path={corpus}"])
    assert ensure_corpus(job.data) is None
    job.validate()  # the prepared corpus opens and its 257 ids fit model.vocab_size=384


def test_blend_points_the_config_at_another_corpus(text_run, tmp_path):
    from megashard.data.prepare import prepare
    from megashard.train.config import JobConfig
    from megashard.train.data import Batches

    _, corpus, _ = text_run
    other = str(tmp_path / "other")
    (tmp_path / "t.txt").write_text("a tiny corpus of its own. " * 200)
    prepare([str(tmp_path / "t.txt")], other, progress=False)
    job = JobConfig.from_yaml(os.path.join(ROOT, "configs", "text.yaml"), [f"data.blend=[[1.0, {other}]]"])
    job.validate()
    b = Batches(job.data, job.model, 4, seed=0)
    assert [s.name for s in b.samples.sources] == [other]
    text = bytes(b.batch(0)[0][0].tolist()).decode()
    assert "tiny corpus" in text
