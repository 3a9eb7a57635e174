"""tools/gpu-check.sh on a machine without a usable CUDA device (here: a CPU-only torch; on a GPU machine the test
hides the GPUs with CUDA_VISIBLE_DEVICES=""): it reuses this interpreter's venv (no installs), every check of
tests/gpu, the default job and the benchmarks is skipped with its one-line reason, one table, JSON, exit 0.
And its report turns a failing test into a failed row and exit status 1."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = dict(os.environ, GPU_CHECK_VENV=sys.prefix, CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    proc = subprocess.run(["bash", os.path.join(ROOT, "tools", "gpu-check.sh"), "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc, out


def test_cpu_run_skips_everything_with_reasons(cpu_run):
    proc, out = cpu_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["check"]: r for r in summary["rows"]}
    tests = [r for name, r in rows.items() if "::" in name]
    assert len(tests) >= 6, sorted(rows)
    for module in ("test_cuda_rng.py", "test_cuda_te.py", "test_cuda_memory.py", "test_nccl.py", "test_cuda_gloo.py",
                   "test_cuda_train.py"):
        assert any(name.startswith(module + "::") for name in rows), f"no row of {module}"
    assert rows["setup"]["detail"].startswith(f"reusing {sys.prefix} as it is")
    assert {"default job on cuda (50 steps)", "benchmarks/gpu.py"} <= set(rows)
    for r in summary["rows"]:
        assert r["result"] == "skipped", r
        assert r["detail"].strip() and "\n" not in r["detail"], r
    for r in tests + [rows["default job on cuda (50 steps)"], rows["benchmarks/gpu.py"]]:
        assert r["detail"].startswith("needs CUDA: this machine has no usable CUDA device (torch "), r
    n = len(summary["rows"])
    assert summary["counts"] == {"passed": 0, "failed": 0, "skipped": n} and summary["exit"] == 0
    assert summary["benchmarks"] is None and summary["machine"]["venv"] == sys.prefix
    # One table on stdout: a header, a row per check, the counts.
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["check", "result", "detail"]
    assert f"gpu-check: 0 passed, 0 failed, {n} skipped" in proc.stdout
    assert sum(" skipped  " in line for line in lines) == n
    log = (out / "pytest.log").read_text()
    # Every test pytest collected has its row (an import error would be a failed row, not a skip).
    assert "PytestUnknownMarkWarning" not in log and f"{len(tests)} skipped in" in log and "error" not in log


def test_report_names_failures_and_fails(tmp_path):
    """A real pytest JUnit file with a pass, a failure and a skip, and a failed script step: exit 1, each detail."""
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok():\n    assert 1 + 1 == 2\n"
        "def test_bad():\n    assert [1, 2] == [1, 3], 'group tp has ranks [1, 3]'\n"
        "def test_later():\n    pytest.skip('needs 2 CUDA devices, this machine has 1')\n")
    junit = tmp_path / "tests.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                    str(tmp_path / "test_sample.py")], cwd=tmp_path, capture_output=True, timeout=120)
    steps = tmp_path / "steps.tsv"
    steps.write_text("default job on cuda (50 steps)\tfailed\tCUDA error: out of memory (log: job.log)\n")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check_report.py"), "--junit", str(junit),
                           "--steps", str(steps), "--json", str(tmp_path / "summary.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {r["check"].rsplit("::", 1)[-1]: r for r in summary["rows"]}
    assert rows["test_ok"]["result"] == "passed"
    assert rows["test_bad"]["result"] == "failed" and "group tp has ranks [1, 3]" in rows["test_bad"]["detail"]
    assert rows["test_later"] == {"check": rows["test_later"]["check"], "result": "skipped",
                                  "detail": "needs 2 CUDA devices, this machine has 1"}
    assert rows["default job on cuda (50 steps)"]["detail"] == "CUDA error: out of memory (log: job.log)"
    assert summary["counts"] == {"passed": 1, "failed": 2, "skipped": 1} and summary["exit"] == 1
    assert "gpu-check: 1 passed, 2 failed, 1 skipped" in proc.stdout
