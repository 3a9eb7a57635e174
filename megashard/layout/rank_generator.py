"""Megatron-LM's ``RankGenerator`` as a view over megashard's rank grid: same signature, groups and errors.

    gen = RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1, order="tp-cp-ep-dp-pp")
    gen.get_ranks("pp")        # [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    gen.get_ranks("tp-dp")     # any token string; the expert generator (ep > 1, cp = 1) alike

Megatron numbers ranks as a mixed-radix number over the axes of ``order`` (leftmost fastest); a ``token`` string
names the axes a group spans. That is exactly :class:`~megashard.layout.grid.RankGrid` over the order's axes, so
this class only translates names and errors: the rank arithmetic is the grid's (DESIGN §6). Pure Python, any world
size, no processes.

Differences from Megatron-LM 0.19, on input it mishandles: ``order`` tokens are matched as tokens (Megatron tests
``name in order`` as a substring, so ``tp`` "appears" in ``gtp_remat``); a negative ``rank_offset`` or a size below 1
raises ConfigError (Megatron ignores the offset / yields nonsense).
"""
from __future__ import annotations

from megashard.errors import ConfigError, RankGridAssertionError, RankGridError, RankGridKeyError, did_you_mean
from megashard.layout.grid import GroupMembers, RankGrid

__all__ = ["RANK_GENERATOR_TOKENS", "RankGenerator"]

#: The tokens a ``RankGenerator`` order may hold, in the order Megatron appends missing ones.
RANK_GENERATOR_TOKENS = ("tp", "pp", "dp", "ep", "cp", "gtp_remat")


