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
    configs, and with --drafts the decode, verify and commit kernels of a draft cache) into the
    disk cache with the options it was given, and leaves no PTX behind; decode, verify and commit
    then find every kernel they ask for on disk."""
    _check_precompile_with_drafts(tmp_path, "qwen3-next-80b", "sm_100a", 8, "2", "fp16", dump=True)


def _check_precompile_with_drafts(tmp_path, name, arch, window, drafts, dtype, dump):
    env = _env()
    env["REPLAYSSM_CUTE_CACHE_DIR"] = str(tmp_path / "cache")
    env.pop("REPLAYSSM_CUTE_DISK_CACHE", None)
    env.pop("CUTE_DSL_ARCH", None)
    cmd = [sys.executable, "-m", "replayssm_cute.precompile", "--model", name, "--arch", arch,
           "--window", str(window), "--dtypes", dtype, "--drafts", drafts]
    if dump:
        cmd += ["--dump-ptx", str(tmp_path / "ptx")]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    m = get_model(name)
    T = [int(t) for t in drafts.split(",")]
    decode = [lb for lb, _, _ in precompile.variants(m, window, [dtype])]
    spec = precompile.draft_variants(m, window, T, [dtype])
    labels = decode + [v.label for v in spec]
    assert f"precompile {name} for {arch}: {len(labels)} kernels" in proc.stdout, log
    printed = [ln.split()[0] for ln in proc.stdout.splitlines()[1:] if ln.strip()]
    assert printed == labels, log
    if dump:
        assert sorted(p.name for p in (tmp_path / "ptx").iterdir()) == sorted(f"{lb}.{arch}.ptx" for lb in labels)
    kinds = [v.kind for v in spec]
    assert kinds.count("commit") == len(set(T)) and kinds.count("verify") >= len(set(T))
    cache = tmp_path / "cache"
    assert len(list(cache.glob(f"{m.layer}_decode-*.o"))) == len(decode) + kinds.count("decode")
    assert len(list(cache.glob(f"{m.layer}_verify-*.o"))) == kinds.count("verify")
    assert len(list(cache.glob("commit-*.o"))) == kinds.count("commit")
    # --keep-ptx's own copy goes to a scratch folder, not the working directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == (["cache", "ptx"] if dump else ["cache"])
    # A server with a draft cache of this shape starts warm: the lookups decode, verify and
    # commit make (engines' usual arguments, small and large batch) all load from disk.
    warm = subprocess.run([sys.executable, "-c", _WARM, arch, name, str(window), drafts, _DTYPE_NAMES[dtype]],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, (warm.stdout + warm.stderr)[-6000:]
    assert warm.stdout.split() == ["warm", str(2 + 2 * len(set(T)) + len(set(T)))], warm.stdout


_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# The kernel lookups of decode / verify / commit on a draft cache, with every compile refused.
_WARM = """
import os, sys
os.environ["CUTE_DSL_ARCH"] = sys.argv[1]
import torch
import replayssm_cute as rs
from replayssm_cute import kernels_host as kh
from replayssm_cute.kernels import commit as kc
from replayssm_cute.kernels.gdn import decode as gd, verify as gv
from replayssm_cute.kernels.mamba2 import decode as md, verify as mv
from replayssm_cute.models import get_model

def refuse(*args, **kwargs):
    raise AssertionError("compiled: not in the disk cache")

for mod, fn in ((kc, "compile_commit"), (gd, "compile_decode"), (gv, "compile_verify"),
                (md, "compile_decode"), (mv, "compile_verify")):
    setattr(mod, fn, refuse)
m, window = get_model(sys.argv[2]), int(sys.argv[3])
drafts, dtype = sorted({int(t) for t in sys.argv[4].split(",")}), getattr(torch, sys.argv[5])
f32, n = torch.float32, 0
if m.layer == "gdn":
    cache = rs.GDNCache(2, m.nheads, m.headdim, m.dstate, m.ngroups, window=window, max_draft=max(drafts), dtype=dtype)
    decode = lambda batch: kh.gdn_decode_kernel(cache, dtype, f32, f32, None, batch)
    verify = lambda T, batch: kh.gdn_verify_kernel(cache, T, dtype, f32, f32, None, batch)
else:
    cache = rs.Mamba2Cache(2, m.nheads, m.headdim, m.dstate, m.ngroups, window=window, max_draft=max(drafts), dtype=dtype)
    decode = lambda batch: kh.mamba2_decode_kernel(cache, dtype, True, False, True, True, batch)
    verify = lambda T, batch: kh.mamba2_verify_kernel(cache, T, dtype, True, False, True, True, batch)
for batch in (1, 1024):
    decode(batch)
    n += 1
    for T in drafts:
        verify(T, batch)
        n += 1
for T in drafts:
    kh.commit_kernel(cache, T)
    n += 1
