"""Per-rank state of a checkpoint: RNG streams and data-loader positions, and how they survive a new layout.

Every rank writes ``rank_state/<rank>.pt``: its RNG states (CPU, CUDA, the model-parallel tracker) and
its data-loader state. Neither can be resharded:

* RNG states are per rank. They are restored exactly when the layout is unchanged; otherwise every
  stream is re-seeded deterministically from ``(seed, step)`` by :func:`reseed_value` and
  :func:`megashard.state.rng.model_parallel_manual_seed`.
* A rank's data-loader state belongs to its data-parallel rank. It is restored when the data-parallel
  size is unchanged (dp rank ``d`` gets what dp rank ``d`` saved); otherwise the position is recomputed
  from the global sample count ``consumed_samples``, which does not depend on the layout.

The layout a checkpoint was saved with (:func:`layout_record`, in ``megashard.json``) decides which.
"""
from __future__ import annotations

import hashlib
import io
import os
from typing import TYPE_CHECKING, Any, Optional

import torch

from megashard.checkpoint import safety
from megashard.checkpoint.planners import load_weights_only

if TYPE_CHECKING:  # pragma: no cover
    from megashard.checkpoint.report import LoadReport

__all__ = [
    "current_state",
    "layout_record",
    "read_rank_state",
    "reseed_value",
    "restore_rank_state",
    "same_layout",
    "write_rank_state",
]


def current_state(parallel_state=None):
    """``parallel_state``, else the current ParallelState if one is initialised, else None (plain data parallel)."""
    if parallel_state is not None:
        return parallel_state
    from megashard.state import get_parallel_state, is_initialized

    return get_parallel_state() if is_initialized() else None


def layout_record(st, world: int) -> dict:
    """The layout a checkpoint records (``megashard.json``): world size, parallel config and resolved sizes."""
    if st is None:
        return {"world_size": world, "config": None, "sizes": None}
    return {"world_size": st.world_size, "config": st.config.to_dict(), "sizes": st.sizes.as_dict()}


def _dp_pp(layout: dict, rank: int) -> tuple[int, int, int, int]:
    """(dp size, dp rank, pp size, pp rank) of ``rank`` in a layout record (no state: pure data parallel)."""
    if layout["sizes"] is None:
        return layout["world_size"], rank, 1, 0
    lay = _rank_layout(layout)
    return lay.size("dp"), lay.rank_in("dp", rank), lay.size("pp"), lay.rank_in("pp", rank)


def _rank_layout(layout: dict):
    from megashard.config import ResolvedSizes
    from megashard.layout import RankLayout

    sizes = dict(layout["sizes"])
    sizes["order"] = tuple(str(sizes["order"]).split("-"))
    if sizes.get("hierarchical_cp") is not None:
        sizes["hierarchical_cp"] = tuple(sizes["hierarchical_cp"])
    return RankLayout(ResolvedSizes(**sizes))


def _saved_rank_with(layout: dict, dp_rank: int, pp_rank: int) -> int:
    """The saved rank at data-parallel index ``dp_rank`` of stage ``pp_rank`` (tp, cp coordinates 0)."""
    if layout["sizes"] is None:
        return dp_rank
    lay = _rank_layout(layout)
    anchor = lay.group_of("pp", 0)[pp_rank]  # rank 0 has every coordinate 0: this is (pp=pp_rank, rest 0)
    return lay.group_of("dp", anchor)[dp_rank]


