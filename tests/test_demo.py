"""The demo's no-GPU path, end to end in a subprocess (CPU only: skipped when a GPU is present)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run_demo(tmp_path, *args, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["REPLAYSSM_CUTE_CACHE_DIR"] = str(tmp_path / "cache")
    env.pop("CUTE_DSL_ARCH", None)  # the demo's own default (sm_90a) is what we check
    return subprocess.run([sys.executable, "-m", "replayssm_cute.demo", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_demo_cpu_path(tmp_path):
    r = _run_demo(tmp_path, "--model", "nemotron-super", "--windows", "2")
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    assert "no CUDA GPU found: running the PyTorch reference path on the CPU and compiling the " \
           "kernels for sm_90a" in r.stdout, log
    assert "summary: all checks passed" in r.stdout, log
    assert "FAILED" not in r.stdout, log
    # Every kernel was compiled into the (fresh) disk cache.
    assert len(list((tmp_path / "cache").glob("mamba2_decode-*.o"))) == 4, log


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_demo_cpu_path_gdn(tmp_path):
    """A GDN model (one tensor-parallel shard, short window to keep the float64 path quick)."""
    r = _run_demo(tmp_path, "--model", "qwen3.5-4b", "--tp", "2", "--window", "8", "--windows", "2")
    log = r.stdout + r.stderr
    assert r.returncode == 0, log
    assert "GDN layer shard HV=16 value heads, V=128, K=128, H=8 key heads" in r.stdout, log
    assert "no CUDA GPU found: running the PyTorch reference path on the CPU and compiling the " \
           "kernels for sm_90a" in r.stdout, log
    assert "check: GDN layer, batch 2, fp32 activations, 7 staggered warm-up steps + 2 windows of 8" \
           in r.stdout, log
    assert "summary: all checks passed" in r.stdout, log
    assert "FAILED" not in r.stdout, log
    from replayssm_cute.models import get_model
    from replayssm_cute.precompile import gdn_variants

    labels = [lb for lb, _, _ in gdn_variants(get_model("qwen3.5-4b").shard(2), 8, ["bf16"])]
    assert f"compile: {len(labels)} kernels for sm_90a" in r.stdout, log
    for label in labels:
        assert label in r.stdout, log
    # Every kernel was compiled into the (fresh) disk cache.
    assert len(list((tmp_path / "cache").glob("gdn_decode-*.o"))) == len(labels), log


def test_demo_rejects_uneven_tp_for_gdn(tmp_path):
    r = _run_demo(tmp_path, "--model", "qwen3.5-4b", "--tp", "32", timeout=120)
    assert r.returncode == 2
    assert "tp=32" in r.stderr and "16 groups" in r.stderr


def test_demo_rejects_unknown_model(tmp_path):
    r = _run_demo(tmp_path, "--model", "no-such-model", timeout=120)
    assert r.returncode != 0
    assert "unknown model 'no-such-model'" in r.stderr
