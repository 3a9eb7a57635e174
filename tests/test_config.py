"""ParallelConfig: resolution of derived sizes, YAML + overrides, and every ConfigError path."""
import pytest

from megashard import ConfigError
from megashard.config import ParallelConfig
from megashard.config.yamlfile import apply_overrides


def R(world, **kw):
    return ParallelConfig(**kw).resolve(world)


def test_derived_sizes():
    s = R(8, tp=2)
    assert (s.tp, s.cp, s.pp, s.dp, s.dp_outer, s.dp_shard, s.ep, s.expt_tp, s.expt_dp) == (2, 1, 1, 4, 1, 4, 1, 1, 8)
    s = R(16, tp=2, cp=2, pp=2, dp_outer=2)
    assert (s.dp, s.dp_outer, s.dp_shard, s.expt_dp) == (2, 2, 1, 8)
    s = R(64, tp=4, pp=2, ep=4, expt_tp=2)
    assert (s.dp, s.expt_dp) == (8, 4)
    assert s.order == ("tp", "cp", "ep", "dp", "pp")


@pytest.mark.parametrize("kw,expect", [
    (dict(tp=-1, dp=2), dict(tp=4, dp=2, dp_shard=2)),
    (dict(tp=-1, dp_shard=2), dict(tp=4, dp=2)),
    (dict(pp=-1, tp=2, dp=2), dict(pp=2)),
    (dict(dp_outer=-1, dp_shard=2), dict(dp_outer=4, dp=8)),
    (dict(dp=4, dp_outer=2, tp=2), dict(dp_shard=2)),
    (dict(dp=4, dp_shard=4, tp=2), dict(dp_outer=1)),
    (dict(ep=-1, expt_dp=2), dict(ep=4)),
    (dict(expt_tp=-1, ep=2, expt_dp=2), dict(expt_tp=2)),
    (dict(tp=2, pp=2, order="tp-pp-dp"), dict(expt_tp=2, expt_dp=2)),  # no experts: folded as Megatron's default
])
def test_minus_one_resolution(kw, expect):
    s = R(8, **kw)
    for k, v in expect.items():
        assert getattr(s, k) == v, (kw, k)


def test_order_appends_missing_size_one_axes():
    s = R(8, tp=2, order="tp-dp")
    assert s.order == ("tp", "dp", "cp", "ep", "pp")


ERRORS = [
    # (world, kwargs, regex)
    (8, dict(tp=3), r"world size 8 is not divisible by tp=3·cp=1·pp=1·dp_outer=1 = 3; valid products for this world: 1, 2, 4, 8"),
    (8, dict(ep=3), r"ep=3 must divide dp·cp·tp/expt_tp = 8; valid: 1, 2, 4, 8"),
    (8, dict(tp=2, ep=3, expt_tp=2), r"ep=3 must divide dp·cp·tp/expt_tp = 4; valid: 1, 2, 4"),
    (8, dict(expt_tp=3), r"expt_tp=3 must divide dp·cp·tp = 4·1·2|expt_tp=3 must divide dp·cp·tp = 8·1·1 = 8; valid: 1, 2, 4, 8"),
    (8, dict(dp=4, dp_outer=3), r"data parallel size dp=4 must be divisible by dp_outer=3; valid dp_outer: 1, 2, 4"),
    (8, dict(dp=4, dp_shard=3, dp_outer=-1), r"data parallel size dp=4 must be divisible by dp_shard=3; valid dp_shard: 1, 2, 4"),
    (8, dict(dp=3), r"dp=3 does not match world/\(tp·cp·pp\) = 8/\(1·1·1\) = 8"),
    (8, dict(dp_shard=2, dp_outer=2), r"tp·cp·pp·dp_outer·dp_shard = 1·1·1·2·2 = 4 must equal the world size 8"),
    (8, dict(dp=8, dp_outer=-1), r"dp_outer=-1 and dp_shard=-1 with dp=8: give dp_outer or dp_shard"),
    (8, dict(tp=-1, dp=3), r"world size 8 is not divisible by cp=1·pp=1·dp_outer=1·dp_shard=3 = 3"),
    (8, dict(expt_dp=3), r"expt_dp=3 does not match dp·cp·tp/\(expt_tp·ep\) = 8/\(1·1\) = 8"),
    (8, dict(ep=-1, expt_dp=3), r"expt_dp=3 must divide dp·cp·tp/expt_tp = 8; valid: 1, 2, 4, 8"),
    (8, dict(expt_tp=-1, ep=3, expt_dp=1), r"ep·expt_dp = 3·1 = 3 must divide dp·cp·tp = 8"),
    (8, dict(tp=2, order="dp-pp"), r"order='dp-pp' omits tp \(size 2\); every axis with size > 1 must appear in order"),
    (8, dict(pp=2, ep=2, order="tp-pp-ep-dp"),
     r"order='tp-pp-ep-dp' does not end with pp, so the dense and expert pipeline groups differ unless expt_dp \(2\) equals dp \(4\)"),
    (0, dict(), r"world size 0 must be a positive integer"),
]


