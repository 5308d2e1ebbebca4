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
from unittest import mock

import pytest

from replayssm_cute.models import ModelSpec, get_model

from tests.helpers import ROOT, repo_pythonpath

# its tests share the module's fixtures: one pytest-xdist worker runs them all (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("kernels_compile")

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
# precompile's "[i/n] label  1.2 s  ETA 3s" lines, and the draft / snapshot children's "label  1.2 s"
_LABEL = re.compile(r"^\s+(?:\[\s*\d+/\d+\] )?((?:mamba2|gdn)_\S+)\s+([0-9.]+) s(?:\s+ETA \S+)?(?:\s+-> (\S+))?\s*$")
_HEADER = re.compile(r"^precompile (\S+) for (\S+): (\d+) kernels$")
_SPILL = re.compile(r"(\d+)\s+bytes\s+stack\s+frame,\s+(\d+)\s+bytes\s+spill\s+stores,\s+(\d+)\s+bytes\s+spill\s+loads")


def _env(cache_dir: Path) -> dict:
    env = dict(os.environ)
    env.pop("CUTE_DSL_ARCH", None)  # --arch decides
    env.pop("REPLAYSSM_CUTE_DISK_CACHE", None)
    env["REPLAYSSM_CUTE_CACHE_DIR"] = str(cache_dir)
    env["CUTE_DSL_COMPILER_OPT"] = "remarks{ptx}"
    env["PYTHONUNBUFFERED"] = "1"  # keep stdout (labels) and stderr (ptxas remarks) in order
    env["PYTHONPATH"] = repo_pythonpath(env)
    return env


def _kernel_sources_hash():
    from replayssm_cute.runtime.compile_cache import _hash_tree

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
    # one worker: ptxas reports stay next to the label line of their kernel
    cmd += ["--model", model, "--arch", arch, "--workers", "1"]
    if ptx_dir is not None:
        cmd += ["--dump-ptx", str(ptx_dir)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(cache_dir), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    return proc, _ANSI.sub("", proc.stdout), time.perf_counter() - t0


def _parse(log: str):
    """(header match, [(label, seconds, ptx path, [spill tuples of the compiles before it])]).

    A spill report may wrap over two lines (ptxas wraps its longer "register spills" remark), so
    reports are matched on the whole log and given to the first label line after them."""
    header, kernels = None, []
    reports = [(m.start(), tuple(int(v) for v in m.groups())) for m in _SPILL.finditer(log)]
    pos = 0
    for line in log.splitlines(keepends=True):
        start, pos = pos, pos + len(line)
        m = _HEADER.match(line.strip())
        if m:
            header = m
            continue
        m = _LABEL.match(line.rstrip("\n"))
        if m:
            done = sum(len(k[3]) for k in kernels)
            pending = [r for at, r in reports[done:] if at < start]
            kernels.append((m.group(1), float(m.group(2)), m.group(3), pending))
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


def _expected_labels(model, arch):
    from replayssm_cute import precompile

    platforms = precompile.target_platforms(None, arch)
    spec = _spec(model)
    with mock.patch.dict(os.environ, {"CUTE_DSL_ARCH": arch}):  # the decode kernel and grid follow the target
        return ([label for label, _, _ in precompile.variants(spec, WINDOW, ["bf16"], platforms=platforms)]
                + [v.label for v in precompile.table_variants(spec.layer, WINDOW, WINDOW, (), f"L{WINDOW}")])


def test_precompile_succeeds(build):
    assert build.proc.returncode == 0, build.tail()
    assert build.header is not None, build.tail()
    assert build.header.group(2) == build.arch
    assert int(build.header.group(3)) == len(build.kernels), build.tail()


def test_every_variant_is_built_with_one_ptx_file(build):
    assert build.proc.returncode == 0, build.tail()
    labels = [k[0] for k in build.kernels]
    assert labels == _expected_labels(build.model, build.arch)
    assert any("conventional" in lb for lb in labels) and any("replay" in lb for lb in labels)
    paths = [Path(k[2]) for k in build.kernels]
    assert all(k[2] for k in build.kernels), build.tail()
    for label, path in zip(labels, paths):
        assert path.parent == build.ptx_dir
        assert path.name == f"{label}.{build.arch}.ptx"
        assert path.is_file() and path.stat().st_size > 0
    assert sorted(p.name for p in build.ptx_dir.iterdir()) == sorted(p.name for p in paths)
    # The compile cache holds one object per variant.
    decode = [lb for lb in labels if "_plan_" not in lb]
    assert len(list(build.cache_dir.glob(f"{_spec(build.model).layer}_decode-*.o"))) == len(decode)
    assert len(list(build.cache_dir.glob("table_plan-*.o"))) == len(labels) - len(decode) == 1


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
    for f in files:  # replay kernels, and the conventional ones (window 1) too; not the step's plan
        assert ("cp.async.bulk.tensor" in f.read_text()) == ("_plan_" not in f.name), f.name


# Programmatic dependent launch: before griddepcontrol.wait a kernel may only read a slot id past
# L1 (ld.global.cg) and prefetch into L2; every other global load, TMA load and store comes after.
_WAIT = "griddepcontrol.wait"
_GLOBAL_ACCESS = re.compile(r"\b(?:ld\.global|st\.global|cp\.async|red\.|atom\.)")
_BEFORE_WAIT_ALLOWED = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:ld\.global\.cg\.b32|cp\.async\.bulk\.prefetch\.L2)")


