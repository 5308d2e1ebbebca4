"""sweeps/bench_verify.py and its perf.py helpers on the CPU: ideal bytes of a verify step
(hand-computed), the cursor cycle (against the reference verify + commit), the pools of verify
and of the snapshot baseline, their configs and kernel keys, the skip of a layer verify() does
not take, the CLI (help, no-GPU message, errors, compile-only)."""

import pytest
import torch

from replayssm_cute.runtime import compile_cache
from replayssm_cute.runtime import launch
from replayssm_cute.models import get_model
from replayssm_cute.perf import DecodePool, bench_layer, cursor_cycle, verify_ideal_bytes
from replayssm_cute.reference import gdn_snapshot_verify, mamba2_snapshot_verify, spec_flush

from tests.helpers.sweeps import TINY, assert_needs_gpu_or_arch, assert_usage_errors, load, run


def _bench():
    return load("bench_verify")


def _run(args, **env):
    return run("bench_verify", args, timeout=900, **env)


# ------------------------------------------------------------------------------------ ideal bytes


def test_verify_ideal_bytes_mamba2_t8():
    # Nemotron-3-Super, batch 1, L = 16, T = 8: S = 4194304, e = 18944, act = 37120 per token.
    m = get_model("nemotron-super")
    # a = 1: h = 1..9, the step at h = 9 flushes (9 + 8 > 16). Per step S + (h + 8) e + 8 act,
    # plus S at the flush: 10 S + (45 + 72) e + 72 act over 9 steps.
    got = verify_ideal_bytes(m, 1, 16, 8, 1)
    assert got["verify"] == pytest.approx((10 * 4194304 + 117 * 18944 + 72 * 37120) / 9)
    assert got["verify"] == pytest.approx(46832128 / 9)
    # a = 8: h = 8 (S + 16 e + 8 act), then h = 16 flushes (2 S + 24 e + 8 act).
    got = verify_ideal_bytes(m, 1, 16, 8, 8)
    assert got["verify"] == (3 * 4194304 + 40 * 18944 + 16 * 37120) / 2 == 6967296
    assert got["conventional"] == 2 * 4194304 + 37120 == 8425728
    # snapshot: (1 + 8) S + S + 8 act; its snapshot_verify alone (no commit) (1 + 8) S + 8 act
    assert got["snapshot"] == 10 * 4194304 + 8 * 37120 == 42240000
    assert got["snapshot_kernel"] == 9 * 4194304 + 8 * 37120


def test_verify_ideal_bytes_gdn_t4_batch256():
    # Qwen3.5-122B: S = 4194304, e = 20736, act = 41216; T = a = 4: h = 4, 8, 12 and the flush
    # at 16: 5 S + (8 + 12 + 16 + 20) e + 16 act over 4 steps.
    got = verify_ideal_bytes(get_model("qwen3.5-122b"), 256, 16, 4, 4)
    assert got["verify"] == 256 * (5 * 4194304 + 56 * 20736 + 16 * 41216) / 4 == 256 * 5698048
    assert got["conventional"] == 256 * (2 * 4194304 + 41216) == 2158034944
    assert got["snapshot"] == 256 * (6 * 4194304 + 4 * 41216) == 6484656128


def test_verify_ideal_bytes_scale_with_batch():
    m = get_model("nemotron-super")
    one, many = verify_ideal_bytes(m, 1, 16, 6, 1), verify_ideal_bytes(m, 512, 16, 6, 1)
    assert many == pytest.approx({k: 512 * v for k, v in one.items()})


# ------------------------------------------------------------------------------------ cursor cycle


@pytest.mark.parametrize("L,T,a,cycle", [
    (16, 8, 8, [8, 16]),
    (16, 8, 1, list(range(1, 10))),
    (16, 6, 6, [6, 12]),
    (16, 4, 4, [4, 8, 12, 16]),
    (16, 2, 1, list(range(1, 16))),
    (16, 16, 16, [16]),
    (16, 5, 3, [3, 6, 9, 12]),
])
def test_cursor_cycle_by_hand(L, T, a, cycle):
    assert cursor_cycle(L, T, a) == cycle


