"""Data benchmark: memory-mapped reading, a rank's memory on a large dataset, and `megashard data prepare`.

Section ``read``: samples/s of the memory-mapped reader (an indexed dataset, ``IndexedDataset`` →
``StreamWindows``) against the *same* samples read from the same tokens held in memory (``TensorTokens``,
the baseline), in the job's order (``BlendedSamples``: seeded split and epoch permutation), batches of
``--batch`` windows of ``seq_len + 1`` tokens; the index arithmetic is included on both sides. The page
cache is warm (the file was just written): this measures megashard's overhead, not the disk.

Section ``rss``: one rank in its own process — data-parallel rank 3 of 8, ``Batches`` of the real job with
``data.source: indexed`` — reads its samples of ``--steps`` steps from a dataset several times larger than
the process; its peak RSS (``ru_maxrss``) against the dataset size (goal: dataset ≥ 10× the rank's RSS,
i.e. the rank holds only the pages it reads). The in-memory way would need the whole file in every rank.
Peak RSS is the kernel's ``VmHWM`` of the rank's process (Linux); at the end the rank also reports its private
memory (``RssAnon``) and the mapped file pages it holds (``RssFile``: the clean, reclaimable page-cache pages
of the samples it read — the kernel maps up to 64 KB around each page fault).

Section ``prepare``: MB/s of input text of ``prepare()`` (byte tokenizer; 1 and 2 workers; a trained
byte-level BPE tokenizer when Hugging Face ``tokenizers`` is installed) against a plain one-process loop
(read each file, tokenize, append the end-of-document id, write one flat token file: no index, no
workers). The text is the Python standard library's sources, repeated.

Usage: ``python benchmarks/data.py [--quick]``; writes ``benchmarks/results/data.json``.
"""
from __future__ import annotations

import argparse
import array
import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results", "data.json")


def _write_dataset(prefix: str, tokens: int, doc_len: int = 5000, chunk_docs: int = 2000) -> None:
    from megashard.data.indexed import IndexedDatasetBuilder

    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 50000, (chunk_docs * doc_len,), generator=g, dtype=torch.int64).to(torch.uint16)
    with IndexedDatasetBuilder(prefix, torch.uint16) as b:
        written = 0
        while written < tokens:
            for d in range(chunk_docs):
                b.add_document(base[d * doc_len: (d + 1) * doc_len])
            written += chunk_docs * doc_len


def bench_read(tmp: str, tokens: int, seq_len: int, batch: int, batches: int) -> dict:
    from megashard.data.blend import BlendedSamples
    from megashard.data.indexed import IndexedDataset
    from megashard.data.samples import StreamWindows
    from megashard.data.tokens import TensorTokens

    prefix = os.path.join(tmp, "read")
    _write_dataset(prefix, tokens)
    mapped = IndexedDataset(prefix)
    with open(prefix + ".bin", "rb") as f:
        memory = TensorTokens(torch.frombuffer(bytearray(f.read()), dtype=torch.uint16), "memory")
    sides = {k: BlendedSamples([StreamWindows(s, seq_len)], [1.0], 0.01, seed=1) for k, s in
             (("mmap", mapped), ("memory", memory))}
    out: dict = {}
    for rnd in range(3):  # interleaved rounds, best of 3
        for k, smp in sides.items():
            t0 = time.perf_counter()
            check = 0
            for s in range(batches):
                rows = smp.tokens(*smp.train(torch.arange(s * batch, (s + 1) * batch)))
                check += int(rows[:, 0].sum())
            dt = time.perf_counter() - t0
            out.setdefault(k, {"seconds": dt, "check": check})
            out[k]["seconds"] = min(out[k]["seconds"], dt)
    assert out["mmap"]["check"] == out["memory"]["check"], "both sides must read the same samples"
    n = batch * batches
    res = {"tokens": mapped.num_tokens, "bytes": os.path.getsize(prefix + ".bin"), "seq_len": seq_len,
           "samples": n}
    for k in sides:
        res[k] = {"samples_per_s": n / out[k]["seconds"], "tokens_per_s": n * (seq_len + 1) / out[k]["seconds"]}
    res["ratio"] = res["mmap"]["samples_per_s"] / res["memory"]["samples_per_s"]
    del mapped, memory, sides
    for ext in (".bin", ".idx"):
        os.remove(prefix + ext)
    return res


