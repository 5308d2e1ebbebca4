"""The device quantisers (kernels/quant.py) against the reference (replayssm_cute.quant).

CPU: the probe kernel compiles for sm_90a, sm_100a and sm_103a without local memory (software
rounding everywhere). GPU (marked): every code bit for bit, RTN and SR with the same random bits,
over random fp32 patterns (normals, subnormals, ties, overflow, Inf, NaN) and the generator's
bits against ``quant.sr_bits``.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replayssm_cute import quant

HERE = Path(__file__).parent


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_probe_compiles_for_every_target(arch, tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH=arch, REPLAYSSM_CUTE_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(HERE / "_quant_kernel.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ptx = proc.stdout
    assert re.search(rf"^\.target {arch}\b", ptx, re.M), ptx[:2000]
    assert ".local" not in ptx
    assert ptx.count("mul.lo.s32") + ptx.count("mul.lo.u32") >= 4  # the two fmix32 rounds


def _patterns(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp32 values across every format's range and edges: random bit patterns, values near the
    formats' spacings (ties and neighbours), subnormals, the largest finite values, Inf, NaN."""
    bits = torch.randint(-2**31, 2**31, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    random_bits = bits.view(torch.float32)
    scale = torch.exp2(torch.randint(-30, 20, (n,), generator=gen).float())
    grid = torch.randint(-4096, 4096, (n,), generator=gen).float() / 8 * scale  # many exact ties
    edges = torch.tensor([0.0, -0.0, 448.0, 464.0, 480.0, 65504.0, 65520.0, 6.0, 7.0, 0.25, 0.75, 2**-9,
                          2**-10, 2**-24, 2**-25, 2**-126, 2**-149, float("inf"), float("-inf"), float("nan")])
    return torch.cat([random_bits, grid, edges])


@pytest.mark.gpu
def test_device_codes_match_the_reference_bit_for_bit():
    from tests.kernels._quant_kernel import FORMATS, build  # noqa: F401 (imports cutlass: GPU tests only)

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    x = _patterns(1 << 18, gen)
    seed = 0x1234ABCD
    out = torch.empty(7, x.numel(), dtype=torch.int32, device=dev)
    build()(x.to(dev), torch.tensor([seed - 2**32 if seed >= 2**31 else seed], dtype=torch.int32, device=dev), out)
    torch.cuda.synchronize()
    out = out.cpu()
    bits = quant.sr_bits(seed, torch.arange(x.numel()))
    assert torch.equal(out[6], bits)
    for f, ref in enumerate((quant.F16, quant.E4M3, quant.E2M1)):
        rtn, _ = ref.round_rtn(x)
        sr, _ = ref.round_sr(x, bits)
        mask = 2 * ref.sign_bit - 1  # codes as unsigned fields of the format's width
        assert torch.equal(out[2 * f].to(torch.int64) & mask, rtn & mask), ref.name
        assert torch.equal(out[2 * f + 1].to(torch.int64) & mask, sr & mask), ref.name
