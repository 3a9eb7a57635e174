"""``megashard run``: validate the job in the launcher process, then start it through torchrun.

    megashard run configs/default.yaml train.steps=50 parallel.tp=1

1. The YAML and its overrides are parsed and checked for the world size ``launch.nnodes ×
   launch.nproc_per_node`` — for an elastic range ``launch.nnodes: MIN:MAX`` every world size of it, each laid out or
   refused (:mod:`megashard.train.elastic`) —, the launch settings as torchrun reads them
   (:mod:`megashard.train.launch_checks`; ``--dry-run`` runs the same checks), and the job against this machine
   (output directories, CUDA/NCCL, memory: :mod:`megashard.launch.preflight`) — a bad config fails here with exit
   code 2, before any process starts.
2. Under Slurm (``SLURM_JOB_ID`` set, ``launch.slurm`` not false) the node count, node rank,
   rendezvous endpoint (first node of the job, port 29500) and id (the job id) come from Slurm
   variables unless given explicitly (on the command line for ``nnodes``).
3. The checkpoint directory must not be held by another live job (:mod:`megashard.train.ckptlock`): on a
   single node the launcher takes its lock for the whole run; otherwise the job's rank 0 does. Where the job
   starts is decided from the checkpoints' records, without torch (:mod:`megashard.train.startpoint`): a
   checkpoint of another model and a fresh start into an earlier run's checkpoints are refused (exit 2; with
   ``checkpoint.move_aside`` the earlier checkpoints are moved aside under the lock), a job already at
   ``train.steps`` has nothing to do (exit 0). Then a corpus
   the config can prepare (``data.prepare_inputs``) and that is missing is tokenized, once
   (:func:`megashard.train.data.ensure_corpus`), and checked against the model.
4. The resolved config is written to ``<out_dir>/config.yaml`` and PyTorch's elastic launcher runs
   ``sys.executable -m megashard.launch.agent ... -m megashard.launch.worker <out_dir>/config.yaml``
   (:mod:`megashard.launch.agent` is ``torch.distributed.run`` with short output that dies with this
   launcher): ``--standalone`` on one node, ``--nnodes/--rdzv-*`` on several (``--nnodes MIN:MAX`` and
   ``--rdzv-conf`` for an elastic job: docs/elastic.md), ``--max-restarts`` from the config. After a failure torchrun restarts every worker, and the job resumes from its newest checkpoint (not
   after a megashard error of a worker: a restart cannot fix it). Every process of the launch gets its run id
   (``MEGASHARD_RUN_ID``), recorded in its checkpoints.
5. Ctrl-C reaches this launcher only (torchrun runs in a session of its own): it stops torchrun with SIGTERM (the
   workers end at once, silently) and prints one line: the step reached and the step a rerun resumes from.
"""
from __future__ import annotations

import dataclasses
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from megashard.config import ResolvedSizes
from megashard.errors import ConfigError
from megashard.train.config import JobConfig
from megashard.train.sections import LaunchConfig, section_from_dict

__all__ = ["LaunchPlan", "plan_launch", "torchrun_command", "slurm_overrides", "first_host", "run"]

SLURM_PORT = 29500
#: Seconds a worker that lost its peers waits for torchrun to stop it (:mod:`megashard.launch.worker`).
PEER_LOSS_GRACE_ENV = "MEGASHARD_PEER_LOSS_GRACE_S"