def _check_programmatic_launch(name: str, ptx: str):
    lines = ptx.splitlines()
    waits = [i for i, ln in enumerate(lines) if _WAIT in ln]
    assert len(waits) == 1, (name, f"{len(waits)} {_WAIT}")
    assert sum("griddepcontrol.launch_dependents" in ln for ln in lines[waits[0]:]) == 1, name
    early = [ln.strip() for ln in lines[:waits[0]] if _GLOBAL_ACCESS.search(ln) and not _BEFORE_WAIT_ALLOWED.match(ln)]
    assert not early, (name, early[:5])


def test_ptx_waits_for_the_previous_kernel_before_touching_its_data(build):
    for f in _ptx_files(build):
        _check_programmatic_launch(f.name, f.read_text())


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


# ----------------------------------------------------------------------------- speculative kernels
#
# The verify kernels (and commit) that `precompile --drafts` builds, at window 16: nemotron-super
# with T = 2, 4, 8 (a cache of max_draft 8: 24 ring records) and nemotron-nano-4b with T = 4
# (max_draft 4, headdim 80), each with the small- and large-batch launch configs verify picks (on
# sm_90a the pipelined verify's two: items of one head, and units),
# plus on sm_90a the decode kernels on the super draft cache (capacity 24 > window); sm_103a (whose
# PTX is sm_100a's but for the .target line) takes the large-batch configs only, to save CI time.
# One child process per arch compiles each kernel once, straight to PTX (precompile --dump-ptx
# would compile everything twice and rebuild the decode kernels checked above), in parallel;
# the kernel list is precompile.draft_variants, and precompile's own --drafts runs are in
# tests/tools/test_precompile_cli.py. T = 16 at window 16 spills registers today and is left out
# (test_verify_draft_range below documents the valid range).

DRAFT_CASES = {"nemotron-super": (2, 4, 8), "nemotron-nano-4b": (4,)}
DRAFT_DECODE = ("nemotron-super",)  # also the decode kernels on its draft cache (sm_90a)

_DRAFT_CHILD = """
import os, sys, time
from pathlib import Path
from unittest import mock
arch, ptx_root, cases, decode_models, large_only = sys.argv[1], Path(sys.argv[2]), *map(eval, sys.argv[3:6])
os.environ["CUTE_DSL_ARCH"] = arch
sys.path.insert(0, {tests!r})
from test_kernels_compile import _draft_kernels
from replayssm_cute import precompile
for name in cases:
    todo = _draft_kernels(name, cases[name], name in decode_models, large_only)
    print(f"precompile {{name}} for {{arch}}: {{len(todo)}} kernels", flush=True)
    (ptx_root / name).mkdir(parents=True)
    for v in todo:
        path = ptx_root / name / f"{{v.label}}.{{arch}}.ptx"
        t0 = time.perf_counter()
        precompile.dump_draft_ptx("mamba2", v, path)
        print(f"  {{v.label}} {{time.perf_counter() - t0:6.1f}} s  -> {{path}}", flush=True)
""".format(tests=str(Path(__file__).resolve().parent))


