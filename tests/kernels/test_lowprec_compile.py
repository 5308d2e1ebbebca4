"""Compile-only checks of the decode and verify kernels' low-precision variants
(tests/kernels/_lowprec_kernels.py) for sm_90a, sm_100a and sm_103a: every variant builds for the
target without local memory, rounds to nearest with the hardware conversions (fp16 / E4M3 writes,
E4M3 reads; E2M1 reads on sm_100a / sm_103a) and stochastically with the software generator (two
fmix32 multiplies) where it writes a low-precision checkpoint; verify kernels load their entry tile
with TMA; the table's plan and commit advance the SR write counter."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_low_precision_variants_compile_for_every_target(arch, tmp_path):
    from tests.kernels._lowprec_kernels import GDN, GDN_VERIFY, MAMBA2, MAMBA2_VERIFY

    env = dict(os.environ, CUTE_DSL_ARCH=arch, REPLAYSSM_CUTE_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(HERE / "_lowprec_kernels.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("compiled") == len(MAMBA2) + len(GDN) + len(MAMBA2_VERIFY) + len(GDN_VERIFY) + 2
    commit = (tmp_path / "commit_fp16_None_sr.ptx").read_text()
    assert commit.count("st.global") == 4, "commit: h (either branch), origin and the SR counter"
    plan = (tmp_path / "plan_fp16_None_sr.ptx").read_text()
    assert plan.count("st.global.v4.b32") == 1, "plan: a row's four columns in one 16-byte store"
    assert plan.count("st.global") == 3, "plan: the plan row, h and the SR counter"
    for path in tmp_path.glob("*.ptx"):
        ptx, name = path.read_text(), path.stem
        if name.startswith(("commit", "plan")):
            assert re.search(rf"^\.target {arch}\b", ptx, re.M) and ".local" not in ptx, name
            continue
        if "verify" in name:
            assert "cp.async.bulk.tensor" in ptx and "mma.sync.aligned.m16n8k8" in ptx, name
        assert re.search(rf"^\.target {arch}\b", ptx, re.M), name
        assert ".local" not in ptx, name
        ckpt, read = name.split("_")[1:3]
        if read in ("fp16", "fp8"):
            assert "cvt.rn.f16.f32" in ptx if read == "fp16" else "cvt.rn.f16x2.e4m3x2" in ptx, name
        if read == "fp8" or ckpt == "fp8":
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx or ckpt == "fp8", name
        if ckpt != "fp32":  # SR into the checkpoint: the counter-based bits
            assert ptx.count("mul.lo.s32") + ptx.count("mul.lo.u32") >= 4, name
        if "nvfp4" in (ckpt, read):
            assert "max.NaN.f32" in ptx, name  # the whole-state amax
            # E2M1 decodes by the hardware conversion where the target has it, else in software
            assert ("cvt.rn.f16x2.e2m1x2" in ptx) == (arch != "sm_90a"), name
        if name.endswith("rederive"):
            assert "bar.sync" in ptx, name  # the CTA shares the keys' Gram matrix