def first_host(nodelist: str) -> str:
    """The first host name of a Slurm node list: ``"gpu[003-005,9],cpu1"`` -> ``"gpu003"``."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            end = i
            break
    first = nodelist[:end].strip()
    m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", first)
    if not m:
        return first
    prefix, ranges, suffix = m.groups()
    start = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{start}{suffix}"


def slurm_overrides(env: Mapping[str, str], cli_overrides: Sequence[str] = (), *, elastic: bool = False) -> list[str]:
    """``launch.*`` overrides taken from Slurm variables; explicit overrides win.

    Empty outside Slurm, and when a node count ``launch.nnodes`` is given on the command line (the user sets up the
    launch). ``elastic``: ``launch.nnodes`` is a range MIN:MAX (in the file or on the command line), which is kept (the
    allocation may grow and shrink); the node rank, endpoint and id still come from Slurm.
    """
    given = {o.split("=", 1)[0].strip() for o in cli_overrides}
    if "SLURM_JOB_ID" not in env or ("launch.nnodes" in given and not elastic):  # an explicit count takes over
        return []
    out = []
    nnodes = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if nnodes and not elastic:
        out.append(f"launch.nnodes={int(nnodes)}")
    if "SLURM_NODEID" in env and "launch.node_rank" not in given:
        out.append(f"launch.node_rank={int(env['SLURM_NODEID'])}")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist and "launch.rdzv_endpoint" not in given:
        out.append(f"launch.rdzv_endpoint={first_host(nodelist)}:{SLURM_PORT}")
    if "launch.rdzv_id" not in given:
        out.append(f"launch.rdzv_id=slurm-{env['SLURM_JOB_ID']}")
    return out


@dataclass
class LaunchPlan:
    """Everything :func:`run` needs: the validated job, the torchrun command and its environment additions."""

    job: JobConfig
    sizes: ResolvedSizes
    """The job's parallel sizes for its world size (from the one :meth:`JobConfig.validate` of the launcher); for an
    elastic range those of the largest world that runs."""
    config_path: str
    command: list[str]
    env: dict[str, str]
    notes: list[str]
    options: list = dataclasses.field(default_factory=list)
    """Elastic (``launch.nnodes: MIN:MAX``): every node count with its layout or refusal
    (:class:`megashard.train.elastic.WorldOption`); empty otherwise."""


def _rdzv_id(job: JobConfig) -> str:
    return job.launch.rdzv_id or f"megashard-{job.name}"


def torchrun_command(job: JobConfig, config_path: str) -> list[str]:
    """The torchrun command line that runs ``config_path`` (a resolved job YAML) on this node.

    ``megashard.launch.agent`` takes torchrun's arguments; ``torch.distributed.run`` in its place works too
    (with torch's longer failure output and no lifeline for torchrun itself).
    """
    from megashard.train.launch_checks import rdzv_conf

    la = job.launch
    lo, hi = la.node_range
    cmd = [sys.executable, "-m", "megashard.launch.agent"]
    if hi == 1 and not la.rdzv_endpoint:
        cmd.append("--standalone")  # a private c10d store on a free port
    else:
        cmd += ["--nnodes", f"{lo}:{hi}" if lo < hi else str(hi), "--rdzv-backend", la.rdzv_backend,
                "--rdzv-endpoint", la.rdzv_endpoint or f"localhost:{SLURM_PORT}",  # plan_launch requires it
                "--rdzv-id", _rdzv_id(job)]
        if la.node_rank is not None and la.rdzv_backend == "static":
            cmd += ["--node-rank", str(la.node_rank)]
        if lo < hi and la.rdzv_backend != "static":  # elastic: how long to wait for nodes, when one counts as gone
            cmd += ["--rdzv-conf", rdzv_conf(la)]
    cmd += ["--nproc-per-node", str(la.nproc_per_node), "--max-restarts", str(la.max_restarts),
            "--monitor-interval", str(la.monitor_interval),
            "-m", "megashard.launch.worker", config_path, "--name", job.name]
    return cmd


def _with_overrides(launch: LaunchConfig, items: Sequence[str]) -> LaunchConfig:
    """``launch`` with ``launch.key=value`` items applied (each value type-checked as in the YAML)."""
    from megashard.config.yamlfile import parse_override

    values = dataclasses.asdict(launch)
    for item in items:
        keys, value = parse_override(item)
        values[keys[-1]] = value
    return section_from_dict(LaunchConfig, values, "launch")


def plan_launch(config: str, overrides: Sequence[str] = (), env: Optional[Mapping[str, str]] = None) -> LaunchPlan:
    """Parse (once), apply Slurm settings, validate for the world size (once), and build the torchrun command.

    Raises :class:`ConfigError` for anything wrong with the job. Writes nothing.
    """
    env = os.environ if env is None else env
    overrides = list(overrides)
    notes: list[str] = []
    job = JobConfig.from_yaml(config, overrides)
    use_slurm = job.launch.slurm is not False and "SLURM_JOB_ID" in env
    if job.launch.slurm and "SLURM_JOB_ID" not in env:
        raise ConfigError("launch.slurm=true but SLURM_JOB_ID is not set: run inside a Slurm allocation (srun), "
                          "or use launch.slurm=null (use Slurm when present)")
    from megashard.train.sections import parse_node_range

    lo, hi = parse_node_range(job.launch.nnodes)  # a malformed range fails here, before Slurm's values are added
    extra = slurm_overrides(env, overrides, elastic=lo < hi) if use_slurm else []
    if extra:  # onto the parsed job (only launch.* keys the command line does not set): the file is read once
        job.launch = _with_overrides(job.launch, extra)
        notes.append("Slurm: " + " ".join(extra))
        if job.launch.multi_node and "SLURM_STEP_ID" not in env:
            notes.append("warning: several Slurm nodes but no job step: start one launcher per node with "
                         "`srun --ntasks-per-node=1 megashard run ...`")
    sizes = job.validate()  # every world size of an elastic range (megashard.train.elastic.validate_range)
    options = []
    if job.launch.elastic:
        from megashard.train.elastic import world_options

        options = world_options(job)
    if job.launch.multi_node and not job.launch.rdzv_endpoint:
        raise ConfigError(
            f"launch.nnodes={job.launch.nnodes} needs launch.rdzv_endpoint=<host:port> of a node every node can reach "
            "(e.g. node 0, port 29500), the same on every node; under Slurm it is taken from SLURM_JOB_NODELIST"
        )
    path = os.path.join(job.out_dir, "config.yaml")
    child_env = {}
    if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in env:
        # torchrun shares its rendezvous store with the workers by default, and after a restart the new
        # workers read the previous attempt's gloo/NCCL addresses from it and fail to connect
        # (pytorch/pytorch#135712). A store per attempt makes max_restarts work.
        child_env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # torch warns at import when numpy is absent; megashard does not need numpy, so keep the log clean (in
    # torchrun and every worker). Appended to the user's own filters: later entries win for that message only.
    quiet = "ignore:Failed to initialize NumPy"
    if quiet not in env.get("PYTHONWARNINGS", ""):
        child_env["PYTHONWARNINGS"] = f"{env['PYTHONWARNINGS']},{quiet}" if env.get("PYTHONWARNINGS") else quiet
    if job.parallel.device != "cuda" and "OMP_NUM_THREADS" not in env:
        child_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // job.launch.nproc_per_node))
    if job.launch.elastic and job.launch.rdzv_backend == "c10d":
        child_env["MEGASHARD_RECOVERY"] = job.launch.recovery  # megashard.launch.live_agent
    if job.launch.elastic and "TORCH_CPP_LOG_LEVEL" not in env:
        # a node that dies breaks the connections of every store client on the others: torch's C++ code warns once
        # per broken call with ~50 lines of stack (issue 40); megashard's own lines say what happened
        child_env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    if job.launch.elastic and PEER_LOSS_GRACE_ENV not in env:
        # A worker that lost its peers waits for torchrun to stop it, so that a failure of its own node is reported
        # first. In an elastic job the lost peer is usually a node that left: leave soon (the agent re-forms the
        # world, megashard.launch.agent), well after this node's own failures are seen (monitor_interval).
        child_env[PEER_LOSS_GRACE_ENV] = f"{max(2.0, 4 * job.launch.monitor_interval):g}"
    return LaunchPlan(job, sizes, path, torchrun_command(job, path), child_env, notes, options)


def _header(plan: LaunchPlan) -> str:
    """What the launch starts: processes, layout, steps, output; for an elastic job every node count of the range."""
    from megashard.train.elastic import absorbing_axis, layout_text, shown_options

    job, s, la = plan.job, plan.sizes, plan.job.launch
    head = f"megashard run: {job.name}: "
    if not plan.options:
        return (f"{head}{job.world_size} processes ({la.node_range[1]} node(s) × {la.nproc_per_node}), "
                f"{layout_text(job, s)}, {job.train.steps} steps → {job.out_dir}")
    lo, hi = la.node_range
    lines = [f"{head}elastic, {lo * la.nproc_per_node} to {hi * la.nproc_per_node} processes (launch.nnodes={lo}:{hi} "
             f"× {la.nproc_per_node}), parallel.{absorbing_axis(job)} absorbs the world size, {job.train.steps} steps "
             f"→ {job.out_dir}"]
    listed, rest = shown_options(plan.options)  # thousands of node counts: summarised, not a line each
    for o in listed:
        where = f"  {o.nodes} node{'s' if o.nodes > 1 else ' '}, world {o.world_size}: "
        lines.append(where + (layout_text(job, o.sizes, per_rank=True) if o.sizes is not None else
                              f"refused ({o.refusal}); the job {la.unfillable_world}s there "
                              f"(launch.unfillable_world={la.unfillable_world})"))
        if rest and o is listed[len(listed) - len(listed) // 3 - 1]:
            lines.append("  " + rest.replace("(--format json lists every one)", "(megashard plan CONFIG --format json "
                                              "lists every one)"))
    return "\n".join(lines)


def _write_config(job: JobConfig, path: str) -> None:
    """Write the resolved config into the run directory (created and marked as megashard's; an existing config.yaml
    there is replaced only when megashard wrote it: checked before by :func:`megashard.launch.preflight.check_outputs`)."""
    import yaml

    from megashard.outputs import RESOLVED_CONFIG_HEADER, claim_dir, temp_path

    claim_dir(os.path.dirname(path) or ".", "run", "train.out_dir=")
    tmp = temp_path(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(f"{RESOLVED_CONFIG_HEADER}{job.name} (overrides applied); the workers read this file\n")
            yaml.safe_dump(job.to_dict(), f, sort_keys=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def lock_id(job: JobConfig) -> str:
    """The job id in the checkpoint lock: this launcher on one node, the rendezvous id on several."""
    from megashard.launch.lifeline import hostname

    return f"rdzv:{_rdzv_id(job)}" if job.launch.multi_node else f"{hostname()}:{os.getpid()}"


def _hold_checkpoint_dir(job: JobConfig):
    """On a single node take the checkpoint directory's lock for the run (returned; CheckpointLockedError if a
    live job holds it), on several leave it to the job's rank 0 (None)."""
    from megashard.train.ckptlock import CheckpointLock

    if job.launch.multi_node:
        return None  # checked in run(); a launcher per node cannot hold one lock (an elastic job's rank 0 moves)
    lock = CheckpointLock.acquire(job.checkpoint_dir, job=job.name, job_id=lock_id(job), owner="launcher")
    if lock.note:
        print(f"megashard run: note: {lock.note}", file=sys.stderr)
    return lock