def reseed_value(seed: int, step: int) -> int:
    """The base seed used after a layout change: a hash of ``(seed, step)``, in ``[0, 2**31)``.

    Deterministic (same on every rank and every run) and different for every step, so a resumed run
    does not replay the random numbers of the run it resumes.
    """
    h = hashlib.blake2b(f"megashard-reseed:{int(seed)}:{int(step)}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % (2**31 - 1)



def _rank_state_name(rank: int) -> str:
    return f"{safety.RANK_STATE_DIR}/{rank:06d}.pt"


def _rng_snapshot() -> dict:
    from megashard.state.rng import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    states = {}
    if tracker.is_initialized():
        for name, s in tracker.get_states().items():
            states[name] = s.get_state() if isinstance(s, torch.Generator) else s
    return {
        "tracker": states,
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def _rng_restore(rng: dict) -> None:
    from megashard.state.rng import get_cuda_rng_tracker

    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if rng.get("tracker"):
        get_cuda_rng_tracker().set_states(dict(rng["tracker"]))



def write_rank_state(tmp_dir: str, rank: int, data_state: Any) -> str:
    """Write this rank's RNG states and ``data_state`` (fsynced); returns the file's path relative to ``tmp_dir``."""
    name = _rank_state_name(rank)
    path = os.path.join(tmp_dir, name)
    obj = {"rank": rank, "rng": _rng_snapshot(), "data_state": data_state}
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    return name


def read_rank_state(ckpt_dir: str, rank: int) -> dict:
    """Saved rank ``rank``'s ``{"rank", "rng", "data_state"}`` (weights-only)."""
    path = os.path.join(ckpt_dir, _rank_state_name(rank))
    with open(path, "rb") as f:
        return load_weights_only(io.BytesIO(f.read()), f"per-rank state {path}")



def same_layout(a: dict, b: dict) -> bool:
    """True if two layout records have the same world size and resolved sizes (per-rank state maps 1:1)."""
    return a["world_size"] == b["world_size"] and a.get("sizes") == b.get("sizes")


def restore_rank_state(report: LoadReport, ckpt: str, info: dict, st, rank: int, seed: Optional[int],
                       restore_rng: bool) -> None:
    """Restore (or re-seed) the RNG states and find this rank's data-loader state; record what was done in ``report``."""
    saved, current = report.saved_layout, report.current_layout
    # RNG: exact per-rank streams only make sense in the identical layout.
    if restore_rng:
        if report.same_layout:
            _rng_restore(read_rank_state(ckpt, rank)["rng"])
            report.rng = "restored"
        else:
            base = seed
            if base is None and st is not None:
                base = st.config.seed
            if base is None and saved.get("config"):
                base = saved["config"].get("seed")
            base = 1234 if base is None else int(base)
            value = reseed_value(base, report.step)
            _reseed(value)
            report.rng, report.rng_seed = "reseeded", value
            report.notes.append(
                f"RNG states are per rank and the layout changed, so every stream was re-seeded from seed={base} and "
                f"step={report.step} (base seed {value}; model_parallel_manual_seed rule)"
            )
    # Data position: dp rank d resumes from what dp rank d saved, if the data-parallel size is unchanged.
    s_dp, _, s_pp, _ = _dp_pp(saved, 0)
    c_dp, c_dp_rank, c_pp, c_pp_rank = _dp_pp(current, rank)
    if info.get("has_data_state") and s_dp == c_dp:
        # Same layout: this rank's own file. Otherwise the saved rank of the same dp rank (and pp stage, if pp
        # is unchanged) with tp = cp = 0: its tensor/context-parallel peers read the same data.
        src = rank if report.same_layout else _saved_rank_with(saved, c_dp_rank, c_pp_rank if s_pp == c_pp else 0)
        report.data_state = read_rank_state(ckpt, src)["data_state"]
        report.data = "restored"
    elif report.consumed_samples is not None:
        report.data = "recomputed"
        why = (f"data-loader states are per data-parallel rank and dp changed ({s_dp} -> {c_dp}), so they were not "
               "restored" if info.get("has_data_state") else "no per-rank data-loader state was saved")
        report.notes.append(f"{why}; resume the data from the global sample count consumed_samples={report.consumed_samples}")
    elif info.get("has_data_state"):
        report.notes.append(
            f"data-loader states could not be restored (dp {s_dp} -> {c_dp}) and no consumed_samples was saved: "
            "the data position is unknown"
        )


def _reseed(value: int) -> None:
    from megashard.state.rng import model_parallel_manual_seed

    torch.manual_seed(value)
    model_parallel_manual_seed(value)
