"""The demo's no-GPU path, end to end in a subprocess (CPU only: skipped when a GPU is present),
its argument checks, and the launch-config lookup it reports (runtime.launch.picked_config)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import repo_pythonpath


def _run_demo(tmp_path, *args, timeout=300):
    env = dict(os.environ)
    env["PYTHONPATH"] = repo_pythonpath(env)
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
    # The launch configs decode would pick (batch 8 is in the small-batch bucket), no GPU: defaults.
    assert "launch configs decode would pick on a GPU at batch 8 (bf16 activations):" in r.stdout, log
    # The pipelined decode on sm_90a's 132 SMs: two CTAs per SM, as many stages as fit in half an SM
    # (the conventional step folds on CUDA cores).
    rest = ("prefetch=4, min_ctas_per_sm=0, rows_per_warp=16, consumer_groups=1, flush_tile=False, heads_per_item=1): "
            "analytical default (no GPU")
    for config in (f"mamba2_decode (stages=3, ctas=264, mma_fold=False, {rest}",
                   f"mamba2_decode (stages=2, ctas=264, mma_fold=True, {rest}"):
        assert r.stdout.count(config) == 1, log  # the conventional step, then ReplaySSM
    assert "looser tolerance" not in r.stdout, log  # the GDN note only
    # Every kernel was compiled into the (fresh) disk cache.
    from replayssm_cute.models import get_model
    from replayssm_cute.precompile import variants

    labels = [lb for lb, _, _ in variants(get_model("nemotron-super"), 16, ["bf16"])]
    assert len(list((tmp_path / "cache").glob("mamba2_decode-*.o"))) == len(labels), log


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
    # Why ReplaySSM's GDN errors are larger than the conventional step's, in one line.
    assert "why GDN ReplaySSM has a looser tolerance: its ring stores each token's correction u in fp16" \
           in r.stdout, log
    # the conventional step on the tile kernel, ReplaySSM (batch 8) on the pipelined one: whole heads, the
    # most stages that fit
    for config in ("gdn_decode (rows_per_cta=8, num_warps=2, min_ctas_per_sm=0): analytical default",
                   "gdn_decode (stages=3, ctas=132, rows_per_item=128, rows_per_warp=16, prefetch=4, consumer_groups=1, "
                   "min_ctas_per_sm=0, mma_dots=True, mma_flush=True, heads_per_item=1, row_lanes=32): analytical default"):
        assert r.stdout.count(config) == 1, log
    assert "summary: all checks passed" in r.stdout, log
    assert "FAILED" not in r.stdout, log
    from replayssm_cute.models import get_model
    from replayssm_cute.precompile import variants

    labels = [lb for lb, _, _ in variants(get_model("qwen3.5-4b").shard(2), 8, ["bf16"])]
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


@pytest.mark.parametrize("args, message", [
    (["--model", "nemotron-super", "--window", "40"], "--window must be in 2..32, got 40"),
    (["--model", "qwen3.5-4b", "--window", "1"], "--window must be in 2..32, got 1"),
    (["--model", "nemotron-super", "--batch", "0"], "--batch must be >= 1, got 0"),
    (["--model", "nemotron-super", "--windows", "0"], "--windows must be >= 1, got 0"),
])
def test_demo_rejects_bad_arguments_before_running(tmp_path, args, message):
    """Bad arguments: exit status 2 and one line on stderr, before any check or compile runs."""
    r = _run_demo(tmp_path, *args, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith(f"demo: {message}"), r.stderr
    assert r.stdout == "", r.stdout
    assert not (tmp_path / "cache").exists()


# ----------------------------------------------------------------------- runtime.launch.picked_config

_TUNED = {  # a launch config each kernel's check takes at the shapes below, not the default
    "mamba2_decode": {"rows_per_cta": 32, "num_warps": 2, "min_ctas_per_sm": 4},
    "gdn_decode": {"rows_per_cta": 32, "num_warps": 2, "min_ctas_per_sm": 4},
    "mamba2_verify": {"rows_per_cta": 32, "num_warps": 2, "min_ctas_per_sm": 0},
    "gdn_verify": {"rows_per_cta": 64, "num_warps": 4, "min_ctas_per_sm": 0},
}


def _cache_and_inputs(kernel):
    from replayssm_cute.cache import GDNCache, Mamba2Cache

    if kernel.startswith("mamba2"):
        cache = Mamba2Cache(4, 4, 64, 128, 1, window=16, max_draft=4, dtype=torch.bfloat16, device="cpu")
        return cache, (torch.bfloat16, True, False, True, True)
    cache = GDNCache(4, 4, 128, 128, 2, window=16, max_draft=4, dtype=torch.bfloat16, device="cpu")
    return cache, (torch.bfloat16, torch.float32, torch.float32, None)


@pytest.mark.usefixtures("tile_decode")  # tuned configs are the tile kernels'
@pytest.mark.parametrize("tuned", ["none", "valid", "rejected"])
@pytest.mark.parametrize("kernel", sorted(_TUNED))
def test_picked_config_is_what_the_kernel_lookup_picks(monkeypatch, kernel, tuned):
    """picked_config agrees with the config the launcher compiles (compiles stubbed out), with no
    tuned entry, a tuned entry the kernel takes, and one its check rejects."""
    import replayssm_cute.kernels.gdn.decode as gdn_decode
    import replayssm_cute.kernels.gdn.verify as gdn_verify
    import replayssm_cute.kernels.mamba2.decode as mamba2_decode
    import replayssm_cute.kernels.mamba2.verify as mamba2_verify
    from replayssm_cute.layers import LAYERS
    from replayssm_cute.runtime import launch, tuning

    fields = {"none": None, "valid": _TUNED[kernel],
              "rejected": {"rows_per_cta": 48, "num_warps": 2, "min_ctas_per_sm": 0}}[tuned]
    asked = []

    def tuned_fields(name, shape, num_drafts, bucket, platform):
        asked.append((name, num_drafts, bucket))
        return None if fields is None else dict(fields)

    monkeypatch.setattr(tuning, "tuned_fields", tuned_fields)
    monkeypatch.setattr(launch, "_launchers", {})
    monkeypatch.setattr(launch.compile_cache, "get_compiled", lambda name, key, build: build())
    monkeypatch.setattr(launch.compile_cache, "compile_options", lambda: None)
    for module, name in ((mamba2_decode, "compile_decode"), (gdn_decode, "compile_decode"),
                         (mamba2_verify, "compile_verify"), (gdn_verify, "compile_verify")):
        monkeypatch.setattr(module, name, lambda shape, config, *rest: config)

    cache, inputs = _cache_and_inputs(kernel)
    batch, drafts = 200, (4 if kernel.endswith("verify") else 0)
    layer_name, op = kernel.split("_")
    layer = LAYERS[layer_name]
    shape = layer.shape(cache, inputs)
    compiled = launch.launcher(getattr(layer, f"{op}_kernel"), shape, drafts, batch)
    config, is_tuned = launch.picked_config(getattr(layer, f"{op}_kernel"), shape, batch, drafts)
    assert config == compiled
    assert is_tuned == (tuned == "valid")
    if tuned == "valid":
        assert {f: getattr(config, f) for f in fields} == fields
    assert asked == [(kernel, drafts, 256)] * 2

def test_picked_config_of_a_kernel_with_no_tuned_configs_is_its_default(monkeypatch):
    """The kernel the old name lookup refused ('mamba2_snapshot', no tuned configs): picked_config
    now takes the Kernel itself, so none is unknown; for one outside tuning.KERNELS it is the
    analytical default, never a tuned one, and the tuned files are not asked."""
    from replayssm_cute.kernels.mamba2.defaults import default_mamba2_snapshot_config
    from replayssm_cute.layers import Mamba2Layer
    from replayssm_cute.runtime import launch, tuning

    monkeypatch.setattr(tuning, "tuned_fields", lambda *args: pytest.fail("tuned configs asked"))
    cache, inputs = _cache_and_inputs("mamba2_decode")
    shape = Mamba2Layer.shape(cache, inputs)
    assert Mamba2Layer.snapshot_kernel.name == "mamba2_snapshot" and "mamba2_snapshot" not in tuning.KERNELS
    for batch, bucket in ((8, 8), (200, 256)):
        assert launch.picked_config(Mamba2Layer.snapshot_kernel, shape, batch, 4) == (
            default_mamba2_snapshot_config(shape.headdim, bucket), False)



@pytest.mark.usefixtures("tile_decode")  # tuned configs are the tile kernels'
def test_launch_config_line_says_where_the_config_came_from(monkeypatch, tmp_path):
    """What the demo prints per kernel: the config, then tuned (which file) or the default."""
    from replayssm_cute import demo
    from replayssm_cute.runtime import tuning

    import torch

    from replayssm_cute.models import get_model

    cache, _ = _cache_and_inputs("mamba2_decode")
    layer = demo._DemoLayer(get_model("nemotron-super"), torch.Generator(), "cpu")
    user = tmp_path / "tuned.json"
    monkeypatch.setenv(tuning.ENV_USER_FILE, str(user))
    monkeypatch.delenv(tuning.ENV_DISABLE, raising=False)
    monkeypatch.setattr(tuning, "tuned_fields", lambda *args: dict(_TUNED["mamba2_decode"]))
    tuned = "mamba2_decode (rows_per_cta=32, num_warps=2, min_ctas_per_sm=4): tuned "
    assert demo.launch_config_line(layer, cache, 200, gpu=True) == tuned + "(H200 file)"
    user.write_text("{}")
    assert demo.launch_config_line(layer, cache, 200, gpu=True) == tuned + f"(H200 file or {user})"

    monkeypatch.setattr(tuning, "tuned_fields", lambda *args: None)
    default = "mamba2_decode (rows_per_cta=64, num_warps=4, min_ctas_per_sm=4): analytical default"
    assert demo.launch_config_line(layer, cache, 200, gpu=True) == default
    assert demo.launch_config_line(layer, cache, 200, gpu=False).startswith(default + " (no GPU")
    monkeypatch.setenv(tuning.ENV_DISABLE, "0")
    assert demo.launch_config_line(layer, cache, 200, gpu=True) == \
        default + " (REPLAYSSM_CUTE_TUNED=0)"
