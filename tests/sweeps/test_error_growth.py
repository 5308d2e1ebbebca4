"""sweeps/error_growth.py on the CPU (tiny shapes, N = 64): the CSV's rows and columns, the fp32
floor, shared low-precision state against a separate fp32 recurrence, GDN fold against re-derive,
the averaging windows, reproducibility, the plot, and the CLI's errors. The GPU path (--device
cuda: every configuration of a layer stepped together, LayerRun) checked on the CPU: with CPU
caches it gives run_job's numbers bit for bit, eager and through the graph control flow, with
partial chunks; main's CUDA flow end to end with CPU caches; its defaults; without a GPU it exits
1. Marked gpu: graph replay against eager steps, the GPU kernels against the CPU reference, and
the command line on the GPU."""

import csv
import dataclasses
import math
import sys

import pytest
import torch

from tests.helpers.sweeps import assert_usage_errors, load, run

# its tests share the module's fixtures: one pytest-xdist worker runs them all (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("error_growth")

TOKENS = 64
POINTS = [1, 2, 4, 8, 16, 32, 64]
CONFIGS = ["conv-fp32", "replay-fp32", "shared-fp8", "sep-fp32-fp8", "sep-fp32-fp8-fold"]
TINY = ["--tokens", str(TOKENS), "--batch", "2", "--prefill", "32", "--mamba2-shape", "2,16,32,1",
        "--gdn-shape", "2,16,32,1", "--progress-every", "1000"]


