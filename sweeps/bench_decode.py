"""Decode latency: conventional vs ReplaySSM standard decoding, Mamba-2 model shapes (GPU).

    python sweeps/bench_decode.py --models nemotron-super,nemotron-nano-4b \
        --batch 1,32,64,128,256,512 --out sweeps/results/decode_h200.csv

Protocol (shared/docs/performance.md): every figure is the median over replays of a CUDA graph of
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
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from replayssm_cute.models import get_model  # noqa: E402
from replayssm_cute.perf import DecodePool, ideal_bytes, time_graph  # noqa: E402



def candidate_configs(model, batch: int):
    """The launch configs each kernel is timed at (its best is reported): small tiles at batch
    <= 16, where more CTAs per row hide latency; larger tiles and fewer warps above."""
    from replayssm_cute.kernels.mamba2.decode import Mamba2Config

    P = model.headdim
    if batch <= 16:
        grid = [(16, 4), (32, 4)]
    else:
        grid = [(16, 4), (32, 2), (64, 4), (40, 2), (80, 4)]
    return [Mamba2Config(rows_per_cta=r, num_warps=w) for r, w in grid if P % r == 0]


def _compile_one(args):
    model, window, cfg = args
    import replayssm_cute.kernels_host as kh

    shape = kh.mamba2_shape(model.nheads, model.headdim, model.dstate, model.ngroups, window, window,
                            torch.bfloat16, torch.bfloat16, True, False, True, True, -1)
    kh.compile_mamba2(shape, cfg)
    return True


def precompile_parallel(jobs, workers):
    """cute.compile is not thread-safe: fill the disk cache from worker processes first."""
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        list(pool.map(_compile_one, jobs))


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


def best(fn_factory, configs):
    results = []
    for cfg in configs:
        fn, n = fn_factory(cfg)
        results.append((time_graph(fn, n), cfg))
    return min(results, key=lambda t: t[0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="nemotron-super,nemotron-nano-4b")
    ap.add_argument("--batch", default="1,32,64,128,256,512")
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--out", default="sweeps/results/decode_h200.csv")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode: no CUDA GPU found; this benchmark times kernels and needs one.")
        return 1
    import pandas as pd

    models = [get_model(m) for m in args.models.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    L = args.window
    jobs = {(m, w, c) for m in models for b in batches for w in (1, L) for c in candidate_configs(m, b)}
    precompile_parallel(sorted(jobs, key=repr), args.workers)

    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write, 2 GiB)", flush=True)
    rows = []
    for m in models:
        for b in batches:
            cfgs = candidate_configs(m, b)
            ideal = ideal_bytes(m, b, L)
            conv = DecodePool(m, b, 1)
            t_conv, c_conv = best(conv.window_fn, cfgs)
            del conv
            aligned = DecodePool(m, b, L)
            t_mean, c_mean = best(aligned.window_fn, cfgs)
            t_flush, _ = best(aligned.flush_fn, [c_mean])
            del aligned
            stag = DecodePool(m, b, L, stagger=True)
            t_stag, _ = best(stag.window_fn, [c_mean])
            del stag
            torch.cuda.empty_cache()
            t_nonflush = (L * t_mean - t_flush) / (L - 1)
            rec = dict(model=m.name, batch=b, window=L, copy_tbps=bw / 1e12,
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
            rows.append(rec)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            pd.DataFrame(rows).to_csv(args.out, index=False)  # after every row: partial runs count
            print(f"{m.name:18s} b={b:4d} conv {t_conv:8.1f}us ({rec['conventional_frac_copy']:.1%}) "
                  f"replay mean {t_mean:8.1f}us ({rec['window_mean_frac_copy']:.1%}) "
                  f"stag {t_stag:8.1f}us ({rec['staggered_frac_copy']:.1%}) "
                  f"flush {t_flush:8.1f}us ({rec['flush_frac_copy']:.1%}) "
                  f"nonflush {t_nonflush:8.1f}us ({rec['nonflush_mean_frac_copy']:.1%}) "
                  f"speedup {rec['speedup_mean_vs_conv']:.2f}x", flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
