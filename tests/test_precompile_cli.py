"""`python -m replayssm_cute.precompile` argument errors and the model registry (CPU).

Every error below is raised before cutlass is imported or anything is compiled, so `main()` runs
in-process; one case also goes through `python -m` to check the exit status and stderr. One GDN
model is precompiled for real in a subprocess (a few seconds: the full compile-only checks of every
model and arch are in test_kernels_compile.py).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from replayssm_cute import precompile
from replayssm_cute.models import MODELS, ModelSpec, get_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAYSSM_CUTE_CACHE_DIR", str(tmp_path / "cache"))
    # main() sets CUTE_DSL_ARCH from --arch; keep that from leaking into other tests.
    if "CUTE_DSL_ARCH" in os.environ:
        monkeypatch.setenv("CUTE_DSL_ARCH", os.environ["CUTE_DSL_ARCH"])
    else:
        monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)


def _cli_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        precompile.main(argv)
    assert e.value.code not in (0, None)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.err


def test_unknown_model_lists_known_ones(capsys):
    err = _cli_error(capsys, ["--model", "nemotron-mega"])
    assert "unknown model 'nemotron-mega'" in err
    for name in MODELS:
        assert name in err


def test_model_is_required(capsys):
    err = _cli_error(capsys, [])
    assert "--model" in err


@pytest.mark.parametrize("dtypes", ["fp64", "bf16,fp64", "int8"])
def test_unknown_dtype(capsys, dtypes):
    err = _cli_error(capsys, ["--model", "nemotron-super", "--dtypes", dtypes])
    bad = [d for d in dtypes.split(",") if d not in ("bf16", "fp16", "fp32")][0]
    assert "--dtypes" in err and repr(bad) in err
    for ok in ("bf16", "fp16", "fp32"):
        assert ok in err


@pytest.mark.parametrize("window", ["1", "0", "-3", "33"])
def test_window_out_of_range(capsys, window):
    err = _cli_error(capsys, ["--model", "nemotron-super", "--window", window])
    assert "--window must be in 2..32" in err


@pytest.mark.parametrize("dtypes", [",", ""])
def test_empty_dtypes(capsys, dtypes):
    err = _cli_error(capsys, ["--model", "nemotron-super", "--dtypes", dtypes])
    assert "--dtypes" in err


def test_window_not_an_int(capsys):
    err = _cli_error(capsys, ["--model", "nemotron-super", "--window", "sixteen"])
    assert "--window" in err


def test_unknown_arch(capsys):
    err = _cli_error(capsys, ["--model", "nemotron-super", "--arch", "sm_80"])
    assert "--arch" in err and "sm_90a" in err and "sm_100a" in err and "sm_103a" in err


GDN_MODELS = sorted(n for n, m in MODELS.items() if m.layer == "gdn")


@pytest.mark.parametrize("name", GDN_MODELS)
def test_gdn_model_has_no_z_variants(capsys, name):
    err = _cli_error(capsys, ["--model", name, "--with-z", "--arch", "sm_90a"])
    assert name in err and "--with-z" in err and "outside the kernel" in err


def test_errors_come_before_the_arch_is_set(capsys):
    before = os.environ.get("CUTE_DSL_ARCH")
    _cli_error(capsys, ["--model", "qwen3.5-4b", "--with-z", "--arch", "sm_100a"])
    assert os.environ.get("CUTE_DSL_ARCH") == before


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "src"), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def test_cli_exit_status_and_stderr():
    proc = subprocess.run(
        [sys.executable, "-m", "replayssm_cute.precompile", "--model", "no-such-model"],
        env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "unknown model 'no-such-model'" in proc.stderr
    assert "nemotron-super" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


# ----------------------------------------------------------------------------- GDN models


def test_gdn_model_precompiles(tmp_path):
    """A GDN model builds its kernels (conventional and ReplaySSM, small- and large-batch
    configs) into the disk cache with the options it was given, and leaves no PTX behind."""
    env = _env()
    env["REPLAYSSM_CUTE_CACHE_DIR"] = str(tmp_path / "cache")
    env.pop("REPLAYSSM_CUTE_DISK_CACHE", None)
    env.pop("CUTE_DSL_ARCH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "replayssm_cute.precompile", "--model", "qwen3-next-80b",
         "--arch", "sm_100a", "--window", "8", "--dtypes", "fp16", "--dump-ptx", str(tmp_path / "ptx")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    labels = [lb for lb, _, _ in precompile.gdn_variants(get_model("qwen3-next-80b"), 8, ["fp16"])]
    assert f"precompile qwen3-next-80b for sm_100a: {len(labels)} kernels" in proc.stdout, log
    printed = [ln.split()[0] for ln in proc.stdout.splitlines()[1:] if ln.strip()]
    assert printed == labels, log
    assert sorted(p.name for p in (tmp_path / "ptx").iterdir()) == sorted(f"{lb}.sm_100a.ptx" for lb in labels)
    assert len(list((tmp_path / "cache").glob("gdn_decode-*.o"))) == len(labels)
    # --keep-ptx's own copy goes to a scratch folder, not the working directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "ptx"]


@pytest.mark.parametrize("name", GDN_MODELS)
def test_gdn_variants_match_what_decode_asks_for(name):
    """Shapes as decode builds them for a GDN cache with the engines' usual arguments (gates in
    the activation dtype, A_log / dt_bias fp32, default scale; HV, V, K, H from the ModelSpec),
    with decode's default launch configs for small and large batches, one label each."""
    import torch

    from replayssm_cute.kernels_host import default_gdn_config, gdn_shape

    m = get_model(name)
    got = precompile.gdn_variants(m, 16, ["bf16", "fp32"])
    want = []
    for d, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for L, mode in ((1, "conventional"), (16, "replay_L16")):
            shape = gdn_shape(m.nheads, m.headdim, m.dstate, m.ngroups, L, L, dtype, dtype,
                              torch.float32, torch.float32, None, False, -1)
            for cfg in sorted({default_gdn_config(m.headdim, b, L, shape) for b in (1, 16, 17, 4096)},
                              key=lambda c: c.key()):
                assert cfg.check(shape) is None
                want.append((f"gdn_{mode}_{d}_{precompile.config_label(cfg)}", shape, cfg))
    assert got == want
    assert len({lb for lb, _, _ in got}) == len(got)
    assert precompile.variants(m, 16, ["bf16"]) == precompile.gdn_variants(m, 16, ["bf16"])
    with pytest.raises(ValueError, match="--with-z"):
        precompile.variants(m, 16, ["bf16"], with_z=True)


