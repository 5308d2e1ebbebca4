"""sweeps/bench_read_precision.py and its perf.py helpers on the CPU: the byte model (ideal ratios of
the read formats against quant and the cache layout, hand-computed steps, fp32 equal to perf's
ideal bytes), the pools with a read copy (RTN-encoded, non-flush steps that never flush), the
measurement flow through the float64 reference with a fake timer (NotImplementedError and refused
configs become notes), rows, speedups, CSV, table and plot from fake measurements, the compile
jobs, the CLI (arguments, the no-GPU refusal)."""

import csv
import math

import pytest
import torch

from replayssm_cute.runtime import launch
from replayssm_cute import perf
from replayssm_cute import quant
from replayssm_cute.models import get_model
from replayssm_cute.perf import DecodePool, bench_layer, compile_pool_kernel, ideal_bytes, verify_ideal_bytes

from tests.helpers.sweeps import TINY, load, run

# its tests share the module's fixtures: one pytest-xdist worker runs them all (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("bench_read_precision")

SUPER, Q122 = get_model("nemotron-super"), get_model("qwen3.5-122b")
S = 4194304  # fp32 state per sequence at both shapes


@pytest.fixture(scope="module")
def bench():
    return load("bench_read_precision")


def _args(bench, *argv):
    return bench.parse(list(argv))


# ------------------------------------------------------------------------------------ byte model