@pytest.mark.parametrize("L", [2, 8, 16])
def test_cursor_cycle_properties(L):
    """Every period starts at a, holds exactly one flush, its last step, never more than L
    committed records, and comes back to its start; bench_verify runs whole periods."""
    steps_per_set = _bench().steps_per_set
    for T in range(1, min(16, L) + 1):
        for a in range(1, T + 1):
            cycle = cursor_cycle(L, T, a)
            flushes = [spec_flush(h, T, L) for h in cycle]
            assert cycle[0] == a and flushes == [False] * (len(cycle) - 1) + [True], (T, a, cycle)
            assert all(0 < h <= L for h in cycle)
            h = cycle[0]
            for expected in cycle:
                assert h == expected
                h = a if spec_flush(h, T, L) else h + a
            assert h == cycle[0]
            n = steps_per_set(L, T, a)
            assert n >= L and n % len(cycle) == 0 and n < L + len(cycle)


@pytest.mark.parametrize("L,T,a", [(16, 0, 1), (16, 4, 0), (16, 4, 5), (8, 9, 1)])
def test_cursor_cycle_rejects(L, T, a):
    with pytest.raises(ValueError, match="cursor_cycle"):
        cursor_cycle(L, T, a)


@pytest.mark.parametrize("layer", ["mamba2", "gdn"])
def test_pool_verify_follows_the_cycle(layer):
    """The pool's verify + commit steps through the float64 reference: the cursors take the
    cycle's values one step after another, the flush (the period's last step) moves the origin
    past the folded records, and a whole period brings every cursor back to its start."""
    L, T = 8, 3
    for a in (1, T):
        pool = DecodePool(TINY[layer], 2, L, drafts=T, device="cpu", rotation_bytes=1)
        c = pool.cache
        assert pool.nsets == 2 and c.capacity == L + T and pool.inputs["out"].shape[:2] == (2, T)
        cycle = cursor_cycle(L, T, a)
        c.cursor.fill_(cycle[0])
        step, launches = pool.verify_fn(a, 1)
        assert launches == 2
        for i, h in enumerate(cycle):
            assert c.cursor.tolist() == [h] * 4
            origin = c.origin.clone()
            try:
                step()
            except NotImplementedError:
                pytest.skip(f"verify() does not take a {type(c).__name__} yet")
            moved = (origin + h) % c.capacity if i == len(cycle) - 1 else origin
            assert torch.equal(c.origin, moved)
        assert c.cursor.tolist() == [cycle[0]] * 4
        assert torch.isfinite(pool.out.float()).all() and pool.out.float().abs().sum() > 0
        period, launches = pool.verify_fn(a, len(cycle))
        assert launches == 2 * len(cycle)
        period()
        assert c.cursor.tolist() == [cycle[0]] * 4


# ------------------------------------------------------------------------------ configs and keys


@pytest.mark.parametrize("name", ["nemotron-super", "qwen3.5-122b"])
@pytest.mark.parametrize("window", [16, 1])
def test_speculative_configs_valid(name, window):
    """Verify (window 16) and the snapshot baseline (window 1): the API's default first (None
    where it picks inline), every other config one the kernel takes."""
    bench = _bench()
    model = get_model(name)
    assert name in bench.DEFAULT_MODELS.split(",")
    layer = bench_layer(model)
    for batch in (1, 16, 17, 64, 256, 512):
        for T in (2, 4, 6, 8):
            full = bench.speculative_configs(model, batch, T, window)
            quick = bench.speculative_configs(model, batch, T, window, quick=True)
            assert full and quick == full[:len(quick)] and len(quick) <= 2 and len(full) <= bench.VERIFY_CANDIDATES
            assert full[0] == layer.default_speculative_config(model, batch, window, T)
            assert (full[0] is None) == (window == 1)  # snapshot_verify picks its default inline
            assert len(set(full)) == len(full)
            assert all(layer.speculative_check(model, window, T, c) is None for c in full[1:])


