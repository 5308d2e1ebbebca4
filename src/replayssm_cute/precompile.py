"""Build every kernel a model needs into the compile cache, with no GPU required.

    python -m replayssm_cute.precompile --model nemotron-super [--arch sm_90a|sm_100a|sm_103a]
        [--device-name "NVIDIA H200"] [--window 16] [--dtypes bf16,fp16] [--with-z] [--drafts 2,4,8]
        [--read-copies fp16,fp8,nvfp4] [--dump-ptx DIR] [--workers N]

A server that runs this at build time starts warm: `decode` (and with --drafts, `verify` and
`commit`) finds its kernels on disk, with the sequence table's plan kernel of a ReplaySSM step. The variants are those `decode` asks for with the engines'
usual arguments, for the conventional step (window 1) and ReplaySSM (--window), each with every
launch config decode picks over the batch buckets (1, 2, 4, ..., 1024) on the target device:

* Mamba-2 models: D and dt_bias given, dt_softplus on, no z (--with-z adds the gated variants),
  dt in the activation dtype, pad sentinel -1.
* Gated DeltaNet models (Qwen3.5, Qwen3-Next): q, k, v and the raw gates a, b in the activation
  dtype, A_log and dt_bias fp32, the default q scale K ** -0.5, no v / beta records, pad
  sentinel -1. --with-z is an error for them: the GDN output gate (RMSNorm, silu(z)) is applied
  outside the kernel, so there is no gated variant.

Launch configs: decode and verify pick the tuned config of their device (replayssm_cute.runtime.tuning:
the shipped H200 file, the user's file) at the batch's bucket or a neighbouring one, else the
analytical default. --device-name names the device the kernels are for, as
torch.cuda.get_device_name() spells it (default: the visible GPU); --arch its target (default:
$CUTE_DSL_ARCH, else the visible GPU's). With no device named and no GPU visible: the defaults
and what every device with tuned configs picks at that arch.

--drafts T1,T2,... (default: none) adds what speculative decoding needs on a cache built with
max_draft = max(T) and the same window, for either layer type: the standard decode kernels on
that cache (its ring is window + max_draft records, a different kernel from the window-only
cache's), the verify kernel for each draft count T with the launch configs verify picks, and
the sequence-table kernels (plan and commit) for each T. Each T needs 1 <= T <= min(16, window), and window + max(T) <= 32.
--dump-ptx covers these kernels too.

--read-copies F1,F2,... (default: none) adds the ReplaySSM decode kernels (--window) of caches
with those low-precision read copies next to an fp32 checkpoint (GDN: keeping v and beta and
re-deriving at a flush, the cache's defaults), with the launch configs decode picks for them;
with --drafts also their draft caches' decode and verify kernels.

The kernels build in --workers processes (default min(16, CPUs); cute.compile is not
thread-safe) through the disk cache, one line each with the count so far and an estimate of the
time left; --workers 1 builds them one after another in this process, in order.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional

from .kernels.limits import MAX_CAPACITY, MAX_DRAFT
from .runtime import tuning
from .runtime.tuning import BATCH_BUCKETS

PROG = "python -m replayssm_cute.precompile"
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def config_label(config) -> str:
    """rows{R}_warps{W}[_ctas{C}], or for the pipelined decode
    pipe{S}_grid{C}[_rows{R}_warps{W}][_cudafold][_prefetch{F}][_groups{G}[_rpw{R}]][_heads{H}][_flushtile][_cudadots][_cudaflush][_lanes{L}][_ctas{M}],
    or for the pipelined verify pipeverify{S}_grid{C}[_prefetch{F}][_groups{G}][_units{U}][_ctas{M}]: a launch config
    in a variant's label (unique per config)."""
    if type(config).__name__ == "PipeVerifyConfig":  # (by name: no cutlass import for a label)
        label = f"pipeverify{config.stages}_grid{config.ctas}"
        label += f"_prefetch{config.prefetch}" if config.prefetch != 4 else ""
        label += f"_groups{config.consumer_groups}" if config.consumer_groups != 1 else ""
        label += f"_units{config.heads_per_unit}" if config.heads_per_unit != 1 else ""
        return label + (f"_ctas{config.min_ctas_per_sm}" if config.min_ctas_per_sm else "")
    if hasattr(config, "stages"):
        label = f"pipe{config.stages}_grid{config.ctas}"
        if hasattr(config, "rows_per_item"):  # GDN's
            label += f"_rows{config.rows_per_item}_warps{config.consumer_warps()}"
            label += f"_prefetch{config.prefetch}" if config.prefetch != 4 else ""
            label += f"_groups{config.consumer_groups}" if config.consumer_groups != 1 else ""
            label += f"_heads{config.heads_per_item}" if config.heads_per_item != 1 else ""
            label += "" if config.mma_dots else "_cudadots"
            label += "" if config.mma_flush else "_cudaflush"
            label += f"_lanes{config.row_lanes}" if config.row_lanes != 32 else ""
            return label + (f"_ctas{config.min_ctas_per_sm}" if config.min_ctas_per_sm else "")
        if not config.mma_fold:
            label += "_cudafold"
        label += f"_prefetch{config.prefetch}" if config.prefetch != 4 else ""
        if (config.consumer_groups, config.rows_per_warp) != (1, 16):
            label += f"_groups{config.consumer_groups}_rpw{config.rows_per_warp}"
        label += f"_heads{config.heads_per_item}" if config.heads_per_item != 1 else ""
        label += "_flushtile" if config.flush_tile else ""
        return label + (f"_ctas{config.min_ctas_per_sm}" if config.min_ctas_per_sm else "")
    label = f"rows{config.rows_per_cta}_warps{config.num_warps}"
    if config.min_ctas_per_sm:
        label += f"_ctas{config.min_ctas_per_sm}"
    return label


