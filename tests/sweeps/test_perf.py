"""perf.py and sweeps/bench_decode.py on the CPU: ideal bytes (hand-computed), the candidate launch
configs, the pools' inputs and kernel shapes, the CLI (help, no-GPU message, compile-only)."""

import pytest
import torch

from replayssm_cute.runtime import launch
from replayssm_cute.models import ModelSpec, get_model
from replayssm_cute.perf import DecodePool, bench_layer, ideal_bytes

from tests.helpers.sweeps import TINY, assert_needs_gpu_or_arch, assert_usage_errors, load, run


def _bench():
    return load("bench_decode")


def _run(args, **env):
    return run("bench_decode", args, **env)


# ------------------------------------------------------------------------------------ ideal bytes


def test_ideal_bytes_gdn_qwen35_122b():
    # HV 64, V 128, K 128, H 16: S = 64*128*128*4 = 4194304, e = 64*128*2 + 16*128*2 + 64*4 = 20736,
    # act = 2*16*128*2 + 2*64*128*2 + 2*64*2 = 41216; batch 256, L = 16.
    got = ideal_bytes(get_model("qwen3.5-122b"), 256, 16)
    assert got["conventional"] == 256 * (2 * 4194304 + 41216) == 2158034944
    # S + S/16 + 20736*15/2 + 20736*15/16 + 41216 = 4194304 + 262144 + 155520 + 19440 + 41216
    assert got["window_mean"] == 256 * 4672624 == 1196191744
    # 2S + 15e + act = 8388608 + 311040 + 41216
    assert got["flush"] == 256 * 8740864 == 2237661184
    # S + 7e + e + act = 4194304 + 145152 + 20736 + 41216
    assert got["nonflush_mean"] == 256 * 4401408 == 1126760448
    # the window mean is the mean of its L - 1 non-flush steps and its flush
    assert got["window_mean"] == pytest.approx((15 * got["nonflush_mean"] + got["flush"]) / 16)


def test_ideal_bytes_gdn_qwen35_4b_per_row():
    # HV 32: S = 2097152, e = 8192 + 4096 + 128 = 12416, act = 8192 + 16384 + 128 = 24704
    got = ideal_bytes(get_model("qwen3.5-4b"), 1, 16)
    assert got["conventional"] == 2 * 2097152 + 24704
    assert got["flush"] == 2 * 2097152 + 15 * 12416 + 24704


def test_ideal_bytes_mamba2_unchanged():
    # Nemotron-3-Super, batch 1 (the figures behind sweeps/results/decode_h200.csv):
    # S = 4194304, e = 16384 + 2048 + 512 = 18944, act = 32768 + 4096 + 256 = 37120.
    got = ideal_bytes(get_model("nemotron-super"), 1, 16)
    assert got == {"conventional": 8425728, "window_mean": 4653408.0, "flush": 8709888,
                   "nonflush_mean": 4382976.0}


def test_ideal_bytes_unknown_layer():
    with pytest.raises(ValueError, match="unknown layer type 'rwkv'"):
        ideal_bytes(ModelSpec("x", "rwkv", 4, 16, 16, 2, 1), 1, 16)


# ------------------------------------------------------------------------------ candidate configs

BATCHES = (1, 16, 17, 32, 64, 128, 256, 512)
GDN_SMALL = {(16, 4), (8, 2), (16, 2)}
GDN_LARGE = {(16, 4), (32, 4), (32, 2), (64, 4), (64, 8), (32, 8), (128, 8)}


@pytest.mark.parametrize("name", ["nemotron-super", "nemotron-nano-4b", "qwen3.5-4b", "qwen3.5-122b"])
def test_candidate_configs_valid(name):
    bench = _bench()
    model = get_model(name)
    assert name in bench.DEFAULT_MODELS.split(",")
    layer = bench_layer(model)
    shapes = [layer.kernel_shape(model, w) for w in (1, 16)]
    for batch in BATCHES:
        full = bench.candidate_configs(model, batch, 16)
        quick = bench.candidate_configs(model, batch, 16, quick=True)
        assert full and quick and len(quick) <= 2 and quick == full[:len(quick)]
        assert len(set(full)) == len(full)
        for cfg in full:
            # decode's default may be the pipelined kernel's config (sm_90a), the grid the tile kernel's
            assert type(cfg).__name__ in (("GDNConfig", "GDNPipeConfig") if model.layer == "gdn"
                                          else ("Mamba2Config", "Mamba2PipeConfig"))
            for shape in shapes:
                assert cfg.check(shape) is None, (name, batch, cfg)
        defaults = [layer.default_config(model, batch, w) for w in (16, 1)]
        assert quick[0] == defaults[0] and set(defaults) <= set(full)  # what decode() would pick
        if model.layer == "gdn":  # every listed config is valid at these shapes
            listed = {layer.config(r, w) for r, w in (GDN_SMALL if batch <= 16 else GDN_LARGE)}
            assert set(full) == listed | set(defaults)


def test_compile_jobs_cover_both_windows():
    bench = _bench()
    model = get_model("qwen3.5-4b")
    jobs = bench.compile_jobs([model], [1, 256], 16, quick=False)
    configs = set(bench.candidate_configs(model, 1)) | set(bench.candidate_configs(model, 256))
    assert len(configs) >= len(GDN_SMALL | GDN_LARGE)
    assert len(jobs) == len(set(jobs)) == 2 * len(configs)
    assert {w for _, w, _ in jobs} == {1, 16}