@pytest.mark.parametrize("name", ["nemotron-super", "qwen3.5-122b"])
def test_compile_jobs(name):
    """Conventional steps, verify and snapshot baseline per (T, config) and the commits."""
    bench = _bench()
    m = get_model(name)
    jobs = bench.compile_jobs([m], [64, 256], [4, 8], 16, quick=True)
    assert len(jobs) == len(set(jobs))
    conv = {c for mm, w, T, c, b in jobs if mm is m and w == 1 and T == 0}
    assert conv == set(bench.candidate_configs(m, 64, 16, quick=True))
    for T in (4, 8):
        for w in (16, 1):
            want = {(c, 17 if c is None else 0) for b in (64, 256) for c in bench.speculative_configs(m, b, T, w, True)}
            assert {(c, b) for mm, ww, t, c, b in jobs if mm is m and ww == w and t == T} == want
    assert {(w, T) for mm, w, T, c, b in jobs if mm is None} == {(16, 4), (16, 8)}  # the commits


@pytest.mark.parametrize("layer,window", [("mamba2", 8), ("gdn", 8), ("mamba2", 1), ("gdn", 1)])
def test_speculative_kernel_is_what_the_api_asks_for(layer, window, monkeypatch):
    """bench_verify precompiles layer.speculative_kernel on a meta cache of the model: the kernel
    that verify() (window > 1) or snapshot_verify() (window 1) looks up for the pool's inputs,
    with the arguments api.py passes, must be that one, at an explicit config and at the API's
    default."""
    model = TINY[layer]
    blayer = bench_layer(model)
    keys = []
    monkeypatch.setattr(compile_cache, "get_compiled", lambda name, key, build: keys.append((name, key)))
    T = 4
    pool = DecodePool(model, 2, window, drafts=T, device="cpu", rotation_bytes=1)
    inp = pool.inputs
    host = blayer.host
    api_kernel = host.verify_kernel if window > 1 else host.snapshot_kernel
    if layer == "gdn":  # what GDNLayer.static_inputs takes from the pool's verify() arguments
        args = (inp["a"].dtype, inp["A_log"].dtype, inp["dt_bias"].dtype, None)
    else:  # what Mamba2Layer.static_inputs takes from them
        args = (inp["dt"].dtype, True, False, True, inp["dt_softplus"])
    explicit = blayer.config(16, 1) if window > 1 else blayer.config(16, 4)  # verify: 16 rows per warp
    for cfg in (explicit, None):
        for kernel in (lambda: launch.launcher(api_kernel, host.shape(pool.cache, args), T, 2, cfg),
                       lambda: blayer.speculative_kernel(blayer.cache(model, 1, window, "meta", T), T, 2, cfg)):
            monkeypatch.setattr(launch, "_launchers", {})
            kernel()
    name = f"{layer}_{'verify' if window > 1 else 'snapshot'}"
    assert len(keys) == 4 and keys[0] == keys[1] and keys[2] == keys[3] and keys[0][0] == keys[2][0] == name


def test_slot_memory():
    """Checkpoint + ring of L + T records + three int32 indices against (T + 1) states."""
    bench = _bench()
    S, e = 128 * 64 * 128 * 4, 128 * 64 * 2 + 8 * 128 * 2 + 128 * 4
    assert bench.slot_memory(get_model("nemotron-super"), 16, 8) == (S + 24 * e + 12, 9 * S)


