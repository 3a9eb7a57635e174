"""A rank's slice of a seeded parameter, drawn in row blocks, equals the slice of the whole draw bit for bit (issue 42:
no rank holds a whole parameter in float64 to initialise its slice), and its peak memory is the slice's."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megashard.models.init_slices import local_normal, slice_ranges

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _whole(shape, cuts, seed):
    full = torch.empty(shape, dtype=torch.float64).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed))
    for dim, n, r in cuts:
        full = full.chunk(n, dim=dim)[r]
    return full


@pytest.mark.parametrize("shape", [(256, 64), (97, 33), (1000, 3), (5, 7, 9), (4096,), (40, 17), (8, 4, 1000)])
@pytest.mark.parametrize("cuts", [[], [(0, 2, 1)], [(1, 1, 0)], [(0, 4, 3)], [(0, 2, 0), (0, 2, 1)]])
def test_blocks_draw_the_values_of_the_whole_tensor(shape, cuts):
    if any(d >= len(shape) or shape[d] % n for d, n, _ in cuts) or (len(cuts) == 2 and shape[0] % 4):
        pytest.skip("the job's slices divide evenly (validated)")
    want = _whole(shape, cuts, 7)
    for block in (16, 48, 100, 1 << 20):  # blocks of a few rows up to the whole tensor
        got = local_normal(shape, cuts, 0.02, torch.Generator().manual_seed(7), block_elements=block)
        assert torch.equal(got, want), (shape, cuts, block)


def test_slice_ranges_are_torch_chunk():
    full = torch.arange(24 * 6).reshape(24, 6)
    for cuts in ([(0, 4, 2)], [(1, 3, 1)], [(0, 2, 1), (0, 3, 2), (1, 2, 0)]):
        want = full
        for dim, n, r in cuts:
            want = want.chunk(n, dim=dim)[r]
        idx = tuple(slice(a, b) for a, b in slice_ranges(full.shape, cuts))
        assert torch.equal(full[idx], want)


def test_a_vocab_sized_slice_needs_no_whole_parameter():
    code = (
        "import json, torch\n"
        "from megashard.models.init_slices import local_normal\n"
        "def st(k):\n"
        "    return next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith(k + ':'))\n"
        "local_normal((64, 16), [(0, 2, 0)], 0.02, torch.Generator().manual_seed(0))\n"
        "base = st('VmRSS'); open('/proc/self/clear_refs', 'w').write('5')\n"
        "x = local_normal((131072, 512), [(0, 8, 3)], 0.02, torch.Generator().manual_seed(0))\n"
        "print(json.dumps({'growth': st('VmHWM') - base, 'shape': list(x.shape)}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["shape"] == [16384, 512]
    # the slice is 64 MiB (float64) and a block 8 MiB, plus what torch's first large draws touch (measured 80-104 MiB
    # in all); the whole parameter would be 512 MiB
    assert got["growth"] < 128 << 20, got


def test_init_parameters_of_a_large_embedding_is_the_whole_draw():
    from megashard.models.gpt.model import GPT, init_parameters, param_init_seed
    from megashard.train.config import JobConfig

    job = JobConfig.from_yaml(os.path.join(REPO, "configs", "default.yaml"),
                              ["model.vocab_size=32768", "model.hidden=64", "model.layers=1"])
    model = GPT(job.model, ffn_hidden=job.ffn_hidden, dtype=torch.float64)
    init_parameters(model, 1234)
    w = model.embed.weight  # 2M elements: drawn in two blocks
    want = torch.empty(tuple(w.shape), dtype=torch.float64).normal_(
        0.0, job.model.init_std, generator=torch.Generator().manual_seed(param_init_seed(1234, "embed.weight")))
    assert w.numel() > 1 << 20 and torch.equal(w.detach(), want)