def _picked(kernel, shape, platforms, num_drafts: int = 0):
    """The distinct launch configs `kernel` (a runtime.launch.Kernel) runs `shape` with, T =
    `num_drafts`, over every batch bucket, sorted: on each of `platforms` (tuning.Platform, or
    None for no tuned configs), or with `platforms` None on the active one
    (launch.active_platform: this process's GPU, or none)."""
    from .runtime import launch

    def picks():
        return {launch.picked_config(kernel, shape, b, num_drafts)[0] for b in BATCH_BUCKETS}

    if platforms is None:
        configs = picks()
    else:
        configs = set()
        for platform in platforms:
            with launch.use_platform(platform):
                configs |= picks()
    return sorted(configs, key=lambda c: (type(c).__name__, c.key()))  # tile and pipelined configs may mix


def _shape(model, dtype, window: int, max_draft: int = 0, read_copy=None, with_z: bool = False,
           pad_slot_id: int = -1):
    """The kernel Shape decode and verify build for the engines' usual arguments (the layer
    adapter's ``engine_inputs``; `with_z`: Mamba-2's gated variant) on a cache of `model`'s layer
    at `window` with room for `max_draft` drafts and activations `dtype`; with `read_copy`, that
    read copy next to an fp32 checkpoint (GDNCache's defaults then: v and beta kept, corrections
    re-derived at a flush)."""
    from .layers import LAYERS, model_cache

    layer = LAYERS[model.layer]
    cache = model_cache(model, 1, window, "meta", max_draft, dtype, read_copy, pad_slot_id)
    return layer.shape(cache, layer.engine_inputs(dtype, with_z))


READ_COPIES = ("fp16", "fp8", "nvfp4")