@pytest.mark.parametrize("layer", ["mamba2", "gdn"])
def test_pool_snapshot_fn(layer):
    """The snapshot baseline's pool (window 1, T drafts) runs snapshot_verify() through the
    reference on every set: the snapshots of the last set hold the states after each draft, and
    the conventional cache is not written."""
    pool = DecodePool(TINY[layer], 2, 1, drafts=3, device="cpu", rotation_bytes=1)
    inp = pool.inputs
    assert pool.cache.max_draft == 0 and inp["out"].shape[:2] == (2, 3)
    before = pool.cache.checkpoint.clone()
    fn, launches = pool.snapshot_fn()
    assert launches == 2
    fn()
    assert torch.equal(pool.cache.checkpoint, before)
    assert len(pool.snapshots) == 1  # rotation_bytes=1: one buffer serves both sets
    if layer == "gdn":
        y, want = gdn_snapshot_verify(before[2:], *(inp[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias")))
    else:
        y, want = mamba2_snapshot_verify(before[2:], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"],
                                         None, inp["dt_bias"], True)
    torch.testing.assert_close(pool.snapshots[0].double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool.out.double(), y, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------ unsupported layers


def test_verify_unsupported_is_the_not_implemented_error(monkeypatch):
    bench = _bench()
    from replayssm_cute import api

    assert bench.verify_unsupported(get_model("nemotron-super")) is None  # its argument check fails

    def not_yet(cache, *args, **kwargs):
        raise NotImplementedError("verify: GDN caches are not supported yet")

    monkeypatch.setattr(api, "verify", not_yet)
    assert bench.verify_unsupported(get_model("qwen3.5-122b")) == "verify: GDN caches are not supported yet"


def test_unsupported_layer_is_skipped_with_a_note(monkeypatch, capsys, tmp_path):
    bench = _bench()
    from replayssm_cute import api

    def not_yet(cache, *args, **kwargs):
        raise NotImplementedError("not yet")

    monkeypatch.setattr(api, "verify", not_yet)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("REPLAYSSM_CUTE_CACHE_DIR", str(tmp_path))
    assert bench.main(["--compile-only", "--layers", "gdn"]) == 0
    out = capsys.readouterr().out
    assert "qwen3.5-122b (gdn): skipped, replayssm_cute.verify does not take its cache yet (not yet)" in out
    assert "no model left to measure" in out and "kernels for" not in out
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------ the CLI


def test_help():
    proc = _run(["--help"], COLUMNS="200")  # one line per option
    assert proc.returncode == 0, proc.stderr
    for flag in ("--models", "--layers", "--batch", "--drafts", "--window", "--quick", "--out",
                 "--compile-only", "nemotron-super,qwen3.5-122b", "1,64,256,512", "2,4,6,8",
                 "verify_<device>_<date>.csv"):
        assert flag in proc.stdout, flag


def test_no_gpu_message_and_compile_only_needs_an_arch():
    assert_needs_gpu_or_arch("bench_verify")


def test_bad_arguments():
    assert_usage_errors("bench_verify", (
        (["--drafts", "2,x"], "--drafts"),
        (["--drafts", "0"], "--drafts"),
        (["--window", "8", "--drafts", "9"], "T must be in 1..min(16, window 8)"),
        (["--drafts", "17", "--window", "32"], "T must be in 1..min(16, window 32)"),
        (["--models", "qwen9"], "unknown model 'qwen9'"),
        (["--batch", "0"], "--batch")))


def test_compile_only_builds_on_cpu(tmp_path):
    """The compile part of the quick run on the CPU (Mamba-2 only, to keep it short): the
    conventional steps, the verify and snapshot-baseline kernels of T = 4 and 8 at two configs
    each, and the sequence-table kernels of both draft caches build in worker processes into the disk cache; the memory per slot
    and the snapshot note are printed."""
    proc = _run(["--compile-only", "--quick", "--layers", "mamba2", "--workers", "2"],
                CUDA_VISIBLE_DEVICES="", CUTE_DSL_ARCH="sm_90a", REPLAYSSM_CUTE_CACHE_DIR=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "12 kernels for sm_90a" in proc.stdout, proc.stdout
    assert "nemotron-super T=8: checkpoint + ring of L + T = 24 records" in proc.stdout
    assert "snapshot baseline measured" in proc.stdout
    assert len(list(tmp_path.glob("mamba2_decode-*.o"))) == 2
    assert len(list(tmp_path.glob("mamba2_verify-*.o"))) == 4
    assert len(list(tmp_path.glob("mamba2_snapshot-*.o"))) == 4  # (32, 4) default and (16, 4), T = 4 and 8
    assert len(list(tmp_path.glob("table_commit-*.o"))) == 2
    assert len(list(tmp_path.glob("table_plan-*.o"))) == 4  # per T: the decode plan and the verify plan
