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


def _unit(r: Suggestion, top: int) -> tuple[str, int]:
    """GiB, or MiB when every peak shown is below 0.1 GiB (a small CPU job)."""
    shown = [c.memory.peak for c in r.ranked[:top] if c.memory is not None]
    return ("MiB", 1 << 20) if shown and max(shown) < GIB // 10 else ("GiB", GIB)


def memory_lines(c: Candidate, unit: tuple[str, int] = ("GiB", GIB)) -> list[str]:
    """What the report says of one layout's memory, a line each: the modelled peak and its parts, the traced peak,
    the host memory per rank (other figures append their own line here)."""
    name, size = unit
    m = c.memory
    assert m is not None
    out = [f"memory per rank, modelled: {m.peak / size:.2f} {name} on pp rank {m.rank} at {m.phase}: " + ", ".join(
        f"{k} {v / size:.2f}" for k, v in m.parts.items() if v) + f" {name}; {m.inflight} microbatch(es) in flight"
           + (f"; largest MoE shard {m.largest_moe_shard / size:.2f} {name}" if m.largest_moe_shard else "")]
    if c.traced is not None:
        t = c.traced
        how = ("one step of every rank on the fake backend, collectives carrying values" if t.exact else
               "one step on the fake backend")
        out.append(f"memory per rank, traced: {t.peak / size:.2f} {name} (rank {t.rank}, pp rank {t.pp_rank}: {how}, "
                   f"live tensor bytes; {t.peak / m.peak - 1:+.1%} against the model) — "
                   + ("partial: this rank, traced alone, receives no peer's tokens for its experts, so the modelled "
                      "figure decides" if t.partial else "the figure that decides whether it fits"))
    elif c.trace_error:
        out.append(f"memory per rank, traced: failed ({c.trace_error}); the modelled figure decides")
    if c.host is not None:
        h = c.host
        out.append(f"host memory per rank (peak RSS growth): {h.peak / size:.2f} {name}: " + ", ".join(
            f"{k} {v / size:.2f}" for k, v in h.parts.items() if v) + f" {name}"
            + ("" if h.measured_runtime else " (runtime assumed: not measured on this device)"))
    return out


