"""distribute_shards_to_ranks and shard metadata: hand-worked cases, then agreement with the plain rule."""
import random

import pytest
import torch

from megashard.checkpoint.distribution import distribute_shards_reference, distribute_shards_to_ranks, shard_size
from megashard.checkpoint.exchange import exchange_by_distribution, is_float8tensor
from megashard.checkpoint.mapping import ShardedTensor, is_main_replica, sharded_tensor_shard_id
from megashard.errors import CheckpointError, MegashardError


def sid(key, *offset, flat=None):
    return (key, tuple(offset), flat)


# ---------------------------------------------------------------- hand-worked assignments
def test_order_single_holders_then_size_then_cross_last():
    ranks = {"a": [0, 1], "b": [1], "c": [0, 1], "d": [0]}
    sizes = {"a": 4, "b": 8, "c": 10, "d": 1}
    # b->1 (8), d->0 (1); two holders: c (10) before a (4): c->0 (11), a->1 (12)
    assert distribute_shards_to_ranks(ranks, sizes, 2, set()) == {"a": 1, "b": 1, "c": 0, "d": 0}
    # c is a cross-group load: assigned after a. a->0 (5), c->0 (5 < 8) -> 15
    assert distribute_shards_to_ranks(ranks, sizes, 2, {"c"}) == {"a": 0, "b": 1, "c": 0, "d": 0}


def test_world8_tp2_replicated_large_key_and_ties():
    # 8 ranks, tp=2: tp rank = rank % 2. TP-sharded keys live on the evens (tp 0) or odds (tp 1).
    even, odd, every = [0, 2, 4, 6], [1, 3, 5, 7], list(range(8))
    ranks = {
        sid("emb", 0, 0): even, sid("emb", 512, 0): odd,   # the large key, 1024 B per shard
        sid("w1", 0, 0): even, sid("w1", 8, 0): odd,       # 64 B
        sid("b", 0): even, sid("b", 2): odd,               # 8 B
        sid("ln", 0): every, sid("ln2", 0): every,         # replicated on all 8, 16 B each
    }
    sizes = {k: {"emb": 1024, "w1": 64, "b": 8, "ln": 16, "ln2": 16}[k[0]] for k in ranks}
    got = distribute_shards_to_ranks(ranks, sizes, 8, set())
    assert got == {
        sid("emb", 0, 0): 0, sid("emb", 512, 0): 1,  # all loads 0: lowest holder
        sid("w1", 0, 0): 2, sid("w1", 8, 0): 3,       # 0 and 1 carry the large key
        sid("b", 0): 4, sid("b", 2): 5,
        sid("ln", 0): 6, sid("ln2", 0): 7,            # 6 and 7 tie at 0 -> 6 first ("ln" < "ln2")
    }
    loads = [0] * 8
    for k, r in got.items():
        loads[r] += sizes[k]
    assert loads == [1024, 1024, 64, 64, 8, 8, 16, 16]


def test_many_holders_walk_path_round_robin():
    # 40 equal shards held by all 32 ranks (the walk over the load order): ids 0..31 go to ranks
    # 0..31, ids 32..39 to ranks 0..7 (every tie to the lower rank).
    ranks = {sid("p", i): list(range(32)) for i in range(40)}
    got = distribute_shards_to_ranks(ranks, dict.fromkeys(ranks, 10), 32, set())
    assert got == {sid("p", i): i % 32 for i in range(40)}


def test_holder_count_includes_duplicates_like_megatron():
    # a lists rank 0 twice: 3 holders, so b (2 holders) goes first although a is larger.
    got = distribute_shards_to_ranks({"a": [0, 0, 1], "b": [0, 1]}, {"a": 5, "b": 1}, 2, set())
    assert got == {"a": 1, "b": 0}