def read_copy_variants(model, window: int, dtypes, read_copies, pad_slot_id: int = -1, platforms=None):
    """(label, shape, config) for the ReplaySSM decode kernels `decode` builds on caches with each
    read copy of `read_copies` next to an fp32 checkpoint (GDNCache's defaults with a read copy:
    v and beta kept, corrections re-derived at a flush), the engines' usual arguments otherwise
    (``variants``), each with the launch configs decode picks on `platforms`."""
    import torch

    from .layers import LAYERS

    kernel = LAYERS[model.layer].decode_kernel
    out = []
    for dname in dtypes:
        dtype = getattr(torch, _DTYPES[dname])
        for fmt in read_copies:
            shape = _shape(model, dtype, window, read_copy=fmt, pad_slot_id=pad_slot_id)
            for cfg in _picked(kernel, shape, platforms):
                out.append((f"{model.layer}_replay_L{window}_read_{fmt}_{dname}_{config_label(cfg)}", shape, cfg))
    return out


def parse_drafts(text: str):
    """`--drafts` text -> (sorted distinct draft counts, None) or (None, why not)."""
    items = [t.strip() for t in text.split(",")]
    if not any(items):
        return None, "--drafts: give at least one draft count, e.g. --drafts 2,4,8"
    drafts = []
    for t in items:
        if not t:
            continue
        try:
            drafts.append(int(t))
        except ValueError:
            return None, f"--drafts: {t!r} is not a draft count; give integers, e.g. --drafts 2,4,8"
    return sorted(set(drafts)), None


def _drafts_error(model, window: int, drafts) -> Optional[str]:
    """Why `drafts` (draft counts) cannot be built for `model` at `window`, or None."""
    for T in drafts:
        if not 1 <= T <= MAX_DRAFT:
            return f"--drafts: draft count {T} is outside 1..{MAX_DRAFT}"
        if T > window:
            return (f"--drafts: draft count {T} is above the window {window} (a verify step of T "
                    f"drafts needs T <= window)")
    if window + max(drafts) > MAX_CAPACITY:
        return (f"--drafts: window {window} + max draft count {max(drafts)} = {window + max(drafts)} "
                f"ring records, above {MAX_CAPACITY} (one lane per record)")
    return None


def _option_error(model, with_z: bool, window: Optional[int] = None, drafts=None):
    """Why the options do not apply to `model`, or None. Needs no cutlass import."""
    from .layers import LAYERS

    if model.layer not in LAYERS:
        return f"{model.name}: unknown layer type {model.layer!r}"
    if with_z and model.layer == "gdn":
        return (f"--with-z: {model.name} is a gdn model; its output gate (RMSNorm, silu(z)) is "
                f"applied outside the kernel, so it has no z variants")
    if drafts is not None:
        return _drafts_error(model, 16 if window is None else window, drafts)
    return None


def variants(model, window: int, dtypes, with_z: bool = False, platforms=None):
    """(label, shape, config) for every decode kernel `decode` needs at `model`'s shape, for the
    conventional step (window 1) and ReplaySSM (`window`), with the launch configs it picks on
    `platforms` (``_picked``): the engines' usual arguments (the module docstring), `with_z`
    adding Mamba-2's gated variants.

    ModelSpec fields for a GDN layer: nheads = HV value heads, headdim = V, dstate = K,
    ngroups = H key heads."""
    import torch

    from .layers import LAYERS

    reason = _option_error(model, with_z)
    if reason is not None:
        raise ValueError(reason)
    kernel = LAYERS[model.layer].decode_kernel
    out = []
    for dname in dtypes:
        dtype = getattr(torch, _DTYPES[dname])
        for L in sorted({1, window}):
            shape = _shape(model, dtype, L, with_z=with_z)
            for cfg in _picked(kernel, shape, platforms):
                mode = "conventional" if L == 1 else f"replay_L{L}"
                out.append((f"{model.layer}_{mode}_{dname}_{config_label(cfg)}", shape, cfg))
    return out


def compile_variant(layer: str, shape, config):
    """Build one variant into the compile cache (or load it); returns the compiled kernel."""
    from .layers import LAYERS
    from .runtime.launch import compiled

    return compiled(LAYERS[layer].decode_kernel, shape, config)