def _exit_on_sigterm():
    """SIGTERM ends the launcher through SystemExit, so the lock is released (torchrun and the workers follow
    through their lifelines); returns the previous handler, or None off the main thread."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        return None


def stopped_line(job: JobConfig, since: float) -> str:
    """What a user reads after stopping the job (Ctrl-C): the last step this launch trained (metrics.jsonl records
    written since ``since``, a time.time()) and the step a rerun resumes from (the newest complete checkpoint)."""
    from megashard.checkpoint.safety import latest_checkpoint, read_marker
    from megashard.errors import CheckpointError
    from megashard.train.metrics import read_metrics

    steps = [r.get("step", 0) for r in read_metrics(os.path.join(job.out_dir, "metrics.jsonl"))
             if r.get("time", 0.0) >= since]
    where = f"stopped at step {max(steps)}" if steps else "stopped during start-up, before the first step"
    newest = latest_checkpoint(job.checkpoint_dir)
    try:
        resume = read_marker(newest).step if newest else None
    except CheckpointError:
        resume = None
    if job.launch.elastic:  # the other nodes may train on: this node only left the job
        return (f"{where.replace('stopped', 'this node left the job', 1)}; the other nodes, if any, train on without "
                "it: rerun the same command to join them again (or, once the job has ended, to resume it from "
                + (f"step {resume})" if resume is not None else "the start)"))
    if resume is None:
        return f"{where}; no checkpoint was saved: rerun the same command to start again"
    how = "rerun the same command" if job.train.resume else "rerun without train.resume=false"
    return f"{where}; {how} to resume from step {resume}"


def _stop(proc: subprocess.Popen, sig: int, grace_s: float) -> None:
    """Send ``sig`` to torchrun (it stops its workers) and wait up to ``grace_s``; then kill it (the workers follow
    through their lifelines)."""
    try:
        proc.send_signal(sig)
        proc.wait(timeout=grace_s)
    except (KeyboardInterrupt, subprocess.TimeoutExpired):  # a second Ctrl-C, or torchrun hangs
        proc.kill()
        proc.wait()


def run(config: str, overrides: Sequence[str] = (), *, dry_run: bool = False,
        collectives: Optional[bool] = None) -> int:
    """Validate and launch; returns the exit code (0 ok or nothing to do, 1 the job failed, 2 a bad config raised as
    ConfigError — a checkpoint of another model, a fresh start into an earlier run's checkpoints included —, a
    checkpoint directory held by another live job raised as CheckpointLockedError, or an error of the job that a
    restart cannot fix; 130 after Ctrl-C)."""
    import time

    from megashard.launch.preflight import check_collectives, check_job_here, check_mode, check_outputs
    from megashard.train.startpoint import RUN_ID_ENV, find_start, move_aside, new_run_id

    check_mode()  # a bad MEGASHARD_CHECK is one line before anything is read or printed
    plan = plan_launch(config, overrides)
    job, s = plan.job, plan.sizes

    check_outputs(job, config)  # where the job writes: megashard's own directories, away from its inputs (no torch)
    if not dry_run:
        from megashard.train.ckptlock import check_free

        # Refuse before anything is printed or written (one line); the lock is taken below.
        check_free(job.checkpoint_dir, lock_id(job))
    start = find_start(job)  # from the checkpoints' records: another model, an earlier run's checkpoints, done
    if start.finished and not dry_run:
        print(f"megashard run: {job.name}: {start.finished}", file=sys.stderr)
        return 0
    check_job_here(job, outputs=False)  # this machine: devices, memory (before anything is written or started)
    if not dry_run:
        from megashard.train.data import check_corpus, ensure_corpus

        if ensure_corpus(job.data):  # e.g. configs/text.yaml: tokenize its corpus once, before any worker starts
            check_corpus(job.data, job.model, job.parallel.seed, s.tp)  # validate() let the corpus be missing: check the one just prepared
    header = _header(plan)
    if not dry_run:  # the start line names the resolved config it writes (below, before torchrun starts)
        first, sep, rest = header.partition("\n")
        header = f"{first} (resolved config: {plan.config_path}){sep}{rest}"
    print(header, file=sys.stderr)
    for note in plan.notes + ([start.finished] if start.finished else []):
        print(f"megashard run: {note}", file=sys.stderr)
    if check_collectives(job, s.world_size, dry_run, collectives):
        return 2 if not dry_run else 1
    if dry_run:
        print(shlex.join(plan.command))
        return 0
    try:
        from megashard.outputs import claim_dir

        claim_dir(job.out_dir, "run", "train.out_dir=")  # created and marked as megashard's (checked above)
        lock = _hold_checkpoint_dir(job)
    except OSError as e:
        print(f"megashard run: error: cannot create the checkpoint directory {job.checkpoint_dir}: "
              f"{e.strerror or e}", file=sys.stderr)
        return 2
    try:
        if start.earlier and lock is not None:  # train.resume=false checkpoint.move_aside=true (several nodes: rank 0)
            dest = move_aside(job, start.earlier)
            print(f"megashard run: moved the earlier run's checkpoints (steps "
                  f"{', '.join(str(e.step) for e in start.earlier)}) into {dest}/", file=sys.stderr)
        _write_config(job, plan.config_path)
    except OSError as e:
        if lock is not None:
            lock.release()
        print(f"megashard run: error: cannot write {plan.config_path} (train.out_dir={job.train.out_dir!r}): "
              f"{e.strerror or e}", file=sys.stderr)
        return 2
    previous = _exit_on_sigterm()
    since = time.time()
    proc = None
    from megashard.launch.startwatch import StartDir

    start_watch = StartDir(job.parallel.timeout)  # the workers' start-up marks (a rank stuck before its group is up)
    try:
        sys.stderr.flush()
        # The lifelines of torchrun (megashard.launch.agent) and of the workers hang on these pids; every process and
        # restart of this launch shares the run id its checkpoints record (megashard.train.startpoint).
        env = {**os.environ, **plan.env, "MEGASHARD_LAUNCHER_PID": str(os.getpid()), "MEGASHARD_JOB_ID": lock_id(job),
               RUN_ID_ENV: os.environ.get(RUN_ID_ENV) or new_run_id(), **start_watch.env}
        # A session of its own: a Ctrl-C reaches this launcher only, which stops torchrun once, in order (below):
        # with SIGTERM, which torchrun passes on to its workers (a SIGINT would raise KeyboardInterrupt in each).
        proc = subprocess.Popen(plan.command, env=env, start_new_session=True)
        code = proc.wait()
    except KeyboardInterrupt:  # Ctrl-C: torchrun stops its workers; say where the job stopped and how to go on
        if proc is not None:  # SIGTERM: the workers end at once and silently, wherever they are (even importing)
            _stop(proc, signal.SIGTERM, grace_s=60.0)
        first = "\n" if sys.stderr.isatty() else ""  # below the progress bar's line
        print(f"{first}megashard run: {stopped_line(job, since)}", file=sys.stderr, flush=True)
        return 130
    except BaseException:  # SIGTERM (SystemExit) or another error: stop torchrun before leaving
        if proc is not None and proc.poll() is None:
            _stop(proc, signal.SIGTERM, grace_s=30.0)
        raise
    finally:
        start_watch.remove()
        if lock is not None:
            lock.release()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    if code == 2:  # a worker's error a restart cannot fix, printed above (megashard.launch.agent.EXIT_NO_RESTART)
        return 2
    if code != 0:
        print(f"megashard run: the job failed (torchrun exit code {code}); "
              f"rerun the same command to resume from the newest checkpoint in {job.checkpoint_dir}", file=sys.stderr)
        return 1
    return 0
