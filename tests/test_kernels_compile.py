"""Compile-only builds of every decode kernel variant (Mamba-2 and GDN), for every supported arch,
no GPU.

Each (model, arch) runs `python -m replayssm_cute.precompile --dump-ptx` in its own process
(CuTe DSL reads CUTE_DSL_ARCH once per process) with `CUTE_DSL_COMPILER_OPT="remarks{ptx}"`, so
ptxas reports every kernel's stack frame and spills. The PTX and those reports are then checked:
right target, TMA streaming of the checkpoint, no local memory, no spills. Besides the registry's
models, two GDN shapes that no model has go through the same precompile (registered in the child
process; sm_90a and sm_100a): 2 key heads with 3 value heads each at K = V = 64, and K = V = 48,
where a state row fills only 24 of a warp's 32 lanes.
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replayssm_cute.models import ModelSpec, get_model

ROOT = Path(__file__).resolve().parents[1]

MODELS = ("nemotron-super", "nemotron-nano-4b", "qwen3.5-4b", "qwen3.5-122b")
# GDN shapes outside the registry: ModelSpec(name, "gdn", HV, V, K, H key heads, layers).
ODD_SHAPES = {
    "gdn-h2-hv6-k64": ModelSpec("gdn-h2-hv6-k64", "gdn", 6, 64, 64, 2, 1),
    "gdn-h2-hv4-k48": ModelSpec("gdn-h2-hv4-k48", "gdn", 4, 48, 48, 2, 1),
}
ARCHS = ("sm_90a", "sm_100a", "sm_103a")
WINDOW = 16  # precompile's default
# The odd shapes skip sm_103a to save CI time: its PTX is sm_100a's but for the .target line.
CASES = ([(m, a) for a in ARCHS for m in MODELS]
         + [(m, a) for a in ARCHS if a != "sm_103a" for m in ODD_SHAPES])

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# "  mamba2_replay_L16_bf16_rows64_warps4             2.7 s  -> DIR/mamba2_...ptx"
_LABEL = re.compile(r"^\s+((?:mamba2|gdn)_\S+)\s+([0-9.]+) s(?:\s+-> (\S+))?\s*$")
_HEADER = re.compile(r"^precompile (\S+) for (\S+): (\d+) kernels$")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def _env(cache_dir: Path) -> dict:
    env = dict(os.environ)
    env.pop("CUTE_DSL_ARCH", None)  # --arch decides
    env.pop("REPLAYSSM_CUTE_DISK_CACHE", None)
    env["REPLAYSSM_CUTE_CACHE_DIR"] = str(cache_dir)
    env["CUTE_DSL_COMPILER_OPT"] = "remarks{ptx}"
    env["PYTHONUNBUFFERED"] = "1"  # keep stdout (labels) and stderr (ptxas remarks) in order
    paths = [str(ROOT / "src"), str(ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def _kernel_sources_hash():
    from replayssm_cute.compile_cache import _hash_tree

    return _hash_tree([ROOT / "kernels"])


def _spec(model):
    return ODD_SHAPES[model] if model in ODD_SHAPES else get_model(model)


# The precompile CLI with one extra registry entry (for the odd shapes).
_WITH_SPEC = ("import sys; from replayssm_cute import models, precompile; "
              "spec = models.ModelSpec(*{!r}); models.MODELS[spec.name] = spec; "
              "sys.exit(precompile.main(sys.argv[1:]))")


def _precompile(model, arch, cache_dir, ptx_dir=None):
    if model in ODD_SHAPES:
        s = ODD_SHAPES[model]
        fields = (s.name, s.layer, s.nheads, s.headdim, s.dstate, s.ngroups, s.num_layers)
        cmd = [sys.executable, "-c", _WITH_SPEC.format(fields)]
    else:
        cmd = [sys.executable, "-m", "replayssm_cute.precompile"]
    cmd += ["--model", model, "--arch", arch]
    if ptx_dir is not None:
        cmd += ["--dump-ptx", str(ptx_dir)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(cache_dir), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    return proc, _ANSI.sub("", proc.stdout), time.perf_counter() - t0


def _parse(log: str):
    """(header match, [(label, seconds, ptx path, [spill tuples of the compiles before it])])."""
    header, kernels, pending = None, [], []
    for line in log.splitlines():
        m = _HEADER.match(line.strip())
        if m:
            header = m
            continue
        m = _SPILL.search(line)
        if m:
            pending.append(tuple(int(v) for v in m.groups()))
            continue
        m = _LABEL.match(line)
        if m:
            kernels.append((m.group(1), float(m.group(2)), m.group(3), pending))
            pending = []
    return header, kernels


class Build:
    def __init__(self, model, arch, tmp):
        self.model, self.arch = model, arch
        self.cache_dir = tmp / "cache"
        self.ptx_dir = tmp / "ptx"
        self.source_hash = _kernel_sources_hash()
        self.proc, self.log, self.seconds = _precompile(model, arch, self.cache_dir, self.ptx_dir)
        self.header, self.kernels = _parse(self.log)

    def tail(self, n=6000):
        return self.log[-n:]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """(model, arch) -> Build, each run at most once per module."""
    done = {}

    def get(model, arch):
        if (model, arch) not in done:
            done[model, arch] = Build(model, arch, tmp_path_factory.mktemp(f"precompile-{model}-{arch}"))
        return done[model, arch]

    return get


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{a}" for m, a in CASES])
def build(request, builds):
    return builds(*request.param)


def _expected_labels(model):
    from replayssm_cute.precompile import variants

    return [label for label, _, _ in variants(_spec(model), WINDOW, ["bf16"])]


def test_precompile_succeeds(build):
    assert build.proc.returncode == 0, build.tail()
    assert build.header is not None, build.tail()
    assert build.header.group(2) == build.arch
    assert int(build.header.group(3)) == len(build.kernels), build.tail()


def test_every_variant_is_built_with_one_ptx_file(build):
    assert build.proc.returncode == 0, build.tail()
    labels = [k[0] for k in build.kernels]
    assert labels == _expected_labels(build.model)
    assert any("conventional" in lb for lb in labels) and any("replay" in lb for lb in labels)
    paths = [Path(k[2]) for k in build.kernels]
    assert all(k[2] for k in build.kernels), build.tail()
    for label, path in zip(labels, paths):
        assert path.parent == build.ptx_dir
        assert path.name == f"{label}.{build.arch}.ptx"
        assert path.is_file() and path.stat().st_size > 0
    assert sorted(p.name for p in build.ptx_dir.iterdir()) == sorted(p.name for p in paths)
    # The compile cache holds one object per variant.
    assert len(list(build.cache_dir.glob(f"{_spec(build.model).layer}_decode-*.o"))) == len(labels)


def _ptx_files(build):
    assert build.proc.returncode == 0, build.tail()
    files = sorted(build.ptx_dir.glob("*.ptx"))
    assert len(files) == len(build.kernels) > 0
    return files


def test_ptx_targets_the_arch(build):
    for f in _ptx_files(build):
        targets = re.findall(r"^\s*\.target\s+(\S+)", f.read_text(), flags=re.M)
        assert targets and all(t.rstrip(",") == build.arch for t in targets), (f.name, targets)


def test_ptx_streams_the_state_with_tma(build):
    files = _ptx_files(build)
    assert any("replay" in f.name for f in files)
    assert any("conventional" in f.name for f in files)
    for f in files:  # replay kernels, and the conventional ones (window 1) too
        assert "cp.async.bulk.tensor" in f.read_text(), f.name


def test_ptx_declares_no_local_memory(build):
    for f in _ptx_files(build):
        hits = [ln.strip() for ln in f.read_text().splitlines() if re.search(r"\.local\b", ln)]
        assert not hits, (f.name, hits[:5])


def test_ptxas_reports_no_spills(build):
    assert build.proc.returncode == 0, build.tail()
    assert build.kernels, build.tail()
    for label, _, _, reports in build.kernels:
        assert reports, f"no ptxas spill report for {label}:\n{build.tail()}"
        for stack, stores, loads in reports:
            assert stores == 0, f"{label}: {stores} bytes spill stores"
            assert loads == 0, f"{label}: {loads} bytes spill loads"
            assert stack == 0, f"{label}: {stack} bytes stack frame"


@pytest.mark.parametrize("model", ["nemotron-super", "qwen3.5-4b"])
def test_second_precompile_is_a_cache_hit(builds, model):
    """Same cache dir again: every kernel loads from disk, nothing is rebuilt or rewritten."""
    build = builds(model, "sm_90a")
    assert build.proc.returncode == 0, build.tail()
    if _kernel_sources_hash() != build.source_hash:
        pytest.skip("kernels/*.py changed since the first build (new cache keys by design)")
    before = {p.name: p.stat().st_mtime_ns for p in build.cache_dir.glob("*.o")}
    assert len(before) == len(build.kernels)
    proc, log, _ = _precompile(build.model, build.arch, build.cache_dir)
    assert proc.returncode == 0, log[-6000:]
    after = {p.name: p.stat().st_mtime_ns for p in build.cache_dir.glob("*.o")}
    assert after == before
    assert not list(build.cache_dir.glob("*.tmp")) and not list(build.cache_dir.glob(".*.tmp"))
    _, hits = _parse(log)
    assert [k[0] for k in hits] == [k[0] for k in build.kernels]
    assert not any(k[3] for k in hits), "ptxas ran on a cache hit"
    miss_s = sum(k[1] for k in build.kernels)
    hit_s = sum(k[1] for k in hits)
    assert hit_s < 0.5 * miss_s, (hit_s, miss_s)
