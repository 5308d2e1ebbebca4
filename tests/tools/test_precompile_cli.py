"""`python -m replayssm_cute.precompile` argument errors and the model registry (CPU).

Every error below is raised before cutlass is imported or anything is compiled, so `main()` runs
in-process; one case also goes through `python -m` to check the exit status and stderr. One GDN
model is precompiled for real in a subprocess (a few seconds: the full compile-only checks of every
model and arch are in tests/kernels/test_kernels_compile.py).
"""

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from replayssm_cute import precompile
from replayssm_cute.models import MODELS, ModelSpec, get_model
from replayssm_cute.runtime import launch, tuning

from tests.helpers import ROOT, repo_pythonpath

H200 = "NVIDIA H200"

# The tuned launch configs are the tile kernels': the tests run decode on them.
pytestmark = pytest.mark.usefixtures("tile_decode")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("REPLAYSSM_CUTE_CACHE_DIR", str(tmp_path / "cache"))
    # the shipped tuned configs only: no user file, tuning on
    monkeypatch.delenv(tuning.ENV_USER_FILE, raising=False)
    monkeypatch.delenv(tuning.ENV_DISABLE, raising=False)
    launch.reload()
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
    env["PYTHONPATH"] = repo_pythonpath(env)
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
    """A GDN model builds its kernels (conventional and ReplaySSM, every launch config decode
    picks, and with --drafts the decode, verify and commit kernels of a draft cache) in worker
    processes into the disk cache with the options it was given, and leaves no PTX behind;
    decode, verify and commit then find every kernel they ask for on disk. No GPU and no
    --device-name: the defaults and the shipped tuned configs of sm_100a (none: they are sm_90a's)."""
    _check_precompile_with_drafts(tmp_path, "qwen3-next-80b", "sm_100a", 8, "2", "fp16", dump=True, workers=2)


_KERNEL_LINE = re.compile(r"^  \[ *(\d+)/(\d+)\] (\S+) +[0-9.]+ s  ETA \S+(?:  -> (\S+))?$")