def _draft_kernels(model, drafts, with_decode, large_only):
    """precompile.draft_variants at WINDOW, bf16: verify and commit, the decode kernels on the draft
    cache if `with_decode`, only the large-batch launch config if `large_only`."""
    from replayssm_cute.kernels.mamba2.defaults import default_mamba2_config, default_mamba2_verify_config
    from replayssm_cute.precompile import draft_variants

    m = get_model(model)
    large = (default_mamba2_config(m.headdim, 1024, WINDOW), default_mamba2_verify_config(m.headdim, 1024))
    return [v for v in draft_variants(m, WINDOW, drafts, ["bf16"])
            if (v.kind != "decode" or with_decode) and (v.config is None or v.config in large or not large_only)]


def _verify_configs(model, large_only, arch):
    """How many launch configs precompile builds each verify kernel at: on sm_90a two, the pipelined
    verify's (it serves every batch there) in items of one head at small batches and in units of a
    group's heads where a batch's units fill the grid (both models: 128 / 96 heads, units of 4);
    elsewhere the tile verify's defaults for small and large batches (one where they agree, e.g. a
    head dim that takes 16-row tiles only)."""
    from replayssm_cute.kernels.mamba2.defaults import default_mamba2_verify_config

    if arch == "sm_90a":
        return 2
    m = get_model(model)
    return len({default_mamba2_verify_config(m.headdim, b) for b in ((1024,) if large_only else (1, 1024))})


class DraftBuild:
    """One child process per arch: {model: (header, kernels)} parsed from its log."""

    def __init__(self, arch, tmp):
        self.arch = arch
        self.ptx_dir = tmp / "ptx"
        self.decode_models = DRAFT_DECODE if arch == "sm_90a" else ()
        self.large_only = arch == "sm_103a"
        cmd = [sys.executable, "-c", _DRAFT_CHILD, arch, str(self.ptx_dir), repr(DRAFT_CASES),
               repr(self.decode_models), repr(self.large_only)]
        t0 = time.perf_counter()
        self.proc = subprocess.run(cmd, env=_env(tmp / "cache"), cwd=tmp, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, timeout=900)
        self.seconds = time.perf_counter() - t0
        self.log = _ANSI.sub("", self.proc.stdout)
        self.models = {}
        for part in re.split(r"(?m)^(?=precompile )", self.log):
            header, kernels = _parse(part)
            if header is not None:
                self.models[header.group(1)] = (header, kernels)

    def tail(self, n=6000):
        return self.log[-n:]

    def kernels(self):
        assert self.proc.returncode == 0, self.tail()
        assert sorted(self.models) == sorted(DRAFT_CASES), self.tail()
        return [(model, k) for model in DRAFT_CASES for k in self.models[model][1]]


def _builds_per_arch(request, tmp_path_factory, fixture, build, prefix):
    """arch -> build(arch, tmp dir) for every arch the selected tests ask for through the
    arch-parametrised `fixture`, built in parallel (one child per core): each child is
    single-threaded, and CI has two cores."""
    from concurrent.futures import ThreadPoolExecutor

    archs = sorted({item.callspec.params[fixture] for item in request.session.items
                    if hasattr(item, "callspec") and fixture in item.callspec.params}) or list(ARCHS)
    with ThreadPoolExecutor(max_workers=max(1, min(len(archs), os.cpu_count() or 1))) as pool:
        futures = {a: pool.submit(build, a, tmp_path_factory.mktemp(f"{prefix}-{a}")) for a in archs}
        return {a: f.result() for a, f in futures.items()}


def _per_arch_fixtures(all_name, one_name, build, prefix):
    """The two module fixtures of one kind of per-arch build: ``all_name``, arch -> build(arch,
    tmp dir), built in parallel (_builds_per_arch), and ``one_name``, parametrised over ARCHS,
    one arch's build."""

    @pytest.fixture(scope="module", name=all_name)
    def all_archs(request, tmp_path_factory):
        return _builds_per_arch(request, tmp_path_factory, one_name, build, prefix)

    @pytest.fixture(scope="module", params=ARCHS, name=one_name)
    def one_arch(request):
        return request.getfixturevalue(all_name)[request.param]

    return all_archs, one_arch


draft_builds, draft_build = _per_arch_fixtures("draft_builds", "draft_build", DraftBuild, "drafts")


@pytest.fixture
def draft_target(draft_build, monkeypatch):
    """The build of one arch, with the launch configs picked for that arch (as its child did)."""
    from replayssm_cute.runtime import launch

    monkeypatch.setenv("CUTE_DSL_ARCH", draft_build.arch)
    monkeypatch.delenv("REPLAYSSM_CUTE_PIPELINED", raising=False)
    launch.reload()
    yield draft_build
    monkeypatch.undo()
    launch.reload()


