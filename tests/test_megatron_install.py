"""``megashard.megatron.install()``: Megatron-LM's own training code on megashard's groups.

Megatron's ``GPTModel`` is built and trained for three steps on 4 gloo ranks (tp=2, dp=2) twice in the same
processes: on Megatron's own ``parallel_state``, then after ``install()`` on megashard's (the model takes its groups
through ``ProcessGroupCollection.use_mpu_process_groups`` and the ``parallel_state`` getters, as Megatron's code
does). Losses and every gradient must be bitwise equal. Skipped, with the install command, without megatron-core.
"""
from __future__ import annotations

import pytest

from tests._dist import spawn_checks

STEPS = 3


def _megatron_reason() -> str | None:
    import importlib
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for mod in ("megatron.core.models.gpt.gpt_model", "megatron.core.parallel_state"):
                importlib.import_module(mod)
    except ModuleNotFoundError as e:
        return f"megatron-core is not installed (pip install -e '.[megatron-test]'): {e}"
    except Exception as e:  # noqa: BLE001 - an installed but broken megatron-core: say why
        return f"megatron-core does not import here: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None


def _train(rank: int, on_megashard: bool) -> dict:
    """Three SGD steps of a 2-layer GPTModel (tp=2, dp=2): losses, gradients, and the groups it used."""
    import warnings

    import torch
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.parallel_state as mps
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.models.gpt.gpt_model import GPTModel
        from megatron.core.transformer.transformer_config import TransformerConfig

    import megashard.megatron

    if on_megashard:
        megashard.megatron.install()
    try:
        mps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                      distributed_timeout_minutes=2)
        if not on_megashard:
            # Megatron's scratch buffer allocates on torch.cuda.current_device(): on CPU give its attention the same
            # buffer on CPU (scratch memory only; megashard's buffer follows the state's device)
            from megashard.state.memory import GlobalMemoryBuffer

            mps._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer("cpu")
        # Megatron's CUDA RNG tracker needs CUDA; its attention forks "model-parallel-rng" even without dropout: the
        # same CPU-capable tracker (megashard's port of it) on both runs
        from megatron.core.tensor_parallel import random as mrandom

        from megashard.state.rng_tracker import RNGStatesTracker

        tracker = RNGStatesTracker()
        tracker.add("model-parallel-rng", 4321 + mps.get_tensor_model_parallel_rank())
        mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = tracker, True
        tp_group, dp_group = mps.get_tensor_model_parallel_group(), mps.get_data_parallel_group()
        out = {"tp": dist.get_process_group_ranks(tp_group), "dp": dist.get_process_group_ranks(dp_group),
               "tp_backend_name": tp_group.group_name}
        cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4, use_cpu_initialization=True,
                                tensor_model_parallel_size=2, params_dtype=torch.float32, hidden_dropout=0.0,
                                attention_dropout=0.0, add_bias_linear=False)
        torch.manual_seed(1234)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                         max_sequence_length=16)
        fc1 = model.decoder.layers[0].mlp.linear_fc1
        out["model_tp_group"], out["model_tp_name"] = dist.get_process_group_ranks(fc1.tp_group), fc1.tp_group.group_name
        dp_rank = mps.get_data_parallel_rank()
        g = torch.Generator().manual_seed(100 + dp_rank)
        losses, grads = [], []
        for _ in range(STEPS):
            tokens = torch.randint(0, 64, (2, 16), generator=g)
            labels = torch.randint(0, 64, (2, 16), generator=g)
            pos = torch.arange(16).unsqueeze(0).expand(2, 16)
            mask = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1).view(1, 1, 16, 16)
            model.zero_grad(set_to_none=True)
            loss = model(tokens, pos, mask, labels=labels).mean()
            loss.backward()
            step_grads = {}
            with torch.no_grad():
                for name, p in model.named_parameters():
                    gr = p.grad if p.grad is not None else torch.zeros_like(p)
                    dist.all_reduce(gr, group=mps.get_data_parallel_group())
                    gr /= mps.get_data_parallel_world_size()
                    step_grads[name] = gr.clone()
                    p -= 0.1 * gr
            dist.all_reduce(loss.detach(), group=mps.get_data_parallel_group())
            losses.append(loss.item())
            grads.append(step_grads)
        out["losses"], out["grads"] = losses, grads
        return out
    finally:
        mps.destroy_model_parallel()
        if on_megashard:
            megashard.megatron.uninstall()


def check_gpt_model_parity(rank, world_size):
    import torch

    if _megatron_reason():
        return  # the test reports the skip
    ref = _train(rank, on_megashard=False)
    got = _train(rank, on_megashard=True)
    assert got["tp"] == ref["tp"] == got["model_tp_group"] and got["dp"] == ref["dp"], (ref["tp"], got["tp"])
    assert got["tp_backend_name"] != ref["tp_backend_name"]  # really another communicator: megashard's …
    assert got["model_tp_name"] == got["tp_backend_name"]  # … and the one the model computes on
    assert got["losses"] == ref["losses"], (ref["losses"], got["losses"])
    assert len(set(ref["losses"])) == STEPS  # it trained: the loss moved
    for step, (a, b) in enumerate(zip(ref["grads"], got["grads"])):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)


def check_install_swaps_and_restores(rank, world_size):
    if _megatron_reason():
        return
    import megatron.core.parallel_state as mps
    from megatron.core.process_groups_config import ProcessGroupCollection

    import megashard
    import megashard.megatron
    import megashard.parallel_state as ms

    own_init, own_use = mps.initialize_model_parallel, ProcessGroupCollection.__dict__["use_mpu_process_groups"]
    megashard.megatron.install()
    try:
        assert mps.get_tensor_model_parallel_group is ms.get_tensor_model_parallel_group
        mps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                      distributed_timeout_minutes=2)
        st = megashard.get_parallel_state()
        assert mps.get_pipeline_model_parallel_group() is st.group("pp")
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        assert pgs.tp is st.group("tp") and pgs.dp is st.group("dp") and pgs.mp is st.group("mp")
        pgs = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp"])
        assert pgs.pp is st.group("pp")
        try:
            ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tpp"])
        except ValueError as e:
            assert "tpp" in str(e)
        else:
            raise AssertionError("an unknown field name must raise ValueError, as Megatron's")
        mps.set_tensor_model_parallel_world_size(7)
        assert mps.get_tensor_model_parallel_world_size() == 7
        mps.destroy_model_parallel()
        assert not mps.model_parallel_is_initialized()
    finally:
        megashard.megatron.uninstall()
    assert mps.initialize_model_parallel is own_init
    assert ProcessGroupCollection.__dict__["use_mpu_process_groups"] is own_use


@pytest.fixture(scope="module")
def world4():
    return spawn_checks([check_install_swaps_and_restores, check_gpt_model_parity], world_size=4, timeout=400)


@pytest.mark.parametrize("check", ["check_install_swaps_and_restores", "check_gpt_model_parity"])
def test_install(world4, check):
    reason = _megatron_reason()
    if reason:
        pytest.skip(reason)
    world4.assert_ok(check)


def test_install_without_megatron_core_names_the_extra(monkeypatch):
    import sys

    import megashard.megatron
    from megashard.errors import MissingExtraError

    if _megatron_reason() is None:
        monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", None)  # import fails as if absent
    with pytest.raises(MissingExtraError, match=r"pip install -e '\.\[megatron-test\]'"):
        megashard.megatron.install()
    assert not megashard.megatron.installed()
