"""The hang doctor on faults in a user's own script under torchrun: what each waiting rank said, and how soon.

For every mode of ``tests/_doctor_user_script.py`` (a user's script with ``megashard.doctor.enable(timeout=T)``: a
rank aborted inside an all-reduce of another size, mismatched operations, a deadlock across two groups, a DTensor
``full_tensor()`` a rank never joins, a group registered on non-members whose member ended, a rank in its own code, a
rank SIGKILLed inside a call, a receive whose sender stays in its own code; and issue 41's: a rank stopped by SIGSTOP
after a call returned or inside one, a rank that ``os._exit``\ s after a call returned, a rank spinning in a Python
loop between calls on two groups, a DTensor all-reduce on a DeviceMesh's ``tp`` axis, a rank SIGKILLed inside a call
under torchrun's default monitor interval), one ``torchrun --standalone`` launch on gloo (for ``kill`` with
``--monitor-interval=3``: see ``TORCHRUN_ARGS``). A line from a rank that is not expected to print one (``kill_default``:
rank 0 may reach the call before torchrun stops it) must still be right. Reported per mode: the ranks that printed
a line, whether each line names the right group, operation, number and ranks with the right words (the expected
fragments below), the seconds from the hang (the rank's ``HANG`` mark, right before the call) to its line as read
from torchrun's stderr, whether ``megashard doctor RUN_DIR`` says the same from the files (exit code 1 and the
fragment in its table), and whether any process of the launch was left over.

    python benchmarks/doctor_hangs.py [--timeout T] [--modes size,op,...]

Prints a table and writes ``benchmarks/results/doctor_hangs.json``. A line is due within T (+ a publication interval
and the peers' read: about T + 0.5 s) of the hang, or at once when a peer died.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCRIPT = os.path.join(ROOT, "tests", "_doctor_user_script.py")
RESULTS = os.path.join(ROOT, "benchmarks", "results", "doctor_hangs.json")

# mode -> (ranks, the ranks expected to print, fragments every such line holds, a fragment of the CLI's table)
MODES = {
    "size": (2, [1], ["waits in all_reduce #4 on world [0, 1]", "rank 0 reached it; its process died inside "
                      "all_reduce #4 on world", "mismatched calls: rank 0: all_reduce float32[4]; rank 1: all_reduce "
                      "float32[8]"], "rank 0: reached it, its process"),
    "op": (2, [0, 1], ["#4 on world [0, 1]", "mismatched calls: rank 0: all_reduce float32[4]; rank 1: all_gather "
                       "float32[8]"], "mismatched calls: rank 0: all_reduce float32[4]; rank 1: all_gather"),
    "deadlock": (2, [0, 1], ["waits in all_reduce #1 on", "deadlock: rank"],
                 "deadlock: rank 0 waits in all_reduce #1 on a for rank 1, which waits in all_reduce #1 on b"),
    "dtensor": (2, [0], ["waits in all_gather", "on world [0, 1]", "rank 1 never reached it", "in user code"],
                "rank 1: last: all_gather"),
    "nonmember": (4, [0], ["waits in all_reduce #1 on pair [0, 1]", "rank 1 never reached it (its process ended"],
                  "rank 1: its process ended"),
    "sleep": (2, [0], ["waits in all_reduce #4 on world [0, 1]", "rank 1 never reached it", "in user code"],
              "rank 1: last: all_reduce #3"),
    "kill": (2, [0], ["waits in all_reduce #4 on world [0, 1]", "rank 1 reached it; its process died inside "
                      "all_reduce #4"], "rank 1: reached it, its process died inside all_reduce #4"),
    "recv": (2, [1], ["waits in recv", "rank 0"], "recv"),
    # issue 41: every rank placed where it is
    "stopped": (2, [0], ["waits in all_reduce #4 on world [0, 1]", "rank 1 never reached it (its process is stopped "
                         "(SIGSTOP) in its own code since all_reduce #3 on world returned"],
                "rank 1: its process is stopped (SIGSTOP) in its own code since all_reduce #3"),
    "stop_inside": (2, [0], ["waits in all_reduce #4 on world [0, 1]", "rank 1 reached it; its process is stopped "
                             "(SIGSTOP) inside all_reduce #4 on world"],
                    "rank 1: reached it, its process is stopped (SIGSTOP) inside all_reduce #4"),
    "exit_after": (2, [0], ["waits in all_reduce #4 on world [0, 1]", "rank 1 never reached it (its process ended "
                            "without its final record", "in its own code since all_reduce #3 on world returned"],
                   "rank 1: its process ended without its final record"),
    "loop": (2, [0], ["waits in all_reduce #4 on b [0, 1]", "rank 1 never reached it (last: all_reduce #4 on a",
                      "in user code"], "rank 1: last: all_reduce #4 on a"),
    "dtensor_tp": (4, [0], ["waits in all_reduce #4 on tp [0, 1]", "rank 1 never reached it", "in user code"],
                   "tp [0, 1] all_reduce #4 3 0 rank 1: last:"),
    "kill_default": (2, [], ["waits in all_reduce #4 on world [0, 1]", "rank 1 reached it; its process died inside "
                             "all_reduce #4"], "rank 1: reached it, its process died inside all_reduce #4"),
    # Bugs the check before launch finds (tests/_rehearse_user_script.py; tp=2 × pp=2 × dp=2 on 8 ranks), left in
    # with the check skipped: the doctor names rank and operation at run time (timeout PRE_LAUNCH_TIMEOUT).
    "pre:skip": (8, [1], ["waits in all_reduce #1 on dp [1, 3]", "rank 3 never reached it"], "rank 3:"),
    "pre:swap": (8, [0], ["waits in all_reduce #1 on tp [0, 1]", "rank 1 never reached it"],
                 "deadlock: rank"),
    "pre:shape": (8, [1], ["rank 0 never reached it (its process died inside all_reduce #1 on dp (float32[16])",
                           "rank 2 never reached it (its process died inside all_reduce #1 on dp (float32[17])"],
                  "rank 2: its process died inside all_reduce #1 on dp (float32[17])"),  # gloo aborts both
    "pre:microbatch": (8, [4], ["waits in recv #3 from rank 0 on pp [0, 4]", "rank 0"], "recv #3 from rank 0"),
    "pre:wrong_grid": (8, [0], ["calls all_reduce float32[16] on the group of ranks [0, 2, 4, 6], a group of layout "
                                "tp2·dp_shard4 on ranks 0-7 while layout tp2·pp2·dp_shard2 on ranks 0-7 is current"],
                       None),
}
#: The user's script of a mode: tests/_doctor_user_script.py, or for ``pre:`` modes tests/_rehearse_user_script.py.
PRE_SCRIPT = os.path.join(ROOT, "tests", "_rehearse_user_script.py")
#: The doctor's timeout of the ``pre:`` modes (seconds): a line is due within about this + 0.5 s of the hang.
PRE_LAUNCH_TIMEOUT = 3.0
#: The script's mode of a row (default: the row's name).
SCRIPT_MODE = {"kill_default": "kill"}
#: torchrun options per row. ``kill``: torchrun stops every other worker at its next check after one dies (every
#: 0.1 s by default), before rank 0 even joins (0.5 s later); with 3 s between checks the survivor gets to the call,
#: as the ranks on other nodes of a multi-node job do while the rendezvous notices. ``kill_default``: the same with
#: torchrun's default: rank 0 is stopped (SIGTERM) before it joins, and says nothing — ``megashard doctor`` names
#: the death from rank 1's entry slot and rank 0's last record (written on SIGTERM).
TORCHRUN_ARGS = {"kill": ["--monitor-interval=3"], "pre:shape": ["--monitor-interval=3"]}  # pre:shape: gloo aborts both


def run_mode(mode: str, t: float) -> dict:
    nproc, expect, fragments, table = MODES[mode]
    script = PRE_SCRIPT if mode.startswith("pre:") else SCRIPT
    if mode.startswith("pre:"):
        t = min(t, PRE_LAUNCH_TIMEOUT)
    run_dir = tempfile.mkdtemp(prefix=f"megashard-hangs-{mode}-")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *TORCHRUN_ARGS.get(mode, []), script, SCRIPT_MODE.get(mode, mode.split(":")[-1]), run_dir, str(t)]
    lines: list[tuple[float, str]] = []
    p = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)

    def read() -> None:
        for line in p.stderr:  # type: ignore[union-attr]
            lines.append((time.time(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        p.wait(timeout=240)
    except subprocess.TimeoutExpired:
        p.kill()
    reader.join(timeout=5)
    hangs = {}
    said: dict[int, tuple[float, str]] = {}
    for when, line in lines:
        # A mark may share a line with another rank's output (the ranks write to one stderr): find it anywhere.
        for m in re.finditer(r"HANG (\d+) (\d+\.\d{3})", line):
            hangs[int(m.group(1))] = float(m.group(2))
        if line.startswith("megashard doctor: rank "):
            said.setdefault(int(line.split()[3]), (when, line))
    rows = []
    for rank in sorted(set(expect) | set(said)):
        when, line = said.get(rank, (None, ""))
        missing = [f for f in fragments if f not in line]
        rows.append({"rank": rank, "expected": rank in expect, "line": line, "right": bool(line) and not missing,
                     "missing": missing,
                     "seconds": round(when - hangs[rank], 2) if when is not None and rank in hangs else None})
    from megashard.cli import main

    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["doctor", run_dir])
    text = " ".join(out.getvalue().split())
    left = subprocess.run(["pgrep", "-f", run_dir], capture_output=True, text=True).stdout.split()
    # table None: no hang to record (a call that completes, named at once by the doctor): the CLI finds none
    cli_right = code == 0 if table is None else (code == 1 and " ".join(table.split()) in text)
    return {"mode": mode, "ranks": nproc, "timeout_s": t, "exit": p.returncode, "rows": rows, "cli_exit": code,
            "cli_right": cli_right, "cli": out.getvalue(), "left_over": left,
            "run_dir": run_dir}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=10.0, help="the doctor's timeout T in seconds (default 10)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {', '.join(unknown)}; known: {', '.join(MODES)}")
    load_before = os.getloadavg()[0]
    results = [run_mode(m, args.timeout) for m in modes]
    load_after = os.getloadavg()[0]
    print(f"hang doctor on users' scripts under torchrun: T = {args.timeout:g} s; load {load_before:.1f} → "
          f"{load_after:.1f} on {os.cpu_count()} cores")
    print("| fault | ranks | waiting rank: right line | s from hang to line | megashard doctor right | left over |")
    print("|---|---|---|---|---|---|")
    for r in results:
        said = "; ".join(f"{row['rank']}: {'yes' if row['right'] else 'NO' if row['expected'] else 'extra'}"
                         for row in r["rows"]) or ("none (stopped first)" if not MODES[r["mode"]][1] else "none")
        secs = ", ".join(f"{row['seconds']:.2f}" for row in r["rows"] if row["seconds"] is not None) or "-"
        print(f"| {r['mode']} | {r['ranks']} | {said} | {secs} | {'yes' if r['cli_right'] else 'NO'} | "
              f"{len(r['left_over'])} |")
    for r in results:
        for row in r["rows"]:
            if row["line"]:
                print(f"{r['mode']}: {row['line']}")
            if row["missing"] and row["expected"]:
                print(f"{r['mode']}: rank {row['rank']} missing: {row['missing']}")
    out = {"benchmark": "doctor_hangs", "timeout_s": args.timeout, "results": results, "load_before": load_before,
           "load_after": load_after, "python": platform.python_version(), "cpus": os.cpu_count()}
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {RESULTS}")
    return 0 if all(all(row["right"] for row in r["rows"] if row["expected"] or not MODES[r["mode"]][1])
                    and r["cli_right"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