class RankGenerator:
    """Rank groups of one Megatron layout (dense: ``ep=1``; expert: ``cp=1``) for any token string.

    Args:
        tp, ep, dp, pp, cp: axis sizes (positive); at most one of ep and cp may exceed 1 (Megatron keeps cp in the
            dense generator and ep in the expert one).
        order: Megatron's order string, e.g. ``"tp-cp-ep-dp-pp"``; the leftmost axis varies fastest. An axis of
            size 1 may be left out (it is appended, as Megatron does); one of size > 1 must appear.
        rank_offset: first global rank of the layout (several layouts on disjoint rank ranges of one job).
        gtp_remat: size of the generalized-tensor-parallel weight-rematerialisation axis (token ``gtp_remat``).

    Attributes (as Megatron's): ``tp, ep, dp, pp, cp, gtp_remat, rank_offset, world_size`` (the product of the
    sizes), ``name_to_size``, ``order`` (with the appended tokens) and ``ordered_size``.

    Raises: :class:`~megashard.errors.RankGridAssertionError` (an AssertionError) when ep and cp both exceed 1;
    :class:`~megashard.errors.RankGridError` (a RuntimeError) when an axis of size > 1 is missing from ``order``;
    :class:`~megashard.errors.RankGridKeyError` (a KeyError) for an unknown order token; ConfigError (a ValueError)
    for a repeated token, a size below 1 or a negative offset.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0,
                 gtp_remat: int = 1) -> None:
        sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp, "gtp_remat": gtp_remat}
        for name, v in sizes.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"RankGenerator: {name}={v!r} must be a positive integer")
        if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
            raise ConfigError(f"RankGenerator: rank_offset={rank_offset!r} must be a non-negative integer")
        if ep != 1 and cp != 1:
            raise RankGridAssertionError(
                f"RankGenerator: ep={ep} and cp={cp} are both > 1; CP is only included in the default (dense) "
                "RankGenerator and EP only in the expert one: pass ep=1 or cp=1")
        if not isinstance(order, str):
            raise ConfigError(f"RankGenerator: order={order!r} must be a string such as 'tp-cp-ep-dp-pp'")
        self.tp, self.ep, self.dp, self.pp, self.cp, self.gtp_remat = tp, ep, dp, pp, cp, gtp_remat
        self.rank_offset = rank_offset
        self.name_to_size = sizes
        self.world_size = tp * dp * pp * cp * ep * gtp_remat
        tokens = order.lower().split("-")
        for t in tokens:
            if t not in sizes:
                raise RankGridKeyError(f"RankGenerator: order '{order}' has unknown token '{t}'"
                                       f"{did_you_mean(t, RANK_GENERATOR_TOKENS)}; tokens: {', '.join(RANK_GENERATOR_TOKENS)}")
        dup = sorted({t for t in tokens if tokens.count(t) > 1})
        if dup:
            raise ConfigError(f"RankGenerator: order '{order}' repeats {', '.join(dup)}; each axis may appear once")
        for name in RANK_GENERATOR_TOKENS:
            if name not in tokens:
                if sizes[name] != 1:
                    raise RankGridError(f"The size of ({name}) is ({sizes[name]}), but you haven't specified the "
                                        f"order ({order}); add '{name}' to order")
                tokens.append(name)
        self.order = "-".join(tokens)
        self.ordered_size = [sizes[t] for t in tokens]
        #: the rank grid over the order's axes (leftmost fastest): all rank arithmetic happens there
        self.grid = RankGrid([(t, sizes[t]) for t in tokens])

    # ------------------------------------------------------------------ Megatron's API
    def get_mask(self, order: str, token: str) -> list[bool]:
        """``[axis in token for axis in order]`` (Megatron's helper; ``order`` as ``self.order``)."""
        ordered = order.split("-")
        mask = [False] * len(ordered)
        for t in self._tokens(token, ordered):
            mask[ordered.index(t)] = True
        return mask

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group spanning the axes of ``token`` (e.g. ``"tp"``, ``"tp-dp"``, ``"tp-ep-pp"``; token order does
        not matter): members with the order's fastest axis fastest, groups in the order of the other axes, every
        rank shifted by ``rank_offset`` — Megatron's ``get_ranks``."""
        groups = self.grid.groups(self._tokens(token))
        if self.rank_offset:
            off = self.rank_offset
            groups = [[r + off for r in g] for g in groups]
        return groups

    def get_gtp_ranks(self, gtp_remat_size: int) -> list[list[int]]:
        """The ``gtp_remat`` groups (singletons when its size is 1); ``gtp_remat_size`` must equal the axis size."""
        if gtp_remat_size != self.gtp_remat:
            raise RankGridAssertionError(
                f"gtp_remat axis size ({self.gtp_remat}) != requested gtp_remat_size ({gtp_remat_size})")
        return self.get_ranks("gtp_remat")

    # ------------------------------------------------------------------ megashard's additions
    def group_of(self, token: str, rank: int) -> GroupMembers:
        """The ``token`` group holding global ``rank`` (without listing the others): O(axes) for any world size."""
        if not self.rank_offset <= rank < self.rank_offset + self.world_size:
            raise ConfigError(f"rank {rank} is outside this RankGenerator's ranks {self.rank_offset}.."
                              f"{self.rank_offset + self.world_size - 1}")
        masked, _ = self.grid.split(self._tokens(token))
        local = rank - self.rank_offset
        base = local - sum(((local // d) % s) * d for s, d in masked)
        return GroupMembers(base + self.rank_offset, masked)

    def _tokens(self, token: str, ordered: list[str] | None = None) -> list[str]:
        ordered = ordered if ordered is not None else self.grid.names
        if not isinstance(token, str):
            raise ConfigError(f"token={token!r} must be a string such as 'tp-dp'")
        toks = token.split("-")
        bad = [t for t in toks if t not in ordered]
        if bad:
            raise ConfigError(f"token '{token}': '{bad[0]}' is not an axis of order '{'-'.join(ordered)}'"
                              f"{did_you_mean(bad[0], ordered)}; axes: {', '.join(ordered)}")
        return list(dict.fromkeys(toks))

    def __repr__(self) -> str:
        return (f"RankGenerator(tp={self.tp}, ep={self.ep}, dp={self.dp}, pp={self.pp}, cp={self.cp}, "
                f"order={self.order!r}, rank_offset={self.rank_offset}, gtp_remat={self.gtp_remat})")