def test_draft_kernels_are_built_with_one_ptx_file(draft_target):
    draft_build = draft_target
    kernels = draft_build.kernels()
    for model in DRAFT_CASES:
        header, built = draft_build.models[model]
        assert header.group(2) == draft_build.arch and int(header.group(3)) == len(built)
        labels = [k[0] for k in built]
        want = _draft_kernels(model, DRAFT_CASES[model], model in draft_build.decode_models,
                              draft_build.large_only)
        assert labels == [v.label for v in want], draft_build.tail()
        assert sum("_verify_" in lb for lb in labels) == (_verify_configs(model, draft_build.large_only, draft_build.arch)
                                                          * len(DRAFT_CASES[model]))
        assert sum("_commit_" in lb for lb in labels) == len(DRAFT_CASES[model])
        assert sum("_plan_" in lb for lb in labels) == 1 + len(DRAFT_CASES[model])
        for label, _, path, _ in built:
            path = Path(path)
            assert path == draft_build.ptx_dir / model / f"{label}.{draft_build.arch}.ptx"
            assert path.is_file() and path.stat().st_size > 0
    assert len(list(draft_build.ptx_dir.rglob("*.ptx"))) == len(kernels)


def test_draft_ptx_targets_the_arch(draft_build):
    for _, (label, _, path, _) in draft_build.kernels():
        targets = re.findall(r"^\s*\.target\s+(\S+)", Path(path).read_text(), flags=re.M)
        assert targets and all(t.rstrip(",") == draft_build.arch for t in targets), (label, targets)


def test_verify_ptx_streams_the_checkpoint_with_tma(draft_build):
    """Verify (and decode on the draft cache) read the checkpoint with TMA; the sequence-table
    kernels (plan, commit) touch only per-row and per-slot positions, so they have no TMA."""
    kinds = set()
    for _, (label, _, path, _) in draft_build.kernels():
        tma = "cp.async.bulk.tensor" in Path(path).read_text()
        kind = "table" if ("_commit_" in label or "_plan_" in label) else "verify" if "_verify_" in label else "decode"
        kinds.add(kind)
        assert tma == (kind != "table"), (label, tma)
    assert kinds == ({"decode", "verify", "table"} if draft_build.decode_models else {"verify", "table"})


def test_draft_ptx_waits_for_the_previous_kernel_before_touching_its_data(draft_build):
    for _, (label, _, path, _) in draft_build.kernels():
        _check_programmatic_launch(label, Path(path).read_text())


def test_draft_ptx_declares_no_local_memory(draft_build):
    for _, (label, _, path, _) in draft_build.kernels():
        hits = [ln.strip() for ln in Path(path).read_text().splitlines() if re.search(r"\.local\b", ln)]
        assert not hits, (label, hits[:5])


def test_draft_ptxas_reports_no_spills(draft_build):
    for model, (label, _, _, reports) in draft_build.kernels():
        assert len(reports) == 1, f"{model} {label}: {len(reports)} ptxas reports:\n{draft_build.tail()}"
        stack, stores, loads = reports[0]
        assert (stack, stores, loads) == (0, 0, 0), (
            f"{model} {label}: {stack} bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads")


def test_verify_draft_range():
    """Which draft counts the verify kernel takes (no compile): 1 <= T <= min(16, max_draft, window),
    window >= 2 and window + max_draft <= 32; precompile --drafts refuses the rest before building."""
    import torch

    from replayssm_cute.kernels.mamba2.config import Mamba2Shape
    from replayssm_cute.kernels.mamba2.defaults import default_mamba2_verify_config
    from replayssm_cute.kernels.mamba2.verify import Mamba2Verify
    from replayssm_cute.precompile import _option_error, draft_variants
    from replayssm_cute.runtime.launch import cute_dtype

    m = get_model("nemotron-super")
    bf16 = cute_dtype(torch.bfloat16)

    def reason(window, max_draft, T, batch=1024):
        shape = Mamba2Shape(m.nheads, m.headdim, m.dstate, m.ngroups, window, window + max_draft,
                            bf16, bf16, True, False, True, True, -1)
        return Mamba2Verify.check(shape, default_mamba2_verify_config(m.headdim, batch), T)

    for window, max_draft in ((16, 16), (16, 8), (4, 8), (24, 8), (2, 1)):
        for batch in (1, 1024):
            ok = [T for T in range(0, 18) if reason(window, max_draft, T, batch) is None]
            assert ok == list(range(1, min(16, max_draft, window) + 1)), (window, max_draft, batch)
    assert "num_drafts" in reason(16, 8, 9) and "num_drafts" in reason(4, 8, 5)
    assert "ring capacity" in reason(24, 9, 8)  # 33 records: one lane per record
    assert reason(1, 0, 1) is not None
    for window, drafts in ((16, [16]), (16, [2, 4, 8]), (4, [4]), (24, [8])):
        assert _option_error(m, False, window, drafts) is None
    for window, drafts, what in ((16, [17], "outside 1..16"), (16, [0], "outside 1..16"),
                                 (4, [8], "above the window"), (24, [1, 9], "above 32")):
        assert what in _option_error(m, False, window, drafts)
        with pytest.raises(ValueError, match="--drafts"):
            draft_variants(m, window, drafts, ["bf16"])


