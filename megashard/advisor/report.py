"""The report of ``megashard plan --suggest``: the ranked layouts as a table or JSON (sizes: :mod:`.units`)."""
from __future__ import annotations

from typing import Any

from megashard.advisor.cost import AXES
from megashard.advisor.search import Candidate, Suggestion
from megashard.advisor.units import check_count, parse_bytes  # noqa: F401 - parse_bytes re-exported (its old home)

GIB = 1 << 30


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f}" if n else "-"


def candidate_dict(c: Candidate) -> dict[str, Any]:
    """One candidate as JSON-ready data (sizes, choices, memory parts, step estimate, bytes per axis)."""
    out: dict[str, Any] = {"layout": c.label(), "sizes": dict(c.sizes), "recompute": c.recompute,
                           "microbatches": c.microbatches, "schedule": c.schedule if c.sizes["pp"] > 1 else None,
                           "overrides": c.overrides()}
    if c.memory is not None:
        m = c.memory
        out["memory"] = {"peak_bytes": m.peak, "rank": m.rank, "phase": m.phase, "parts": m.parts,
                         "activation_per_block": m.activation_per_block,
                         "activation_kept_per_block": m.activation_kept_per_block, "inflight_microbatches": m.inflight,
                         "largest_moe_shard": m.largest_moe_shard}
    if c.cost is not None:
        k = c.cost
        out["step"] = {"seconds": k.seconds, "measured_seconds": c.measured_s,
                       "source": "measured" if c.measured_s is not None else "modelled",
                       "compute_s": k.compute_s, "bubble": k.bubble,
                       "tokens_per_s": k.tokens_per_s, "comm_s": k.comm_s, "bytes_by_axis": k.bytes_by_axis,
                       "in_node": k.in_node}
    return out


def suggestion_dict(r: Suggestion, top: int, source: str = "") -> dict[str, Any]:
    """The whole suggestion as JSON-ready data: the ``top`` layouts, every too-large and every refused one."""
    check_count("top", top, 1)
    hw = r.hardware
    return {
        "source": source, "world_size": r.world_size, "device_memory": r.device_memory,
        "ranks_per_node": r.ranks_per_node,
        "hardware": {k: getattr(hw, k) for k in ("tflops", "mfu", "intra_gbps", "inter_gbps", "latency_us",
                                                 "fp32_factor")},
        "moe_imbalance": r.moe_imbalance,
        "considered": r.considered, "fit": len(r.ranked), "too_large": len(r.too_big), "refused": len(r.rejected),
        "measured": sum(c.measured_s is not None for c in r.ranked),
        "ranked_by": ("measured step time, then the model" if any(c.measured_s is not None for c in r.ranked)
                      else "modelled step time"),
        "top": [candidate_dict(c) for c in r.ranked[:top]],
        "too_large_layouts": [{"layout": c.label(), "reason": too_big_reason(c, r.device_memory)} for c in r.too_big],
        "refused_layouts": [{"layout": c.label(), "reason": why} for c, why in r.rejected],
    }


def too_big_reason(c: Candidate, device_memory: int) -> str:
    """``needs 93.10 GiB > 80.00 GiB on pp rank 0 at backward block 3 (activations 61.2, optimizer 18.0 …)``."""
    m = c.memory
    assert m is not None
    biggest = sorted(((v, k) for k, v in m.parts.items() if v), reverse=True)[:3]
    what = ", ".join(f"{k} {_gib(v)}" for v, k in biggest)
    return f"needs {_gib(m.peak)} GiB > {_gib(device_memory)} GiB on pp rank {m.rank} at {m.phase} ({what} GiB)"