_RANK = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})

def status(key):  # KiB; VmHWM = peak RSS of this process (unlike ru_maxrss, not inherited from the parent)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))

def hwm():
    return status("VmHWM")

import torch
from megashard.train.config import JobConfig
from megashard.train.data import Batches
base = hwm()
job = JobConfig.from_dict({{"model": {{"vocab_size": 50304, "seq_len": {seq_len}}},
                           "data": {{"source": "indexed", "path": {prefix!r}, "valid_fraction": 0.001}}}})
b = Batches(job.data, job.model, {global_batch}, seed=1234, dp_rank=3, dp_size=8)
t0 = time.perf_counter()
tokens = 0
for s in range({steps}):
    x, y = b.batch(s)
    tokens += x.numel()
dt = time.perf_counter() - t0
peak = hwm()
print(json.dumps({{"rss_after_imports_mb": base / 1024, "peak_rss_mb": peak / 1024, "tokens_read": tokens,
                  "seconds": dt, "private_mb": status("RssAnon") / 1024, "file_pages_mb": status("RssFile") / 1024}}))
"""


def bench_rss(tmp: str, tokens: int, seq_len: int, steps: int) -> dict:
    prefix = os.path.join(tmp, "big")
    t0 = time.perf_counter()
    _write_dataset(prefix, tokens)
    write_s = time.perf_counter() - t0
    size = os.path.getsize(prefix + ".bin") + os.path.getsize(prefix + ".idx")
    code = _RANK.format(root=ROOT, seq_len=seq_len, prefix=prefix, global_batch=64, steps=steps)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200)
    if p.returncode:
        raise RuntimeError(p.stderr)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for ext in (".bin", ".idx"):
        os.remove(prefix + ext)
    res.update({"dataset_mb": size / 2**20, "dataset_over_peak_rss": size / 2**20 / res["peak_rss_mb"],
                "steps": steps, "seq_len": seq_len, "write_mb_per_s": size / 2**20 / write_s})
    return res


def _corpus(tmp: str, mb: int, files: int) -> list[str]:
    sources = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    text = b"".join(open(p, "rb").read() for p in sources)
    per = mb * 2**20 // files
    paths = []
    for i in range(files):
        path = os.path.join(tmp, f"text{i}.txt")
        with open(path, "wb") as f:
            left = per
            while left > 0:
                f.write(text[:left])
                left -= len(text)
        paths.append(path)
    return paths


def _plain_prepare(paths: list[str], out: str, encode, eod: int) -> None:
    """The baseline: one process, read, tokenize, append the end-of-document id, write one flat uint16 file."""
    with open(out, "wb") as f:
        for p in paths:
            with open(p, "rb") as src:
                ids = array.array("H", encode(src.read()))
            ids.append(eod)
            f.write(ids.tobytes())


def bench_prepare(tmp: str, mb: int, files: int) -> dict:
    from megashard.data.prepare import prepare

    paths = _corpus(tmp, mb, files)
    nbytes = sum(os.path.getsize(p) for p in paths)
    res: dict = {"input_mb": nbytes / 2**20, "files": files, "runs": {}}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        res["runs"][name] = {"seconds": time.perf_counter() - t0, "mb_per_s": nbytes / 2**20 / (time.perf_counter() - t0)}

    out = os.path.join(tmp, "out")
    timed("plain loop, byte", lambda: _plain_prepare(paths, out + ".flat", lambda b: b, 256))
    timed("megashard, byte, 1 worker", lambda: prepare(paths, out + "1", "byte", workers=1, progress=False))
    timed("megashard, byte, 2 workers", lambda: prepare(paths, out + "2", "byte", workers=2, progress=False))
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        res["bpe"] = "skipped: Hugging Face tokenizers is not installed"
    else:
        from megashard.data.tokenizer import HFTokenizer, train_bpe

        sample = os.path.join(tmp, "sample.txt")
        with open(paths[0], "rb") as f, open(sample, "wb") as s:
            s.write(f.read(2 * 2**20))
        tok_path = os.path.join(tmp, "bpe.json")
        train_bpe(iter([open(sample, encoding="utf-8", errors="replace").read()]), 4096, tok_path)
        tok = HFTokenizer(tok_path)
        timed("plain loop, BPE 4096", lambda: _plain_prepare(
            paths, out + ".bpe.flat", lambda b: tok.encode(b.decode("utf-8", errors="replace")), tok.eod_id))
        timed("megashard, BPE 4096, 1 worker", lambda: prepare(paths, out + "b1", tok_path, workers=1, progress=False))
        timed("megashard, BPE 4096, 2 workers", lambda: prepare(paths, out + "b2", tok_path, workers=2, progress=False))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller datasets and corpus")
    args = ap.parse_args()
    q = args.quick
    load0 = os.getloadavg()
    tmp = tempfile.mkdtemp(prefix="megashard-bench-data-")
    try:
        read = bench_read(tmp, tokens=20_000_000 if q else 100_000_000, seq_len=2048, batch=8,
                          batches=100 if q else 400)
        rss = bench_rss(tmp, tokens=300_000_000 if q else 2_000_000_000, seq_len=2048, steps=50 if q else 200)
        prep = bench_prepare(tmp, mb=16 if q else 64, files=4 if q else 8)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load1 = os.getloadavg()
    print(f"\nload average {load0[0]:.1f} at start, {load1[0]:.1f} at the end (2 cores); torch {torch.__version__}\n")
    print(f"### read: {read['samples']} samples of {read['seq_len'] + 1} tokens from {read['bytes'] / 2**20:.0f} MB "
          "(warm page cache)\n")
    print("| reader | samples/s | tokens/s | vs in-memory |\n|---|---|---|---|")
    for k, label in (("mmap", "megashard, memory-mapped IndexedDataset"), ("memory", "tensor in memory (baseline)")):
        r = read[k]
        print(f"| {label} | {r['samples_per_s']:,.0f} | {r['tokens_per_s'] / 1e6:,.1f} M | "
              f"{r['samples_per_s'] / read['memory']['samples_per_s']:.2f}× |")
    print(f"\n### rss: one rank (dp 3 of 8), {rss['steps']} steps of 8 samples × {rss['seq_len'] + 1} tokens\n")
    print("| dataset | rank peak RSS | RSS after imports | at the end: private / mapped file pages | "
          "dataset / peak RSS |\n|---|---|---|---|---|")
    print(f"| {rss['dataset_mb']:,.0f} MB | {rss['peak_rss_mb']:,.0f} MB | {rss['rss_after_imports_mb']:,.0f} MB | "
          f"{rss['private_mb']:,.0f} / {rss['file_pages_mb']:,.0f} MB | **{rss['dataset_over_peak_rss']:.1f}×** |")
    print(f"\n### prepare: {prep['input_mb']:.0f} MB of text in {prep['files']} files\n")
    print("| pipeline | MB/s | vs plain loop |\n|---|---|---|")
    for name, r in prep["runs"].items():
        base = prep["runs"]["plain loop, BPE 4096" if "BPE" in name else "plain loop, byte"]["mb_per_s"]
        print(f"| {name} | {r['mb_per_s']:,.1f} | {r['mb_per_s'] / base:.2f}× |")
    if isinstance(prep.get("bpe"), str):
        print(f"\n(BPE {prep['bpe']})")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump({"read": read, "rss": rss, "prepare": prep, "load_start": load0, "load_end": load1,
                   "torch": torch.__version__, "quick": q}, f, indent=1)
    print(f"\nwrote {RESULTS}")


if __name__ == "__main__":
    main()