class DraftVariant(NamedTuple):
    """One kernel that speculative decoding needs (``draft_variants``)."""

    label: str
    kind: str  # "decode", "verify", or a sequence-table kernel: "plan" or "commit"
    shape: object  # Mamba2Shape / GDNShape, or kernels.table.TableShape for "plan" / "commit"
    config: object  # launch config; None for "plan" / "commit"
    num_drafts: int  # T of a verify / plan / commit kernel; 0 for "decode" and a decode step's plan


def table_variants(layer: str, window: int, capacity: int, drafts, cache: str, pad_slot_id: int = -1):
    """The sequence-table kernels (kernels/table.py) of a cache of `window` and `capacity`: the
    plan of a standard decode step, and for each T of `drafts` the plan of a verify step and its
    commit."""
    from .kernels.table import TableShape

    out = [DraftVariant(f"{layer}_plan_{cache}_T0", "plan", TableShape(window, capacity, 0, pad_slot_id), None, 0)]
    for T in drafts:
        shape = TableShape(window, capacity, T, pad_slot_id)
        out += [DraftVariant(f"{layer}_plan_{cache}_T{T}", "plan", shape, None, T),
                DraftVariant(f"{layer}_commit_{cache}_T{T}", "commit", shape, None, T)]
    return out


def draft_variants(model, window: int, drafts, dtypes, with_z: bool = False, pad_slot_id: int = -1,
                   read_copy=None, platforms=None):
    """Every kernel that speculative decoding with `drafts` draft counts needs at this model shape,
    on a cache with max_draft = max(drafts) and `window`: the decode kernels on that cache (its
    capacity differs from the window-only cache's), one verify kernel per (dtype, T, launch config)
    and the cache's sequence-table kernels (``table_variants``). Launch configs: those decode and verify pick on `platforms`
    (``_picked``). Arguments as ``variants`` (the engines' usual ones).
    ``read_copy``: those of a cache with that read copy next to an fp32 checkpoint (GDN keeping v
    and beta, re-deriving at a flush), without the table kernels (the plain cache's).
    Raises ValueError (naming --drafts) when the draft counts do not apply."""
    import torch

    drafts = sorted(set(drafts))
    reason = _option_error(model, with_z, window, drafts)
    if reason is not None:
        raise ValueError(reason)
    from .layers import LAYERS

    layer = model.layer
    decode, verify = LAYERS[layer].decode_kernel, LAYERS[layer].verify_kernel
    max_draft = max(drafts)
    capacity = window + max_draft
    cache = f"L{window}_maxdraft{max_draft}" + (f"_read_{read_copy}" if read_copy else "")
    out = []
    for dname in dtypes:
        shape = _shape(model, getattr(torch, _DTYPES[dname]), window, max_draft, read_copy, with_z, pad_slot_id)
        for cfg in _picked(decode, shape, platforms):
            reason = decode.check(shape, cfg, 0)
            if reason is not None:
                raise ValueError(f"--drafts: the decode kernel on a cache of max_draft {max_draft} "
                                 f"cannot take {cfg}: {reason}")
            out.append(DraftVariant(f"{layer}_replay_{cache}_{dname}_{config_label(cfg)}", "decode",
                                    shape, cfg, 0))
        for T in drafts:
            for cfg in _picked(verify, shape, platforms, T):
                reason = verify.check(shape, cfg, T)
                if reason is not None:
                    raise ValueError(f"--drafts: the verify kernel cannot take T = {T} with {cfg}: {reason}")
                out.append(DraftVariant(f"{layer}_verify_{cache}_T{T}_{dname}_{config_label(cfg)}",
                                        "verify", shape, cfg, T))
    if read_copy is None:
        out += table_variants(layer, window, capacity, drafts, cache, pad_slot_id)
    return out