def _check_precompile_with_drafts(tmp_path, name, arch, window, drafts, dtype, dump, workers, device=None):
    env = _env()
    env["REPLAYSSM_CUTE_CACHE_DIR"] = str(tmp_path / "cache")
    for var in ("REPLAYSSM_CUTE_DISK_CACHE", "CUTE_DSL_ARCH", tuning.ENV_USER_FILE, tuning.ENV_DISABLE):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "replayssm_cute.precompile", "--model", name, "--arch", arch,
           "--window", str(window), "--dtypes", dtype, "--drafts", drafts, "--workers", str(workers)]
    if dump:
        cmd += ["--dump-ptx", str(tmp_path / "ptx")]
    if device:
        cmd += ["--device-name", device]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    m = get_model(name)
    T = [int(t) for t in drafts.split(",")]
    platforms = precompile.target_platforms(device, arch)
    decode = [lb for lb, _, _ in precompile.variants(m, window, [dtype], platforms=platforms)]
    spec = precompile.draft_variants(m, window, T, [dtype], platforms=platforms)
    plan = precompile.table_variants(m.layer, window, window, (), f"L{window}")  # the ReplaySSM cache's plan
    labels = decode + [v.label for v in plan + spec]
    assert f"precompile {name} for {arch}: {len(labels)} kernels" in proc.stdout, log
    lines = [_KERNEL_LINE.match(ln) for ln in proc.stdout.splitlines()]
    lines = [ln for ln in lines if ln]
    assert [int(ln.group(1)) for ln in lines] == list(range(1, len(labels) + 1)), log  # the count so far
    assert {ln.group(2) for ln in lines} == {str(len(labels))}, log
    printed = [ln.group(3) for ln in lines]
    assert printed == labels if workers == 1 else sorted(printed) == sorted(labels), log
    if dump:
        ptx = sorted(str(tmp_path / "ptx" / f"{lb}.{arch}.ptx") for lb in labels)
        assert sorted(ln.group(4) for ln in lines) == ptx
        assert sorted(p.name for p in (tmp_path / "ptx").iterdir()) == sorted(f"{lb}.{arch}.ptx" for lb in labels)
    kinds = [v.kind for v in spec]
    assert kinds.count("commit") == len(set(T)) and kinds.count("verify") >= len(set(T))
    cache = tmp_path / "cache"
    assert len(list(cache.glob(f"{m.layer}_decode-*.o"))) == len(decode) + kinds.count("decode")
    assert len(list(cache.glob(f"{m.layer}_verify-*.o"))) == kinds.count("verify")
    assert len(list(cache.glob("table_commit-*.o"))) == kinds.count("commit") == len(set(T))
    assert len(list(cache.glob("table_plan-*.o"))) == 1 + kinds.count("plan") == 2 + len(set(T))
    # --keep-ptx's own copy goes to a scratch folder, not the working directory.
    assert sorted(p.name for p in tmp_path.iterdir()) == (["cache", "ptx"] if dump else ["cache"])
    # A server with these caches starts warm: the lookups decode, verify and commit make
    # (engines' usual arguments, every batch bucket) on the device named (else on an H200 and
    # without a GPU) all load from disk.
    warm = subprocess.run([sys.executable, "-c", _WARM, arch, name, str(window), drafts, _DTYPE_NAMES[dtype],
                           device or ""], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, (warm.stdout + warm.stderr)[-6000:]
    per_platform = len(tuning.BATCH_BUCKETS) * (3 + len(set(T)))
    tables = 2 + 2 * len(set(T))  # the plan of each ReplaySSM cache; plan and commit per T
    assert warm.stdout.split() == ["warm", str((1 if device else 2) * per_platform + tables)], warm.stdout


_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

# The kernel lookups of decode / verify / commit on a conventional cache, a ReplaySSM cache and
# its draft cache, at every batch bucket, on the device named (else on an H200 and without a
# GPU), with every compile refused.
_WARM = """
import os, sys
os.environ["CUTE_DSL_ARCH"] = arch = sys.argv[1]
import torch
from replayssm_cute import __version__
from replayssm_cute.kernels import table as kt
from replayssm_cute.layers import LAYERS
from replayssm_cute.runtime import launch, tuning
from replayssm_cute.runtime.compile_cache import cutlass_version
from replayssm_cute.kernels.gdn import decode as gd, verify as gv
from replayssm_cute.kernels.mamba2 import decode as md, verify as mv
from replayssm_cute.models import get_model

def refuse(*args, **kwargs):
    raise AssertionError("compiled: not in the disk cache")

for mod, fn in ((kt, "compile_plan"), (kt, "compile_commit"), (gd, "compile_decode"), (gv, "compile_verify"),
                (md, "compile_decode"), (mv, "compile_verify")):
    setattr(mod, fn, refuse)
m, window = get_model(sys.argv[2]), int(sys.argv[3])
drafts, dtype = sorted({int(t) for t in sys.argv[4].split(",")}), getattr(torch, sys.argv[5])
devices = [sys.argv[6]] if sys.argv[6] else [None, "NVIDIA H200"]
f32, n = torch.float32, 0
dims, kinds = (m.nheads, m.headdim, m.dstate, m.ngroups), ((1, 0), (window, 0), (window, max(drafts)))
layer = LAYERS[m.layer]
caches = [layer.cache_type(2, *dims, window=w, max_draft=d, dtype=dtype) for w, d in kinds]
static = (dtype, f32, f32, None) if m.layer == "gdn" else (dtype, True, False, True, True)
decode = lambda cache, batch: launch.launcher(layer.decode_kernel, layer.shape(cache, static), 0, batch)
verify = lambda cache, T, batch: launch.launcher(layer.verify_kernel, layer.shape(cache, static), T, batch)
for device in devices:
    platform = device and tuning.Platform(device, arch, __version__, cutlass_version())
    with launch.use_platform(platform):
        for batch in tuning.BATCH_BUCKETS:
            for cache in caches:
                decode(cache, batch)
                n += 1
            for T in drafts:
                verify(caches[-1], T, batch)
                n += 1
for c in caches[1:]:  # each ReplaySSM cache's decode plan
    launch.table_launcher("plan", c.window, c.capacity, 0, c.pad_slot_id)
    n += 1
c = caches[-1]
for T in drafts:
    launch.table_launcher("plan", c.window, c.capacity, T, c.pad_slot_id)
    launch.table_launcher("commit", c.window, c.capacity, T, c.pad_slot_id)
    n += 2
print("warm", n)
"""


@pytest.mark.parametrize("name", GDN_MODELS)
def test_gdn_variants_match_what_decode_asks_for(name):
    """Shapes as decode builds them for a GDN cache with the engines' usual arguments (gates in
    the activation dtype, A_log / dt_bias fp32, default scale; HV, V, K, H from the ModelSpec),
    with decode's default launch configs for small and large batches, one label each."""
    import torch

    from replayssm_cute.kernels.gdn.config import GDNShape
    from replayssm_cute.kernels.gdn.defaults import default_gdn_config
    from replayssm_cute.runtime.launch import cute_dtype

    m = get_model(name)
    got = precompile.variants(m, 16, ["bf16", "fp32"])
    want = []
    f32 = cute_dtype(torch.float32)
    for d, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for L, mode in ((1, "conventional"), (16, "replay_L16")):
            act = cute_dtype(dtype)
            shape = GDNShape(m.nheads, m.headdim, m.dstate, m.ngroups, L, L, act, act, f32, f32, 0.0, False, -1)
            for cfg in sorted({default_gdn_config(m.headdim, b, L, shape) for b in (1, 16, 17, 4096)},
                              key=lambda c: c.key()):
                assert cfg.check(shape) is None
                want.append((f"gdn_{mode}_{d}_{precompile.config_label(cfg)}", shape, cfg))
    assert got == want
    assert len({lb for lb, _, _ in got}) == len(got)
    assert precompile.variants(m, 16, ["bf16"]) == [v for v in got if "_bf16_" in v[0]]
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
    """Mamba-2 --drafts end to end (small window to keep it fast) for an H200, one kernel after
    another in order (--workers 1): decode kernels (the conventional step's with the shipped H200
    tuned configs), then decode on the draft cache, verify per (T, launch config) and commit per
    T; decode, verify and commit on an H200 then find every kernel they ask for on disk. (The GDN
    run above covers --dump-ptx and the worker processes, test_kernels_compile.py the Mamba-2
    verify PTX.)"""
    _check_precompile_with_drafts(tmp_path, "nemotron-super", "sm_90a", 4, "2,1", "bf16", dump=False, workers=1,
                                  device=H200)


@pytest.mark.parametrize("name,window,drafts", [
    ("nemotron-super", 16, [8, 2, 4]), ("nemotron-nano-4b", 16, [4]), ("nemotron-h-8b", 8, [1, 8]),
])
@pytest.mark.parametrize("with_z", [False, True])
def test_mamba2_draft_variants_match_what_verify_asks_for(name, window, drafts, with_z):
    """The draft cache (max_draft = max T) shape as decode / verify build it for a Mamba2Cache with
    the engines' usual arguments, decode's and verify's default launch configs for small and large
    batches, the commit shape per T; one label each."""
    import torch

    from replayssm_cute.kernels.mamba2.config import Mamba2Shape
    from replayssm_cute.kernels.mamba2.defaults import default_mamba2_config, default_mamba2_verify_config
    from replayssm_cute.runtime.launch import cute_dtype

    m = get_model(name)
    got = precompile.draft_variants(m, window, drafts, ["bf16", "fp16"], with_z=with_z)
    Ts, D = sorted(drafts), max(drafts)
    want = []
    for d, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        act = cute_dtype(dtype)
        shape = Mamba2Shape(m.nheads, m.headdim, m.dstate, m.ngroups, window, window + D, act, act,
                            True, with_z, True, True, -1)
        cfgs = sorted({default_mamba2_config(m.headdim, b, window) for b in (1, 16, 17, 4096)},
                      key=lambda c: c.key())
        verify_cfgs = sorted({default_mamba2_verify_config(m.headdim, b) for b in (1, 16, 17, 4096)},
                             key=lambda c: c.key())
        cache = f"L{window}_maxdraft{D}"
        want += [(f"mamba2_replay_{cache}_{d}_{precompile.config_label(c)}", "decode", shape, c, 0) for c in cfgs]
        want += [(f"mamba2_verify_{cache}_T{T}_{d}_{precompile.config_label(c)}", "verify", shape, c, T)
                 for T in Ts for c in verify_cfgs]
    want += _table_want("mamba2", cache, window, window + D, Ts)
    assert [tuple(v) for v in got] == want
    assert len({v.label for v in got}) == len(got)


def _table_want(layer, cache, window, capacity, Ts):
    """The sequence-table kernels of a draft cache: the decode plan, then plan and commit per T."""
    from replayssm_cute.kernels.table import TableShape

    want = [(f"{layer}_plan_{cache}_T0", "plan", TableShape(window, capacity, 0, -1), None, 0)]
    for T in Ts:
        want += [(f"{layer}_plan_{cache}_T{T}", "plan", TableShape(window, capacity, T, -1), None, T),
                 (f"{layer}_commit_{cache}_T{T}", "commit", TableShape(window, capacity, T, -1), None, T)]
    return want


@pytest.mark.parametrize("name", GDN_MODELS)
def test_gdn_draft_variants_match_what_verify_asks_for(name):
    """GDN: decode's default configs on the draft cache, verify's own default config (one for every
    batch today), the commit shape per T."""
    import torch

    from replayssm_cute.kernels.gdn.config import GDNShape
    from replayssm_cute.kernels.gdn.defaults import default_gdn_config, default_gdn_verify_config
    from replayssm_cute.runtime.launch import cute_dtype

    m = get_model(name)
    got = precompile.draft_variants(m, 16, [4, 2], ["bf16"])
    bf16, f32 = cute_dtype(torch.bfloat16), cute_dtype(torch.float32)
    shape = GDNShape(m.nheads, m.headdim, m.dstate, m.ngroups, 16, 20, bf16, bf16, f32, f32, 0.0, False, -1)
    dec = sorted({default_gdn_config(m.headdim, b, 16, shape) for b in tuning.BATCH_BUCKETS}, key=lambda c: c.key())
    ver = sorted({default_gdn_verify_config(m.headdim, b) for b in tuning.BATCH_BUCKETS}, key=lambda c: c.key())
    want = [(f"gdn_replay_L16_maxdraft4_bf16_{precompile.config_label(c)}", "decode", shape, c, 0) for c in dec]
    want += [(f"gdn_verify_L16_maxdraft4_T{T}_bf16_{precompile.config_label(c)}", "verify", shape, c, T)
             for T in (2, 4) for c in ver]
    want += _table_want("gdn", "L16_maxdraft4", 16, 20, (2, 4))
    assert [tuple(v) for v in got] == want
    with pytest.raises(ValueError, match="--with-z"):
        precompile.draft_variants(m, 16, [2], ["bf16"], with_z=True)


# ----------------------------------------------------------------------------- read copies


@pytest.mark.parametrize("name", ["nemotron-super", "qwen3.5-122b"])
def test_read_copy_variants_are_what_decode_builds(name):
    """--read-copies: for each read copy and dtype, the shape decode builds for a cache with that
    read copy (fp32 checkpoint; GDN keeping v and beta, re-deriving) and the launch configs it
    picks at every batch bucket (no tuned read-copy configs: the defaults)."""
    import torch

    from replayssm_cute.cache import GDNCache, Mamba2Cache
    from replayssm_cute.kernels.gdn.defaults import default_gdn_config
    from replayssm_cute.kernels.mamba2.defaults import default_mamba2_config
    from replayssm_cute.layers import GDNLayer, Mamba2Layer
    from replayssm_cute.layers.common import whole_head

    m = get_model(name)
    got = precompile.read_copy_variants(m, 16, ["bf16"], ["fp8", "nvfp4"])
    assert len({lb for lb, _, _ in got}) == len(got) >= 2
    for fmt in ("fp8", "nvfp4"):
        dims = (m.nheads, m.headdim, m.dstate, m.ngroups)
        if m.layer == "gdn":
            cache = GDNCache(1, *dims, window=16, device="meta", read_copy=fmt)
            shape = GDNLayer.shape(cache, (torch.bfloat16, torch.float32, torch.float32, None))
            configs = {default_gdn_config(m.headdim, b, 16, shape, whole_head(shape)) for b in tuning.BATCH_BUCKETS}
        else:
            cache = Mamba2Cache(1, *dims, window=16, device="meta", read_copy=fmt)
            shape = Mamba2Layer.shape(cache, (torch.bfloat16, True, False, True, True))
            configs = {default_mamba2_config(m.headdim, b, 16, whole_head(shape), shape) for b in tuning.BATCH_BUCKETS}
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

    from replayssm_cute.cache import GDNCache, Mamba2Cache
    from replayssm_cute.kernels.gdn.defaults import default_gdn_config, default_gdn_verify_config
    from replayssm_cute.kernels.mamba2.defaults import default_mamba2_config, default_mamba2_verify_config
    from replayssm_cute.layers import GDNLayer, Mamba2Layer

    m = get_model(name)
    got = precompile.draft_variants(m, 16, [4], ["bf16"], read_copy=fmt)
    dims = (m.nheads, m.headdim, m.dstate, m.ngroups)
    whole = fmt == "nvfp4"
    if m.layer == "gdn":
        cache = GDNCache(1, *dims, window=16, max_draft=4, device="meta", read_copy=fmt)
        shape = GDNLayer.shape(cache, (torch.bfloat16, torch.float32, torch.float32, None))
        dec = {default_gdn_config(m.headdim, b, 16, shape, whole) for b in tuning.BATCH_BUCKETS}
        ver = {default_gdn_verify_config(m.headdim, b, whole) for b in tuning.BATCH_BUCKETS}
    else:
        cache = Mamba2Cache(1, *dims, window=16, max_draft=4, device="meta", read_copy=fmt)
        shape = Mamba2Layer.shape(cache, (torch.bfloat16, True, False, True, True))
        dec = {default_mamba2_config(m.headdim, b, 16, whole, shape) for b in tuning.BATCH_BUCKETS}
        ver = {default_mamba2_verify_config(m.headdim, b, whole) for b in tuning.BATCH_BUCKETS}
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


# ----------------------------------------------------------------------------- tuned configs

SHIPPED = [e for path in sorted(tuning.SHIPPED_DIR.glob("*.json")) for e in tuning.read_entries(path)]


def _entries_of(model):
    """The shipped tuned entries at `model`'s layer dims."""
    dims = (model.nheads, model.headdim, model.dstate, model.ngroups)
    return [e for e in SHIPPED if e["kernel"].startswith(model.layer + "_")
            and tuple(e["shape"][n] for n in tuning.LAYER_DIMS[model.layer]) == dims]


TUNED_MODELS = sorted(n for n, m in MODELS.items() if _entries_of(m))


def _h200(arch="sm_90a"):
    from replayssm_cute import __version__
    from replayssm_cute.runtime.compile_cache import cutlass_version

    return tuning.Platform(H200, arch, __version__, cutlass_version())


class _Lookups:
    """What decode / verify / commit of `model` ask the compile cache for with the engines' usual
    arguments, at every batch bucket: the conventional cache, the ReplaySSM cache of `window` and,
    with `drafts`, the draft cache of max_draft = max(drafts) (decode, verify per T, commit per T)."""

    def __init__(self, model, window, drafts, dtype):
        import torch

        from replayssm_cute.layers import LAYERS

        self.layer, self.model, f32 = LAYERS[model.layer], model, torch.float32
        self.dtype = getattr(torch, _DTYPE_NAMES[dtype])
        dims = (model.nheads, model.headdim, model.dstate, model.ngroups)
        cls = self.layer.cache_type
        self.caches = {(w, d): cls(1, *dims, window=w, max_draft=d, dtype=self.dtype, device="meta")
                       for w, d in [(1, 0), (window, 0)] + ([(window, max(drafts))] if drafts else [])}
        self.inputs = (self.dtype, f32, f32, None) if model.layer == "gdn" else (self.dtype, True, False, True, True)

    def decode(self, cache, batch):
        return launch.launcher(self.layer.decode_kernel, self.layer.shape(cache, self.inputs), 0, batch)

    def verify(self, cache, T, batch):
        return launch.launcher(self.layer.verify_kernel, self.layer.shape(cache, self.inputs), T, batch)

    def all(self, drafts):
        """Every lookup at every bucket, then the sequence-table kernels (as the table asks for
        them: each ReplaySSM cache's decode plan, the draft cache's verify plan and commit per T)."""
        for (w, d), cache in self.caches.items():
            for batch in tuning.BATCH_BUCKETS:
                self.decode(cache, batch)
                for T in drafts if d else []:
                    self.verify(cache, T, batch)
            if w > 1:
                launch.table_launcher("plan", cache.window, cache.capacity, 0, cache.pad_slot_id)
        cache = self.caches[max(self.caches)]
        for T in drafts:
            launch.table_launcher("plan", cache.window, cache.capacity, T, cache.pad_slot_id)
            launch.table_launcher("commit", cache.window, cache.capacity, T, cache.pad_slot_id)

    def tuned_key(self, entry):
        """(name, key) the compile cache is asked for when `entry`'s tuned config is picked, or
        None where decode runs the other kernel class at the entry's bucket (a tile kernel's entry
        where the pipelined kernel is the default: it serves under REPLAYSSM_CUTE_PIPELINED=0)."""
        verify = entry["kernel"].endswith("_verify")
        cache = self.caches[max(self.caches)] if verify else self.caches[(entry["window"], 0)]
        shape = self.layer.shape(cache, self.inputs)
        kernel = self.layer.verify_kernel if verify else self.layer.decode_kernel
        default = kernel.default_config(shape, entry["batch"])
        try:
            config = dataclasses.replace(default, **entry["config"])
        except TypeError:
            return None
        return entry["kernel"], shape.key() + config.key() + ((entry["num_drafts"],) if verify else ())


@pytest.mark.parametrize("how", ["--device-name", "visible GPU", "no GPU"])
@pytest.mark.parametrize("name", TUNED_MODELS)
def test_precompile_builds_the_tuned_configs_decode_picks(name, how, monkeypatch):
    """Every shipped tuned entry of the model: after precompile for an H200 (named with
    --device-name, or the visible GPU, faked with launch.use_platform; or with neither: the
    defaults and every shipped entry), decode, verify and commit on an H200 find every kernel they
    pick at every batch bucket (the entry's tuned config at its bucket) without compiling; with
    neither, so do they without a GPU (the defaults). Compiles recorded, not run (--workers 1)."""
    from replayssm_cute.runtime import compile_cache

    m = get_model(name)
    entries = [e for e in _entries_of(m) if e.get("state", "fp32") == "fp32"]  # plain caches (read copies: below)
    window = max([e["window"] for e in entries if e["window"] > 1], default=16)  # ReplaySSM's
    drafts = sorted({e["num_drafts"] for e in entries if e["num_drafts"]})
    dtypes = sorted({e["dtype"] for e in entries})
    built = set()
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(compile_cache, "get_compiled", lambda n, key, build: built.add((n, key)))
    argv = ["--model", name, "--arch", "sm_90a", "--window", str(window), "--dtypes", ",".join(dtypes),
            "--workers", "1"] + (["--drafts", ",".join(map(str, drafts))] if drafts else [])
    if how == "--device-name":
        assert precompile.main(argv + ["--device-name", H200]) == 0
    elif how == "visible GPU":
        with launch.use_platform(_h200()):
            assert precompile.main(argv) == 0
    else:
        with launch.use_platform(None):
            assert precompile.main(argv) == 0

    asked = []

    def at_first_use(n, key, build):
        assert (n, key) in built, f"{n} {key}: not precompiled, compiled at first use"
        asked.append((n, key))

    monkeypatch.setattr(compile_cache, "get_compiled", at_first_use)
    for dtype in dtypes:
        lookups = _Lookups(m, window, drafts, dtype)
        for platform in [_h200()] + ([None] if how == "no GPU" else []):
            with launch.use_platform(platform):
                lookups.all(drafts)
        for e in entries:
            key = lookups.tuned_key(e) if e["dtype"] == dtype else None
            assert key is None or key in asked, e


def test_target_platforms():
    """The device named; else the visible GPU's (faked); else none (the defaults) and every device
    with tuned configs; at the arch given, with this package's and CuTe DSL's versions."""
    b200 = dataclasses.replace(_h200("sm_100a"), device="NVIDIA B200")
    assert precompile.target_platforms(H200, "sm_90a") == [_h200()]
    assert precompile.target_platforms("NVIDIA B200", "sm_100a") == [b200]
    with launch.use_platform(tuning.Platform("NVIDIA B200", "sm_100a", "0.0.1", "0.0")):
        assert precompile.target_platforms(None, "sm_100a") == [b200]
        assert precompile.target_platforms(H200, "sm_90a") == [_h200()]
    with launch.use_platform(None):
        assert precompile.target_platforms(None, "sm_90a") == [None, _h200()]


def test_use_platform_is_what_decode_looks_up(monkeypatch):
    """Inside launch.use_platform decode picks the platform's tuned config (the shipped H200 one
    of nemotron-super's conventional step at batch 1), outside it this process's (patched: none);
    memoised picks do not leak across."""
    import torch

    import replayssm_cute as rs
    from replayssm_cute.kernels.mamba2.config import Mamba2Config
    from replayssm_cute.layers import Mamba2Layer

    monkeypatch.setattr(tuning, "current_platform", lambda: None)
    m = get_model("nemotron-super")
    cache = rs.Mamba2Cache(1, m.nheads, m.headdim, m.dstate, m.ngroups, window=1, device="meta")
    seen = []
    monkeypatch.setattr(launch, "compiled", lambda kernel, shape, cfg, num_drafts=0: seen.append(cfg))
    launch.reload()
    shape = Mamba2Layer.shape(cache, (torch.bfloat16, True, False, True, True))
    for platform in (_h200(), None):
        with launch.use_platform(platform):
            launch.launcher(Mamba2Layer.decode_kernel, shape, 0, 1)
        launch.launcher(Mamba2Layer.decode_kernel, shape, 0, 1)
    assert seen == [Mamba2Config(8, 2, 0), Mamba2Config(8, 2, 0), Mamba2Config(8, 2, 0), Mamba2Config(8, 2, 0)]


# ----------------------------------------------------------------------------- usage errors


def _run_cli(args, **env):
    full = _env()
    for var in ("CUTE_DSL_ARCH", "REPLAYSSM_CUTE_DISK_CACHE"):
        full.pop(var, None)
    full.update(env)
    return subprocess.run([sys.executable, "-m", "replayssm_cute.precompile", *args], env=full, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _one_line_usage_error(proc, message):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and message in lines[-1] and lines[-1].startswith(
        "python -m replayssm_cute.precompile: error: "), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_no_arch_and_no_gpu():
    proc = _run_cli(["--model", "nemotron-super"], CUDA_VISIBLE_DEVICES="")
    _one_line_usage_error(proc, "--arch: not given and none to default to (no CUDA GPU is visible")
    assert "give sm_90a, sm_100a or sm_103a" in proc.stderr


def test_bad_dump_ptx_path_fails_before_building(tmp_path):
    """A --dump-ptx that is a file, or under one, fails at once: no kernel is built, no folder made."""
    afile = tmp_path / "afile"
    afile.write_text("")
    cache = tmp_path / "cache"
    for path, message in ((afile, f"--dump-ptx: {afile} is a file, expected a folder"),
                          (afile / "ptx", f"--dump-ptx: cannot create {afile / 'ptx'}: {afile} is a file")):
        proc = _run_cli(["--model", "qwen3.5-4b", "--arch", "sm_90a", "--dump-ptx", str(path)],
                        REPLAYSSM_CUTE_CACHE_DIR=str(cache))
        _one_line_usage_error(proc, message)
    assert not cache.exists()


@pytest.mark.parametrize("argv,message", [
    (["--workers", "0"], "--workers must be >= 1, got 0"),
    (["--device-name", " "], "--device-name: expected a GPU name such as \"NVIDIA H200\""),
])
def test_workers_and_device_name_errors(capsys, argv, message):
    assert message in _cli_error(capsys, ["--model", "nemotron-super", "--arch", "sm_90a"] + argv)


def test_path_error(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert precompile.path_error(tmp_path / "new" / "deeper" / "x.csv") is None  # folders to create
    assert precompile.path_error(afile) is None and precompile.path_error(tmp_path, folder=True) is None
    assert precompile.path_error(tmp_path / "new", folder=True) is None
    assert precompile.path_error(tmp_path) == f"{tmp_path} is a folder, expected a file path"
    assert precompile.path_error(afile, folder=True) == f"{afile} is a file, expected a folder"
    assert precompile.path_error(afile / "x" / "y.csv") == (
        f"cannot create {afile / 'x' / 'y.csv'}: {afile} is a file, not a folder")


def test_a_kernel_that_does_not_compile_fails_the_run(monkeypatch, capsys):
    """Every other kernel is still built; the failure is named on stderr, exit 1, no traceback."""
    from replayssm_cute.runtime import compile_cache

    built = []
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(compile_cache, "get_compiled", lambda n, key, build: built.append(n))
    real = precompile.compile_draft_variant

    def compile_or_fail(layer, variant):
        if variant.label == "gdn_conventional_bf16_rows8_warps2":
            raise RuntimeError("ptxas died\nmore detail")
        return real(layer, variant)

    monkeypatch.setattr(precompile, "compile_draft_variant", compile_or_fail)
    with launch.use_platform(None):
        assert precompile.main(["--model", "qwen3.5-4b", "--arch", "sm_90a", "--device-name", "NVIDIA B200",
                                "--workers", "1"]) == 1
    out, err = capsys.readouterr()
    assert "launch configs: the defaults (no tuned configs for 'NVIDIA B200'; tuned: 'NVIDIA H200')" in out
    assert "gdn_conventional_bf16_rows8_warps2" in out and "FAILED" in out and "Traceback" not in err
    assert err.splitlines()[-1] == ("python -m replayssm_cute.precompile: 1 of 4 kernels did not compile: "
                                    "gdn_conventional_bf16_rows8_warps2")
    assert len(built) == 3  # the other decode kernels and the ReplaySSM cache's plan
