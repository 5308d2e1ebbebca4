"""Where every sweep writes (sweeps/result_files.py, CPU): by default a new file per device and
day, never a committed result; an --out (or --plot) that cannot be written is a usage error, one
line naming the argument, before anything is built or run."""

import datetime

import pytest

from tests.helpers.sweeps import load, run

# its tests share the module's fixtures: one pytest-xdist worker runs them all (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("sweep_outputs")

SWEEPS = ("bench_decode", "bench_verify", "bench_read_precision", "error_growth")


@pytest.fixture(scope="module")
def rf():
    return load("result_files")


@pytest.mark.parametrize("name,tag", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                      ("NVIDIA B200", "b200"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
                                      ("NVIDIA A100-SXM4-80GB", "a100"), ("", "gpu"), (None, "cpu")])
def test_device_tag(rf, name, tag):
    assert rf.device_tag(name) == tag


def test_default_out(rf):
    day = datetime.date(2026, 12, 1)
    assert rf.default_out("decode", "h200", day=day) == rf.RESULTS / "decode_h200_2026-12-01.csv"
    assert rf.default_out("verify", "cpu", quick=True, day=day) == rf.RESULTS / "verify_cpu_2026-12-01_quick.csv"
    assert rf.default_out("decode", "h200").name == f"decode_h200_{datetime.date.today().isoformat()}.csv"


def test_defaults_are_new_files_per_device_and_day(rf, monkeypatch):
    """Each sweep's default --out, with a GPU (faked) and without: never a committed result."""
    import torch

    committed = {p.name for p in rf.RESULTS.iterdir()}
    bd, rp, eg = load("bench_decode"), load("bench_read_precision"), load("error_growth")
    for gpu in (None, "NVIDIA H200"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu)
        tag = "cpu" if gpu is None else "h200"
        for stem in ("decode", "verify"):
            for quick in (False, True):
                ap = bd.make_parser(bd.__doc__, stem, bd.DEFAULT_MODELS, bd.BATCHES, bd.QUICK_BATCHES, "")
                out = bd.parse_args(ap, ["--quick"] if quick else []).out
                assert out == str(rf.default_out(stem, tag, quick)) and out.split("/")[-1] not in committed
        assert rp.parse([]).out == str(rf.default_out("read_precision", tag))
        assert eg.parse(["--tokens", "8"]).out == rf.default_out("error_growth", "cpu")  # the CPU reference
        if gpu is not None:
            assert eg.parse(["--tokens", "8", "--device", "cuda"]).out == rf.default_out("error_growth", "h200")


def _bad_paths(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    return [(tmp_path, f"{tmp_path} is a folder, expected a file path"),
            (afile / "x.csv", f"cannot create {afile / 'x.csv'}: {afile} is a file, not a folder")]


@pytest.mark.parametrize("name", SWEEPS)
def test_bad_out_is_a_usage_error_before_any_work(name, tmp_path):
    """--compile-only with an arch and no GPU would build kernels (error_growth: run on the CPU):
    a bad --out stops it first, exit 2 and one line, nothing compiled."""
    cache = tmp_path / "cache"
    for path, message in _bad_paths(tmp_path):
        args = ["--out", str(path)] + ([] if name == "error_growth" else ["--compile-only"])
        proc = run(name, args, CUDA_VISIBLE_DEVICES="", CUTE_DSL_ARCH="sm_90a", REPLAYSSM_CUTE_CACHE_DIR=str(cache))
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and err[-1].endswith(f"error: --out: {message}"), proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not cache.exists()


@pytest.mark.parametrize("name", ["bench_read_precision", "error_growth"])
def test_bad_plot_is_a_usage_error(name, tmp_path, capsys, monkeypatch):
    sweep = load(name)
    if name == "error_growth":  # which refuses --plot without matplotlib first
        monkeypatch.setattr(sweep, "require_matplotlib", lambda: None)
    argv = ["--tokens", "8"] if name == "error_growth" else []
    for path, message in _bad_paths(tmp_path):
        with pytest.raises(SystemExit) as e:
            sweep.parse(argv + ["--plot", str(path)])
        assert e.value.code == 2 and f"error: --plot: {message}" in capsys.readouterr().err