# ----------------------------------------------------------------------------- models


def test_get_model_known_and_unknown():
    m = get_model("nemotron-super")
    assert isinstance(m, ModelSpec) and m.layer == "mamba2"
    assert (m.nheads, m.headdim, m.dstate, m.ngroups) == (128, 64, 128, 8)
    m = get_model("nemotron-nano-4b")
    assert (m.nheads, m.headdim, m.dstate, m.ngroups) == (96, 80, 128, 8)
    with pytest.raises(ValueError) as e:
        get_model("nemotron-ultra")
    msg = str(e.value)
    assert "unknown model 'nemotron-ultra'" in msg
    for name in MODELS:
        assert name in msg


def test_registry_names_match_specs():
    for name, m in MODELS.items():
        assert m.name == name and m.layer in ("mamba2", "gdn")
        assert m.nheads % m.ngroups == 0


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shard_splits_heads_and_groups(tp):
    m = get_model("nemotron-super")
    s = m.shard(tp)
    assert s.nheads == m.nheads // tp and s.ngroups == m.ngroups // tp
    assert (s.name, s.layer, s.headdim, s.dstate, s.num_layers) == (
        m.name, m.layer, m.headdim, m.dstate, m.num_layers)
    assert s.nheads * tp == m.nheads and s.ngroups * tp == m.ngroups


def test_shard_default_is_identity():
    m = get_model("nemotron-nano-4b")
    assert m.shard() == m


@pytest.mark.parametrize("model,tp", [
    ("nemotron-super", 3),  # 128 heads
    ("nemotron-super", 16),  # heads split, 8 groups do not
    ("nemotron-nano-4b", 5),  # 96 heads, 8 groups
    ("nemotron-nano-4b", 0),
    ("nemotron-nano-4b", -2),
    ("qwen3.5-4b", 32),  # 32 value heads split, 16 key heads do not
])
def test_shard_rejects_uneven_tp(model, tp):
    with pytest.raises(ValueError, match=f"tp={tp}"):
        get_model(model).shard(tp)