def compile_draft_variant(layer: str, variant: DraftVariant):
    """Build one of `draft_variants` into the compile cache (or load it); returns the kernel."""
    from .layers import LAYERS
    from .runtime.launch import launcher, table_launcher

    if variant.kind == "decode":
        return compile_variant(layer, variant.shape, variant.config)
    if variant.kind == "verify":
        return launcher(LAYERS[layer].verify_kernel, variant.shape, variant.num_drafts, 1, variant.config)
    if variant.kind in ("plan", "commit"):
        return table_launcher(variant.kind, *variant.shape.key())
    raise ValueError(f"unknown kernel kind {variant.kind!r}")


def _write_ptx(build, path: Path) -> None:
    """build(options) compiles with the given options; its PTX goes to `path`."""
    import shlex
    import tempfile

    from .runtime.compile_cache import compile_options

    # --keep-ptx also writes a copy into the DSL's dump dir (by default the current directory);
    # a scratch folder keeps that from littering wherever precompile was started.
    with tempfile.TemporaryDirectory(prefix="replayssm_cute_ptx_") as scratch:
        options = compile_options("--keep-ptx", f"--dump-dir {shlex.quote(scratch)}")
        Path(path).write_text(build(options).__ptx__)


def dump_ptx(layer: str, shape, config, path: Path) -> None:
    """Compile one variant once more with --keep-ptx and write its PTX to `path`."""
    from .layers import LAYERS

    _write_ptx(lambda options: LAYERS[layer].decode_kernel.build(shape, config, 0, options), path)


def dump_draft_ptx(layer: str, variant: DraftVariant, path: Path) -> None:
    """Compile one of `draft_variants` once more with --keep-ptx and write its PTX to `path`."""
    from .layers import LAYERS

    if variant.kind == "decode":
        return dump_ptx(layer, variant.shape, variant.config, path)
    if variant.kind == "verify":
        return _write_ptx(lambda options: LAYERS[layer].verify_kernel.build(
            variant.shape, variant.config, variant.num_drafts, options), path)
    if variant.kind in ("plan", "commit"):
        from .kernels.table import compile_commit, compile_plan

        build = compile_plan if variant.kind == "plan" else compile_commit
        return _write_ptx(lambda options: build(variant.shape, options), path)
    raise ValueError(f"unknown kernel kind {variant.kind!r}")


def path_error(path, folder: bool = False) -> Optional[str]:
    """Why nothing can be written at `path` (a file; with `folder`, a folder to write files into),
    or None. Checked before long work starts, creating nothing: missing folders on the way are
    fine where they can be created."""
    path = Path(path)
    if path.exists():
        if path.is_dir() and not folder:
            return f"{path} is a folder, expected a file path"
        if folder and not path.is_dir():
            return f"{path} is a file, expected a folder"
        return None if os.access(path, os.W_OK) else f"{path} is not writable"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot create {path}: {parent} is a file, not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {path}: {parent} is not writable"
    return None


def target_platforms(device_name: Optional[str], arch: str) -> list:
    """The platforms whose picks precompile builds (``_picked``) for kernels compiled for `arch`:
    that of the device named (None: of the active platform's device, the visible GPU); with
    neither, None (no tuned configs: the defaults, as decode without a GPU) and that of every
    device with tuned configs."""
    from .runtime.compile_cache import cutlass_version
    from .runtime.launch import active_platform
    from .version import __version__

    def on(device):
        return tuning.Platform(device, arch, __version__, cutlass_version())

    if device_name is None:
        active = active_platform()
        if active is None:
            return [None] + [on(d) for d in tuning.tuned_devices()]
        device_name = active.device
    return [on(device_name)]