# ----------------------------------------------------------------------------- snapshot baseline
#
# The GDN conventional speculative baseline (kernels/gdn/snapshot.py: snapshot_verify on a
# window-1 cache), compiled straight to PTX in one child process per arch, in parallel:
# Qwen3.5-122B with T = 2, 8 and 16 at the launch configs snapshot_verify picks for small and
# large batches, and the two odd GDN shapes with T = 5; sm_103a (sm_100a's PTX but for the
# .target line) takes the Qwen3.5-122B large-batch config only, to save CI time. Same checks as
# the decode and verify kernels: target, TMA streaming of the state, no local memory, no spills.

SNAPSHOT_CASES = {"qwen3.5-122b": (2, 8, 16), "gdn-h2-hv6-k64": (5,), "gdn-h2-hv4-k48": (5,)}

_SNAPSHOT_CHILD = """
import os, sys, time
from pathlib import Path
from unittest import mock
arch, ptx_dir, large_only = sys.argv[1], Path(sys.argv[2]), sys.argv[3] == "1"
os.environ["CUTE_DSL_ARCH"] = arch
sys.path.insert(0, {tests!r})
from test_kernels_compile import _snapshot_kernels
from replayssm_cute.kernels.gdn.snapshot import compile_snapshot
from replayssm_cute.precompile import _write_ptx
todo = _snapshot_kernels(large_only)
print(f"precompile gdn-snapshot for {{arch}}: {{len(todo)}} kernels", flush=True)
ptx_dir.mkdir(parents=True)
for label, shape, config, T in todo:
    path = ptx_dir / f"{{label}}.{{arch}}.ptx"
    t0 = time.perf_counter()
    _write_ptx(lambda options: compile_snapshot(shape, config, T, options), path)
    print(f"  {{label}} {{time.perf_counter() - t0:6.1f}} s  -> {{path}}", flush=True)
""".format(tests=str(Path(__file__).resolve().parent))


def _snapshot_kernels(large_only):
    """(label, shape, config, T) for SNAPSHOT_CASES in bf16 with the engines' usual arguments (as
    precompile's GDN variants), at the configs snapshot_verify picks for batch 1 and 1024 (only
    1024 and Qwen3.5-122B if `large_only`)."""
    import torch

    from replayssm_cute.kernels.gdn.config import GDNShape
    from replayssm_cute.kernels.gdn.defaults import default_gdn_snapshot_config
    from replayssm_cute.precompile import config_label
    from replayssm_cute.runtime.launch import cute_dtype

    bf16, fp32 = cute_dtype(torch.bfloat16), cute_dtype(torch.float32)
    batches = (1024,) if large_only else (1, 1024)
    out = []
    for name, drafts in SNAPSHOT_CASES.items():
        if large_only and name != "qwen3.5-122b":
            continue
        m = _spec(name)
        shape = GDNShape(m.nheads, m.headdim, m.dstate, m.ngroups, 1, 1, bf16, bf16, fp32, fp32, 0.0, False, -1)
        configs = sorted({default_gdn_snapshot_config(m.headdim, b) for b in batches}, key=lambda c: c.key())
        out += [(f"gdn_snapshot_{name}_T{T}_bf16_{config_label(cfg)}", shape, cfg, T)
                for T in drafts for cfg in configs]
    return out