def _eg():
    return load("error_growth")


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f)), open(path).readline().strip().split(",")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("eg") / "eg.csv"
    proc = run("error_growth", TINY + ["--configs", ",".join(CONFIGS), "--out", str(out)], timeout=600,
               CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 0, proc.stderr
    rows, header = _read(out)
    return {"rows": rows, "header": header, "stdout": proc.stdout}


def _get(rows, layer, config, N=None):
    sel = [r for r in rows if r["layer"] == layer and r["config"] == config]
    return sel if N is None else next(r for r in sel if int(r["N"]) == N)


def test_csv_rows_and_columns(sweep):
    rows, header = sweep["rows"], sweep["header"]
    assert tuple(header) == _eg().COLUMNS == (
        "layer", "config", "checkpoint_format", "read_copy", "shared", "window", "flush_corrections", "N",
        "rel_err_output", "rel_err_state", "backend", "batch", "shape")
    assert {(r["backend"], r["batch"]) for r in rows} == {("cpu-reference", "2")}
    assert {r["shape"] for r in rows} == {"2x16x32x1"}
    # the *-fold configuration is GDN only: 4 Mamba-2 runs, 5 GDN runs, 7 points each
    expected = [(la, c) for la in ("mamba2", "gdn") for c in CONFIGS if not (la == "mamba2" and c.endswith("-fold"))]
    assert [(r["layer"], r["config"]) for r in rows[::len(POINTS)]] == expected
    assert len(rows) == len(expected) * len(POINTS)
    for la, c in expected:
        sel = _get(rows, la, c)
        assert [int(r["N"]) for r in sel] == POINTS
        assert all(float(r["rel_err_output"]) >= 0 for r in sel)
    fields = lambda la, c: {k: _get(rows, la, c, 1)[k] for k in  # noqa: E731
                            ("checkpoint_format", "read_copy", "shared", "window", "flush_corrections")}
    assert fields("mamba2", "conv-fp32") == dict(checkpoint_format="fp32", read_copy="none", shared="False",
                                                 window="1", flush_corrections="")
    assert fields("mamba2", "shared-fp8") == dict(checkpoint_format="fp8", read_copy="none", shared="True",
                                                  window="16", flush_corrections="")
    assert fields("gdn", "shared-fp8")["flush_corrections"] == "fold"
    assert fields("gdn", "sep-fp32-fp8") == dict(checkpoint_format="fp32", read_copy="fp8", shared="False",
                                                 window="16", flush_corrections="rederive")
    assert fields("gdn", "sep-fp32-fp8-fold")["flush_corrections"] == "fold"
    # the checkpoint is written every step at L = 1, from N = 16 on at L = 16 (empty before)
    for la in ("mamba2", "gdn"):
        assert all(r["rel_err_state"] != "" for r in _get(rows, la, "conv-fp32"))
        for r in _get(rows, la, "sep-fp32-fp8"):
            assert (r["rel_err_state"] != "") == (int(r["N"]) >= 16), r
    assert "rel_err_output (window mean) at N = 64" in sweep["stdout"]


def test_fp32_floor(sweep):
    rows = sweep["rows"]
    for la, c in (("mamba2", "conv-fp32"), ("mamba2", "replay-fp32"), ("gdn", "conv-fp32")):
        for r in _get(rows, la, c):
            assert float(r["rel_err_output"]) < 1e-6, r
            assert r["rel_err_state"] == "" or float(r["rel_err_state"]) < 1e-6, r
    # GDN ReplaySSM keeps its corrections in an fp16 ring: an fp32 checkpoint is not the fp32 floor there
    assert all(float(r["rel_err_output"]) < 1e-3 for r in _get(rows, "gdn", "replay-fp32"))


def test_shared_fp8_worse_than_separate_fp32_checkpoint(sweep):
    rows = sweep["rows"]
    for la in ("mamba2", "gdn"):
        for N in (16, 32, 64):
            shared, sep = _get(rows, la, "shared-fp8", N), _get(rows, la, "sep-fp32-fp8", N)
            assert float(shared["rel_err_output"]) > 1.5 * float(sep["rel_err_output"]), (la, N)
            # the separate recurrence checkpoint stays at fp32 rounding; the shared one carries fp8 SR
            assert float(sep["rel_err_state"]) < 1e-6, (la, N)
            assert float(shared["rel_err_state"]) > 1e-3, (la, N)


def test_gdn_fold_lets_read_copy_error_into_the_recurrence(sweep):
    rows = sweep["rows"]
    for N in (16, 32, 64):
        fold, rederive = _get(rows, "gdn", "sep-fp32-fp8-fold", N), _get(rows, "gdn", "sep-fp32-fp8", N)
        assert float(fold["rel_err_state"]) > 100 * float(rederive["rel_err_state"]), N


def test_points_and_windows_tile_the_run():
    eg = _eg()
    assert eg.points(64) == POINTS and eg.points(100) == POINTS and eg.points(1) == [1]
    for tokens in (1, 64, 100, 4096):
        steps = [n for N in eg.points(tokens) for n in eg.window_steps(N, tokens)]
        last = eg.window_steps(eg.points(tokens)[-1], tokens).stop - 1
        assert steps == list(range(1, last + 1))  # contiguous, disjoint, from step 1
        assert last == min(tokens, eg.window_steps(eg.points(tokens)[-1], 10**9).stop - 1)
        for N in eg.points(tokens):
            w = eg.window_steps(N, tokens)
            assert N in w and all(2 * n * n > N * N and n * n <= 2 * N * N for n in w)
    assert list(eg.window_steps(4, 4096)) == [3, 4, 5] and list(eg.window_steps(4096, 4096)) == list(range(2897, 4097))


def test_run_job_is_reproducible():
    eg = _eg()
    job = eg.Job("gdn", "sep-fp16-nvfp4", (2, 16, 32, 1), 2, 20, 8, 4, (1e-4, 0.1), 7)
    a, b = eg.run_job(job), eg.run_job(job)
    assert a["meta"] == b["meta"] and a["meta"]["window"] == 4
    assert (a["out"] == b["out"]).all() and a["state"].isnan().equal(b["state"].isnan())
    c = eg.run_job(dataclasses.replace(job, seed=8))  # other inputs and SR bits
    assert not (c["out"] == a["out"]).all()
    # L = 4: the checkpoint is written at steps 4, 8, ... (index 3, 7, ...)
    assert [i for i in range(20) if not a["state"][i].isnan()] == [3, 7, 11, 15, 19]


def test_slow_heads():
    eg = _eg()
    rates = eg.head_rates(4, eg.DEFAULT_RATES)
    alpha = (-rates).exp()
    assert (alpha > 0.999).sum() >= 2 and alpha.min() < 0.95
    assert float(rates[0]) == pytest.approx(5e-5) and float(rates[-1]) == pytest.approx(0.1)


def test_list():
    proc = run("error_growth", ["--list"])
    assert proc.returncode == 0
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == list(_eg().CONFIGS) and len(names) == 27
    assert "sep-fp16-nvfp4-fold" in names and "[GDN only]" in proc.stdout


def test_device_cuda_without_a_gpu(monkeypatch, capsys):
    proc = run("error_growth", ["--device", "cuda", "--tokens", "8"], CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert "error_growth: no CUDA GPU found: --device cuda runs the decode kernels and needs one" in proc.stderr
    eg = _eg()
    monkeypatch.setattr(eg.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        eg.parse(["--device", "cuda"])
    assert e.value.code == 1 and capsys.readouterr().err.strip() == eg.NO_CUDA
    # usage errors come first (exit 2), with or without a GPU
    with pytest.raises(SystemExit) as e:
        eg.parse(["--device", "cuda", "--graph-steps", "0"])
    assert e.value.code == 2


USAGE_ERRORS = [
    (["--tokens", "0"], "--tokens must be in [1, 65536], got 0"),
    (["--tokens", "65537"], "--tokens must be in [1, 65536], got 65537"),
    (["--configs", "shared-fp8,bogus"], "--configs: unknown 'bogus'; choose from conv-fp32"),
    (["--configs", ","], "--configs: empty list"),
    (["--layers", "rwkv"], "--layers: unknown 'rwkv'; choose from mamba2, gdn"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--window", "1"], "--window must be >= 2"),
    (["--prefill", "-1"], "--prefill must be >= 0"),
    (["--jobs", "0"], "--jobs must be >= 1"),
    (["--rates", "0.1,0.01"], "--rates: expected MIN,MAX with 0 < MIN <= MAX"),
    (["--rates", "fast"], "--rates: expected MIN,MAX"),
    (["--gdn-shape", "4,32,32"], "--gdn-shape: expected 4 comma-separated integers"),
    (["--mamba2-shape", "4,16,x,1"], "--mamba2-shape: expected 4 comma-separated integers"),
    (["--layers", "mamba2", "--configs", "sep-fp32-fp8-fold"],
     "the *-fold and *-rederive configurations are GDN only"),
    (["--layers", "mamba2", "--configs", "shared-nvfp4", "--mamba2-shape", "4,16,24,1"],
     "mamba2 configuration shared-nvfp4 at --mamba2-shape 4,16,24,1: checkpoint_format='nvfp4' needs dstate to be "
     "a multiple of 16"),
    (["--layers", "gdn", "--gdn-shape", "3,32,32,2"], "num_v_heads (3) must be a multiple of num_k_heads (2)"),
    (["--no-graph"], "--graph-steps and --no-graph apply to --device cuda only"),
    (["--graph-steps", "8"], "--graph-steps and --no-graph apply to --device cuda only"),
    (["--device", "cuda", "--graph-steps", "0"], "--graph-steps must be >= 1, got 0"),
    (["--device", "cuda", "--tokens", "65537"], "--tokens must be in [1, 65536], got 65537"),
]


@pytest.mark.parametrize("args,message", USAGE_ERRORS)
def test_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        _eg().parse(args)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_usage_error_from_the_command_line():
    assert_usage_errors("error_growth", USAGE_ERRORS[:1])


def test_plot_without_matplotlib(monkeypatch, capsys):
    eg = _eg()
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert eg.require_matplotlib() == eg.NO_MATPLOTLIB
    with pytest.raises(SystemExit) as e:
        eg.parse(["--plot", "x.png", "--tokens", "8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib" in err and "pip install 'replayssm-cute[plots]'" in err


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "p.csv", tmp_path / "p.png"
    proc = run("error_growth", TINY + ["--tokens", "16", "--configs", "conv-fp32,shared-fp16,sep-fp32-nvfp4",
                                       "--jobs", "1", "--out", str(out), "--plot", str(png)], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in proc.stdout


# ----------------------------------------------------------------------------- the GPU path, checked on the CPU

LAYER_CONFIGS = {  # window 1 and L, every format, shared and separate, GDN fold and re-derive
    "mamba2": ["conv-fp32", "conv-nvfp4", "shared-fp8", "replay-fp32", "sep-fp16-nvfp4", "sep-fp8-fp16"],
    "gdn": ["conv-fp8", "shared-nvfp4", "replay-fp32", "replay-fp32-rederive", "sep-fp32-fp8", "sep-fp8-fp16-fold"],
}


def _jobs(eg, layer, configs, tokens=37, window=4, batch=2, shape=(2, 16, 32, 1), device="cpu", prefill=8):
    return [eg.Job(layer, c, shape, batch, tokens, prefill, window, (1e-4, 0.1), 7, device) for c in configs]


def _same(a, b, rtol=1e-12):
    torch.testing.assert_close(a, b, rtol=rtol, atol=0, equal_nan=True)


@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("layer", ["mamba2", "gdn"])
def test_layer_run_gives_run_jobs_numbers(layer, graphs):
    """All configurations stepped together (chunks of 8 steps at L = 4, 37 steps: a first eager
    chunk, three replays of the captured chunk, a partial chunk) = each run alone."""
    eg = _eg()
    jobs = _jobs(eg, layer, LAYER_CONFIGS[layer])
    run = eg.LayerRun(jobs, eg.graph_chunk(4, 6))
    assert run.chunk == 8
    run.run(graphs)
    assert run.graphed_chunks == (3 if graphs else 0)
    got = run.results()
    for job in jobs:
        want = eg.run_job(job)
        assert got[job.config]["meta"] == want["meta"]
        _same(got[job.config]["out"], want["out"])
        _same(got[job.config]["state"], want["state"])
        assert eg.summarize(got[job.config], job.tokens)[-1]["N"] == 32


def test_run_layer_ticks_and_chunk_rounding():
    eg = _eg()
    jobs = _jobs(eg, "gdn", ["conv-fp16", "sep-fp32-fp16"], tokens=20, window=3)
    ticks = []
    res = eg.run_layer(jobs, graph_steps=4, tick=ticks.append)  # 4 rounds up to 6 = 2 windows of 3
    assert ticks == [12, 12, 12, 4] and sum(ticks) == 2 * 20
    assert [i for i in range(20) if not res["sep-fp32-fp16"]["state"][i].isnan()] == [2, 5, 8, 11, 14, 17]
    assert not res["conv-fp16"]["state"].isnan().any()


def test_graph_chunk_and_flush_schedule():
    eg = _eg()
    assert eg.graph_chunk(16, 64) == 64 and eg.graph_chunk(16, 1) == 16 and eg.graph_chunk(16, 65) == 80
    assert eg.graph_chunk(5, 64) == 65 and eg.graph_chunk(32, 64) == 64
    assert [n for n in range(10) if eg.writes_checkpoint(n, 4)] == [3, 7]
    assert all(eg.writes_checkpoint(n, 1) for n in range(5))


def test_layer_run_checks():
    eg = _eg()
    jobs = _jobs(eg, "mamba2", ["conv-fp32", "shared-fp8"], tokens=10)
    with pytest.raises(ValueError, match="jobs differ beyond their configuration"):
        eg.LayerRun([jobs[0], dataclasses.replace(jobs[1], seed=8)], 8)
    with pytest.raises(ValueError, match="chunk 6 is not a multiple of the window 4"):
        eg.LayerRun(jobs, 6)
    run = eg.LayerRun(jobs, 8)
    run.run()
    run.caches[1].cursor[0] += 1  # a row off the assumed schedule
    with pytest.raises(RuntimeError, match="shared-fp8: cursors .* expected 2: the flush schedule"):
        run.results()


def test_checkpoint_value_is_read_state():
    eg = _eg()
    for c in ("conv-fp32", "shared-fp16", "sep-fp8-fp8", "shared-nvfp4"):
        lay = eg.make_layer("gdn", (2, 16, 32, 1), 3, (1e-4, 0.1))
        cache = eg.make_cache(lay, eg.CONFIGS[c], 4, 1)
        cache.load_prefill([0, 1, 2], torch.randn(3, 2, 16, 32))
        assert torch.equal(eg.checkpoint_value(cache), cache.read_state([0, 1, 2])), c


def test_default_out():
    """A new file per device and day: the CPU reference's, or the GPU's by its short name."""
    eg = _eg()
    assert eg.parse(["--tokens", "8"]).out == eg.default_out("error_growth", "cpu")
    assert eg.default_out("error_growth", "cpu").name.startswith("error_growth_cpu_20")


def _fake_gpu(monkeypatch, eg):
    monkeypatch.setattr(eg.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(eg.torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")


def test_cuda_defaults(monkeypatch):
    eg = _eg()
    _fake_gpu(monkeypatch, eg)
    args = eg.parse(["--device", "cuda"])
    assert (args.tokens, args.batch, args.graph_steps, args.no_graph) == (65536, 64, 64, False)
    assert (args.mamba2_shape, args.gdn_shape) == ("4,16,64,1", "4,32,64,1")
    assert args.out == eg.default_out("error_growth", "h200") and args.gpu_name == "NVIDIA H200"
    assert len(args.jobs_list) == 44 and {j.device for j in args.jobs_list} == {"cuda"}
    assert {j.tokens for j in args.jobs_list} == {65536} and {j.batch for j in args.jobs_list} == {64}
    args = eg.parse(["--device", "cuda", "--tokens", "100", "--batch", "3", "--out", "x.csv", "--no-graph",
                     "--graph-steps", "20", "--gdn-shape", "2,16,64,1", "--layers", "gdn"])
    assert (args.tokens, args.batch, str(args.out), args.graph_steps, args.no_graph) == (100, 3, "x.csv", 20, True)
    assert {j.shape for j in args.jobs_list} == {(2, 16, 64, 1)} and len(args.jobs_list) == 27
    args = eg.parse([])  # the CPU defaults are unchanged
    assert (args.tokens, args.batch, args.mamba2_shape, args.gdn_shape, args.out) == (
        4096, 2, "4,16,32,1", "4,32,32,1", eg.default_out("error_growth", "cpu"))
    assert {j.device for j in args.jobs_list} == {"cpu"}


def test_main_cuda_flow_with_cpu_caches(monkeypatch, tmp_path, capsys):
    """main --device cuda end to end, the caches on the CPU: compiles first (in this process),
    then each layer's configurations together; the CSV holds run_job's numbers."""
    eg = _eg()
    _fake_gpu(monkeypatch, eg)
    on_cpu = lambda jobs: [dataclasses.replace(j, device="cpu") for j in jobs]  # noqa: E731
    compiled = []
    real_precompile, real_run_layer = eg.precompile, eg.run_layer

    def precompile(jobs, workers):
        compiled.extend((j.layer, j.config, j.device) for j in jobs)
        return real_precompile(on_cpu(jobs), 1)

    monkeypatch.setattr(eg, "precompile", precompile)
    monkeypatch.setattr(eg, "run_layer", lambda jobs, *a: real_run_layer(on_cpu(jobs), *a))
    out = tmp_path / "gpu.csv"
    configs = ["conv-fp8", "shared-nvfp4", "sep-fp32-fp8", "sep-fp32-fp8-fold"]
    argv = ["--device", "cuda", "--tokens", "40", "--batch", "2", "--window", "4", "--graph-steps", "8",
            "--prefill", "8", "--seed", "7", "--rates", "1e-4,0.1", "--configs", ",".join(configs),
            "--mamba2-shape", "2,16,32,1", "--gdn-shape", "2,16,32,1", "--out", str(out), "--progress-every", "1000"]
    assert eg.main(argv) == 0
    stdout = capsys.readouterr().out
    assert "NVIDIA H200: replayssm_cute.decode on CUDA caches" in stdout and "CUDA graphs of 8 steps" in stdout
    assert "mamba2: 3 configurations x 40 steps" in stdout and "gdn: 4 configurations x 40 steps" in stdout
    assert len(compiled) == 7 and {d for *_, d in compiled} == {"cuda"}
    rows, _ = _read(out)
    assert len(rows) == 7 * 6
    for la in ("mamba2", "gdn"):
        for c in configs:
            if la == "mamba2" and c.endswith("-fold"):
                continue
            job = _jobs(eg, la, [c], tokens=40)[0]
            want = eg.summarize(eg.run_job(job), 40)
            got = _get(rows, la, c)
            assert [int(r["N"]) for r in got] == [w["N"] for w in want] == [1, 2, 4, 8, 16, 32]
            for g, w in zip(got, want):
                assert float(g["rel_err_output"]) == pytest.approx(w["rel_err_output"], rel=1e-6)
                assert (g["rel_err_state"] == "") == (w["rel_err_state"] is None)
                if w["rel_err_state"] is not None:
                    assert float(g["rel_err_state"]) == pytest.approx(w["rel_err_state"], rel=1e-6)


def test_main_cuda_stops_when_a_configuration_fails(monkeypatch, capsys):
    eg = _eg()
    _fake_gpu(monkeypatch, eg)
    monkeypatch.setattr(eg, "precompile", lambda jobs, workers: {("gdn", "shared-nvfp4"): "ValueError: no"})
    monkeypatch.setattr(eg, "run_layer", lambda *a: pytest.fail("ran after a failed compile"))
    assert eg.main(["--device", "cuda", "--layers", "gdn", "--configs", "shared-nvfp4", "--out", "x.csv"]) == 1
    assert "error_growth: gdn configuration shared-nvfp4: the GPU decode step failed: ValueError: no" in \
        capsys.readouterr().err


def test_precompile_reports_failures():
    eg = _eg()
    good = _jobs(eg, "mamba2", ["shared-fp8"], tokens=4)
    assert eg.precompile(good, 1) == {}
    bad = _jobs(eg, "gdn", ["conv-fp16"], tokens=4, shape=(3, 16, 32, 2))  # HV not a multiple of H
    failed = eg.precompile(good + bad, 1)
    assert list(failed) == [("gdn", "conv-fp16")]
    assert "num_v_heads (3) must be a multiple" in failed[("gdn", "conv-fp16")]


# ----------------------------------------------------------------------------- on the GPU

GPU_CONFIGS = {
    "mamba2": ["conv-fp32", "conv-fp8", "conv-nvfp4", "shared-fp16", "shared-nvfp4", "replay-fp32", "sep-fp32-fp8",
               "sep-fp16-nvfp4", "sep-fp8-fp16"],
    "gdn": ["conv-fp32", "conv-fp8", "conv-nvfp4", "shared-fp16", "shared-nvfp4", "replay-fp32",
            "replay-fp32-rederive", "sep-fp32-fp8", "sep-fp32-fp8-fold", "sep-fp16-nvfp4", "sep-fp8-fp16"],
}
FLOOR = {("mamba2", "conv-fp32"), ("mamba2", "replay-fp32"), ("gdn", "conv-fp32")}  # fp32 state, no fp16 ring


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["mamba2", "gdn"])
def test_gpu_graph_replay_matches_eager(layer):
    """The captured chunk replayed = the same steps run eagerly, bit for bit (44 steps, chunks of
    8 at L = 4: an eager chunk, four replays, a partial chunk)."""
    eg = _eg()
    jobs = _jobs(eg, layer, GPU_CONFIGS[layer], tokens=44, batch=8, shape=eg.CUDA_DEFAULT_SHAPES[layer],
                 device="cuda")
    runs = {}
    for graphs in (True, False):
        run = eg.LayerRun(jobs, 8)
        run.run(graphs)
        assert run.graphed_chunks == (4 if graphs else 0)
        runs[graphs] = run.results()
    for c in GPU_CONFIGS[layer]:
        assert runs[True][c]["meta"]["backend"] == "cuda-kernels"
        _same(runs[True][c]["out"], runs[False][c]["out"], rtol=0)
        _same(runs[True][c]["state"], runs[False][c]["state"], rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", ["mamba2", "gdn"])
def test_gpu_kernels_track_the_cpu_reference(layer):
    """The same inputs, prefill and SR seeds on the GPU kernels and on the CPU reference: the
    error curves agree (fp32 arithmetic and the odd code across a rounding boundary apart)."""
    eg = _eg()
    kw = dict(tokens=128, window=16, batch=4, shape=eg.CUDA_DEFAULT_SHAPES[layer], prefill=32)
    gpu = eg.run_layer(_jobs(eg, layer, GPU_CONFIGS[layer], device="cuda", **kw))
    cpu = eg.run_layer(_jobs(eg, layer, GPU_CONFIGS[layer], device="cpu", **kw))
    for c in GPU_CONFIGS[layer]:
        g, r = eg.summarize(gpu[c], 128), eg.summarize(cpu[c], 128)
        for gr, rr in zip(g[-2:], r[-2:]):  # N = 64, 128
            ge, re_ = gr["rel_err_output"], rr["rel_err_output"]
            if (layer, c) in FLOOR:
                assert ge < 1e-5 and re_ < 1e-5, (c, gr["N"], ge, re_)
            else:
                assert 1 / 3 < ge / re_ < 3, (c, gr["N"], ge, re_)  # catches gross mistakes only
            if c.startswith("sep-fp32") and not c.endswith("-fold"):  # an fp32 recurrence checkpoint stays clean
                assert gr["rel_err_state"] < 1e-5, (c, gr)


@pytest.mark.gpu
def test_gpu_command_line(tmp_path):
    out = tmp_path / "gpu.csv"
    proc = run("error_growth", ["--device", "cuda", "--tokens", "256", "--jobs", "2", "--configs",
                                "conv-fp32,shared-fp8,sep-fp32-nvfp4,sep-fp32-fp8-fold", "--out", str(out)],
               timeout=900)
    assert proc.returncode == 0, proc.stderr
    rows, _ = _read(out)
    assert len(rows) == 7 * 9 and {(r["backend"], r["batch"]) for r in rows} == {("cuda-kernels", "64")}
    assert {r["shape"] for r in rows if r["layer"] == "gdn"} == {"4x32x64x1"}
    assert all(math.isfinite(float(r["rel_err_output"])) for r in rows)
    for la in ("mamba2", "gdn"):
        assert float(_get(rows, la, "conv-fp32", 256)["rel_err_output"]) < 1e-5
        assert float(_get(rows, la, "shared-fp8", 256)["rel_err_output"]) > 1e-3
