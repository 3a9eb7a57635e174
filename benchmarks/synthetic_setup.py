"""Peak host memory and time of the synthetic data's set-up: megashard's linear set-up against the old one.

* **megashard**: :func:`megashard.train.data.synthetic_sequences` as the job runs it (Floyd's distinct successors,
  a float32 CDF per token, one ``[num]`` draw per position, rows in int16/int32);
* **before** (the plain-PyTorch baseline it replaced): every token's successors the head of a full
  ``torch.randperm(vocab)`` (the slices keep their ``randperm`` storage alive until the stack: vocab² × 8 bytes),
  ``torch.multinomial`` per position, rows in int64.

Each side runs in a fresh process (OMP_NUM_THREADS=1, one core), its peak RSS growth measured from a baseline after
the imports (``VmHWM`` reset through ``/proc/self/clear_refs``). The old set-up is timed up to
``--old-max-time-vocab`` (65,536) and run whole only up to ``--old-max-vocab`` (its memory is vocab² × 8 bytes: 19 GiB at 50,304); above that its time is measured without the
quadratic memory (the same draws into one reused buffer: the same time) and its
peak is given as computed, ``vocab² × 8 + tokens × 8`` bytes, marked ``(computed)``.

    python benchmarks/synthetic_setup.py [--quick] [--old-max-vocab 16384] [--out PATH]

Rows: vocabularies 4,096 … 131,072 at 64 sequences of 65 tokens (the chain dominates), and the data of
``configs/gpu-tp-fsdp-cp.yaml`` (vocab 50,304, 65,536 sequences of 2,049 tokens, branching 16: the tokens dominate).
Prints a table (with the machine's load) and writes ``benchmarks/results/synthetic_setup.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "synthetic_setup.json")

_CHILD = r"""
import json, sys, time
import torch

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

def old_sequences(num, length, vocab, branching, seed, keep_storage=True):
    g = torch.Generator().manual_seed(seed)
    if keep_storage:  # as it was: every slice keeps its randperm(vocab) storage until the stack
        succ = torch.stack([torch.randperm(vocab, generator=g)[:branching] for _ in range(vocab)])
    else:  # the same draws into one reused buffer, each head copied out (time without the vocab² memory; a fresh
        # randperm per token with .clone() still grows the heap by vocab² through fragmentation: OOM at 50,304)
        succ = torch.empty(vocab, branching, dtype=torch.int64)
        buf = torch.empty(vocab, dtype=torch.int64)
        for i in range(vocab):
            torch.randperm(vocab, generator=g, out=buf)
            succ[i] = buf[:branching]
    probs = torch.rand(vocab, branching, generator=g, dtype=torch.float64) + 0.1
    probs /= probs.sum(dim=1, keepdim=True)
    out = torch.empty(num, length, dtype=torch.int64)
    out[:, 0] = torch.randint(0, vocab, (num,), generator=g)
    for t in range(1, length):
        prev = out[:, t - 1]
        out[:, t] = succ[prev, torch.multinomial(probs[prev], 1, generator=g).squeeze(1)]
    return out

side, num, length, vocab, branching = sys.argv[1], *map(int, sys.argv[2:6])
from megashard.train.data import synthetic_sequences
synthetic_sequences(4, 8, 64, 4, 0); old_sequences(4, 8, 64, 4, 0)  # one-time allocations into the baseline
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
t0 = time.perf_counter()
if side == "megashard":
    rows = synthetic_sequences(num, length, vocab, branching, 1234)
else:
    rows = old_sequences(num, length, vocab, branching, 1234, keep_storage=(side == "before"))
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_growth": status("VmHWM") - base,
                  "rows_bytes": rows.numel() * rows.element_size()}))
"""


def _measure(side: str, num: int, length: int, vocab: int, branching: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", _CHILD, side, str(num), str(length), str(vocab), str(branching)],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gpu_config() -> tuple[int, int, int, int]:
    sys.path.insert(0, ROOT)
    from megashard.train.config import JobConfig

    job = JobConfig.from_yaml(os.path.join(ROOT, "configs", "gpu-tp-fsdp-cp.yaml"))
    return job.data.num_sequences, job.model.seq_len + 1, job.model.vocab_size, job.data.branching


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="vocabularies up to 16,384, no GPU config row")
    ap.add_argument("--old-max-vocab", type=int, default=16384, help="largest vocabulary the old set-up runs whole")
    ap.add_argument("--old-max-time-vocab", type=int, default=65536,
                    help="largest vocabulary the old set-up is timed at (its time grows with vocab²: ~30 min at 131,072)")
    ap.add_argument("--cases", default="", help="comma-separated cases to run (vocabularies, or 'gpu'); default all")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    rows = [("vocab", 64, 65, v, 4) for v in (4096, 16384) + (() if args.quick else (50304, 131072))]
    if not args.quick:
        rows.append(("gpu-tp-fsdp-cp.yaml", *_gpu_config()))
    if args.cases:
        want = set(args.cases.split(","))
        rows = [r for r in rows if str(r[3]) in want or ("gpu" in want and r[0] != "vocab")]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    results = []
    print(f"synthetic set-up, one core per process, {platform.node()}, load {load:.1f} at the start")
    print(f"{'case':<22}{'vocab':>8}{'tokens':>12}  {'megashard':>22}  {'before':>34}  ratio (time)")
    for name, num, length, vocab, b in rows:
        new = _measure("megashard", num, length, vocab, b)
        whole = vocab <= args.old_max_vocab
        old = (_measure("before" if whole else "before-time-only", num, length, vocab, b)
               if vocab <= args.old_max_time_vocab else {"error": f"not run (vocab > {args.old_max_time_vocab:,})"})
        if not whole and "error" not in old:
            old["peak_growth"] = vocab * vocab * 8 + num * length * 8  # computed: the randperm storage + int64 rows
            old["computed_peak"] = True
        entry = {"case": name, "vocab": vocab, "sequences": num, "length": length, "branching": b, "megashard": new,
                 "before": old}
        results.append(entry)

        def cell(r: dict) -> str:
            if "error" in r:
                return r["error"][:30]
            mark = " (computed)" if r.get("computed_peak") else ""
            return f"{r['peak_growth'] / 2**20:9,.1f} MiB {r['seconds']:7.2f} s{mark}"

        ratio = (f"{new['seconds'] / old['seconds']:.3f}" if "error" not in new and "error" not in old
                 and old["seconds"] > 0 else "-")
        print(f"{name:<22}{vocab:>8,}{num * length:>12,}  {cell(new):>22}  {cell(old):>34}  {ratio}", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"load_at_start": load, "rows": results}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
