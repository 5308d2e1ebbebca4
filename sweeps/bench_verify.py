"""Speculative verification latency: ReplaySSM verify + commit against the conventional step (GPU).

    python sweeps/bench_verify.py                                          # every case (~5 min, H200)
    python sweeps/bench_verify.py --quick                                  # fast GPU check
    python sweeps/bench_verify.py --layers mamba2 --batch 256 --drafts 8   # a subset
    CUTE_DSL_ARCH=sm_90a python sweeps/bench_verify.py --compile-only      # fill the compile cache

Protocol as bench_decode.py (docs/benchmarking.md): CUDA-graph timing (median over
replays), a rotating pool of >= 512 MiB of checkpoints so every step streams its checkpoint from
HBM, random inputs with realistic decays, the device-to-device copy rate measured in the same run.

Per (model, batch, T drafts) and a = 1 (every draft but the first rejected) and a = T (all
accepted), every row accepting a drafts at every step:
- the cursors follow their real cycle (perf.cursor_cycle: h -> h + a, or -> a when the step
  flushes, h + T > L); one CUDA graph holds, for each slot set of the pool, whole periods of
  that cycle (at least L steps) of verify + commit, flushes included, so the reported mean time
  per verify + commit step amortises the flushes as a real run does;
- that time normalised to our conventional standard decode step (window-1 cache, same model and
  batch, same run, best of bench_decode's candidate configs);
- the ideal-byte floor (perf.verify_ideal_bytes: checkpoint read once per step and written once
  per flush, the committed records read, the T draft records written, activations), as time at
  the copy rate and as a fraction of the conventional step; the achieved TB/s on those ideal
  bytes and the fraction of the copy rate;
- the conventional snapshot baseline (state loaded once, a state snapshot stored per draft),
  measured for both layer types (replayssm_cute.snapshot_verify: its launch alone, snapshot
  buffers rotating over >= 512 MiB; the commit's copy or pointer switch is not timed), as time,
  fraction of the conventional step and of the copy rate; and its ideal bytes (1 + T) S + S plus
  activations, normalised to the conventional step, labelled ideal;
- the memory per slot: checkpoint + ring of L + T records (cache.memory_per_slot()) against the
  snapshot baseline's state per draft, (T + 1) S.
Verify (and the snapshot baseline) run at the API's default launch config and the layer's grid
(bench_decode.GRIDS) where the kernel takes them, at most VERIFY_CANDIDATES; one verify config
serves both a (verify cannot know a): the one with the least total time over a = 1 and a = T.

A layer whose replayssm_cute.verify raises NotImplementedError (GDN before its kernel landed) is
skipped with a note. Every kernel is compiled first, in parallel worker processes, into the
on-disk compile cache; rows are written to the CSV as they are measured.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import (  # noqa: E402
    QUICK_CANDIDATES, SMALL_BATCH, best, candidate_configs, compile_target, grid_configs, int_list, make_parser,
    parse_args, precompile_and_copy_rate, write_rows)
from replayssm_cute.perf import (  # noqa: E402
    DecodePool, bench_layer, compile_table_kernels, compile_pool_kernel, cursor_cycle, time_graph,
    verify_ideal_bytes)

DEFAULT_MODELS = "nemotron-super,qwen3.5-122b"
BATCHES = "1,64,256,512"
QUICK_BATCHES = "64,256"
DRAFTS = "2,4,6,8"
QUICK_DRAFTS = "4,8"
VERIFY_CANDIDATES = 3


def speculative_configs(model, batch: int, drafts: int, window: int = 16, quick: bool = False):
    """The launch configs the speculative step of (model, batch, T) is timed at on a cache of
    `window`: verify (window > 1) or the snapshot baseline (window 1). The API's default first
    (None where it picks it inline), then the pipelined verify's space where that is the default,
    then the layer's grid, those the kernel takes; at most VERIFY_CANDIDATES (QUICK_CANDIDATES with quick)."""
    layer = bench_layer(model)
    defaults = [layer.default_speculative_config(model, batch, window, drafts)]
    return grid_configs(model, batch, defaults + layer.speculative_space(model, window, drafts, batch),
                        lambda c: c is None or layer.speculative_check(model, window, drafts, c) is None,
                        QUICK_CANDIDATES if quick else VERIFY_CANDIDATES)


