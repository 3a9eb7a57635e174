"""Which rank saves / loads every checkpoint shard: the pure balancing rule, no communication.

Same names, signatures and assignments as Megatron-LM's ``dist_checkpointing.exchange_utils``:
:func:`distribute_shards_to_ranks` is the greedy balance rule (cross-group loads last, fewest holders
first, largest first, shard id; least-loaded holder wins, ties to the lower rank). Every rank computes
it alone and gets the same answer, so no communication is needed after the metadata exchange
(:func:`megashard.checkpoint.exchange.determine_main_replica_uniform_distribution`). This
implementation gives exactly Megatron's assignment with int64 tensor sorting, bulk handling of
one-holder shards and a walk over the ranks kept in load order for large holder sets, instead of
Megatron's O(shards · ranks · holders) scan; :func:`distribute_shards_reference` is the plain rule it
must agree with.

Ranks in a :class:`ShardDistribution` are ranks *within* the parallelization group.
"""
from __future__ import annotations

import operator
from array import array
from bisect import insort
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, TypeVar

import torch

from megashard.checkpoint.mapping import ShardedTensor, ShardId
from megashard.errors import CheckpointError

__all__ = [
    "ShardDistribution",
    "distribute_shards_reference",
    "distribute_shards_to_ranks",
    "shard_size",
    "_shard_size",
]

T = TypeVar("T")


class ShardDistribution(NamedTuple):
    """Which rank of one parallelization group saves/loads every shard (the group itself is implicit).

    Args:
        main_rank_for_shard: shard id -> group rank that holds the main replica (saves / loads it).
        shards_in_this_group: shard ids whose main replica this group is responsible for.
        shard_to_metadata: shard id -> ShardedTensor metadata (``data`` None).
        all_ranks_for_shard: shard id -> group ranks that hold / need the shard, ascending.
    """

    main_rank_for_shard: Dict[ShardId, int]
    shards_in_this_group: Set[ShardId]
    shard_to_metadata: Dict[ShardId, ShardedTensor]
    all_ranks_for_shard: Dict[ShardId, List[int]]


def shard_size(sh_ten: ShardedTensor) -> int:
    """Size in bytes of the data ``sh_ten`` stores (its flattened range if it has one)."""
    fr = sh_ten.flattened_range
    if fr is None:
        numel = 1
        for s in sh_ten.local_shape:
            numel *= int(s)
    else:
        numel = fr.stop - fr.start
    return numel * sh_ten.dtype.itemsize


_shard_size = shard_size  # Megatron's (private) name


# --------------------------------------------------------------------------------------------------
# distribution
# --------------------------------------------------------------------------------------------------
_WALK_MIN_HOLDERS = 16  # below this (or R/10) a scan over the holders beats walking the rank order
_SENTINEL = 1 << 255  # "load" of a slot that is not a rank of the group: never the minimum


def distribute_shards_reference(
    shard_to_ranks: Dict[T, Sequence[int]],
    shard_to_size: Dict[T, Any],
    num_ranks: int,
    cross_parallelization_group_loads: Optional[Iterable[T]] = None,
) -> Dict[T, int]:
    """The plain O(shards · holders) statement of the rule; the fast path must agree with it.

    Sort by (in cross-group loads, number of holders, -size, shard id); give each shard to the holder
    with the smallest (load, rank). Holders outside ``range(num_ranks)`` are ignored, as in Megatron.
    Also used for inputs the fast path does not take (non-integer or negative sizes).
    """
    cross = cross_parallelization_group_loads or ()
    items = [(k, tuple(v)) for k, v in shard_to_ranks.items()]
    try:
        sizes = {k: shard_to_size[k] for k, _ in items}
    except KeyError as e:
        raise CheckpointError(
            f"shard_to_size has no size for shard {e.args[0]!r}; every key of shard_to_ranks needs a size in bytes."
        ) from None
    try:
        items.sort(key=lambda kv: (int(kv[0] in cross), len(kv[1]), -sizes[kv[0]], kv[0]))
    except TypeError as e:
        raise CheckpointError(
            f"shard ids could not be ordered ({e}); ties are broken by comparing shard ids, so they "
            "must be mutually comparable (e.g. all (key, offset, range-or-None) tuples)."
        ) from None
    loads = [0] * num_ranks
    out: Dict[T, int] = {}
    for sid, ranks in items:
        best = None
        for r in ranks:
            try:
                r = operator.index(r)
            except TypeError:
                raise CheckpointError(
                    f"shard {sid!r} lists holder {r!r}, which is not an int; holders are group ranks."
                ) from None
            if 0 <= r < num_ranks and (best is None or (loads[r], r) < (loads[best], best)):
                best = r
        if best is None:
            raise CheckpointError(
                f"shard {sid!r} has holders {list(ranks)} but none is a rank of the group "
                f"(0 .. {num_ranks - 1}); every shard needs at least one holder in range(num_ranks)."
            )
        out[sid] = best
        loads[best] += sizes[sid]
    return out


@contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Run torch's CPU ops on one thread inside the block (restored after).

    The tensors here have ~10^5 elements: too few to gain from a second thread, and on a busy
    machine OpenMP's barriers make a 100k-element argsort or max 30-100x slower than single-threaded
    (measured: 190 ms vs 5.6 ms on 2 loaded cores). The thread count is per calling thread in
    OpenMP builds, so other threads' work is not affected.
    """
    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


def _int64_tensor(values: Iterable[Any]) -> Optional[torch.Tensor]:
    """1-D CPU int64 tensor of ``values`` (non-empty) if every one is an integer, else None.

    Goes through ``array('q')``, which takes anything with ``__index__`` (int, bool, numpy and 0-dim
    torch integers) and refuses floats, strings and integers beyond int64 -- exactly the fast path's
    domain -- and is faster than ``torch.tensor(list)``; ``frombuffer`` then shares its memory.
    """
    try:
        return torch.frombuffer(array("q", values), dtype=torch.int64)
    except (TypeError, ValueError, OverflowError):
        return None


def _tie_sorted(order: List[int], equal_next: torch.Tensor, ids: List[Any]) -> bool:
    """Sort every run of positions whose numeric keys are equal by shard id, in place; True if any."""
    idx = torch.nonzero(equal_next).view(-1)  # position p ties with p + 1
    if idx.numel() == 0:
        return False
    breaks = torch.nonzero(torch.diff(idx) != 1).view(-1)
    starts = torch.cat((idx[:1], idx[breaks + 1])).tolist()
    stops = (torch.cat((idx[breaks], idx[-1:])) + 2).tolist()
    key = ids.__getitem__
    try:
        for a, b in zip(starts, stops):
            order[a:b] = sorted(order[a:b], key=key)
    except TypeError as e:
        raise CheckpointError(
            f"shard ids could not be ordered ({e}); ties are broken by comparing shard ids, so they "
            "must be mutually comparable (e.g. all (key, offset, range-or-None) tuples)."
        ) from None
    return True


def _greedy_order(
    cov: torch.Tensor, sizes: torch.Tensor, cross: Optional[torch.Tensor], ids: List[Any]
) -> Tuple[List[int], torch.Tensor]:
    """Indices sorted by (cross, holders, -size, id), as a list and an int64 tensor.

    Numeric keys are sorted as int64 tensors; shard ids are compared only within runs of equal
    numeric keys.
    """
    max_size = int(sizes.max())
    size_bits, cov_bits = max_size.bit_length(), int(cov.max()).bit_length()
    if size_bits + cov_bits + 1 <= 62:  # one packed int64 key: a single argsort
        key = (cov << size_bits) | (max_size - sizes)
        if cross is not None:
            key |= cross.to(torch.int64) << (size_bits + cov_bits)
        order_t = torch.argsort(key, stable=True)  # ties are re-sorted by shard id below anyway
        ks = key[order_t]
        equal_next = ks[1:] == ks[:-1]
    else:
        # Successive stable sorts, least significant key first (what a lexsort does).
        keys = (-sizes, cov) if cross is None else (-sizes, cov, cross.to(torch.int64))
        order_t = torch.arange(len(sizes), dtype=torch.int64)
        for k in keys:
            order_t = order_t[torch.argsort(k[order_t], stable=True)]
        equal_next = torch.ones(len(order_t) - 1, dtype=torch.bool)
        for k in keys:
            ks = k[order_t]
            equal_next &= ks[1:] == ks[:-1]
    order = order_t.tolist()
    if _tie_sorted(order, equal_next, ids):
        order_t = torch.frombuffer(array("q", order), dtype=torch.int64)
    return order, order_t


def distribute_shards_to_ranks(
    shard_to_ranks: Dict[T, List[int]],
    shard_to_size: Dict[T, int],
    num_ranks: int,
    cross_parallelization_group_loads: Optional[Set[T]] = None,
) -> Dict[T, int]:
    """Assign every shard to one of its holders so that the bytes per rank are as even as possible.

    Greedy, in this order: shards in ``cross_parallelization_group_loads`` last (their main replica
    lives in another group; assigning them at the end keeps load and save distributions alike), then
    fewest holders first, then largest size first, then shard id. Each shard goes to the holder with
    the smallest total so far, ties to the lower rank. Deterministic, so every rank computes the same
    map; identical to Megatron-LM's ``distribute_shards_to_ranks`` for the same input.

    Args:
        shard_to_ranks: shard id -> ranks (0 .. num_ranks-1) that hold it. The holder count used for
            ordering is ``len()`` of this sequence; holders outside ``range(num_ranks)`` are ignored.
        shard_to_size: shard id -> size in bytes (non-negative ints take the fast path; other
            comparable numbers work through the plain reference implementation).
        num_ranks: size of the parallelization group.
        cross_parallelization_group_loads: shard ids to assign last (None = none).

    Returns:
        shard id -> rank (listed in the order of ``shard_to_ranks``).

    Raises:
        CheckpointError: a shard without size, without any holder in range, or incomparable shard ids.
    """
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise CheckpointError(f"num_ranks={num_ranks!r} must be a positive int (the group size).")
    with _one_intra_op_thread():
        return _distribute_fast(shard_to_ranks, shard_to_size, num_ranks, cross_parallelization_group_loads)


def _distribute_fast(
    shard_to_ranks: Dict[T, Sequence[int]],
    shard_to_size: Dict[T, Any],
    num_ranks: int,
    cross_parallelization_group_loads: Optional[Iterable[T]],
) -> Dict[T, int]:
    """:func:`distribute_shards_to_ranks` after the argument check (the reference for exotic input)."""
    n = len(shard_to_ranks)
    if n == 0:
        return {}
    cross_set = cross_parallelization_group_loads or ()
    ids = list(shard_to_ranks)
    holders = list(shard_to_ranks.values())
    try:
        cov = torch.frombuffer(array("q", map(len, holders)), dtype=torch.int64)
    except TypeError:  # iterators without len(): materialise once
        holders = [tuple(h) for h in holders]
        cov = torch.frombuffer(array("q", map(len, holders)), dtype=torch.int64)
    # Same key order in both dicts (the usual case) lets us skip n hash lookups.
    if len(shard_to_size) == n and list(shard_to_size) == ids:
        size_list = list(shard_to_size.values())
    else:
        try:
            size_list = [shard_to_size[k] for k in ids]
        except KeyError as e:
            raise CheckpointError(
                f"shard_to_size has no size for shard {e.args[0]!r}; every key of shard_to_ranks "
                "needs a size in bytes."
            ) from None
    sizes = _int64_tensor(size_list)
    R = num_ranks
    if (sizes is None or int(cov.min()) == 0 or int(sizes.min()) < 0
            or int(sizes.max()) * max(R, n) >= 1 << 62):
        # Exotic input (float / negative / huge sizes, a shard with no holder): the plain rule decides.
        return distribute_shards_reference(shard_to_ranks, shard_to_size, num_ranks, cross_parallelization_group_loads)
    cross = None
    if cross_set:
        if not isinstance(cross_set, (set, frozenset, dict)):
            cross_set = set(cross_set)
        cross = torch.frombuffer(array("b", [k in cross_set for k in ids]), dtype=torch.bool)
        if not bool(cross.any()):
            cross = None
    order, order_t = _greedy_order(cov, sizes, cross, ids)
    try:
        ranks = _assign(order, order_t, holders, cov, sizes, R)
    except (IndexError, TypeError):
        ranks = None  # a holder far outside the group or not an int: let the reference explain
    if ranks is None:
        return distribute_shards_reference(shard_to_ranks, shard_to_size, num_ranks, cross_parallelization_group_loads)
    # Built in input order: the ids stay in memory order, which makes hashing them ~3x cheaper than
    # in assignment order (Megatron's dict order); the mapping itself is the same.
    by_input = torch.empty(n, dtype=torch.int64)
    by_input[order_t] = ranks
    return dict(zip(ids, by_input.tolist()))


def _assign(
    order: List[int],
    order_t: torch.Tensor,
    holders: List[Sequence[int]],
    cov: torch.Tensor,
    sizes: torch.Tensor,
    R: int,
) -> Optional[torch.Tensor]:
    """Run the greedy over ``order``; returns the rank per position or None if a holder set is invalid.

    Loads are kept as ``enc[r] = load[r] * R + r``: one integer comparison orders by (load, rank).
    ``order`` has, per cross-flag segment, the one-holder shards first (no choice: added in bulk),
    then holder counts ascending, which picks the cheapest search per stretch of shards:

    * few holders: ``min(map(enc.__getitem__, holders))``, O(holders), unrolled for 2 and 3 holders.
      Slots ``R .. 3R-1`` of ``enc`` hold a sentinel, so out-of-group holders (``-2R <= r < 3R``) never
      win while a real one exists.
    * many holders (>= max(16, R/10)): keep all ranks sorted by (load, rank) and walk that list to the
      first holder, O(R / holders) steps expected, then move the rank to its new place by bisection.
      No per-holder-set state, so it costs the same whether sets repeat (replicas) or are all distinct.
    """
    n = len(order)
    cov_s = cov[order_t]
    sizes_s = sizes[order_t]
    scaled = (sizes_s * R).tolist()  # size * R: adding it to enc[r] adds size to load[r]
    hs = operator.itemgetter(*order)(holders) if n > 1 else (holders[order[0]],)
    enc = list(range(R)) + [_SENTINEL] * (2 * R)
    out: List[Any] = [None] * n

    single_t = cov_s == 1
    many_t = cov_s >= max(_WALK_MIN_HOLDERS, -(-R // 10))
    # Stretches of one kind: single holder (-1), walk (-2), or a scan over exactly k holders (k).
    kind = torch.where(single_t, -1, torch.where(many_t, -2, cov_s))
    bounds = [0, *(torch.nonzero(torch.diff(kind)).view(-1) + 1).tolist(), n]
    kinds = kind[bounds[:-1]].tolist()  # one entry per stretch
    g = enc.__getitem__
    for a, b, k in zip(bounds[:-1], bounds[1:], kinds):
        if k == -1:  # one holder each: no choice, add the sizes per rank in bulk
            firsts = _int64_tensor(next(iter(h)) for h in hs[a:b])
            if firsts is None or int(firsts.min()) < 0 or int(firsts.max()) >= R:
                return None
            totals = torch.zeros(R, dtype=torch.int64).index_add_(0, firsts, sizes_s[a:b])
            for r, t in enumerate(totals.tolist()):
                if t:
                    enc[r] += t * R
            out[a:b] = firsts.tolist()
            continue
        seg: List[Any] = []
        app = seg.append
        if k == -2:
            ranked = sorted(enc[:R])  # enc values ascending = ranks in (load, rank) order
            for h, sz in zip(hs[a:b], scaled[a:b]):
                i = 0
                v = ranked[0]
                while v % R not in h:  # IndexError past the end: no holder in the group
                    i += 1
                    v = ranked[i]
                del ranked[i]
                insort(ranked, v + sz)  # sz is a multiple of R: the rank stays v % R
                app(v % R)
            for v in ranked:
                enc[v % R] = v
        elif k == 2:  # the commonest small cases, unrolled (2.4x / 1.7x faster than min(map(...)))
            for (x, y), sz in zip(hs[a:b], scaled[a:b]):
                vx = enc[x]
                vy = enc[y]
                if vx < vy:
                    enc[x] = vx + sz
                    app(x)
                else:
                    enc[y] = vy + sz
                    app(y)
        elif k == 3:
            for (x, y, z), sz in zip(hs[a:b], scaled[a:b]):
                v = min(enc[x], enc[y], enc[z])
                r = v % R
                enc[r] = v + sz
                app(r)
        else:
            for h, sz in zip(hs[a:b], scaled[a:b]):
                v = min(map(g, h))  # (load, rank) of the best holder in one int; cheaper than key=
                r = v % R
                enc[r] = v + sz
                app(r)
        out[a:b] = seg
    if max(enc[:R]) >= _SENTINEL:
        return None  # some shard had no holder inside the group (its minimum was a sentinel slot)
    ranks = _int64_tensor(out)
    if ranks is None or int(ranks.min()) < 0 or int(ranks.max()) >= R:
        return None  # ... or, with two holders, both were outside it
    return ranks