print("warm", n)
"""


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


# ----------------------------------------------------------------------------- --drafts


@pytest.mark.parametrize("drafts,what", [
    ("x", "'x' is not a draft count"),
    ("2,four", "'four' is not a draft count"),
    ("2.5", "'2.5' is not a draft count"),
    (",", "at least one draft count"),
    ("", "at least one draft count"),
    ("0", "draft count 0 is outside 1..16"),
    ("2,17", "draft count 17 is outside 1..16"),
    ("-1", "draft count -1 is outside 1..16"),
])
def test_drafts_must_be_draft_counts(capsys, drafts, what):
    err = _cli_error(capsys, ["--model", "nemotron-super", "--drafts", drafts, "--arch", "sm_90a"])
    assert "--drafts" in err and what in err, err


def test_drafts_must_fit_the_window(capsys):
    err = _cli_error(capsys, ["--model", "nemotron-super", "--window", "4", "--drafts", "2,8"])
    assert "--drafts" in err and "draft count 8 is above the window 4" in err
    err = _cli_error(capsys, ["--model", "qwen3.5-4b", "--window", "24", "--drafts", "4,16"])
    assert "--drafts" in err and "24 + max draft count 16 = 40" in err and "above 32" in err


def test_drafts_errors_come_before_the_arch_is_set(capsys):
    before = os.environ.get("CUTE_DSL_ARCH")
    _cli_error(capsys, ["--model", "nemotron-super", "--drafts", "0", "--arch", "sm_100a"])
    assert os.environ.get("CUTE_DSL_ARCH") == before


def test_parse_drafts_sorts_and_dedups():
    assert precompile.parse_drafts("8,2,4,2") == ([2, 4, 8], None)
    assert precompile.parse_drafts(" 4 ") == ([4], None)
    assert precompile.parse_drafts("2,,4") == ([2, 4], None)


def test_mamba2_precompiles_with_drafts(tmp_path):
    """Mamba-2 --drafts end to end (small window to keep it fast): decode kernels, then decode on
    the draft cache, verify per (T, launch config) and commit per T; decode, verify and commit then
    find every kernel they ask for on disk. (The GDN run above covers --dump-ptx through main(),
    test_kernels_compile.py the Mamba-2 verify PTX.)"""
    _check_precompile_with_drafts(tmp_path, "nemotron-super", "sm_90a", 4, "2,1", "bf16", dump=False)


@pytest.mark.parametrize("name,window,drafts", [
    ("nemotron-super", 16, [8, 2, 4]), ("nemotron-nano-4b", 16, [4]), ("nemotron-h-8b", 8, [1, 8]),
])
@pytest.mark.parametrize("with_z", [False, True])
def test_mamba2_draft_variants_match_what_verify_asks_for(name, window, drafts, with_z):
    """The draft cache (max_draft = max T) shape as decode / verify build it for a Mamba2Cache with
    the engines' usual arguments, decode's and verify's default launch configs for small and large
    batches, the commit shape per T; one label each."""
    import torch

    from replayssm_cute.kernels.commit import CommitShape
    from replayssm_cute.kernels_host import default_mamba2_config, default_mamba2_verify_config, mamba2_shape

    m = get_model(name)
    got = precompile.draft_variants(m, window, drafts, ["bf16", "fp16"], with_z=with_z)
    Ts, D = sorted(drafts), max(drafts)
    want = []
    for d, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        shape = mamba2_shape(m.nheads, m.headdim, m.dstate, m.ngroups, window, window + D, dtype, dtype,
                             True, with_z, True, True, -1)
        cfgs = sorted({default_mamba2_config(m.headdim, b, window) for b in (1, 16, 17, 4096)},
                      key=lambda c: c.key())
        verify_cfgs = sorted({default_mamba2_verify_config(m.headdim, b) for b in (1, 16, 17, 4096)},
                             key=lambda c: c.key())
        cache = f"L{window}_maxdraft{D}"
        want += [(f"mamba2_replay_{cache}_{d}_{precompile.config_label(c)}", "decode", shape, c, 0) for c in cfgs]
        want += [(f"mamba2_verify_{cache}_T{T}_{d}_{precompile.config_label(c)}", "verify", shape, c, T)
                 for T in Ts for c in verify_cfgs]
    want += [(f"mamba2_commit_{cache}_T{T}", "commit", CommitShape(window, window + D, T, -1), None, T) for T in Ts]
    assert [tuple(v) for v in got] == want
    assert len({v.label for v in got}) == len(got)


@pytest.mark.parametrize("name", GDN_MODELS)
def test_gdn_draft_variants_match_what_verify_asks_for(name):
    """GDN: decode's default configs on the draft cache, verify's own default config (one for every
    batch today), the commit shape per T."""
    import torch

    from replayssm_cute.kernels.commit import CommitShape
    from replayssm_cute.kernels_host import default_gdn_config, default_gdn_verify_config, gdn_shape

    m = get_model(name)
    got = precompile.draft_variants(m, 16, [4, 2], ["bf16"])
    shape = gdn_shape(m.nheads, m.headdim, m.dstate, m.ngroups, 16, 20, torch.bfloat16, torch.bfloat16,
                      torch.float32, torch.float32, None, False, -1)
    dec = sorted({default_gdn_config(m.headdim, b, 16, shape) for b in (1, 4096)}, key=lambda c: c.key())
    ver = sorted({default_gdn_verify_config(m.headdim, b) for b in (1, 4096)}, key=lambda c: c.key())
    want = [(f"gdn_replay_L16_maxdraft4_bf16_{precompile.config_label(c)}", "decode", shape, c, 0) for c in dec]
    want += [(f"gdn_verify_L16_maxdraft4_T{T}_bf16_{precompile.config_label(c)}", "verify", shape, c, T)
             for T in (2, 4) for c in ver]
    want += [(f"gdn_commit_L16_maxdraft4_T{T}", "commit", CommitShape(16, 20, T, -1), None, T) for T in (2, 4)]
    assert [tuple(v) for v in got] == want
    with pytest.raises(ValueError, match="--with-z"):
        precompile.draft_variants(m, 16, [2], ["bf16"], with_z=True)


# ----------------------------------------------------------------------------- read copies


@pytest.mark.parametrize("name", ["nemotron-super", "qwen3.5-122b"])
def test_read_copy_variants_are_what_decode_builds(name):
    """--read-copies: for each read copy and dtype, the shape decode builds for a cache with that
    read copy (fp32 checkpoint; GDN keeping v and beta, re-deriving) and the launch configs it
    picks at small and large batch."""
    import torch

    from replayssm_cute import kernels_host as kh
    from replayssm_cute.cache import GDNCache, Mamba2Cache

    m = get_model(name)
    got = precompile.read_copy_variants(m, 16, ["bf16"], ["fp8", "nvfp4"])
    assert len({lb for lb, _, _ in got}) == len(got) >= 2
    for fmt in ("fp8", "nvfp4"):
        dims = (m.nheads, m.headdim, m.dstate, m.ngroups)
        if m.layer == "gdn":
            cache = GDNCache(1, *dims, window=16, device="meta", read_copy=fmt)
            shape = kh._gdn_cache_shape(cache, torch.bfloat16, torch.float32, torch.float32, None)
            configs = {kh.default_gdn_config(m.headdim, b, 16, shape, kh._whole_head(cache)) for b in (1, 1024)}
        else:
            cache = Mamba2Cache(1, *dims, window=16, device="meta", read_copy=fmt)
            shape = kh._mamba2_cache_shape(cache, torch.bfloat16, True, False, True, True)
            configs = {kh.default_mamba2_config(m.headdim, b, 16, kh._whole_head(cache), shape) for b in (1, 1024)}
        mine = [(lb, s, c) for lb, s, c in got if f"_read_{fmt}_" in lb]
        assert {s for _, s, _ in mine} == {shape}
        assert {c for _, _, c in mine} == configs
        assert all(c.check(shape) is None for c in configs)


@pytest.mark.parametrize("name", ["nemotron-super", "qwen3.5-122b"])
@pytest.mark.parametrize("fmt", ["fp16", "nvfp4"])
def test_read_copy_draft_variants_are_what_verify_builds(name, fmt):
    """--read-copies with --drafts: decode and verify on a draft cache with that read copy, with
    the shapes and launch configs decode / verify build for it; the commit is the plain cache's."""
    import torch

    from replayssm_cute import kernels_host as kh
    from replayssm_cute.cache import GDNCache, Mamba2Cache

    m = get_model(name)
    got = precompile.draft_variants(m, 16, [4], ["bf16"], read_copy=fmt)
    dims = (m.nheads, m.headdim, m.dstate, m.ngroups)
    whole = fmt == "nvfp4"
    if m.layer == "gdn":
        cache = GDNCache(1, *dims, window=16, max_draft=4, device="meta", read_copy=fmt)
        shape = kh._gdn_cache_shape(cache, torch.bfloat16, torch.float32, torch.float32, None)
        dec = {kh.default_gdn_config(m.headdim, b, 16, shape, whole) for b in (1, 4096)}
        ver = {kh.default_gdn_verify_config(m.headdim, b, whole) for b in (1, 4096)}
    else:
        cache = Mamba2Cache(1, *dims, window=16, max_draft=4, device="meta", read_copy=fmt)
        shape = kh._mamba2_cache_shape(cache, torch.bfloat16, True, False, True, True)
        dec = {kh.default_mamba2_config(m.headdim, b, 16, whole, shape) for b in (1, 4096)}
        ver = {kh.default_mamba2_verify_config(m.headdim, b, whole) for b in (1, 4096)}
    assert {v.kind for v in got} == {"decode", "verify"}
    assert all(f"_read_{fmt}_" in v.label for v in got) and len({v.label for v in got}) == len(got)
    assert {v.shape for v in got} == {shape}
    assert {v.config for v in got if v.kind == "decode"} == dec
    assert {v.config for v in got if v.kind == "verify"} == ver
    if whole:
        assert all(v.config.rows_per_cta == m.headdim for v in got)


def test_unknown_read_copy(capsys):
    assert "--read-copies: unknown read copy 'fp4'" in _cli_error(
        capsys, ["--model", "nemotron-super", "--read-copies", "fp8,fp4"])