@pytest.mark.parametrize("world,kw,regex", ERRORS)
def test_resolve_errors(world, kw, regex):
    with pytest.raises(ConfigError, match=regex):
        R(world, **kw)


VALIDATE_ERRORS = [
    (dict(tp=2.5), r"tp=2.5 must be an integer"),
    (dict(tp=True), r"tp=True must be an integer"),
    (dict(cp=0), r"cp=0 is not a valid size; use a positive integer or -1"),
    (dict(pp=-2), r"pp=-2 is not a valid size"),
    (dict(tp=-1, cp=-1), r"at most one size may be -1, but tp=-1, cp=-1"),
    (dict(tp=-1), r"tp=-1 needs dp or dp_shard to be given"),
    (dict(ep=-1), r"ep=-1 with expt_dp=-1: at most one expert size"),
    (dict(ep=-1, expt_tp=-1, expt_dp=2), r"ep=-1 and expt_tp=-1"),
    (dict(vpp=0), r"vpp=0 must be a positive integer or null"),
    (dict(vpp=2), r"vpp=2 needs pipeline parallelism, but pp=1"),
    (dict(order=5), r"order=5 must be a string"),
    (dict(order="tp-dpp-pp"), r"order='tp-dpp-pp' has unknown token\(s\) 'dpp' \(did you mean '(dp|pp)'\?\)"),
    (dict(order="tp-dp-tp"), r"order='tp-dp-tp' repeats tp"),
    (dict(backend="mpi"), r"backend='mpi' is not supported; valid: auto, nccl, gloo, fake"),
    (dict(device="tpu"), r"device='tpu' is not supported; valid: auto, cpu, cuda"),
    (dict(timeout=0), r"timeout=0 must be a positive number of seconds"),
    (dict(seed="x"), r"seed='x' must be an integer"),
]


@pytest.mark.parametrize("kw,regex", VALIDATE_ERRORS)
def test_validate_errors(kw, regex):
    with pytest.raises(ConfigError, match=regex):
        ParallelConfig(**kw).validate()


def test_unknown_key_did_you_mean():
    with pytest.raises(ConfigError, match=r"unknown config key\(s\): 'parallel.tensor_parallel'|'parallel.dp_outter' \(did you mean 'parallel.dp_outer'\?\)"):
        ParallelConfig.from_dict({"dp_outter": 2})
    with pytest.raises(ConfigError, match=r"'parallel.expt_pt' \(did you mean 'parallel.expt_tp'\?\)"):
        ParallelConfig.from_dict({"expt_pt": 2})


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("parallel:\n  tp: 2\n  dp_outer: 1\nother: {x: 1}\n")
    cfg = ParallelConfig.from_yaml(str(p), ["parallel.tp=4", "parallel.order=tp-dp-pp"])
    assert cfg.tp == 4 and cfg.order == "tp-dp-pp"
    assert cfg.resolve(8).dp == 2
    with pytest.raises(ConfigError, match=r"'parallel.tpp' \(did you mean 'parallel.tp'\?\)"):
        ParallelConfig.from_yaml(str(p), ["parallel.tpp=4"])
    assert apply_overrides({"a": {"b": 1}}, ["a.c=[1, 2]", "d.e=null"]) == {"a": {"b": 1, "c": [1, 2]}, "d": {"e": None}}


@pytest.mark.parametrize("text,override,regex", [
    ("parallel: [1, 2]\n", [], r"section 'parallel' must be a mapping of keys, got list"),
    ("- 1\n", [], r"the top level must be a mapping, got list"),
    ("parallel: {tp: 2\n", [], r"not valid YAML"),
    ("parallel: {tp: 2}\n", ["parallel.tp"], r"override 'parallel.tp' must look like key.sub=value"),
    ("parallel: {tp: 2}\n", ["parallel.tp.x=1"], r"override 'parallel.tp.x=1': 'tp' is 2, not a mapping"),
    ("parallel: {tp: 2}\n", ["parallel..tp=1"], r"has an empty key part"),
])
def test_yaml_errors(tmp_path, text, override, regex):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=regex):
        ParallelConfig.from_yaml(str(p), override)


def test_missing_file():
    with pytest.raises(ConfigError, match=r"config file '/nonexistent.yaml' does not exist"):
        ParallelConfig.from_yaml("/nonexistent.yaml")
