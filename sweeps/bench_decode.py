"""Decode latency: conventional vs ReplaySSM standard decoding, Mamba-2 and GDN model shapes (GPU).

    python sweeps/bench_decode.py                                          # every model, all batches
    python sweeps/bench_decode.py --quick                                  # fast GPU check
    python sweeps/bench_decode.py --layers gdn --batch 1,256               # a subset
    CUTE_DSL_ARCH=sm_90a python sweeps/bench_decode.py --compile-only      # fill the compile cache

Protocol (docs/benchmarking.md): every figure is the median over replays of a CUDA graph of
many launches; the pool rotates over enough slot sets that each step streams its checkpoint from
HBM (>= 512 MB per rotation, far above the 60 MB L2); inputs are random with realistic decays. The
device-to-device copy rate is measured in the same run and every kernel is reported as achieved
TB/s on its ideal bytes and as a fraction of that copy rate.

Per (model, batch) it reports, each kernel at the best of a small set of launch configs:
- conventional step (window 1: load, update, store);
- ReplaySSM window mean (L steps, h = 0..L-1, flush included), rows aligned and rows staggered
  over ring positions (row r starts at h = r mod L);
- ReplaySSM flush step alone (every row at h = L-1), and the non-flush mean derived from the two
  as (L * mean - flush) / (L - 1).
Staggered rows and the flush step run at the launch config that is best for the aligned window
mean (one config serves every step of a batch size), so the non-flush mean is that config's too.

Every candidate kernel is compiled first, in parallel worker processes, into the on-disk compile
cache (a warm cache makes this a few seconds); rows are written to the CSV as they are measured.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from replayssm_cute.models import MODELS, get_model  # noqa: E402
from replayssm_cute.perf import (  # noqa: E402
    DecodePool, bench_layer, compile_pool_kernel, compile_table_kernels, ideal_bytes, time_graph)
from result_files import check_out, default_out, device_tag, gpu_name  # noqa: E402

DEFAULT_MODELS = "nemotron-super,nemotron-nano-4b,qwen3.5-4b,qwen3.5-122b"
BATCHES = "1,32,64,128,256,512"
QUICK_BATCHES = "1,64,256"
SMALL_BATCH = 16
# (rows_per_cta, num_warps) per layer type, (batch <= SMALL_BATCH, above), most promising first,
# timed after the configs decode() picks by default; --quick keeps the first two of those that
# are valid for the model. Small tiles at small batch, where more CTAs per row hide latency;
# larger tiles and fewer warps above.
GRIDS = {
    "mamba2": ([(16, 4), (32, 4)], [(64, 4), (80, 4), (32, 2), (40, 2), (16, 4)]),
    "gdn": ([(16, 4), (8, 2), (16, 2)], [(32, 4), (64, 4), (16, 4), (32, 2), (64, 8), (32, 8), (128, 8)]),
}
QUICK_CANDIDATES = 2
NO_GPU = ("{prog}: no CUDA GPU found (torch.cuda.is_available() is False); this benchmark "
          "times kernels on a GPU and needs one. Without a GPU, --compile-only (with CUTE_DSL_ARCH="
          "sm_90a, sm_100a or sm_103a) builds the candidate kernels into the compile cache.")


def grid_configs(model, batch: int, defaults, valid, limit=None):
    """`defaults`, then the layer's grid (GRIDS) for this batch: the distinct configs for which
    valid(config) holds, the first `limit` of them (all with None)."""
    layer = bench_layer(model)
    configs = list(defaults) + [layer.config(rows, warps) for rows, warps in GRIDS[model.layer][batch > SMALL_BATCH]]
    return [c for c in dict.fromkeys(configs) if valid(c)][:limit]


def candidate_configs(model, batch: int, window: int = 16, quick: bool = False):
    """The launch configs each kernel of `model` is timed at (its best is reported): decode()'s
    defaults for ReplaySSM and the conventional step, then the layer's grid for this batch,
    keeping those valid for both (one config list serves both kernels)."""
    layer = bench_layer(model)
    windows = sorted({1, window}, reverse=True)
    shapes = [layer.kernel_shape(model, w) for w in windows]
    return grid_configs(model, batch, [layer.default_config(model, batch, w) for w in windows],
                        lambda c: all(c.check(s) is None for s in shapes), QUICK_CANDIDATES if quick else None)


def compile_jobs(models, batches, window, quick):
    """(model, window, config) for every kernel the run times, in a stable order."""
    jobs = {(m, w, c) for m in models for b in batches for w in sorted({1, window})
            for c in candidate_configs(m, b, window, quick)}
    return sorted(jobs, key=repr)


def _compile_one(job):
    model, window, cfg = job
    compile_pool_kernel(model, window, cfg)
    if window > 1:  # the step's plan
        compile_table_kernels(window)
    return True


def precompile_parallel(jobs, workers, arch, compile_one=_compile_one):
    """cute.compile is not thread-safe: fill the disk cache from worker processes first, running
    compile_one(job) (a module-level function) for every job, and say how long it took. The
    workers compile for `arch` (passed on as CUTE_DSL_ARCH, so they need not touch the GPU); a job
    found in the disk cache costs a load."""
    from replayssm_cute.runtime.compile_cache import ENV_ARCH

    t0 = time.perf_counter()
    os.environ[ENV_ARCH] = arch
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(jobs))), mp_context=ctx) as pool:
        list(pool.map(compile_one, jobs))
    print(f"{len(jobs)} kernels for {arch} compiled or loaded from the compile cache in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)


def compile_target(prog: str, compile_only: bool):
    """The arch to compile for, or None after saying on stderr why `prog` cannot run: no GPU to
    time on, or --compile-only with neither a GPU nor CUTE_DSL_ARCH."""
    if not (compile_only or torch.cuda.is_available()):
        print(NO_GPU.format(prog=prog), file=sys.stderr)
        return None
    from replayssm_cute.runtime.compile_cache import target_arch

    try:
        return target_arch()
    except RuntimeError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None


def write_rows(rows, path):
    """The CSV of every row so far (rewritten after each, so that a partial run counts)."""
    import pandas as pd

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path, index=False)


def copy_bandwidth() -> float:
    """Bytes read + written per second of a 2 GiB device-to-device copy: the faster of torch's
    copy_ (a memcpy, timed on the stream) and an elementwise copy kernel (timed in a graph)."""
    n = (2 << 30) // 4
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(9):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(5):
            dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / 5)
    us_memcpy = sorted(times)[len(times) // 2]
    us_kernel = time_graph(lambda: [torch.mul(src, 1.0, out=dst) for _ in range(5)], 5, replays=9)
    return 2 * n * 4 / (min(us_memcpy, us_kernel) * 1e-6)


def precompile_and_copy_rate(jobs, args, arch, compile_one=_compile_one):
    """Build `jobs` (``precompile_parallel``); then, unless --compile-only (None), the measured copy
    bandwidth, printed."""
    precompile_parallel(jobs, args.workers, arch, compile_one)
    if args.compile_only:
        return None
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write, 2 GiB)", flush=True)
    return bw


def best(fn_factory, configs, replays):
    results = []
    for cfg in configs:
        fn, n = fn_factory(cfg)
        results.append((time_graph(fn, n, replays=replays), cfg))
    return min(results, key=lambda t: t[0])


def measure(model, batch, L, bw, configs, replays):
    """One CSV row: every kernel of (model, batch) at its best config, as us, TB/s, % of copy."""
    conv = DecodePool(model, batch, 1)
    t_conv, c_conv = best(conv.window_fn, configs, replays)
    del conv
    aligned = DecodePool(model, batch, L)
    t_mean, c_mean = best(aligned.window_fn, configs, replays)
    t_flush, _ = best(aligned.flush_fn, [c_mean], replays)
    del aligned
    stag = DecodePool(model, batch, L, stagger=True)
    t_stag, _ = best(stag.window_fn, [c_mean], replays)
    del stag
    torch.cuda.empty_cache()
    t_nonflush = (L * t_mean - t_flush) / (L - 1)
    ideal = ideal_bytes(model, batch, L)
    rec = dict(model=model.name, layer=model.layer, batch=batch, window=L, copy_tbps=bw / 1e12,
               conv_us=t_conv, conv_cfg=str(c_conv.key()),
               replay_mean_us=t_mean, replay_cfg=str(c_mean.key()),
               replay_staggered_us=t_stag, flush_us=t_flush, nonflush_mean_us=t_nonflush)
    for name, t in (("conventional", t_conv), ("window_mean", t_mean), ("flush", t_flush),
                    ("nonflush_mean", t_nonflush)):
        tbps = ideal[name] / (t * 1e-6) / 1e12
        rec[f"{name}_tbps"] = tbps
        rec[f"{name}_frac_copy"] = tbps * 1e12 / bw
    rec["staggered_frac_copy"] = ideal["window_mean"] / (t_stag * 1e-6) / bw
    rec["speedup_mean_vs_conv"] = t_conv / t_mean
    rec["staggered_vs_aligned"] = t_stag / t_mean
    return rec


def make_parser(doc: str, stem: str, models: str, batches: str, quick_batches: str, quick_what: str):
    """The arguments every sweep here takes; CSVs go to a new file per device and day
    (result_files.default_out); `quick_what` says what --quick cuts besides the batches. A sweep
    adds its own arguments, then calls ``parse_args``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=models,
                    help=f"comma-separated model names (default {models}; known: {', '.join(MODELS)})")
    ap.add_argument("--layers", default="mamba2,gdn",
                    help="keep only the models of these layer types (default mamba2,gdn)")
    ap.add_argument("--batch", help=f"comma-separated batch sizes (default {batches}; with --quick {quick_batches})")
    ap.add_argument("--window", type=int, default=16, help="ReplaySSM window L (default 16)")
    ap.add_argument("--quick", action="store_true",
                    help=f"fast GPU check: batches {quick_batches}, {quick_what}, fewer replays, output to "
                         f"sweeps/results/{stem}_<device>_<date>_quick.csv")
    ap.add_argument("--out", help=f"CSV path (default sweeps/results/{stem}_<device>_<date>.csv, a new file per "
                                  f"device and day: <device> the GPU's short name, e.g. h200, <date> today's, "
                                  f"YYYY-MM-DD)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                    help="compile worker processes (default min(16, CPUs))")
    ap.add_argument("--replays", type=int, help="CUDA-graph replays per timing (default 15, with --quick 7)")
    ap.add_argument("--compile-only", action="store_true",
                    help="only build the candidate kernels into the compile cache (no GPU needed with "
                         "CUTE_DSL_ARCH set), then exit")
    ap.set_defaults(stem=stem, default_batches=batches, quick_batches=quick_batches)
    return ap


def int_list(ap, flag: str, text: str):
    """Comma-separated integers >= 1 of argument `flag`, or exit with a usage error."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        ap.error(f"{flag}: expected comma-separated integers, got {text!r}")
    if any(v < 1 for v in values):
        ap.error(f"{flag}: values must be >= 1")
    return values


def parse_args(ap, argv):
    """Parse `argv` with a ``make_parser`` parser: models (as ModelSpecs, filtered by --layers),
    batches, window, output path (checked writable before any work) and replays checked and
    filled in."""
    args = ap.parse_args(argv)
    try:
        args.models = [get_model(m.strip()) for m in args.models.split(",") if m.strip()]
    except ValueError as e:
        ap.error(f"--models: {e}")
    layers = {s.strip() for s in args.layers.split(",") if s.strip()}
    if layers - set(GRIDS):
        ap.error(f"--layers: unknown layer types {sorted(layers - set(GRIDS))}; known: {', '.join(GRIDS)}")
    args.models = [m for m in args.models if m.layer in layers]
    if not args.models:
        ap.error(f"no model of layer type {', '.join(sorted(layers))} among --models")
    args.batch = int_list(ap, "--batch", args.batch or (args.quick_batches if args.quick else args.default_batches))
    if not 2 <= args.window <= 32:
        ap.error("--window must be in 2..32 (window 1, the conventional step, is always measured)")
    args.out = args.out or str(default_out(args.stem, device_tag(gpu_name()), args.quick))
    check_out(ap, "--out", args.out)
    args.replays = args.replays or (7 if args.quick else 15)
    return args


def main(argv=None):
    args = parse_args(make_parser(__doc__, "decode", DEFAULT_MODELS, BATCHES, QUICK_BATCHES,
                                  f"the first {QUICK_CANDIDATES} candidate configs per kernel"), argv)
    models, batches, L = args.models, args.batch, args.window
    arch = compile_target("bench_decode", args.compile_only)
    if arch is None:
        return 1
    t0 = time.perf_counter()
    bw = precompile_and_copy_rate(compile_jobs(models, batches, L, args.quick), args, arch)
    if bw is None:
        return 0
    rows = []
    for m in models:
        for b in batches:
            rec = measure(m, b, L, bw, candidate_configs(m, b, L, args.quick), args.replays)
            rows.append(rec)
            write_rows(rows, args.out)
            print(f"{m.name:18s} b={b:4d} conv {rec['conv_us']:8.1f}us ({rec['conventional_frac_copy']:.1%}) "
                  f"replay mean {rec['replay_mean_us']:8.1f}us ({rec['window_mean_frac_copy']:.1%}) "
                  f"stag {rec['replay_staggered_us']:8.1f}us ({rec['staggered_frac_copy']:.1%}) "
                  f"flush {rec['flush_us']:8.1f}us ({rec['flush_frac_copy']:.1%}) "
                  f"nonflush {rec['nonflush_mean_us']:8.1f}us ({rec['nonflush_mean_frac_copy']:.1%}) "
                  f"speedup {rec['speedup_mean_vs_conv']:.2f}x  [{time.perf_counter() - t0:.0f} s]",
                  flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