def compile_jobs(models, batches, drafts, window, quick):
    """(model, window, T, config, batch) for every kernel the run times, in a stable order: the
    conventional steps (window 1, T = 0), the verify steps (window L), the snapshot baselines
    (window 1, T > 0), and the commits, one per T whatever the model
    (model None). The batch counts only where the API picks the config (None) by it, which it
    does by batch <= SMALL_BATCH: one job for each side of that."""
    jobs = {(m, 1, 0, c, 0) for m in models for b in batches for c in candidate_configs(m, b, window, quick)}
    for m in models:
        for w in (window, 1):
            jobs |= {(m, w, T, c, min(b, SMALL_BATCH + 1) if c is None else 0)
                     for b in batches for T in drafts for c in speculative_configs(m, b, T, w, quick)}
    jobs |= {(None, window, T, None, 0) for T in drafts}
    return sorted(jobs, key=repr)


def _compile_job(job):
    model, window, drafts, cfg, batch = job
    if model is None:
        compile_table_kernels(window, drafts)
    else:
        compile_pool_kernel(model, window, cfg, drafts, batch)
    return True


def verify_unsupported(model):
    """Why replayssm_cute.verify does not take `model`'s layer yet (its NotImplementedError), or
    None. Probed with a one-slot cache of the layer on the meta device (nothing allocated) and no
    tokens: verify() dispatches on the cache type first, so a layer it takes fails the argument
    check instead."""
    from replayssm_cute.api import verify

    try:
        verify(bench_layer(model).cache(model, 1, 2, "meta", drafts=1))
    except NotImplementedError as e:
        return str(e)
    except (TypeError, ValueError):
        pass
    return None


def slot_memory(model, window: int, drafts: int):
    """(bytes per slot of a cache with room for T drafts: checkpoint, ring of L + T records and
    indices; the snapshot baseline's (T + 1) S)."""
    mem = bench_layer(model).cache(model, 1, window, "meta", drafts).memory_per_slot()
    return mem["total"], (drafts + 1) * mem["checkpoint"]


def steps_per_set(window: int, drafts: int, accepted: int) -> int:
    """Verify + commit steps per slot set in one graph: whole periods of the cursor cycle, at
    least `window` steps."""
    period = len(cursor_cycle(window, drafts, accepted))
    return period * math.ceil(window / period)


def time_verify(pool, accepted: int, config, replays: int) -> float:
    """Mean us per verify + commit step of `pool`, every row accepting `accepted` drafts: the
    cursors start on their cycle and each graph replay runs whole periods, so every replay
    starts where the last one began."""
    L, T = pool.window, pool.drafts
    pool.cache.cursor.fill_(cursor_cycle(L, T, accepted)[0])
    fn, steps = pool.verify_fn(accepted, steps_per_set(L, T, accepted), config)
    return time_graph(fn, steps, replays=replays)


def _config_name(cfg) -> str:
    return "API default" if cfg is None else str(cfg.key())


def measure_snapshot(model, batch, T, replays, quick):
    """(us, config name) of the conventional snapshot baseline's verify at its best config."""
    pool = DecodePool(model, batch, 1, drafts=T)
    t, cfg = best(pool.snapshot_fn, speculative_configs(model, batch, T, 1, quick), replays)
    del pool
    torch.cuda.empty_cache()
    return t, _config_name(cfg)


def measure(model, batch, L, T, bw, conv_us, conv_cfg, replays, quick):
    """CSV rows for a = 1 and a = T of (model, batch, T), at the verify config with the least
    total time over both, beside the snapshot baseline."""
    pool = DecodePool(model, batch, L, drafts=T)
    accepted = sorted({1, T})
    configs = speculative_configs(model, batch, T, L, quick)
    times = {cfg: [time_verify(pool, a, cfg, replays) for a in accepted] for cfg in configs}
    del pool
    torch.cuda.empty_cache()
    cfg = min(configs, key=lambda c: sum(times[c]))
    snap_us, snap_cfg = measure_snapshot(model, batch, T, replays, quick)
    mem, snapshot_mem = slot_memory(model, L, T)
    rows = []
    for a, t in zip(accepted, times[cfg]):
        ideal = verify_ideal_bytes(model, batch, L, T, a)
        floor_us = ideal["verify"] / bw * 1e6
        rec = dict(
            model=model.name, layer=model.layer, batch=batch, window=L, drafts=T, accepted=a,
            copy_tbps=bw / 1e12, conv_us=conv_us, conv_cfg=str(conv_cfg.key()),
            conv_frac_copy=ideal["conventional"] / (conv_us * 1e-6) / bw,
            verify_cfg=_config_name(cfg), cycle_steps=len(cursor_cycle(L, T, a)),
            steps_per_set=steps_per_set(L, T, a),
            verify_us=t, vs_conv=t / conv_us, per_token_vs_conv=t / conv_us / a,
            ideal_bytes=ideal["verify"], ideal_vs_conv_bytes=ideal["verify"] / ideal["conventional"],
            floor_us=floor_us, floor_vs_conv=floor_us / conv_us, vs_floor=t / floor_us,
            tbps=ideal["verify"] / (t * 1e-6) / 1e12, frac_copy=floor_us / t,
            snapshot_ideal_bytes=ideal["snapshot"],
            snapshot_ideal_vs_conv_bytes=ideal["snapshot"] / ideal["conventional"],
            snapshot_ideal_floor_vs_conv=ideal["snapshot"] / bw * 1e6 / conv_us,
            mem_per_slot=mem, snapshot_mem_per_slot=snapshot_mem,
            snapshot_us=snap_us, snapshot_cfg=snap_cfg, snapshot_vs_conv=snap_us / conv_us,
            vs_snapshot=t / snap_us, snapshot_frac_copy=ideal["snapshot_kernel"] / (snap_us * 1e-6) / bw)
        rows.append(rec)
    return rows