def _platforms_line(platforms) -> str:
    devices = [p.device for p in platforms if p is not None]
    if not tuning.tuned_enabled():
        return f"launch configs: the defaults ({tuning.ENV_DISABLE}=0 turns tuned configs off)"
    if None not in platforms and devices[0] not in tuning.tuned_devices():  # a typo in --device-name, say
        return (f"launch configs: the defaults (no tuned configs for {devices[0]!r}; tuned: "
                f"{', '.join(map(repr, tuning.tuned_devices())) or 'none'})")
    if None not in platforms:
        return f"launch configs: those decode and verify pick on {devices[0]} (tuned where tuned, else the defaults)"
    return ("launch configs: the defaults" + "".join(f", and those picked on {d}" for d in devices)
            + " (no --device-name and no GPU visible)")


class BuildJob(NamedTuple):
    """One kernel to build: a `draft_variants` item (decode variants as kind "decode"), and where
    its PTX goes (None: nowhere)."""

    layer: str
    variant: DraftVariant
    ptx: Optional[Path]


def init_worker(arch: str) -> None:
    """A compile worker process's start: the target arch before cutlass is imported (the workers
    never touch a GPU)."""
    from .runtime.compile_cache import ENV_ARCH

    os.environ[ENV_ARCH] = arch


def build_job(job: BuildJob):
    """Build `job` into the compile cache (and write its PTX): (seconds, None), or (seconds, why
    it failed)."""
    t0 = time.perf_counter()
    try:
        compile_draft_variant(job.layer, job.variant)
        if job.ptx is not None:
            dump_draft_ptx(job.layer, job.variant, job.ptx)
    except Exception as e:  # reported with the others, then precompile fails
        return time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    return time.perf_counter() - t0, None


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def build_all(jobs, workers: int, arch: str) -> dict:
    """Build every job: in `workers` spawned processes through the disk cache (cute.compile is
    not thread-safe), in this one, in order, when workers <= 1 or that cache is off. A line per
    kernel as it is done: the count so far, its time and the time left at the mean rate so far.
    Returns {label: why} of those that failed."""
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from .runtime.compile_cache import disk_cache_enabled

    t0, failed = time.perf_counter(), {}
    count, label = len(str(len(jobs))), max(len(job.variant.label) for job in jobs)

    def done(i, job, seconds, why):
        left = (time.perf_counter() - t0) / i * (len(jobs) - i)
        line = f"  [{i:{count}d}/{len(jobs)}] {job.variant.label:{label}s} {seconds:6.1f} s  ETA {_duration(left)}"
        if why is not None:
            failed[job.variant.label] = why
            line += "  FAILED"
            print(f"{PROG}: {job.variant.label}: {why}", file=sys.stderr)
        elif job.ptx is not None:
            line += f"  -> {job.ptx}"
        print(line, flush=True)

    if workers <= 1 or not disk_cache_enabled():
        for i, job in enumerate(jobs, 1):
            done(i, job, *build_job(job))
        return failed
    import multiprocessing

    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn"),
                             initializer=init_worker, initargs=(arch,)) as pool:
        futures = {pool.submit(build_job, job): job for job in jobs}
        for i, future in enumerate(as_completed(futures), 1):
            done(i, futures[future], *future.result())
    return failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model registry name")
    parser.add_argument("--arch", choices=["sm_90a", "sm_100a", "sm_103a"],
                        help="target (default: $CUTE_DSL_ARCH, else the visible GPU's)")
    parser.add_argument("--device-name", metavar="NAME",
                        help="the GPU the kernels are for, as torch.cuda.get_device_name() says it, e.g. "
                             "\"NVIDIA H200\": its tuned launch configs are built (default: the visible GPU; "
                             "without one, the defaults and those of every device with tuned configs)")
    parser.add_argument("--window", type=int, default=16, help="ReplaySSM window L (default 16)")
    parser.add_argument("--dtypes", default="bf16", help="activation dtypes, comma separated")
    parser.add_argument("--with-z", action="store_true",
                        help="also the gated (z) variants (Mamba-2 only; an error for GDN models, "
                             "whose output gate is outside the kernel)")
    parser.add_argument("--drafts", metavar="T1,T2,...",
                        help="also the speculative kernels for these draft counts (default: none): "
                             "decode and verify on a cache of max_draft = max(T), and commit")
    parser.add_argument("--read-copies", metavar="F1,F2,...", default="",
                        help=f"also the decode kernels of caches with these read copies ({', '.join(READ_COPIES)})")
    parser.add_argument("--dump-ptx", metavar="DIR", help="write each kernel's PTX into DIR")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                        help="compile worker processes (default min(16, CPUs)); 1: one kernel after "
                             "another in this process")
    args = parser.parse_args(argv)

    from .models import get_model

    try:
        model = get_model(args.model)
    except ValueError as e:
        parser.error(str(e))
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in _DTYPES:
            parser.error(f"--dtypes: unknown dtype {d!r}; use {', '.join(_DTYPES)}")
    if not dtypes:
        parser.error("--dtypes: give at least one of " + ", ".join(_DTYPES))
    read_copies = [r.strip() for r in args.read_copies.split(",") if r.strip()]
    for r in read_copies:
        if r not in READ_COPIES:
            parser.error(f"--read-copies: unknown read copy {r!r}; use {', '.join(READ_COPIES)}")
    if not 2 <= args.window <= 32:
        parser.error("--window must be in 2..32 (window 1 is the conventional kernel, always built; "
                     "the kernel keeps one record per lane)")
    if args.workers < 1:
        parser.error(f"--workers must be >= 1, got {args.workers}")
    if args.device_name is not None and not args.device_name.strip():
        parser.error("--device-name: expected a GPU name such as \"NVIDIA H200\", got an empty one")
    drafts = None
    if args.drafts is not None:
        drafts, reason = parse_drafts(args.drafts)
        if reason is not None:
            parser.error(reason)
    reason = _option_error(model, args.with_z, args.window, drafts)
    if reason is not None:
        parser.error(reason)
    if args.dump_ptx is not None:
        reason = path_error(args.dump_ptx, folder=True)
        if reason is not None:
            parser.error(f"--dump-ptx: {reason}")
    if args.arch:
        if "cutlass" in sys.modules and os.environ.get("CUTE_DSL_ARCH") != args.arch:
            raise RuntimeError("--arch must be chosen before cutlass is imported")
        os.environ["CUTE_DSL_ARCH"] = args.arch

    from .runtime.compile_cache import target_arch

    try:
        arch = target_arch()
    except RuntimeError as e:  # no GPU and no CUTE_DSL_ARCH, an unsupported GPU, or a bad CUTE_DSL_ARCH
        parser.error(f"--arch: not given and none to default to ({e}); give sm_90a, sm_100a or sm_103a")
    platforms = target_platforms(args.device_name, arch)
    layer = model.layer
    spec = [DraftVariant(label, "decode", shape, cfg, 0)
            for label, shape, cfg in variants(model, args.window, dtypes, args.with_z, platforms)
            + read_copy_variants(model, args.window, dtypes, read_copies, platforms=platforms)]
    spec += table_variants(layer, args.window, args.window, (), f"L{args.window}")
    if drafts is not None:
        try:
            spec += [v for r in [None] + read_copies
                     for v in draft_variants(model, args.window, drafts, dtypes, with_z=args.with_z, read_copy=r,
                                             platforms=platforms)]
        except ValueError as e:
            parser.error(str(e))
    ptx_dir = None if args.dump_ptx is None else Path(args.dump_ptx)
    jobs = [BuildJob(layer, v, None if ptx_dir is None else ptx_dir / f"{v.label}.{arch}.ptx") for v in spec]
    print(f"precompile {model.name} for {arch}: {len(jobs)} kernels")
    print(_platforms_line(platforms), flush=True)
    if ptx_dir is not None:
        ptx_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    failed = build_all(jobs, args.workers, arch)
    if failed:
        print(f"{PROG}: {len(failed)} of {len(jobs)} kernels did not compile: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"{len(jobs)} kernels built or loaded in {_duration(time.perf_counter() - t0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
