"""Megatron TP attribute getters/setters: column, row, attribute, none and bad-input cases."""
import pytest
import torch

from megashard.errors import ConfigError
from megashard.tensors.tp_attrs import (
    copy_tensor_model_parallel_attributes,
    get_mcore_tensor_parallel_partition_dim,
    get_tensor_model_parallel_partition_stride,
    is_mcore_tensor_model_parallel,
    is_mcore_tensor_parallel_duplicated,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
    set_tensor_parallel_mode,
)


def _p(*shape):
    return torch.nn.Parameter(torch.zeros(*shape))


@pytest.mark.parametrize("mode,dim,tp,dup", [("column", 0, True, False), ("row", 1, True, False), ("replicated", None, False, True)])
def test_mode(mode, dim, tp, dup):
    p = _p(4, 6)
    set_tensor_parallel_mode(p, mode)
    assert get_mcore_tensor_parallel_partition_dim(p) == dim
    assert is_mcore_tensor_model_parallel(p) is tp
    assert is_mcore_tensor_parallel_duplicated(p) is dup


def test_megatron_attributes():
    p = _p(4, 6, 2)
    set_tensor_model_parallel_attributes(p, True, 2, 1)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (True, 2, 1)
    assert is_mcore_tensor_model_parallel(p) and not is_mcore_tensor_parallel_duplicated(p)
    assert get_mcore_tensor_parallel_partition_dim(p) == 2
    assert get_tensor_model_parallel_partition_stride(p) == 1


def test_mode_wins_over_attributes():
    p = _p(4, 6)
    set_tensor_model_parallel_attributes(p, True, 1, 1)
    set_tensor_parallel_mode(p, "column")
    assert get_mcore_tensor_parallel_partition_dim(p) == 0


def test_megatron_fsdp_internal_attributes():
    p = _p(4, 6)
    p._mcore_tp, p._tp_partition_dim = True, 1
    assert is_mcore_tensor_model_parallel(p) and get_mcore_tensor_parallel_partition_dim(p) == 1
    q = _p(4)
    q._tp_duplicated = True
    assert is_mcore_tensor_parallel_duplicated(q) and get_mcore_tensor_parallel_partition_dim(q) is None


def test_none_and_defaults():
    p = _p(3, 3)
    assert get_mcore_tensor_parallel_partition_dim(p) is None
    assert not is_mcore_tensor_model_parallel(p) and not is_mcore_tensor_parallel_duplicated(p)
    assert get_tensor_model_parallel_partition_stride(p) == 1
    set_defaults_if_not_set_tensor_model_parallel_attributes(p)
    assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (False, -1, 1)
    assert get_mcore_tensor_parallel_partition_dim(p) is None
    # not parallel, so it counts once per model only on TP rank 0
    assert param_is_not_tensor_parallel_duplicate(p, tp_rank=0)
    assert not param_is_not_tensor_parallel_duplicate(p, tp_rank=1)


def test_copy_attributes():
    src, dst = _p(4, 6), _p(4, 6)
    set_tensor_model_parallel_attributes(src, True, 1, 2)
    set_tensor_parallel_mode(src, "row")
    copy_tensor_model_parallel_attributes(dst, src)
    assert (dst.tensor_model_parallel, dst.partition_dim, dst.partition_stride, dst._tensor_parallel_mode) == (True, 1, 2, "row")
    assert param_is_not_tensor_parallel_duplicate(dst, tp_rank=1)


def test_bad_input():
    p = _p(4, 6)
    set_tensor_model_parallel_attributes(p, True, 0, 1)
    with pytest.raises(ConfigError, match="already has TP attributes"):
        set_tensor_model_parallel_attributes(p, True, 1, 1)
    with pytest.raises(ConfigError, match="not a dim"):
        set_tensor_model_parallel_attributes(_p(4), True, 1, 1)
    with pytest.raises(ConfigError, match="stride"):
        set_tensor_model_parallel_attributes(_p(4), True, 0, 0)
    with pytest.raises(ConfigError, match="'diagonal'.*legal"):
        set_tensor_parallel_mode(_p(4), "diagonal")
    with pytest.raises(ConfigError, match="splits dim 1"):
        set_tensor_parallel_mode(_p(4), "row")
    q = _p(4, 6)
    q.tensor_model_parallel, q.partition_dim = True, -1
    with pytest.raises(ConfigError, match="partition_dim=-1"):
        get_mcore_tensor_parallel_partition_dim(q)
    r = _p(4)
    r._tensor_parallel_mode = "col"
    with pytest.raises(ConfigError, match="'col'"):
        is_mcore_tensor_model_parallel(r)
