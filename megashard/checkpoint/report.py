"""What a load restored: :class:`LoadReport`, returned by :func:`megashard.checkpoint.load`.

Apart from :mod:`megashard.checkpoint.loading` so that :mod:`megashard.checkpoint.rank_state`, which fills in its
RNG and data fields, does not import the loader that imports it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["LoadReport"]


@dataclass
class LoadReport:
    """What :func:`load` restored, and what it could not restore exactly and how it handled that.

    ``rng``: ``"restored"`` (same layout), ``"reseeded"`` (layout changed: streams re-seeded with
    ``model_parallel_manual_seed(reseed_value(seed, step))``, value in ``rng_seed``) or ``"untouched"``
    (``restore_rng=False``).
    ``data``: ``"restored"`` (``data_state`` holds this rank's saved data-loader state), ``"recomputed"``
    (data-parallel size changed or no state saved: resume from the global ``consumed_samples``), or
    ``"not saved"`` (neither a data state nor a sample count was saved).
    """

    path: str
    step: int
    consumed_samples: Optional[int]
    saved_layout: dict
    current_layout: dict
    same_layout: bool
    rng: str
    rng_seed: Optional[int]
    data: str
    data_state: Any = None
    missing_keys: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def summary(self) -> str:
        def sizes(layout: dict) -> str:
            s = layout.get("sizes")
            if not s:
                return f"{layout['world_size']} ranks (no megashard layout)"
            keys = ("tp", "cp", "pp", "dp_outer", "dp_shard", "ep", "expt_tp")
            return f"{s['world_size']} ranks (" + ", ".join(f"{k}={s[k]}" for k in keys if s.get(k, 1) != 1 or k == "dp_shard") + ")"

        lines = [f"loaded {self.path} (step {self.step}) saved with {sizes(self.saved_layout)} into {sizes(self.current_layout)}",
                 f"  rng: {self.rng}" + (f" (base seed {self.rng_seed})" if self.rng_seed is not None else ""),
                 f"  data position: {self.data}" + (f" (consumed_samples={self.consumed_samples})" if self.consumed_samples is not None else "")]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