# ------------------------------------------------------------------------------ pools (CPU)

@pytest.mark.parametrize("layer", ["gdn", "mamba2"])
def test_pool_steps_whole_windows(layer):
    """The pool's inputs pass decode()'s checks and step through the reference: a window brings
    every staggered cursor back where it was, a flush step leaves every cursor at 0."""
    pool = DecodePool(TINY[layer], 3, 4, stagger=True, device="cpu", rotation_bytes=1)
    assert pool.nsets == 2 and pool.cache.num_slots == 6
    start = pool.cache.cursor.clone()
    assert start.tolist() == [0, 1, 2, 0, 1, 2]
    fn, launches = pool.window_fn()
    assert launches == 8
    fn()
    assert torch.equal(pool.cache.cursor, start)
    assert torch.isfinite(pool.out.float()).all() and pool.out.float().abs().sum() > 0
    fn, launches = pool.flush_fn()
    assert launches == 2
    fn()
    assert pool.cache.cursor.tolist() == [0] * 6


def test_gdn_pool_is_realistic():
    pool = DecodePool(get_model("qwen3.5-4b").shard(8), 2, 16, device="cpu", rotation_bytes=1)
    c = pool.cache
    norms = c.ring_k.float().norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-2)  # stored keys are normalised
    assert (c.ring_g < 0).all() and (c.ring_g > -3).all()
    decay = c.ring_g.exp()  # 2 sets x 2 rows x 16 records x 4 heads
    assert 0.6 < decay.median() < 0.95 and (decay > 0.5).float().mean() > 0.8
    inp = pool.inputs
    A_log, dt_bias = inp["A_log"], inp["dt_bias"]
    assert ((A_log >= 0) & (A_log <= torch.log(torch.tensor(16.0)))).all()
    assert ((dt_bias >= -4) & (dt_bias <= -3)).all()
    g = -A_log.exp() * torch.nn.functional.softplus(inp["a"].float() + dt_bias)
    assert (g < 0).all() and 0.5 < g.exp().median() < 1
    for name in ("q", "k", "v", "a", "b"):
        assert inp[name].dtype == torch.bfloat16 and inp[name].float().std() > 0.1, name


@pytest.mark.parametrize("layer", ["gdn", "mamba2"])
@pytest.mark.parametrize("window", [1, 16])
def test_pool_kernel_shape_is_what_decode_asks_for(layer, window, monkeypatch):
    """bench_decode precompiles layer.kernel_shape(model, window): the kernel the pool's decode()
    calls must be that one, or the timed run would compile (or miss the disk cache)."""
    model = TINY[layer]
    pool = DecodePool(model, 2, window, device="cpu", rotation_bytes=1)
    seen = []
    monkeypatch.setattr(launch, "_launchers", {})
    monkeypatch.setattr(launch, "compiled", lambda kernel, shape, cfg, num_drafts: seen.append(shape))
    inp, cfg = pool.inputs, bench_layer(model).config(16, 4)
    host = bench_layer(model).host
    if layer == "gdn":  # what GDNLayer.static_inputs takes from the pool's decode() arguments
        static = (inp["a"].dtype, inp["A_log"].dtype, inp["dt_bias"].dtype, None)
    else:  # what Mamba2Layer.static_inputs takes from them
        static = (inp["dt"].dtype, True, False, True, inp["dt_softplus"])
    launch.launcher(host.decode_kernel, host.shape(pool.cache, static), 0, 2, cfg)
    assert seen == [bench_layer(model).kernel_shape(model, window)]


# ------------------------------------------------------------------------------------ the CLI


def test_help():
    proc = _run(["--help"])
    assert proc.returncode == 0, proc.stderr
    for flag in ("--models", "--layers", "--batch", "--quick", "--compile-only", "qwen3.5-122b"):
        assert flag in proc.stdout


def test_no_gpu_message_and_compile_only_needs_an_arch():
    assert_needs_gpu_or_arch("bench_decode")


def test_bad_arguments():
    assert_usage_errors("bench_decode", (
        (["--models", "qwen9"], "unknown model 'qwen9'"),
        (["--layers", "rwkv"], "unknown layer types"),
        (["--layers", "gdn", "--models", "nemotron-super"], "no model of layer type gdn"),
        (["--batch", "1,x"], "--batch"),
        (["--window", "1"], "--window")))


def test_compile_only_builds_gdn_candidates(tmp_path):
    """The compile part of the benchmark on the CPU: the quick GDN candidates at batch 1 (two
    configs, conventional and ReplaySSM) build in worker processes into the disk cache."""
    proc = _run(["--compile-only", "--quick", "--models", "qwen3.5-4b", "--batch", "1", "--workers", "2"],
                CUDA_VISIBLE_DEVICES="", CUTE_DSL_ARCH="sm_90a", REPLAYSSM_CUTE_CACHE_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4 kernels for sm_90a" in proc.stdout
    assert len(list(tmp_path.glob("gdn_decode-*.o"))) == 4