def test_state_ratios_at_the_model_shapes(bench):
    # per (128 x 128) or (64 x 128) head state: fp32 4 V K; fp16 2 V K; fp8 V K + 4 V (one fp32
    # scale per 128-element row); nvfp4 V K / 2 + V K / 16 (E4M3 per 16) + 4 (fp32 per state)
    for m, V in ((SUPER, 64), (Q122, 128)):
        K = 128
        assert bench.state_bytes(m, "fp32") == S
        assert bench.state_bytes(m, "fp16") == m.nheads * 2 * V * K == S // 2
        assert bench.state_bytes(m, "fp8") == m.nheads * (V * K + 4 * V)
        assert bench.state_bytes(m, "nvfp4") == m.nheads * (V * K // 2 + V * K // 16 + 4)
        assert bench.state_ratio(m, "fp32") == 1 and bench.state_ratio(m, "fp16") == 2
        assert bench.state_ratio(m, "fp8") == pytest.approx(4 * K / (K + 4))  # 3.88x
        assert bench.state_ratio(m, "nvfp4") == pytest.approx(4 * V * K / (V * K // 2 + V * K // 16 + 4))
    assert bench.state_ratio(Q122, "nvfp4") == pytest.approx(65536 / 9220)  # README: 9220 bytes at V = K = 128


@pytest.mark.parametrize("model", [SUPER, Q122, TINY["mamba2"], TINY["gdn"]], ids=lambda m: m.name)
def test_state_bytes_are_the_cache_layout(bench, model):
    """quant.bytes_per_state (fp8 blocks as cache.py picks them: per row at K = 32) equals what the
    cache allocates per slot for the read copy and its scales."""
    for fmt in ("fp16", "fp8", "nvfp4"):
        mem = bench_layer(model).cache(model, 1, 16, "meta", read_copy=fmt).memory_per_slot()
        assert bench.state_bytes(model, fmt) == sum(v for k, v in mem.items() if k.startswith("read_copy")), fmt
    assert bench.state_bytes(model, "fp32") == bench_layer(model).cache(model, 1, 16, "meta").memory_per_slot()[
        "checkpoint"]
    assert perf.quant_format("fp8", 32).block_k == 32 and perf.quant_format("fp8", 256).block_k == 128


@pytest.mark.parametrize("model", [SUPER, Q122, get_model("qwen3.5-4b"), TINY["gdn"]], ids=lambda m: m.name)
@pytest.mark.parametrize("L", [2, 8, 16])
def test_fp32_bytes_are_perfs(bench, model, L):
    """The fp32 read (the plain cache) is perf's byte model: ideal_bytes and verify_ideal_bytes."""
    got = bench.read_ideal_bytes(model, 3, L, "fp32")
    want = ideal_bytes(model, 3, L)
    assert got["nonflush"] == pytest.approx(want["nonflush_mean"])
    for k in ("flush", "window_mean", "conventional"):
        assert got[k] == pytest.approx(want[k]), k
    for T in range(1, min(L, 4) + 1):
        for a in (1, T):
            assert bench.verify_read_ideal_bytes(model, 3, L, T, a, "fp32") == pytest.approx(
                verify_ideal_bytes(model, 3, L, T, a)["verify"])


def test_read_copy_bytes_by_hand(bench):
    # Nemotron-3-Super nvfp4, batch 1, L = 16: R = 128 heads * (64 * 64 + 64 * 8 + 4) = 590336 (the
    # README's read copy), e = 18944, act = 37120. Non-flush mean (h = 7 on average):
    # R + 7 e + e + act; flush: 2 S + R + 15 e + act.
    got = bench.read_ideal_bytes(SUPER, 1, 16, "nvfp4")
    assert got["nonflush"] == 590336 + 8 * 18944 + 37120 == 779008
    assert got["flush"] == 2 * S + 590336 + 15 * 18944 + 37120 == 9300224
    assert got["window_mean"] == pytest.approx((15 * 779008 + 9300224) / 16)
    assert bench.read_ideal_bytes(SUPER, 1, 16, "nvfp4", cursor=3)["nonflush"] == 590336 + 4 * 18944 + 37120
    # Qwen3.5-122B fp8, batch 256: R = 64 * 16896 = 1081344; records read e = 20736 (u, k, g);
    # written e + v (64 * 128 * 2) + beta (64 * 4) = 37376; a re-deriving flush reads k, g, v,
    # beta: 20736 - 16384 + 16640 = 20992 per record; act = 41216.
    z = perf.step_sizes(Q122, "fp8", 16)
    assert (z.S, z.R, z.e, z.e_w, z.e_f, z.act, z.R_w) == (S, 1081344, 20736, 37376, 20992, 41216, 1081344)
    got = bench.read_ideal_bytes(Q122, 256, 16, "fp8")
    assert got["nonflush"] == 256 * (1081344 + 7 * 20736 + 37376 + 41216) == 256 * 1305088
    assert got["flush"] == 256 * (2 * S + 1081344 + 15 * 20992 + 41216) == 256 * 9826048
    # Mamba-2 keeps the same records with a read copy
    z = perf.step_sizes(SUPER, "fp16", 16)
    assert (z.e, z.e_w, z.e_f, z.R, z.R_w) == (18944, 18944, 18944, S // 2, S // 2)


def test_verify_read_copy_bytes_by_hand(bench):
    # Super fp8, T = a = 4, L = 16: h = 4, 8, 12 read the copy, h = 16 flushes (2 S + R written).
    R, e, act = 128 * (64 * 128 + 64 * 4), 18944, 37120  # 1081344, the README's fp8 read copy
    steps = [R + h * e + 4 * e + 4 * act for h in (4, 8, 12)] + [2 * S + R + 16 * e + 4 * e + 4 * act]
    assert bench.verify_read_ideal_bytes(SUPER, 2, 16, 4, 4, "fp8") == pytest.approx(2 * sum(steps) / 4)


def test_byte_ratios_below_state_ratios(bench):
    """The ring and activations do not shrink, so every step's ideal byte ratio lies between 1 and
    the state ratio, and the non-flush step gains most."""
    for m in (SUPER, Q122):
        base = bench.read_ideal_bytes(m, 256, 16, "fp32")
        for fmt in ("fp16", "fp8", "nvfp4"):
            got = bench.read_ideal_bytes(m, 256, 16, fmt)
            nonflush = base["nonflush"] / got["nonflush"]
            assert 1 < nonflush < bench.state_ratio(m, fmt)
            assert 1 < base["window_mean"] / got["window_mean"] < nonflush
            assert got["flush"] > base["flush"]  # a flush also writes the read copy


# ------------------------------------------------------------------------------------ perf pools


@pytest.mark.parametrize("layer", ["mamba2", "gdn"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8", "nvfp4"])
def test_read_copy_pool(layer, fmt):
    """A pool with a read copy: the copy is the RTN encoding of each checkpoint, the sets rotate
    over the read copy's bytes, non-flush steps (nonflush_fn, cursor_fn) leave both copies alone,
    the flush rewrites both."""
    model = TINY[layer]
    pool = DecodePool(model, 2, 4, device="cpu", rotation_bytes=1, read_copy=fmt)
    c = pool.cache
    assert c.read_copy_format == fmt and c.checkpoint_format == "fp32" and pool.read_copy == fmt
    assert pool.nsets == 2 and c.cursor.tolist() == [0] * 4
    enc = c._copy("read_copy")[0].encode_rtn(c.checkpoint)
    assert torch.equal(c.read_state(range(4), "read_copy"), enc.dequantized)
    assert c.read_state(range(4), "read_copy").abs().sum() > 0
    if layer == "gdn":  # v and beta kept for the re-deriving flush, filled like the other records
        assert c.ring_v.float().std() > 0.5 and ((c.ring_beta > 0) & (c.ring_beta < 1)).all()
    ckpt, rc = c.checkpoint.clone(), c.read_copy.clone()
    fn, n = pool.nonflush_fn()
    assert n == 3 * 2
    fn()
    assert c.cursor.tolist() == [3] * 4  # h = 0, 1, 2: no row reached h = L - 1
    assert torch.equal(c.checkpoint, ckpt) and torch.equal(c.read_copy, rc)
    assert torch.isfinite(pool.out.float()).all() and pool.out.float().abs().sum() > 0
    fn, n = pool.cursor_fn(1)
    assert n == 2
    fn()
    assert c.cursor.tolist() == [2] * 4 and torch.equal(c.checkpoint, ckpt)
    fn, _ = pool.flush_fn()
    fn()
    assert c.cursor.tolist() == [0] * 4 and not torch.equal(c.checkpoint, ckpt) and not torch.equal(c.read_copy, rc)


def test_read_copy_pool_rotates_over_the_read_bytes():
    big = get_model("qwen3.5-4b").shard(8)  # 4 heads of 128 x 128: S = 262144 per row
    plain = DecodePool(big, 2, 4, device="cpu", rotation_bytes=4 << 20)
    assert plain.nsets == math.ceil((4 << 20) / (2 * 262144)) == 8
    assert DecodePool(big, 2, 4, device="cpu", rotation_bytes=4 << 20, read_copy="fp16").nsets == 16


def test_pool_step_fn_errors():
    pool = DecodePool(TINY["mamba2"], 2, 4, device="cpu", rotation_bytes=1)
    with pytest.raises(ValueError, match="cursor_fn"):
        pool.cursor_fn(4)
    with pytest.raises(ValueError, match="nonflush_fn"):
        DecodePool(TINY["mamba2"], 2, 1, device="cpu", rotation_bytes=1).nonflush_fn()


@pytest.mark.parametrize("layer", ["mamba2", "gdn"])
def test_compile_pool_kernel_with_a_read_copy(layer, monkeypatch):
    """With a read copy (or no config) the kernel is looked up as decode() does: the launcher of
    the layer's decode kernel on the Shape of a meta cache of the pool's layout, with the pool's
    arguments and batch."""
    model = TINY[layer]
    seen = []
    monkeypatch.setattr(launch, "launcher", lambda kernel, shape, T, *rest: seen.append((shape, rest)))
    cfg = bench_layer(model).config(16, 4)
    compile_pool_kernel(model, 16, cfg, batch=7, read_copy="nvfp4")
    compile_pool_kernel(model, 16, None, batch=300)
    (s1, r1), (s2, r2) = seen
    assert s1.read_copy == "nvfp4" and s1.window == 16
    assert s2.read_copy is None and r1 == (7, cfg) and r2 == (300, None)
    pool = DecodePool(model, 2, 16, device="cpu", rotation_bytes=1)
    inp = pool.inputs
    host = bench_layer(model).host
    want = ((inp["a"].dtype, inp["A_log"].dtype, inp["dt_bias"].dtype, None) if layer == "gdn"
            else (inp["dt"].dtype, True, False, True, inp["dt_softplus"]))  # what the adapter takes from them
    assert s2 == host.shape(pool.cache, want)


# ------------------------------------------------------------------------------------ measuring


def _fake_timer(bench, monkeypatch, refuse=()):
    """time_graph runs fn once (the float64 reference on the CPU) and returns a time that falls
    with the pool's read bytes; `refuse` maps read formats to the exception their step raises."""
    calls = []

    def fake(fn, n, replays=15):
        fn()
        calls.append(n)
        return 100.0 + len(calls)

    monkeypatch.setattr(bench, "time_graph", fake)
    return calls


@pytest.mark.parametrize("layer", ["mamba2", "gdn"])
def test_measure_flow_on_the_cpu(bench, layer, monkeypatch):
    _fake_timer(bench, monkeypatch)
    model = TINY[layer]
    dec = bench.measure_decode(model, 2, 4, "nvfp4", [None], 3, device="cpu", rotation_bytes=1)
    assert dec["note"] is None and dec["cfg"] == "API pick"
    assert all(dec[k] > 0 for k in ("nonflush", "window_mean", "flush"))
    dec = bench.measure_decode(model, 2, 4, "fp8", [None], 3, cursor=2, device="cpu", rotation_bytes=1)
    assert dec["note"] is None
    try:
        ver = bench.measure_verify(model, 2, 8, 3, [1, 3], "fp16", [None], 3, device="cpu", rotation_bytes=1)
    except NotImplementedError:  # pragma: no cover - the CPU reference verifies read-copy caches
        pytest.skip("verify() does not take a read-copy cache on the CPU")
    assert ver["note"] is None and set(ver["us"]) == {1, 3} and all(v > 0 for v in ver["us"].values())


def test_unsupported_and_refused_become_notes(bench, monkeypatch):
    model = TINY["mamba2"]
    cfg = bench_layer(model).config(16, 4)

    def refusing(fn, n, replays=15):
        raise NotImplementedError("argument 'cache': low-precision caches run on the CPU reference only")

    monkeypatch.setattr(bench, "time_graph", refusing)
    dec = bench.measure_decode(model, 2, 4, "fp8", [None, cfg], 3, device="cpu", rotation_bytes=1)
    assert dec["nonflush"] is None and dec["window_mean"] is None and dec["cfg"] is None
    assert dec["note"].startswith("decode: ") and "CPU reference only" in dec["note"]
    ver = bench.measure_verify(model, 2, 8, 4, [1, 4], "fp8", [None], 3, device="cpu", rotation_bytes=1)
    assert ver["us"] == {1: None, 4: None} and ver["note"].startswith("verify: ")

    def picky(fn, n, replays=15):  # the explicit config is refused, the API's pick runs
        if picky.cfg is not None:
            raise ValueError("decode: argument 'config': the GPU kernel cannot take it: rows")
        return 50.0

    def window_fn(c):
        picky.cfg = c
        return (lambda: None), 1

    monkeypatch.setattr(bench, "time_graph", picky)
    assert bench.best_config(window_fn, [cfg, None], 3) == (50.0, None, None)
    t, c, note = bench.best_config(window_fn, [cfg], 3)
    assert t is None and c is None and "cannot take it" in note


def _fake_rows(bench):
    """Rows of a fake run: Super with fp32, fp8 (verify refused) and nvfp4 (decode refused)."""
    m, L, T, bw = SUPER, 16, 4, 4.2e12
    dec = {"fp32": dict(nonflush=320.0, window_mean=344.0, flush=696.0, cfg="API pick", note=None),
           "fp8": dict(nonflush=100.0, window_mean=140.0, flush=760.0, cfg="(64, 4)", note=None),
           "nvfp4": dict(nonflush=None, window_mean=None, flush=None, cfg=None, note="decode: not written yet")}
    ver = {"fp32": dict(us={1: 583.0, 4: 631.0}, cfg="API pick", note=None),
           "fp8": dict(us={1: None, 4: None}, cfg=None, note="verify: not written yet"),
           "nvfp4": dict(us={1: 200.0, 4: 300.0}, cfg="API pick", note=None)}
    rows = [bench.make_row(m, 256, L, f, bw, "h200", 530.0, "(32, 2)", dec[f], ver[f], T) for f in dec]
    return bench.add_speedups(rows)


def test_rows_and_speedups_from_fake_measurements(bench):
    fp32, fp8, nvfp4 = _fake_rows(bench)
    assert fp32["nonflush_speedup_vs_fp32"] == 1 and fp8["nonflush_speedup_vs_fp32"] == 3.2
    assert fp8["window_mean_speedup_vs_fp32"] == pytest.approx(344 / 140)
    assert fp8["state_ratio"] == pytest.approx(4 * 128 / 132) and fp32["state_ratio"] == 1
    ideal = bench.read_ideal_bytes(SUPER, 256, 16, "fp8")
    assert fp8["nonflush_bytes"] == ideal["nonflush"]
    assert fp8["nonflush_tbps"] == pytest.approx(ideal["nonflush"] / 100e-6 / 1e12)
    assert fp8["nonflush_frac_copy"] == pytest.approx(ideal["nonflush"] / 100e-6 / 4.2e12)
    assert fp8["nonflush_byte_ratio"] == pytest.approx(bench.read_ideal_bytes(SUPER, 256, 16, "fp32")["nonflush"]
                                                       / ideal["nonflush"])
    assert fp8["nonflush_vs_conv"] == 5.3 and fp32["conv_frac_copy"] == pytest.approx(
        ideal_bytes(SUPER, 256, 16)["conventional"] / 530e-6 / 4.2e12)
    assert fp8["verify_a1_us"] is None and fp8["verify_a1_speedup_vs_fp32"] is None
    assert fp8["note"] == "verify: not written yet" and fp32["note"] is None
    assert nvfp4["nonflush_us"] is None and nvfp4["nonflush_tbps"] is None and nvfp4["nonflush_speedup_vs_fp32"] is None
    assert nvfp4["verify_a4_speedup_vs_fp32"] == pytest.approx(631 / 300) and nvfp4["note"] == "decode: not written yet"
    assert fp32["nonflush_h"] == "0..14" and fp8["read_copy"] == "fp8" and fp32["read_copy"] == ""
    assert bench.timed_steps(fp32) == ["nonflush", "window_mean", "flush", "verify_a1", "verify_a4"]


def test_csv_table_and_plot(bench, tmp_path, capsys):
    rows = _fake_rows(bench)
    out = tmp_path / "results" / "read_precision_h200_b256.csv"
    bench.write_outputs(rows, str(out), str(tmp_path / "rp.png"))
    with open(out) as f:
        got = list(csv.DictReader(f))
    assert [r["read_format"] for r in got] == ["fp32", "fp8", "nvfp4"]
    assert "note" in got[0] and got[0]["note"] == "" and got[2]["note"] == "decode: not written yet"
    assert got[2]["nonflush_us"] == "" and got[1]["verify_a1_us"] == "" and got[1]["verify_a1_bytes"] != ""
    assert float(got[1]["nonflush_speedup_vs_fp32"]) == 3.2 and got[0]["gpu"] == "h200"
    text = capsys.readouterr().out
    assert "nemotron-super (mamba2), batch 256, L = 16" in text and "conventional 530.0 us" in text
    assert "T=4 a=1 us" in text and "3.20x" in text and "notes:" in text
    assert "nvfp4: decode: not written yet" in text and f"wrote {out}" in text
    if bench.require_matplotlib() is None:
        assert (tmp_path / "rp.png").stat().st_size > 0 and "wrote" in text.splitlines()[-1]
    import pandas as pd  # the table also renders rows read back from the CSV (NaN cells)

    assert "nemotron-super" in bench.format_table(bench.add_speedups(pd.read_csv(out).to_dict("records")))


def test_plot_skipped_without_matplotlib(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "require_matplotlib", lambda: bench.NO_MATPLOTLIB)
    bench.write_outputs(_fake_rows(bench), str(tmp_path / "x.csv"), str(tmp_path / "x.png"))
    text = capsys.readouterr().out
    assert "matplotlib is not installed" in text and not (tmp_path / "x.png").exists()
    assert (tmp_path / "x.csv").exists()


def test_measure_rows_end_to_end_on_the_cpu(bench, tmp_path, monkeypatch):
    """The run's loop with tiny models on the CPU and the fake timer: one row per (model, format),
    speedups against fp32, the CSV written."""
    calls = _fake_timer(bench, monkeypatch)
    args = _args(bench, "--formats", "fp8", "--drafts", "2", "--accepted", "2", "--configs", "default",
                 "--window", "4")
    args.models, args.batch, args.replays = [TINY["mamba2"], TINY["gdn"]], [2], 1
    out = tmp_path / "rp.csv"
    rows = bench.measure_rows(args, 4e12, "cpu", str(out), device="cpu", rotation_bytes=1)
    assert [(r["model"], r["read_format"]) for r in rows] == [
        ("tiny-mamba2", "fp32"), ("tiny-mamba2", "fp8"), ("tiny-gdn", "fp32"), ("tiny-gdn", "fp8")]
    assert all(r["note"] is None and r["nonflush_us"] > 0 and r["verify_a2_us"] > 0 for r in rows)
    assert rows[0]["nonflush_speedup_vs_fp32"] == 1 and rows[1]["nonflush_speedup_vs_fp32"] is not None
    assert out.exists() and len(list(csv.DictReader(open(out)))) == 4
    assert calls  # every step ran through the reference


# ------------------------------------------------------------------------------------ compile jobs


@pytest.mark.parametrize("mode", ["grid", "default"])
def test_compile_jobs(bench, mode):
    jobs = bench.compile_jobs([SUPER, Q122], [256], list(bench.FORMATS), 16, 4, mode, quick=False)
    assert len(jobs) == len(set(jobs))
    for m in (SUPER, Q122):
        conv = {c for mm, w, f, T, c, b in jobs if mm is m and w == 1}
        assert conv == set(bench.candidate_configs(m, 256, 16))
        for f in bench.FORMATS:
            dec = {(c, b) for mm, w, ff, T, c, b in jobs if mm is m and w == 16 and ff == f and T == 0}
            assert (None, 256) in dec and len(dec) == len(bench.decode_configs(m, 256, 16, mode, fmt=f))
            ver = {c for mm, w, ff, T, c, b in jobs if mm is m and ff == f and T == 4}
            assert None in ver and ver == set(bench.verify_configs(m, 256, 4, 16, mode))
    assert [j for j in jobs if j[0] is None] == [(None, 16, "fp32", 4, None, 0)]  # the commit
    assert not [j for j in bench.compile_jobs([SUPER], [256], ["fp32"], 16, 0, mode, False) if j[3]]


def test_compile_job_reports_what_it_cannot_build(bench, monkeypatch, capsys):
    """A worker never fails the run: a refused grid config is skipped quietly, anything else is
    printed (the timed run notes it)."""
    seen = []

    def fake(model, window, cfg, drafts, batch, read_copy=None):
        seen.append((model.name, window, cfg, drafts, batch, read_copy))
        if read_copy == "nvfp4":
            raise ValueError("decode: argument 'config': the GPU kernel cannot take it: whole heads")
        if read_copy == "fp8":
            raise NotImplementedError("no fp8 kernel yet")

    tables = []
    monkeypatch.setattr(bench, "compile_pool_kernel", fake)
    monkeypatch.setattr(bench, "compile_table_kernels", lambda *args: tables.append(args))
    assert bench._compile_job((SUPER, 16, "fp32", 0, None, 256)) is True
    assert tables == [(16,)]  # a decode step's plan
    assert bench._compile_job((SUPER, 16, "nvfp4", 0, None, 0)) is False
    assert capsys.readouterr().out == ""
    assert bench._compile_job((Q122, 16, "fp8", 4, None, 17)) is False
    out = capsys.readouterr().out
    assert "not built: qwen3.5-122b fp8 T=4 API pick: NotImplementedError: no fp8 kernel yet" in out
    assert seen[0] == ("nemotron-super", 16, None, 0, 256, None) and seen[1][4] == 1  # batch >= 1
    assert seen[2] == ("qwen3.5-122b", 16, None, 4, 17, "fp8")


# ------------------------------------------------------------------------------------ the CLI


def test_defaults(bench):
    a = _args(bench)
    assert [m.name for m in a.models] == ["nemotron-super", "qwen3.5-122b"]
    assert a.batch == [256] and a.window == 16 and a.formats == ["fp32", "fp16", "fp8", "nvfp4"]
    assert a.drafts == 4 and a.accepted == [1, 4] and a.cursor is None
    rf = load("result_files")
    assert a.out == str(rf.default_out("read_precision", rf.device_tag(rf.gpu_name())))
    assert a.configs == "grid" and a.replays == 15 and a.plot is None and not a.no_plot
    a = _args(bench, "--formats", "nvfp4,fp8", "--layers", "gdn", "--batch", "64,256", "--out", "x.csv",
              "--drafts", "0", "--cursor", "3", "--no-plot", "--window", "8")
    assert a.formats == ["fp32", "fp8", "nvfp4"] and [m.name for m in a.models] == ["qwen3.5-122b"]
    assert a.batch == [64, 256] and a.out == "x.csv" and a.accepted == [] and a.cursor == 3 and a.no_plot


@pytest.mark.parametrize("argv,msg", [
    (["--formats", "fp64"], "unknown read formats ['fp64']"),
    (["--drafts", "17"], "--drafts"),
    (["--window", "8", "--drafts", "9"], "--drafts"),
    (["--window", "30", "--drafts", "4"], "--drafts"),
    (["--accepted", "5"], "--accepted: a must be in 1..T = 4"),
    (["--drafts", "0", "--accepted", "1"], "--accepted needs --drafts"),
    (["--cursor", "15"], "--cursor"),
    (["--cursor", "-1"], "--cursor"),
    (["--window", "1"], "--window"),
    (["--layers", "rwkv"], "unknown layer types"),
    (["--batch", "x"], "--batch"),
])
def test_bad_arguments(bench, argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse(argv)
    assert e.value.code == 2 and msg in capsys.readouterr().err


def test_help():
    proc = run("bench_read_precision", ["--help"])
    assert proc.returncode == 0, proc.stderr
    for flag in ("--formats", "--layers", "--batch", "--window", "--drafts", "--accepted", "--cursor",
                 "--replays", "--out", "--compile-only", "read_precision_<device>_<date>.csv"):
        assert flag in proc.stdout, flag


def test_refuses_without_a_gpu():
    proc = run("bench_read_precision", [], CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert "bench_read_precision: no CUDA GPU found" in proc.stderr and "needs one" in proc.stderr
    proc = run("bench_read_precision", ["--compile-only"], CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "CUTE_DSL_ARCH" in proc.stderr


def test_quant_bytes_per_state_is_what_the_sweep_reports(bench):
    for fmt in ("fp16", "fp8", "nvfp4"):
        assert bench.state_bytes(Q122, fmt) == 64 * quant.bytes_per_state(fmt, 128, 128)