def test_holders_outside_group_are_ignored_not_wrapped():
    # -1 must not mean rank 3 (Python indexing): q's only real holder is 2, which is loaded.
    got = distribute_shards_to_ranks({"p": [2], "q": [-1, 2], "r": [9, 3]}, {"p": 100, "q": 1, "r": 1}, 4)
    assert got == {"p": 2, "q": 2, "r": 3}
    with pytest.raises(CheckpointError, match="none is a rank of the group"):
        distribute_shards_to_ranks({"x": [0], "y": [4, 5]}, {"x": 1, "y": 1}, 4)
    with pytest.raises(CheckpointError, match="none is a rank of the group"):
        distribute_shards_to_ranks({"y": [10**9]}, {"y": 1}, 4)


def test_non_integer_sizes_and_bad_input():
    assert distribute_shards_to_ranks({"a": [0, 1], "b": [0, 1]}, {"a": 1.5, "b": 2.5}, 2) == {"a": 1, "b": 0}
    assert distribute_shards_to_ranks({}, {}, 4, set()) == {}
    with pytest.raises(CheckpointError, match="no size for shard 'b'"):
        distribute_shards_to_ranks({"a": [0], "b": [0]}, {"a": 1}, 2)
    with pytest.raises(CheckpointError, match="num_ranks=0"):
        distribute_shards_to_ranks({"a": [0]}, {"a": 1}, 0)
    with pytest.raises(CheckpointError, match="mutually comparable"):
        distribute_shards_to_ranks({("k", (0,), None): [0, 1], ("k", (0,), (0, 4)): [0, 1]},
                                   {("k", (0,), None): 4, ("k", (0,), (0, 4)): 4}, 2)


# ---------------------------------------------------------------- agreement with the plain rule
def _random_case(rng: random.Random):
    R = rng.choice([1, 2, 3, 8, 17, 64, 130])
    n = rng.randint(1, 250)
    tie_heavy = rng.random() < 0.4
    max_k = R if rng.random() < 0.5 else min(R, rng.choice([1, 2, 4, 8, 24]))
    s2r, s2s = {}, {}
    for k in rng.sample(range(10**6), n):
        key = (f"layer{k % 13}.w", (k % 97, k), None if k % 3 else (0, k % 7 + 1))
        holders = rng.sample(range(R), rng.randint(1, max_k))
        if rng.random() < 0.5:
            holders.sort()
        if rng.random() < 0.05:
            holders.append(holders[0])  # a duplicate holder
        s2r[key] = holders
        s2s[key] = rng.choice([0, 2, 4, 4096, 4096, 1 << 20]) if tie_heavy else rng.randint(0, 10**7)
    if rng.random() < 0.3:  # a size dict in another key order (no fast path for the sizes)
        items = list(s2s.items())
        rng.shuffle(items)
        s2s = dict(items)
    cross = set(rng.sample(sorted(s2r), rng.randint(0, n))) if rng.random() < 0.5 else set()
    return s2r, s2s, R, cross


def test_matches_reference_on_random_inputs():
    rng = random.Random(1234)
    for trial in range(250):
        s2r, s2s, R, cross = _random_case(rng)
        got = distribute_shards_to_ranks(s2r, s2s, R, cross)
        assert got == distribute_shards_reference(s2r, s2s, R, cross), f"trial {trial} (R={R}, n={len(s2r)})"


def test_large_regimes_match_reference():
    rng = random.Random(7)
    for lo, hi in [(1, 8), (64, 64), (1, 64)]:
        s2r = {("t", (i,), None): sorted(rng.sample(range(64), rng.randint(lo, hi))) for i in range(3000)}
        s2s = {k: 4 * rng.randint(1, 1 << 16) for k in s2r}
        assert distribute_shards_to_ranks(s2r, s2s, 64, set()) == distribute_shards_reference(s2r, s2s, 64, set())