def candidate_dict(c: Candidate) -> dict[str, Any]:
    """One candidate as JSON-ready data (sizes, choices, memory parts, step estimate, bytes per axis)."""
    out: dict[str, Any] = {"layout": c.label(), "sizes": dict(c.sizes), "recompute": c.recompute,
                           "microbatches": c.microbatches, "schedule": c.schedule if c.sizes["pp"] > 1 else None,
                           "overrides": c.overrides()}
    if c.memory is not None:
        m = c.memory
        out["memory"] = {"peak_bytes": m.peak, "source": "traced" if c.traced is not None else "modelled",
                         "fits_by_bytes": c.peak, "modelled_bytes": m.peak,
                         "traced_bytes": c.traced.peak if c.traced is not None else None,
                         "traced_rank": c.traced.rank if c.traced is not None else None, "trace_error": c.trace_error,
                         "rank": m.rank, "phase": m.phase, "parts": m.parts,
                         "activation_per_block": m.activation_per_block,
                         "activation_kept_per_block": m.activation_kept_per_block, "inflight_microbatches": m.inflight,
                         "largest_moe_shard": m.largest_moe_shard}
    if c.host is not None:
        out["host_memory"] = {"peak_bytes": c.host.peak, "parts": c.host.parts,
                              "runtime_measured": c.host.measured_runtime}
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
        "hardware": {k: getattr(hw, k) for k in ("device", "name", "tflops", "mfu", "intra_gbps", "inter_gbps",
                                                 "latency_us", "fp32_factor", "op_overhead_us")},
        "dtype": r.dtype, "notes": list(r.notes),
        "moe_imbalance": r.moe_imbalance,
        "considered": r.considered, "fit": len(r.ranked), "too_large": len(r.too_big), "refused": len(r.rejected),
        "measured": sum(c.measured_s is not None for c in r.ranked),
        "kendall_tau": r.kendall_tau, "noise_notes": list(r.noise_notes),
        "traced": r.traced_count, "trace_seconds": r.trace_seconds, "trace_notes": list(r.trace_notes),
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
    if c.traced is not None:
        return (f"needs {_gib(c.traced.peak)} GiB traced (rank {c.traced.rank}; modelled {_gib(m.peak)}) > "
                f"{_gib(device_memory)} GiB")
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
           f"assumed: {hw.describe(r.dtype)} (docs/advisor.md)"
           + (f"; MoE memory: the busiest ep rank gets at most {r.moe_imbalance:g}× its even share of routed tokens "
              "(--moe-imbalance)" if r.moe_imbalance else ""),
           *(f"from: {n}" for n in r.notes),
           f"considered {r.considered:,} layouts: {len(r.ranked):,} fit, {len(r.too_big):,} too large, "
           f"{len(r.rejected):,} refused by the job's rules"]
    timed = [c for c in r.ranked if c.measured_s is not None]
    failed = [c for c in r.ranked if c.measure_error]
    if timed or failed:
        out.append(f"ranked by step time measured on this machine for {len(timed)} layout(s) (meas_ms), fastest "
                   f"first; the other {len(r.ranked) - len(timed):,} by the model (step_ms, not calibrated)"
                   + (f"; {len(failed)} calibration run(s) failed (listed below)" if failed else ""))
        if r.kendall_tau is not None:
            out.append(f"Kendall's τ between the model's order and the measured order of the {len(timed)} timed: "
                       f"{r.kendall_tau:+.2f} (1: the same order, -1: reversed)")
        out += [f"noise: {n}" for n in r.noise_notes]
    else:
        out.append("ranked by the modelled step time (step_ms; not calibrated: --calibrate times the top layouts)")
    if r.traced_count:
        out.append(f"memory traced for {r.traced_count} layout(s) in {r.trace_seconds:.1f} s (one step of the rank that "
                   "peaks, fake backend: traced_*); a traced figure decides whether a layout fits")
    out += [f"trace: {n}" for n in r.trace_notes]
    out.append("")
    unit, size = _unit(r, top)
    if r.ranked:
        head = ("#", "tp", "cp", "pp", "vpp", "dp_out", "dp_shd", "ep", "etp", "recomp", "mb", "meas_ms", "step_ms",
                "tok/s", f"peak_{unit}", f"traced_{unit}", f"host_{unit}", *(f"{a}_GB" for a in AXES))
        rows = [head]
        for i, c in enumerate(r.ranked[:top], 1):
            s, k, m = c.sizes, c.cost, c.memory
            assert k is not None and m is not None
            rows.append((str(i), str(s["tp"]), str(s["cp"]), str(s["pp"]), str(s["vpp"] or "-"), str(s["dp_outer"]),
                         str(s["dp_shard"]), str(s["ep"]), str(s["expt_tp"]), "on" if c.recompute else "off",
                         str(c.microbatches), f"{c.measured_s * 1e3:.1f}" if c.measured_s is not None else "-",
                         f"{k.seconds * 1e3:.1f}", f"{k.tokens_per_s:,.0f}", f"{m.peak / size:.2f}",
                         f"{c.traced.peak / size:.2f}" if c.traced is not None else "-",
                         f"{c.host.peak / size:.2f}" if c.host is not None else "-",
                         *(_gb(k.bytes_by_axis[a]) + ("" if k.in_node[a] or not k.bytes_by_axis[a] else "*")
                           for a in AXES)))
        widths = [max(len(row[j]) for row in rows) for j in range(len(head))]
        out += ["  " + "  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
        out.append(f"  (meas_ms: measured on this machine; traced_{unit}: one step traced; step_ms, tok/s, peak_{unit}, "
                   f"host_{unit} (peak RSS growth), GB: modelled; GB sent per rank and step on each axis; * = crosses "
                   "nodes)")
        best = r.ranked[0]
        out += [""] + [f"#1 {line}" for line in memory_lines(best, (unit, size))]
        out.append(f"#1 as overrides: {' '.join(best.overrides())}")
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