def _notes(models, window, drafts):
    """Print the memory per slot of every (model, T) and where the snapshot baseline comes from."""
    for m in models:
        for T in drafts:
            mem, snap = slot_memory(m, window, T)
            print(f"{m.name:14s} T={T}: checkpoint + ring of L + T = {window + T} records "
                  f"{mem / 2**20:6.2f} MiB per slot; snapshot baseline (T + 1) S {snap / 2**20:6.2f} MiB "
                  f"({mem / snap:.2f}x)")
    print("snapshot baseline measured (snapshot_verify: state read once, a snapshot written per draft; "
          "the commit's copy or pointer switch not timed)")


def main(argv=None):
    ap = make_parser(__doc__, "verify", DEFAULT_MODELS, BATCHES, QUICK_BATCHES,
                     f"T = {QUICK_DRAFTS}, the first {QUICK_CANDIDATES} candidate configs per kernel")
    ap.add_argument("--drafts", help=f"comma-separated draft counts T (default {DRAFTS}; with --quick {QUICK_DRAFTS})")
    args = parse_args(ap, argv)
    L = args.window
    drafts = int_list(ap, "--drafts", args.drafts or (QUICK_DRAFTS if args.quick else DRAFTS))
    if max(drafts) > min(16, L):
        ap.error(f"--drafts: T must be in 1..min(16, window {L})")
    arch = compile_target("bench_verify", args.compile_only)
    if arch is None:
        return 1
    models = []
    for m in args.models:
        why = verify_unsupported(m)
        if why is None:
            models.append(m)
        else:
            print(f"{m.name} ({m.layer}): skipped, replayssm_cute.verify does not take its cache yet ({why})")
    if not models:
        print("bench_verify: no model left to measure")
        return 0
    _notes(models, L, drafts)

    t0 = time.perf_counter()
    bw = precompile_and_copy_rate(compile_jobs(models, args.batch, drafts, L, args.quick), args, arch, _compile_job)
    if bw is None:
        return 0
    rows = []
    for m in models:
        for b in args.batch:
            conv = DecodePool(m, b, 1)
            conv_us, conv_cfg = best(conv.window_fn, candidate_configs(m, b, L, args.quick), args.replays)
            del conv
            torch.cuda.empty_cache()
            for T in drafts:
                for rec in measure(m, b, L, T, bw, conv_us, conv_cfg, args.replays, args.quick):
                    rows.append(rec)
                    write_rows(rows, args.out)
                    print(f"{m.name:14s} b={b:4d} T={T} a={rec['accepted']}: {rec['verify_us']:8.1f} us = "
                          f"{rec['vs_conv']:.3f}x conv ({conv_us:.1f} us, {rec['conv_frac_copy']:.0%} copy) | "
                          f"floor {rec['floor_vs_conv']:.3f}x, {rec['vs_floor']:.2f}x floor, "
                          f"{rec['tbps']:.2f} TB/s = {rec['frac_copy']:.0%} copy | "
                          f"snapshot {rec['snapshot_vs_conv']:.2f}x ({rec['snapshot_frac_copy']:.0%} copy), "
                          f"ideal {rec['snapshot_ideal_vs_conv_bytes']:.2f}x conv bytes, "
                          f"floor {rec['snapshot_ideal_floor_vs_conv']:.2f}x | "
                          f"cfg {rec['verify_cfg']}  [{time.perf_counter() - t0:.0f} s]", flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