def format_suggestion(r: Suggestion, top: int, source: str = "", shown_rejections: int = 10) -> str:
    """The suggestion as text: header, the ranked table, the best layout's memory and command, what does not fit."""
    check_count("top", top, 1)
    check_count("shown_rejections", shown_rejections, 0)
    hw = r.hardware
    out = [f"megashard plan --suggest{': ' + source if source else ''} — {r.world_size} rank{'s' if r.world_size != 1 else ''}, "
           f"{_gib(r.device_memory)} GiB per device, {r.ranks_per_node} ranks per node",
           f"assumed: {hw.tflops:g} TFLOP/s × {hw.mfu:g} MFU (fp32 × {hw.fp32_factor:g}), {hw.intra_gbps:g} GB/s in a "
           f"node, {hw.inter_gbps:g} GB/s across nodes, {hw.latency_us:g} µs per collective (docs/advisor.md)"
           + (f"; MoE memory: the busiest ep rank gets at most {r.moe_imbalance:g}× its even share of routed tokens "
              "(--moe-imbalance)" if r.moe_imbalance else ""),
           f"considered {r.considered:,} layouts: {len(r.ranked):,} fit, {len(r.too_big):,} too large, "
           f"{len(r.rejected):,} refused by the job's rules"]
    timed = [c for c in r.ranked if c.measured_s is not None]
    failed = [c for c in r.ranked if c.measure_error]
    if timed or failed:
        out.append(f"ranked by step time measured on this machine for {len(timed)} layout(s) (meas_ms), fastest "
                   f"first; the other {len(r.ranked) - len(timed):,} by the model (step_ms, not calibrated)"
                   + (f"; {len(failed)} calibration run(s) failed (listed below)" if failed else ""))
    else:
        out.append("ranked by the modelled step time (step_ms; not calibrated: --calibrate times the top layouts)")
    out.append("")
    if r.ranked:
        head = ("#", "tp", "cp", "pp", "vpp", "dp_out", "dp_shd", "ep", "etp", "recomp", "mb", "meas_ms", "step_ms",
                "tok/s", "peak_GiB", *(f"{a}_GB" for a in AXES))
        rows = [head]
        for i, c in enumerate(r.ranked[:top], 1):
            s, k, m = c.sizes, c.cost, c.memory
            assert k is not None and m is not None
            rows.append((str(i), str(s["tp"]), str(s["cp"]), str(s["pp"]), str(s["vpp"] or "-"), str(s["dp_outer"]),
                         str(s["dp_shard"]), str(s["ep"]), str(s["expt_tp"]), "on" if c.recompute else "off",
                         str(c.microbatches), f"{c.measured_s * 1e3:.1f}" if c.measured_s is not None else "-",
                         f"{k.seconds * 1e3:.1f}", f"{k.tokens_per_s:,.0f}", _gib(m.peak),
                         *(_gb(k.bytes_by_axis[a]) + ("" if k.in_node[a] or not k.bytes_by_axis[a] else "*")
                           for a in AXES)))
        widths = [max(len(row[j]) for row in rows) for j in range(len(head))]
        out += ["  " + "  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
        out.append("  (meas_ms: measured on this machine; step_ms, tok/s, peak_GiB, GB: modelled; GB sent per rank and "
                   "step on each axis; * = crosses nodes)")
        best = r.ranked[0]
        m = best.memory
        assert m is not None
        out += ["", f"#1 memory on pp rank {m.rank} at {m.phase}: " + ", ".join(
            f"{k} {_gib(v)}" for k, v in m.parts.items() if v) + f" GiB; {m.inflight} microbatch(es) in flight"
                + (f"; largest MoE shard {_gib(m.largest_moe_shard)} GiB" if m.largest_moe_shard else ""),
                f"#1 as overrides: {' '.join(best.overrides())}"]
    else:
        out.append("no valid layout fits: see below")
    if failed:
        out += ["", "calibration runs that failed (ranked by the model):"]
        out += [f"  {c.label()}: {c.measure_error}" for c in failed]
    if r.too_big:
        out += ["", f"too large ({len(r.too_big):,}, smallest first):"]
        out += [f"  {c.label()}: {too_big_reason(c, r.device_memory)}" for c in r.too_big[:shown_rejections]]
        if len(r.too_big) > shown_rejections:
            out.append(f"  … and {len(r.too_big) - shown_rejections:,} more (--format json lists every one)")
    if r.rejected:
        out += ["", f"refused by the job's rules ({len(r.rejected):,}; one line each, as `megashard run` would say):"]
        out += [f"  {c.label()}: {why}" for c, why in r.rejected[:shown_rejections]]
        if len(r.rejected) > shown_rejections:
            out.append(f"  … and {len(r.rejected) - shown_rejections:,} more (--format json lists every one)")
    return "\n".join(out) + "\n"