class SnapshotBuild:
    """One child process per arch: the header and kernels parsed from its log."""

    def __init__(self, arch, tmp):
        self.arch = arch
        self.ptx_dir = tmp / "ptx"
        self.large_only = arch == "sm_103a"
        cmd = [sys.executable, "-c", _SNAPSHOT_CHILD, arch, str(self.ptx_dir), str(int(self.large_only))]
        self.proc = subprocess.run(cmd, env=_env(tmp / "cache"), cwd=tmp, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, timeout=900)
        self.log = _ANSI.sub("", self.proc.stdout)
        self.header, self.built = _parse(self.log)

    def tail(self, n=6000):
        return self.log[-n:]

    def kernels(self):
        assert self.proc.returncode == 0, self.tail()
        assert self.header is not None and self.built, self.tail()
        return self.built


snapshot_builds, snapshot_build = _per_arch_fixtures("snapshot_builds", "snapshot_build", SnapshotBuild, "snapshot")


def test_snapshot_kernels_are_built_with_one_ptx_file(snapshot_build):
    kernels = snapshot_build.kernels()
    assert snapshot_build.header.group(2) == snapshot_build.arch
    assert int(snapshot_build.header.group(3)) == len(kernels)
    want = _snapshot_kernels(snapshot_build.large_only)
    assert [k[0] for k in kernels] == [label for label, _, _, _ in want], snapshot_build.tail()
    for label, _, path, _ in kernels:
        assert Path(path) == snapshot_build.ptx_dir / f"{label}.{snapshot_build.arch}.ptx"
        assert Path(path).is_file() and Path(path).stat().st_size > 0
    assert len(list(snapshot_build.ptx_dir.glob("*.ptx"))) == len(kernels)


def test_snapshot_ptx_targets_the_arch(snapshot_build):
    for label, _, path, _ in snapshot_build.kernels():
        targets = re.findall(r"^\s*\.target\s+(\S+)", Path(path).read_text(), flags=re.M)
        assert targets and all(t.rstrip(",") == snapshot_build.arch for t in targets), (label, targets)


def test_snapshot_ptx_streams_the_state_with_tma(snapshot_build):
    for label, _, path, _ in snapshot_build.kernels():
        assert "cp.async.bulk.tensor" in Path(path).read_text(), label


def test_snapshot_ptx_declares_no_local_memory(snapshot_build):
    for label, _, path, _ in snapshot_build.kernels():
        hits = [ln.strip() for ln in Path(path).read_text().splitlines() if re.search(r"\.local\b", ln)]
        assert not hits, (label, hits[:5])


def test_snapshot_ptxas_reports_no_spills(snapshot_build):
    for label, _, _, reports in snapshot_build.kernels():
        assert len(reports) == 1, f"{label}: {len(reports)} ptxas reports:\n{snapshot_build.tail()}"
        assert reports[0] == (0, 0, 0), f"{label}: (stack frame, spill stores, spill loads) = {reports[0]}"


def test_snapshot_check():
    """Which launches the snapshot kernel takes (no compile): a conventional cache (window 1),
    1 <= T <= 16, at most 8 rows per warp; snapshot_verify's defaults always fit."""
    import torch

    from replayssm_cute.kernels.gdn.config import GDNConfig, GDNShape
    from replayssm_cute.kernels.gdn.defaults import default_gdn_snapshot_config
    from replayssm_cute.kernels.gdn.snapshot import GDNSnapshot
    from replayssm_cute.runtime.launch import cute_dtype

    bf16, fp32 = cute_dtype(torch.bfloat16), cute_dtype(torch.float32)

    def shape(name, window=1):
        m = _spec(name)
        return GDNShape(m.nheads, m.headdim, m.dstate, m.ngroups, window, window, bf16, bf16, fp32, fp32, 0.0,
                        False, -1)

    for name in ("qwen3.5-4b", "qwen3.5-122b", *ODD_SHAPES):
        for batch in (1, 1024):
            cfg = default_gdn_snapshot_config(_spec(name).headdim, batch)
            ok = [T for T in range(0, 18) if GDNSnapshot.check(shape(name), cfg, T) is None]
            assert ok == list(range(1, 17)), (name, batch)
    assert "window 1" in GDNSnapshot.check(shape("qwen3.5-122b", 16), GDNConfig(16, 4), 4)
    assert "rows per warp 16" in GDNSnapshot.check(shape("qwen3.5-122b"), GDNConfig(64, 4), 4)
    with pytest.raises(ValueError, match="num_drafts 17"):
        GDNSnapshot(shape("qwen3.5-122b"), GDNConfig(16, 4), 17)

