"""The synthetic data's set-up is linear in what it makes (issue 42): no ``vocab × vocab`` table.

Earlier versions drew every token's successors as the head of a full ``randperm(vocab)`` and stacked them: vocab² ×
8 bytes at once (16 GiB at vocab 131,072). The peak RSS growth is measured in a fresh process (``VmHWM`` reset
through ``/proc/self/clear_refs`` after the imports, else ``ru_maxrss``): bytes, not seconds, are asserted
(the time is ``benchmarks/synthetic_setup.py``'s).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_MEASURE = r"""
import json, resource, sys
import torch
from megashard.train.data import synthetic_sequences

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return None

vocab = int(sys.argv[1])
synthetic_sequences(4, 8, 64, 4, 0)  # first use of every op: their one-time allocations belong to the baseline
base = status("VmRSS")
try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    reset = status("VmHWM") is not None and status("VmHWM") <= base + (8 << 20)
except OSError:
    reset = False
before_max = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
rows = synthetic_sequences(64, 65, vocab, 4, 1)
if reset:
    growth = status("VmHWM") - base
else:  # ru_maxrss never goes down: the growth above the larger of the baseline and the earlier peak
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - max(base, before_max)
print(json.dumps({"growth": growth, "dtype": str(rows.dtype), "max": int(rows.max()), "shape": list(rows.shape)}))
"""


def _peak_growth(vocab: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(vocab)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_synthetic_setup_at_vocab_131072_stays_under_100_mib():
    got = _peak_growth(131_072)
    # the chain is 131,072 × 4 successors (int64) and their float32 CDFs: 6 MiB; the old set-up needed 128 GiB
    assert got["growth"] < 100 << 20, f"peak RSS grew by {got['growth'] / 2**20:.1f} MiB"
    assert got["shape"] == [64, 65] and got["dtype"] == "torch.int32" and got["max"] < 131_072


def test_distinct_successors_are_distinct_in_range_and_cover_the_vocabulary():
    from megashard.train.data import distinct_successors

    for vocab, b in ((256, 4), (97, 97), (5000, 16), (8, 1)):
        g = torch.Generator().manual_seed(3)
        succ = distinct_successors(vocab, b, g)
        assert succ.shape == (vocab, b)
        assert int(succ.min()) >= 0 and int(succ.max()) < vocab
        assert all(len(set(row)) == b for row in succ.tolist())  # no successor twice in a row
        if b == vocab:
            assert all(sorted(row) == list(range(vocab)) for row in succ.tolist())
    # uniform over the vocabulary: each of 16 buckets of ids gets its share of 5000 × 16 draws (±10 %)
    succ = distinct_successors(5000, 16, torch.Generator().manual_seed(0))
    counts = torch.bincount(succ.flatten() * 16 // 5000, minlength=16).tolist()
    assert all(abs(c - 5000) < 500 for c in counts), counts


def test_synthetic_sequences_follow_their_chain_and_repeat_per_seed():
    from megashard.train.data import synthetic_sequences, synthetic_token_dtype

    a = synthetic_sequences(200, 40, vocab=300, branching=3, seed=5)
    assert a.dtype == synthetic_token_dtype(300) == torch.int16
    assert torch.equal(a, synthetic_sequences(200, 40, vocab=300, branching=3, seed=5))
    assert not torch.equal(a, synthetic_sequences(200, 40, vocab=300, branching=3, seed=6))
    successors: dict[int, set] = {}
    for x, y in zip(a[:, :-1].flatten().tolist(), a[:, 1:].flatten().tolist()):
        successors.setdefault(x, set()).add(y)
    assert max(len(v) for v in successors.values()) == 3  # every token's successors come from its 3
    assert synthetic_token_dtype(32_768) == torch.int16 and synthetic_token_dtype(32_769) == torch.int32


def test_batches_of_narrow_rows_are_int64():
    from megashard.train.config import JobConfig
    from megashard.train.data import Batches

    job = JobConfig.from_yaml(os.path.join(REPO, "configs", "default.yaml"))
    x, y = Batches(job.data, job.model, 16, seed=1).batch(0)
    assert x.dtype == y.dtype == torch.int64 and x.shape == (16, 64)