def test_huge_sizes_lexsort_path_and_integer_like_sizes():
    # Sizes near 2**57 leave no room for one packed int64 key: successive stable sorts decide.
    rng = random.Random(3)
    s2r = {("h", (i,), None): sorted(rng.sample(range(8), rng.randint(1, 8))) for i in range(24)}
    s2s = {k: (1 << 57) - rng.choice([0, 1, 1 << 40]) for k in s2r}
    cross = set(list(s2r)[::5])
    got = distribute_shards_to_ranks(s2r, s2s, 8, cross)
    assert got == distribute_shards_reference(s2r, s2s, 8, cross)
    # Integer-like sizes (bool, 0-dim integer tensors) are integers; the thread count is restored.
    threads = torch.get_num_threads()
    ranks = {"a": [0, 1], "b": [0, 1], "c": [1]}
    assert distribute_shards_to_ranks(ranks, {"a": True, "b": torch.tensor(3), "c": 2}, 2) == {"a": 1, "b": 0, "c": 1}
    assert torch.get_num_threads() == threads


# ---------------------------------------------------------------- metadata records
def test_sharded_tensor_ids_sizes_and_validation():
    local = torch.zeros(2, 3, dtype=torch.bfloat16)
    sh = ShardedTensor.from_rank_offsets("w", local, (0, 1, 4), replica_id=(0, 1))
    assert (sh.global_shape, sh.global_offset, sh.axis_fragmentations) == ((8, 3), (2, 0), (4, 1))
    assert sharded_tensor_shard_id(sh) == ("w", (2, 0), None)
    assert shard_size(sh) == 12 and not is_main_replica(sh.replica_id) and is_main_replica((0, 0))
    assert sh.global_slice() == (slice(2, 4), slice(0, 3))
    meta = sh.without_data()
    assert meta.data is None and sh.data is local
    flat = ShardedTensor("f", torch.zeros(4), torch.float32, (3, 5), (6, 5), (3, 0), None,
                         flattened_range=slice(2, 6))
    assert sharded_tensor_shard_id(flat) == ("f", (3, 0), (2, 6)) and shard_size(flat) == 16
    empty = ShardedTensor("e", None, torch.float32, (0, 5), (6, 5), (6, 0))  # PyTorch's empty-shard offset
    empty.init_data("cpu")
    assert empty.data.shape == (0, 5)
    with pytest.raises(CheckpointError, match="outside global size"):
        ShardedTensor("w", None, torch.float32, (4,), (6,), (3,))
    with pytest.raises(CheckpointError, match="data dtype"):
        ShardedTensor("w", torch.zeros(2), torch.float16, (2,), (2,), (0,))
    with pytest.raises(CheckpointError, match="not a multiple"):
        ShardedTensor("w", None, torch.float32, (4,), (7,), (3,), (2,))
    with pytest.raises(CheckpointError, match="flattened_range"):
        ShardedTensor("w", None, torch.float32, (4,), (4,), (0,), flattened_range=slice(0, 5))
    with pytest.raises(MegashardError, match="bad rank offset"):
        ShardedTensor.from_rank_offsets("w", local, (0, 4, 4))


def test_float8_detection_without_transformer_engine():
    assert is_float8tensor(torch.ones(2)) is False
    fake = type("Float8Tensor", (torch.Tensor,), {"__module__": "transformer_engine.pytorch.tensor"})
    assert is_float8tensor(torch.Tensor._make_subclass(fake, torch.ones(2))) is True


def test_unknown_exchange_algorithm():
    with pytest.raises(CheckpointError, match="exchange_algo='ring'.*broadcast, gather_rounds, gather_object"):
        exchange_by_distribution({}, {}, ({}, set(), {}, {}), None, exchange_algo="ring")


def test_megatron_names_are_importable_where_megatron_has_them():
    """``exchange_utils`` and ``mapping`` keep Megatron-LM's names, private ones as aliases of the public ones."""
    from megashard.checkpoint import distribution, exchange, mapping

    assert exchange._shard_size is shard_size and exchange.distribute_shards_to_ranks is distribute_shards_to_ranks
    assert exchange.ShardDistribution is distribution.ShardDistribution
    assert mapping._sharded_tensor_shard_id is sharded_tensor_shard_id and mapping._ShardId is mapping.ShardId
