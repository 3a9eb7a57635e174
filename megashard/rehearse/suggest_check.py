"""``megashard plan --suggest --check-collectives``: the layouts the advisor lists, each rehearsed rank by rank and
checked (:mod:`megashard.rehearse.compare`); a layout the check refuses leaves the list for the refused ones, with
the finding as its reason. So the advisor never suggests a layout the check before launch would stop.

    drop_refused(result, job, top=10)       # result: megashard.advisor.search.Suggestion (changed in place)
"""
from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["drop_refused", "layout_job"]


def layout_job(job: Any, overrides: list[str]) -> Any:
    """``job`` with a candidate layout's ``key=value`` overrides (:meth:`Candidate.overrides`) applied."""
    from megashard.config import yamlfile
    from megashard.train.config import JobConfig

    return JobConfig.from_dict(yamlfile.apply_overrides(job.to_dict(), list(overrides)), name=job.name)


def drop_refused(result: Any, job: Any, top: int, *, jobs: Optional[int] = None,
                 log: Optional[Callable[[str], None]] = None) -> int:
    """Check the first ``top`` layouts of ``result.ranked`` (re-filling the top as layouts leave); a refused one moves
    to ``result.rejected`` as ``(candidate, "the check before launch: <finding>")``. Returns how many were refused."""
    from megashard.rehearse.runs import rehearse_job
    from megashard.rehearse.compare import check_traces

    refused = 0
    i = 0
    while i < min(top, len(result.ranked)):
        c = result.ranked[i]
        check = check_traces(rehearse_job(layout_job(job, c.overrides()), result.world_size, jobs=jobs))
        if log is not None:
            log(f"collectives of {c.label()}: {'OK' if check.ok else 'refused'}")
        if check.ok:
            i += 1
            continue
        result.ranked.pop(i)
        result.rejected.insert(0, (c, f"the check before launch: {check.findings[0].line}"))
        refused += 1
    return refused
