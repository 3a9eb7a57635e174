"""Run tests/_doctor_user_script.py under torchrun and collect each rank's doctor line (test_doctor_faults.py,
test_doctor_places.py)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "_doctor_user_script.py")


def doctor_torchrun(mode: str, nproc: int, run_dir: str, timeout_s: float, *torchrun_args: str,
                    limit_s: float = 300) -> tuple[dict[int, str], str]:
    """The script in ``mode`` on ``nproc`` ranks with the doctor's timeout ``timeout_s``; returns each rank's doctor
    line (rank -> line; a rank reported twice fails) and torchrun's whole stderr."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *torchrun_args,
           SCRIPT, mode, run_dir, str(timeout_s)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=limit_s)
    lines = {}
    for line in p.stderr.splitlines():
        if line.startswith("megashard doctor: rank "):
            rank = int(line.split()[3])
            assert rank not in lines, f"rank {rank} reported twice:\n{p.stderr[-3000:]}"
            lines[rank] = line
    return lines, p.stderr
