"""Autotune the launch configs of a layer's kernels per batch bucket and cache the best (GPU).

    python -m replayssm_cute.tune --model nemotron-super [--batch 1,64,256]
        [--modes conventional,standard,verify] [--window 16] [--drafts 4,8] [--dtypes bf16,fp16]
        [--out FILE] [--replays 15] [--workers N] [--pool-mb 512] [--compile-only]
    python -m replayssm_cute.tune --shape mamba2:128,64,128,8 ...     # explicit layer dims
    python -m replayssm_cute.tune --model nemotron-super --read-copies fp16,fp8,nvfp4 --modes standard,verify
        [--read-copies-only]

--model takes the registry names of replayssm_cute.models (docs/design.md section 7), several
separated by commas; --shape takes explicit dims instead: mamba2:H,P,N,G (heads, headdim,
dstate, groups) or gdn:HV,V,K,H (value heads, V, K, key heads). Modes: conventional (the
window-1 step), standard (ReplaySSM decode at --window) and verify (verify + commit of T
drafts at --window, for each T of --drafts); default conventional,standard. Batches are
buckets, powers of two up to 1024 (default: all of them). --read-copies adds the standard and
verify modes (those of --modes) on caches with each of those low-precision read copies next to
an fp32 checkpoint (their kernels, keyed by the read copy, are tuned apart); --read-copies-only
leaves out the fp32-read kernels of those modes.

For each kernel, activation dtype and batch bucket:
1. candidates: the launch configs of the layer's config space (kernels/config_space.py) that
   the kernel's check takes (shared memory, register cap, divisibility), the analytical default
   among them. All are compiled first, in parallel worker processes (cute.compile is not
   thread-safe), into the on-disk compile cache; one that fails to compile is dropped. One whose
   kernel spills registers (ptxas's report) is listed with its spill bytes and timed like the
   others: timing decides, whether the candidate was compiled now or loaded from the cache
   (where ptxas does not run, so nothing is listed; a note says how many).
2. each candidate runs a whole window on a small pool (ring positions 0..L-1, flush included;
   whole cursor cycles of verify + commit at a = 1 and a = T drafts accepted) from the same
   state as the default config; one whose outputs or final state differ from the default's is
   rejected.
3. timing as docs/benchmarking.md describes: median over CUDA-graph replays of whole windows
   (verify: whole cursor cycles, the mean of a = 1 and a = T) over a pool that rotates through
   --pool-mb MiB of slots, so every step streams its checkpoint from HBM. Every candidate gets
   SCREEN_REPLAYS replays; the FINALISTS fastest and the default are timed again with
   --replays; the fastest of those wins.
Steps 2 and 3 run in a child process per kernel: a candidate that faults the GPU (which leaves
the process's CUDA context unusable) is dropped, and a fresh child goes on from that batch
bucket (a faulting default skips the bucket; after MAX_RESTARTS the kernel is given up).

The winners, with their times, go to --out (default: the user's tuned-config file, see
replayssm_cute.runtime.tuning), merged with what is there; decode and verify use them from then on,
this process included. The summary gives per kernel and batch the best config, its time, the
achieved TB/s on the ideal bytes (perf.ideal_bytes, perf.verify_ideal_bytes: 16-bit
activations) and the speedup over the analytical default. --compile-only builds the candidates
and stops (no GPU needed with CUTE_DSL_ARCH set).

Each batch bucket is tuned on the kernel decode / verify runs there: the tile kernels
(kernels/*/decode.py, verify.py), or where decode runs the pipelined kernels (kernels/*/pipelined.py:
on sm_90a Mamba-2 standard decode on an fp32 checkpoint, alone or next to an fp16 read copy, and GDN
ReplaySSM decode on the plain fp32 cache from batch 8 and next to a read copy from the 32 bucket;
anywhere under REPLAYSSM_CUTE_PIPELINED=1) their space: stages, CTAs per SM, rows per item /
consumer warp, Mamba-2's consumer groups and, next to a read copy, its heads per item
(``pipelined_space``); where verify runs the pipelined verify (kernels/*/pipelined_verify.py: on
sm_90a on an fp32 checkpoint, Mamba-2 always, GDN with T <= 4 drafts), its stages and CTAs per SM
(``pipelined_verify_space``). A tuned
entry replaces only a default of its own class, so run the tuner under REPLAYSSM_CUTE_PIPELINED=0 to
tune the tile kernels where the pipeline is the default.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import multiprocessing
import os
import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

from .kernels.limits import MAX_CAPACITY, MAX_DRAFT
from .models import MODELS, ModelSpec, get_model
from .precompile import config_label, init_worker, path_error
from .runtime.tuning import BATCH_BUCKETS, MODES

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # the 16-bit activations the byte model counts
READ_COPIES = ("fp16", "fp8", "nvfp4")
DEFAULT_MODES = "conventional,standard"
SCREEN_REPLAYS = 3
FINALISTS = 4
# Candidate outputs must match the default config's to this fraction of the largest magnitude
# (tilings differ in summation order only: a few ulps of a 16-bit output, far less in fp32).
RTOL_16BIT = 1e-2
RTOL_FP32 = 1e-4
MAX_RESTARTS = 8  # timing processes started again after faults, per kernel, before it is given up
ENV_COMPILER_OPT = "CUTE_DSL_COMPILER_OPT"
PTXAS_REMARKS = "remarks{ptx}"  # has ptxas report each kernel's stack frame and spills
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# ptxas's resource line, which may wrap: "24 bytes stack frame, 24 bytes spill stores, 24 bytes spill loads"
_SPILLS = re.compile(r"(\d+)\s+bytes\s+stack\s+frame,\s+(\d+)\s+bytes\s+spill\s+stores,"
                     r"\s+(\d+)\s+bytes\s+spill\s+loads")
_CUDA_ERROR = re.compile(r"\bcuda[ _]?error", re.IGNORECASE)  # "CUDA error: ...", "CUDA Error Code: 715", cudaError...
NO_GPU = ("{prog}: no CUDA GPU found (torch.cuda.is_available() is False); tuning times the kernels "
          "on the GPU it tunes for, so run it there. Until then decode and verify use the shipped "
          "tuned configs or the analytical defaults. Without a GPU, --compile-only (with "
          "CUTE_DSL_ARCH=sm_90a, sm_100a or sm_103a) builds the candidate kernels into the compile cache.")
PROG = "python -m replayssm_cute.tune"


@dataclass(frozen=True)
class TuneTarget:
    """One kernel to tune: a layer, a mode, its window (1 for conventional) and draft count (T
    for verify, else 0), an activation dtype (a key of DTYPES)."""

    model: ModelSpec
    mode: str
    window: int
    num_drafts: int
    dtype: str
    read_copy: Optional[str] = None  # a low-precision read copy next to the fp32 checkpoint

    @property
    def kernel(self):
        """Its kernel (runtime.launch.Kernel, the layer adapter's decode or verify kernel); its
        name keys the tuned-config files (tuning.KERNELS)."""
        from .layers import LAYERS

        layer = LAYERS[self.model.layer]
        return layer.verify_kernel if self.mode == "verify" else layer.decode_kernel

    @property
    def label(self) -> str:
        mode = {"conventional": "conventional", "standard": f"standard L{self.window}",
                "verify": f"verify L{self.window} T{self.num_drafts}"}[self.mode]
        read = f" read {self.read_copy}" if self.read_copy else ""
        return f"{self.model.name} {mode}{read} {self.dtype}"

    def torch_dtype(self):
        import torch

        return getattr(torch, DTYPES[self.dtype])

    def pool(self, batch: int, rotation_bytes: int):
        """The timing pool (perf.DecodePool) of this kernel at `batch` in this dtype."""
        from .perf import DecodePool

        return DecodePool(self.model, batch, self.window, drafts=self.num_drafts, rotation_bytes=rotation_bytes,
                          dtype=self.torch_dtype(), read_copy=self.read_copy)

    def shape(self):
        """The kernel Shape decode / verify build for the pool's inputs (perf.DecodePool: the
        engines' usual arguments in this dtype, on a cache with this read copy)."""
        from .perf import bench_layer

        return bench_layer(self.model).kernel_shape(self.model, self.window, self.num_drafts, self.torch_dtype(),
                                                    self.read_copy)

    def check(self, config) -> Optional[str]:
        """Why the kernel cannot take `config` at this shape, or None."""
        return self.kernel.check(self.shape(), config, self.num_drafts)

    def default_config(self, batch: int):
        """The analytical default decode / verify pick at this batch bucket (the kernel's)."""
        return self.kernel.default_config(self.shape(), batch)

    def candidates(self, space: str = "full", batches=BATCH_BUCKETS) -> list:
        """The launch configs worth compiling for `batches`: the layer's tile space
        (kernels/config_space.py) that the kernel takes, where the default of some bucket of
        `batches` is a tile config (with `space` "compact", for decode modes only the part where
        the H200 winners lie, ``in_compact_space``); then, where it is the pipelined kernel, that
        kernel's space (``pipelined_candidates``). A bucket is only ever timed on its default's
        class (``batch_candidates``), so the other class is not built."""
        from .layers import LAYERS

        tile_class = LAYERS[self.model.layer].launch_config()
        configs = []
        if any(type(self.default_config(b)) is tile_class for b in batches):
            configs = [c for c in tile_class.space(self.model.headdim) if self.check(c) is None]
            if space == "compact" and self.mode != "verify":
                configs = [c for c in configs if in_compact_space(c, self.read_copy is not None)]
        return configs + self.pipelined_candidates(batches)

    def pipelined_candidates(self, batches=BATCH_BUCKETS) -> list:
        """The pipelined kernel's space (decode: kernels/*/pipelined.py ``pipelined_space``;
        verify: kernels/*/pipelined_verify.py ``pipelined_verify_space``) that the kernel takes,
        where its default at some bucket of `batches` is the pipelined kernel (on the targets it is
        the default on, or under REPLAYSSM_CUTE_PIPELINED=1); else []."""
        import importlib

        from .layers.common import sm_count, target_arch

        name = "pipelined_verify" if self.mode == "verify" else "pipelined"
        module = importlib.import_module(f"replayssm_cute.kernels.{self.model.layer}.{name}")
        default = getattr(module, f"{name}_config")(self.shape(), sm_count(), target_arch())
        if default is None or not any(type(self.default_config(b)) is type(default) for b in batches):
            return []
        return [c for c in getattr(module, f"{name}_space")(self.shape(), sm_count(), target_arch())
                if self.check(c) is None]

    def batch_candidates(self, candidates, batch: int) -> list:
        """Of ``candidates``, those of the kernel that decode runs at ``batch`` (the default's
        class: a tuned entry replaces the default only with a config of its class), default first."""
        default = self.default_config(batch)
        return [default] + [c for c in candidates if c != default and type(c) is type(default)]

    def compile(self, config):
        """Build (or load) the kernel at `config` into the compile cache, under the key decode /
        verify look it up by."""
        from .runtime.launch import compiled

        return compiled(self.kernel, self.shape(), config, self.num_drafts)

    def accepted_counts(self) -> List[int]:
        """Drafts accepted per row in the verify runs: a = 1 and a = T (verify cannot know a)."""
        return sorted({1, self.num_drafts})

    def ideal_bytes(self, batch: int) -> float:
        """Ideal bytes per step (perf): the conventional step, the ReplaySSM window mean, or the
        mean over accepted_counts() of a verify + commit step."""
        from .perf import ideal_bytes, read_ideal_bytes, verify_ideal_bytes, verify_read_ideal_bytes

        if self.mode == "verify":
            per_a = [verify_ideal_bytes(self.model, batch, self.window, self.num_drafts, a)["verify"]
                     if self.read_copy is None else
                     verify_read_ideal_bytes(self.model, batch, self.window, self.num_drafts, a, self.read_copy)
                     for a in self.accepted_counts()]
            return sum(per_a) / len(per_a)
        if self.read_copy is not None:
            return read_ideal_bytes(self.model, batch, self.window, self.read_copy)["window_mean"]
        return ideal_bytes(self.model, batch, self.window)["conventional" if self.window == 1 else "window_mean"]


def in_compact_space(config, light: bool) -> bool:
    """The decode configs worth timing when every batch bucket of many kernels is tuned in one
    run (--space compact, about half the full space): 2, 4 or 8 warps of 2-20 rows each, and
    register caps for none, 2, 4 or 6 CTAs per SM (8 too for the `light` read-copy tiles, whose
    small shared memory lets that many in). Of the 22 decode winners of the full-space H200 runs
    shipped before it, all but one lie in it (Nemotron-Nano-4B's conventional step at batch 1,
    (20, 5, 4), 1.2% faster than the default)."""
    caps = (0, 2, 4, 6, 8) if light else (0, 2, 4, 6)
    return (config.num_warps in (2, 4, 8) and 2 <= config.rows_per_cta // config.num_warps <= 20
            and config.min_ctas_per_sm in caps)


@dataclass(frozen=True)
class TuneResult:
    """The winner of one (target, batch) and how it was found."""

    target: TuneTarget
    batch: int
    config: object
    time_us: float
    default_config: object
    default_time_us: float
    timed: int  # candidates timed (passed the output check)
    rejected: Dict[str, str]  # config label -> why it was rejected

    @property
    def tbps(self) -> float:
        return self.target.ideal_bytes(self.batch) / (self.time_us * 1e-6) / 1e12

    @property
    def speedup(self) -> float:
        return self.default_time_us / self.time_us

    def entry(self, platform) -> dict:
        """Its tuned-config file entry (replayssm_cute.runtime.tuning) for `platform`."""
        from .runtime.tuning import tune_key

        t = self.target
        key = tune_key(t.kernel.name, t.shape(), t.num_drafts, platform)
        return {**key.fields(self.batch),
                "config": dataclasses.asdict(self.config), "time_us": round(self.time_us, 3),
                "tbps": round(self.tbps, 4), "default_config": dataclasses.asdict(self.default_config),
                "default_time_us": round(self.default_time_us, 3), "speedup": round(self.speedup, 4),
                "candidates": self.timed, "rejected": len(self.rejected), "model": t.model.name,
                "tuned_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, else a line per tenth of the
    way (so that logs stay short)."""

    WIDTH = 30

    def __init__(self, title: str, total: int, stream=None):
        self.title, self.total, self.done = title, max(1, total), 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.shown = -1

    def advance(self, note: str = "") -> None:
        self.done += 1
        tenth = self.done * 10 // self.total
        if not self.tty and tenth == self.shown:
            return
        self.shown = tenth
        filled = self.WIDTH * self.done // self.total
        line = (f"{self.title} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.t0:5.0f} s  {note}")
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K" + ("\n" if self.done >= self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


# ------------------------------------------------------------------------------------- compiling


@contextlib.contextmanager
def environment(name: str, value: str):
    """Environment variable ``name`` set to ``value`` for the block (child processes started in
    it inherit it), then restored."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def ptxas_reports():
    """PTXAS_REMARKS added to CUTE_DSL_COMPILER_OPT for the block. CuTe DSL reads that once,
    when cutlass is first imported: so this covers processes started in the block, and this one
    if cutlass is not imported yet."""
    return environment(ENV_COMPILER_OPT, f"{os.environ.get(ENV_COMPILER_OPT) or ''} {PTXAS_REMARKS}".strip())


def ptxas_report(text: str) -> Tuple[Optional[Tuple[int, int, int]], str]:
    """What a compile wrote to stderr, split: the worst (stack frame, spill stores, spill loads)
    that ptxas reported, None without a report (nothing compiled); and the rest, without the
    remark blocks: a "remark[ptxas" line and the lines after it that are blank, indented, ptxas's
    or the marked line of the source excerpt ("> 176 |     @cute.jit")."""
    text = _ANSI.sub("", text)
    rest, in_remark = [], False
    for line in text.splitlines(keepends=True):
        in_remark = line.startswith("remark[ptxas") or (
            in_remark and (not line.strip() or line[0].isspace() or line.startswith(("ptxas", "> "))))
        if not in_remark:
            rest.append(line)
    reports = [tuple(int(v) for v in m.groups()) for m in _SPILLS.finditer(text)]
    return max(reports, key=lambda r: r[1] + r[2], default=None), "".join(rest)


@contextlib.contextmanager
def _fd2_to(file):
    """File descriptor 2 into `file` for the block: ptxas's report comes from native code."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _compile_job(job) -> Tuple[Optional[str], Optional[Tuple[int, int, int]]]:
    """Build one (target, config) into the compile cache: (why it is dropped, or None; ptxas's
    worst (stack frame, spill stores, spill loads), None where ptxas did not run: loaded from the
    cache). Only a kernel that fails to compile is dropped: a spilling one is timed like the
    others, so the outcome does not depend on what the cache held."""
    target, config = job
    why = None
    with tempfile.TemporaryFile() as log:
        with _fd2_to(log):
            try:
                target.compile(config)
            except Exception as e:  # a candidate the compiler rejects is dropped, not fatal
                why = f"{type(e).__name__}: {e}"
        log.seek(0)
        report, rest = ptxas_report(log.read().decode(errors="replace"))
    sys.stderr.write(rest)  # what else was said (warnings, errors) still shows
    sys.stderr.flush()
    return why, report


def compile_candidates(jobs, workers: int,
                       arch: str) -> Tuple[Dict[tuple, str], Dict[tuple, Tuple[int, int, int]], int]:
    """Build every (target, config) of `jobs`: in `workers` processes through the disk cache
    (cute.compile is not thread-safe), in this one when that cache is off or workers <= 1. Returns
    {(target, config): why it is dropped} for those that did not compile, {(target, config):
    ptxas's (stack frame, spill stores, spill loads)} for the others that spill (where ptxas
    reports them: ``ptxas_reports``), and how many of the others were loaded from the compile
    cache, so ptxas did not report on them."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from .runtime.compile_cache import disk_cache_enabled

    outcomes = {}
    progress = Progress(f"compile {len(jobs)} kernels for {arch}", len(jobs))
    if workers <= 1 or not disk_cache_enabled():
        for job in jobs:
            outcomes[job] = _compile_job(job)
            progress.advance(job[0].label)
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx, initializer=init_worker,
                                 initargs=(arch,)) as pool:
            futures = {pool.submit(_compile_job, job): job for job in jobs}
            for future in as_completed(futures):
                outcomes[futures[future]] = future.result()
                progress.advance(futures[future][0].label)
    dropped = {job: why for job, (why, _) in outcomes.items() if why is not None}
    spills = {job: report for job, (why, report) in outcomes.items()
              if why is None and report is not None and (report[1] or report[2])}
    return dropped, spills, sum(why is None and report is None for why, report in outcomes.values())


# ---------------------------------------------------------------------------------------- timing


def _steps_per_cycle(window: int, drafts: int, accepted: int) -> int:
    """Verify + commit steps per slot set: whole periods of the cursor cycle, >= `window` steps."""
    from .perf import cursor_cycle

    period = len(cursor_cycle(window, drafts, accepted))
    return period * -(-window // period)


def time_config(target: TuneTarget, pool, config, replays: int) -> float:
    """Median us per step of `config` on `pool` over `replays` CUDA-graph replays: the window
    mean of a decode mode (every ring position, flush included); for verify the mean over
    accepted_counts() of a verify + commit step over whole cursor cycles."""
    from .perf import cursor_cycle, time_graph

    if target.mode != "verify":
        # One step warms up (the output check has loaded the kernel); a whole window, thousands of
        # launches at small batch on a small read copy, would cost seconds of host time per config.
        # It moves one set a ring position, which leaves the window mean as it is.
        fn, steps = pool.window_fn(config)
        return time_graph(fn, steps, replays=replays, warmup=lambda: pool.step(pool.sets[0], config))
    times = []
    for a in target.accepted_counts():
        pool.cache.cursor.fill_(cursor_cycle(target.window, target.num_drafts, a)[0])
        fn, steps = pool.verify_fn(a, _steps_per_cycle(target.window, target.num_drafts, a), config)
        times.append(time_graph(fn, steps, replays=replays))
    return sum(times) / len(times)


class OutputCheck:
    """Outputs and final state of one config over a whole window (decode) or whole cursor
    cycles at each accepted count (verify) on a small pool (two slot sets, the first used),
    every run from the same starting state."""

    def __init__(self, target: TuneTarget, batch: int):
        import torch

        self.target = target
        self.pool = target.pool(batch, rotation_bytes=0)
        # the cache's tensors and its sequence table's (a verify cycle moves the origins)
        owners = (self.pool.cache, self.pool.cache.table)
        self.start = [(owner, name, t.clone()) for owner in owners
                      for name, t in vars(owner).items() if isinstance(t, torch.Tensor)]

    def run(self, config) -> list:
        import torch

        from .api import commit, verify
        from .perf import cursor_cycle

        t, pool, cache = self.target, self.pool, self.pool.cache
        for owner, name, value in self.start:
            getattr(owner, name).copy_(value)
        ids = pool.sets[0]
        outs = []
        if t.mode == "verify":
            for a in t.accepted_counts():
                cache.cursor.fill_(cursor_cycle(t.window, t.num_drafts, a)[0])
                num_accepted = torch.full_like(ids, a)
                for _ in range(_steps_per_cycle(t.window, t.num_drafts, a)):
                    verify(cache, slot_ids=ids, config=config, **pool.inputs)
                    commit(cache, ids, num_accepted)
                    outs.append(pool.out.clone())
        else:
            for _ in range(max(2, t.window)):  # two conventional steps: the second reads the first's state
                pool.step(ids, config)
                outs.append(pool.out.clone())
        rows = ids.long()
        outs += [cache.checkpoint[rows].clone(), cache.cursor[rows].clone()]
        torch.cuda.synchronize()
        return outs


def mismatch(got: list, want: list) -> Optional[str]:
    """Why the tensors `got` differ from `want` (a candidate's run against the default's), or
    None: beyond RTOL_16BIT / RTOL_FP32 of each tensor's largest magnitude, or not finite."""
    import torch

    for i, (g, w) in enumerate(zip(got, want)):
        if not w.is_floating_point():
            if not torch.equal(g, w):
                return f"tensor {i} (cursors) differs"
            continue
        if not torch.isfinite(g).all():
            return f"tensor {i}: non-finite values"
        rtol = RTOL_16BIT if w.element_size() == 2 else RTOL_FP32
        err = (g.float() - w.float()).abs().max().item()
        scale = w.float().abs().max().item()
        if err > rtol * scale:
            return f"tensor {i}: max |difference| {err:.3g} above {rtol:g} x max |default| {scale:.3g}"
    return None


def tune_one(target: TuneTarget, batch: int, candidates, replays: int, rotation_bytes: int, progress,
             watch=lambda config: None) -> TuneResult:
    """The fastest of `candidates` (the default config included) at `batch` whose outputs match
    the default's; `progress` advances once per candidate, `watch(config)` is called before each
    run of a config (``time_batches``)."""
    import torch

    configs = target.batch_candidates(candidates, batch)
    default = configs[0]
    check = OutputCheck(target, batch)
    watch(default)
    want = check.run(default)
    for w in want:
        if w.is_floating_point() and not torch.isfinite(w).all():
            raise RuntimeError(f"{target.label} batch {batch}: the default config {config_label(default)} gives "
                               f"non-finite outputs")
    passed, rejected = [default], {}
    for c in configs[1:]:
        watch(c)
        try:
            why = mismatch(check.run(c), want)
        except RuntimeError as e:  # e.g. too many resources requested for launch
            torch.cuda.synchronize()  # raises after a fault (the context is lost): tune_target's case
            why = f"failed to run: {e}"
        if why is None:
            passed.append(c)
        else:
            rejected[config_label(c)] = why
            progress.advance(f"{target.label} b={batch}")
    del check
    pool = target.pool(batch, rotation_bytes)
    screen = {}
    for c in passed:
        watch(c)
        screen[c] = time_config(target, pool, c, SCREEN_REPLAYS) if len(passed) > 1 else 0.0
        progress.advance(f"{target.label} b={batch}")
    finalists = sorted(passed, key=screen.get)[:FINALISTS]
    if default not in finalists:
        finalists.append(default)
    final = {}
    for c in finalists:
        watch(c)
        final[c] = time_config(target, pool, c, replays)
    del pool
    torch.cuda.empty_cache()
    best = min(finalists, key=final.get)
    return TuneResult(target, batch, best, final[best], default, final[default], len(passed), rejected)


def time_batches(send, target: TuneTarget, batches, candidates, replays: int, rotation_bytes: int) -> None:
    """A timing process's work (``tune_target``): tune_one at each of `batches`, sending
    ("run", (batch, config)) before each run of a config, ("tick", batch) per progress step and
    ("result", TuneResult) per batch."""
    import torch

    for b in batches:
        def watch(config, b=b):
            torch.cuda.synchronize()  # a fault surfaces here, while the config that caused it is the one named
            send(("run", (b, config)))

        progress = SimpleNamespace(advance=lambda note="", b=b: send(("tick", b)))
        result = tune_one(target, b, candidates, replays, rotation_bytes, progress, watch)
        torch.cuda.synchronize()
        send(("result", result))


def _timing_process(work, conn, *args) -> None:
    """A timing process: `work(conn.send, *args)`, an exception sent back as ("error", (its
    message, its traceback))."""
    try:
        work(conn.send, *args)
    except Exception as e:
        conn.send(("error", (str(e), traceback.format_exc())))


def tune_target(target: TuneTarget, batches, candidates, replays: int, rotation_bytes: int, progress,
                work=time_batches):
    """Yields the TuneResult of `target` at each of `batches` (tune_one), as they come, timed in
    a spawned child process that runs `work` (``time_batches``). A candidate that faults the GPU
    leaves that process's CUDA context unusable: when the child dies or reports a CUDA error, the
    config it was running is dropped for this target and a fresh child goes on from that batch
    (a faulting default skips the batch: nothing to compare with), at most MAX_RESTARTS times.
    `progress` advances len(candidates) per batch, whatever the restarts."""
    ctx = multiprocessing.get_context("spawn")
    todo, faulted, restarts = list(batches), [], 0
    shown = dict.fromkeys(batches, 0)  # progress steps shown per batch: none twice when a batch runs again

    def advance_to(b, n):
        while shown[b] < n:
            shown[b] += 1
            progress.advance(f"{target.label} b={b}")

    while todo:
        reader, writer = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_timing_process, daemon=True, args=(
            work, writer, target, todo, [c for c in candidates if c not in faulted], replays, rotation_bytes))
        child.start()
        writer.close()  # the child's end only: recv() then fails once the child is gone
        running, error, ticks = None, None, dict.fromkeys(todo, 0)
        with reader:
            while True:
                try:
                    kind, value = reader.recv()
                except EOFError:
                    break
                if kind == "run":
                    running = value
                elif kind == "tick":
                    ticks[value] += 1
                    advance_to(value, ticks[value])
                elif kind == "result":
                    running = None
                    todo.remove(value.batch)
                    advance_to(value.batch, len(candidates))
                    yield value
                else:
                    error = value
        child.join()
        if not todo:
            return
        if error is not None and not _CUDA_ERROR.search(error[0]):
            raise RuntimeError(f"{target.label}: timing failed in its process:\n{error[1]}")
        why = error[0].strip().splitlines()[0] if error else f"its process died, exit code {child.exitcode}"
        give_up = f"faulted outside any candidate ({why})"
        if running is not None:
            b, config = running
            faulted.append(config)
            if config == target.default_config(b):
                print(f"  {target.label} b={b} {config_label(config)}: faulted ({why}), the default config: "
                      f"batch skipped")
                todo.remove(b)
                advance_to(b, len(candidates))
            else:
                print(f"  {target.label} b={b} {config_label(config)}: faulted ({why}), dropped")
            restarts += 1
            give_up = f"given up after {MAX_RESTARTS} restarts on faults" if restarts > MAX_RESTARTS else None
        if todo and give_up:
            print(f"  {target.label}: {give_up}; batches {', '.join(map(str, todo))} not tuned")
            for b in todo:
                advance_to(b, len(candidates))
            return


# ------------------------------------------------------------------------------------- the CLI


def _int_list(parser, flag: str, text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        parser.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if not values:
        parser.error(f"{flag}: give at least one value")
    return sorted(set(values))


def parse_shape(parser, text: str) -> ModelSpec:
    """--shape LAYER:D1,D2,D3,D4 as a ModelSpec named after it."""
    layer, sep, dims = text.partition(":")
    if not sep or layer not in ("mamba2", "gdn"):
        parser.error(f"--shape: expected mamba2:H,P,N,G or gdn:HV,V,K,H, got {text!r}")
    try:
        values = [int(v) for v in dims.split(",")]
    except ValueError:
        values = []
    if len(values) != 4 or min(values) < 1:
        what = "H,P,N,G (heads, headdim, dstate, groups)" if layer == "mamba2" else "HV,V,K,H (value heads, V, K, key heads)"
        parser.error(f"--shape: {layer} takes four dims >= 1, {what}; got {dims!r}")
    return ModelSpec(f"{layer}:{','.join(map(str, values))}", layer, *values, num_layers=1)


def parse_args(argv=None) -> argparse.Namespace:
    """Arguments, checked before cutlass is imported; `targets` and `batches` filled in."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help=f"model registry names, comma separated (known: {', '.join(MODELS)})")
    which.add_argument("--shape", help="explicit layer dims: mamba2:H,P,N,G or gdn:HV,V,K,H")
    parser.add_argument("--batch", help="batch buckets, powers of two up to 1024, comma separated (default: all)")
    parser.add_argument("--modes", default=DEFAULT_MODES,
                        help=f"comma separated, of {', '.join(MODES)} (default {DEFAULT_MODES})")
    parser.add_argument("--window", type=int, default=16, help="ReplaySSM window L of standard and verify (default 16)")
    parser.add_argument("--drafts", metavar="T1,T2,...", help="draft counts T of the verify mode (needed with it)")
    parser.add_argument("--read-copies", metavar="F1,F2", default="",
                        help="also tune standard decoding with these read copies (fp16, fp8, nvfp4)")
    parser.add_argument("--read-copies-only", action="store_true",
                        help="tune only the read-copy kernels of --read-copies, not the fp32-read ones of --modes")
    parser.add_argument("--dtypes", default="bf16", help=f"activation dtypes, of {', '.join(DTYPES)} (default bf16)")
    parser.add_argument("--out", help="tuned-config file to merge the winners into (default: the user file, "
                                      "$REPLAYSSM_CUTE_TUNED_FILE or tuned.json in the compile-cache folder)")
    parser.add_argument("--replays", type=int, default=15, help="CUDA-graph replays of a final timing (default 15)")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                        help="compile worker processes (default min(16, CPUs))")
    parser.add_argument("--pool-mb", type=int, default=512,
                        help="slot pool per rotation in MiB (default 512, far above L2 so that every step "
                             "streams its checkpoint from HBM; smaller only for quick checks)")
    parser.add_argument("--space", choices=("full", "compact"), default="full",
                        help="decode launch configs to time: the whole space, or compact: the part where "
                             "measured winners lie (for tuning many kernels x buckets in one run)")
    parser.add_argument("--compile-only", action="store_true",
                        help="only build the candidate kernels into the compile cache (no GPU needed with "
                             "CUTE_DSL_ARCH set), then exit")
    args = parser.parse_args(argv)

    if args.model is not None:
        try:
            models = [get_model(name.strip()) for name in args.model.split(",") if name.strip()]
        except ValueError as e:
            parser.error(f"--model: {e}")
        if not models:
            parser.error("--model: give at least one model name")
    else:
        models = [parse_shape(parser, args.shape)]
    args.batches = list(BATCH_BUCKETS)
    if args.batch is not None:
        args.batches = _int_list(parser, "--batch", args.batch)
        for b in args.batches:
            if b not in BATCH_BUCKETS:
                parser.error(f"--batch: {b} is not a batch bucket; give powers of two from 1 to "
                             f"{BATCH_BUCKETS[-1]}, e.g. --batch 1,64,256")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            parser.error(f"--modes: unknown mode {m!r}; use {', '.join(MODES)}")
    if not modes:
        parser.error(f"--modes: give at least one of {', '.join(MODES)}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in DTYPES:
            parser.error(f"--dtypes: unknown dtype {d!r}; use {', '.join(DTYPES)}")
    if not dtypes:
        parser.error(f"--dtypes: give at least one of {', '.join(DTYPES)}")
    if not 2 <= args.window <= MAX_CAPACITY:
        parser.error(f"--window must be in 2..{MAX_CAPACITY} (window 1 is the conventional mode)")
    drafts = []
    if "verify" in modes:
        if args.drafts is None:
            parser.error("--modes verify: give the draft counts with --drafts, e.g. --drafts 4,8")
        drafts = _int_list(parser, "--drafts", args.drafts)
        for T in drafts:
            if not 1 <= T <= min(MAX_DRAFT, args.window) or args.window + T > MAX_CAPACITY:
                parser.error(f"--drafts: draft count {T} outside 1..min({MAX_DRAFT}, window {args.window}) "
                             f"with window + T <= {MAX_CAPACITY}")
    elif args.drafts is not None:
        parser.error("--drafts: only used by the verify mode; add verify to --modes")
    for flag, value, low in (("--replays", args.replays, 1), ("--workers", args.workers, 1), ("--pool-mb", args.pool_mb, 0)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")

    read_copies = [r.strip() for r in args.read_copies.split(",") if r.strip()]
    for r in read_copies:
        if r not in READ_COPIES:
            parser.error(f"--read-copies: unknown read copy {r!r}; use {', '.join(READ_COPIES)}")
    if read_copies and not {"standard", "verify"} & set(modes):
        parser.error("--read-copies: tunes the standard and verify modes (the read copy's GPU kernels); "
                     "add standard or verify to --modes")
    if args.read_copies_only and not read_copies:
        parser.error("--read-copies-only: needs --read-copies")

    args.targets = [] if args.read_copies_only else [
                    TuneTarget(m, mode, window, T, d)
                    for m in models for d in dtypes for mode in MODES if mode in modes
                    for window, T in ({"conventional": [(1, 0)], "standard": [(args.window, 0)],
                                       "verify": [(args.window, T) for T in drafts]}[mode])]
    args.targets += [TuneTarget(m, mode, args.window, T, d, r) for m in models for d in dtypes for r in read_copies
                     for mode, T in ([("standard", 0)] if "standard" in modes else [])
                     + ([("verify", T) for T in drafts] if "verify" in modes else [])]
    return args


def _target_arch(compile_only: bool) -> Optional[str]:
    """The arch to compile for, or None after saying on stderr why the tuner cannot run: no GPU
    to time on, or --compile-only with neither a GPU nor CUTE_DSL_ARCH."""
    import torch

    if not (compile_only or torch.cuda.is_available()):
        print(NO_GPU.format(prog=PROG), file=sys.stderr)
        return None
    from .runtime.compile_cache import target_arch

    try:
        return target_arch()
    except RuntimeError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return None


def summary(results: List[TuneResult]) -> str:
    """The table of winners: per kernel and batch the best config, its time and TB/s, the
    default and the speedup over it."""
    header = (f"{'kernel':40s} {'batch':>5s}  {'best config':22s} {'us':>9s} {'TB/s':>6s}  "
              f"{'default config':22s} {'us':>9s} {'speedup':>8s}  candidates")
    lines = [header, "-" * len(header)]
    for r in results:
        rejected = f" ({len(r.rejected)} rejected)" if r.rejected else ""
        lines.append(f"{r.target.label:40s} {r.batch:5d}  {config_label(r.config):22s} {r.time_us:9.1f} "
                     f"{r.tbps:6.2f}  {config_label(r.default_config):22s} {r.default_time_us:9.1f} "
                     f"{r.speedup:7.3f}x  {r.timed}{rejected}")
    return "\n".join(lines)


def config_order(config) -> tuple:
    """A sort key over launch configs of both decode kernels (tile and pipelined keys do not compare)."""
    return type(config).__name__, config.key()


def main(argv=None) -> int:
    args = parse_args(argv)
    arch = _target_arch(args.compile_only)
    if arch is None:
        return 1
    from .runtime import launch, tuning

    out = args.out or tuning.user_file()
    # a file the winners cannot be written to or merged into fails now, not after tuning
    reason = path_error(out)
    if reason is None:
        try:
            entries = tuning.read_entries(out)
        except (OSError, ValueError) as e:
            reason = str(e)
    if reason is not None:
        print(f"{PROG}: error: --out: {reason}", file=sys.stderr)
        return 2

    # From before cutlass is imported (t.candidates), so that the compiles in this process
    # (--workers 1) report their spills too; the timing processes, started later, do not.
    with ptxas_reports():
        candidates = {}
        for t in args.targets:
            configs = t.candidates(args.space, args.batches)
            defaults = {t.default_config(b) for b in args.batches}
            for d in defaults:
                reason = t.check(d)
                if reason is not None:
                    print(f"{PROG}: {t.label}: the kernel cannot take this shape: {reason}", file=sys.stderr)
                    return 1
            ordered = sorted(defaults, key=config_order)
            candidates[t] = list(dict.fromkeys(ordered + configs))
        jobs = [(t, c) for t in args.targets for c in candidates[t]]
        print(f"{PROG}: {len(args.targets)} kernels x {len(args.batches)} batch buckets, {len(jobs)} candidate "
              f"launch configs for {arch}", flush=True)
        dropped, spills, unreported = compile_candidates(jobs, args.workers, arch)
    for (t, c), why in sorted(dropped.items(), key=lambda kv: (kv[0][0].label, config_order(kv[0][1]))):
        print(f"  {t.label} {config_label(c)}: dropped ({why.splitlines()[0]})")
    for (t, c), (stack, stores, loads) in sorted(spills.items(), key=lambda kv: (kv[0][0].label,
                                                                                 config_order(kv[0][1]))):
        print(f"  {t.label} {config_label(c)}: spills {max(stores, loads)} bytes (stack frame {stack} bytes); "
              f"timed like the others")
    if unreported:
        print(f"  {unreported} candidates were in the compile cache already: ptxas did not run, so their spills "
              f"are not reported")
    if args.compile_only:
        print(f"{len(jobs) - len(dropped)} kernels in the compile cache")
        return 0
    # a kernel whose default is dropped has nothing to compare its candidates with: the others go on
    targets = []
    for t in args.targets:
        why = next((dropped[t, t.default_config(b)] for b in args.batches if (t, t.default_config(b)) in dropped), None)
        if why is not None:
            print(f"{PROG}: {t.label}: not tuned: its default config is dropped, nothing to compare the "
                  f"candidates with ({why.splitlines()[0]})", file=sys.stderr)
            continue
        targets.append(t)
        candidates[t] = [c for c in candidates[t] if (t, c) not in dropped]

    platform = tuning.current_platform()
    results = []
    progress = Progress("tune", sum(len(t.batch_candidates(candidates[t], b)) for t in targets
                                    for b in args.batches))
    for t in targets:
        for r in tune_target(t, args.batches, candidates[t], args.replays, args.pool_mb << 20, progress):
            results.append(r)
            # each winner as it comes: a run cut short keeps what it measured
            entries = tuning.write_entries(out, [r.entry(platform)])
    launch.reload()
    print(summary(results))
    for r in results:
        for label, why in r.rejected.items():
            print(f"  {r.target.label} b={r.batch} {label}: rejected, {why}")
    print(f"{len(results)} tuned configs for {platform.device} ({platform.arch}) merged into {out} "
          f"({len(entries)} entries); decode and verify use them from now on "
          f"({tuning.ENV_DISABLE}=0 turns them off)")
    return 0 if len(targets) == len(args.targets) else 1


if __name__ == "__main__":
    sys.exit(main())
