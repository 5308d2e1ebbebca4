"""Read latency by read precision (the paper's Fig. 11): the ReplaySSM non-flush decode step reading
the fp32 checkpoint or an fp16 / fp8 / nvfp4 read copy, Mamba-2 and GDN model shapes (GPU).

    python sweeps/bench_read_precision.py                          # batch 256, both layers, every format
    python sweeps/bench_read_precision.py --formats fp32,fp8 --layers gdn --drafts 0   # a subset
    python sweeps/bench_read_precision.py --quick                  # fast GPU check
    CUTE_DSL_ARCH=sm_90a python sweeps/bench_read_precision.py --compile-only   # fill the compile cache

Protocol as bench_decode.py (docs/benchmarking.md): every figure is the median over replays of
a CUDA graph of many launches; the pool rotates over slot sets holding >= 512 MiB of the state a
non-flush step reads (the read copy with its scales, or the fp32 checkpoint), far above the 60 MB
L2; random inputs with realistic decays; the device-to-device copy rate is measured in the same
run, and all formats of a model are measured one after another in the same process, so the
speedups are ratios measured side by side.

Per (model, batch) and read format F (fp32 = the plain cache: fp32 checkpoint, no read copy; else
``checkpoint_format="fp32", read_copy=F``, Mamba2Cache / GDNCache; read copies RTN-encoded from the
checkpoints), at the launch config with the least window mean among the API's pick and, with
``--configs grid`` (default), bench_decode's candidates (configs a kernel refuses are skipped):
- non-flush step: rows aligned, every cursor h with h + 1 < L, so no row flushes: the mean over
  h = 0..L-2 (one graph: cursors set to 0, then L - 1 steps of every slot set; DecodePool.nonflush_fn),
  or with ``--cursor H`` the step at h = H alone (DecodePool.cursor_fn);
- window mean: L steps h = 0..L-1 with the flush (window-amortised), and the flush step alone;
- speculative verify + commit of T = ``--drafts`` drafts (default 4; 0 skips it) accepting a of
  them (``--accepted``, default 1 and T), over whole cursor cycles as bench_verify.py, where
  ``replayssm_cute.verify`` takes the cache on the GPU;
- for reference, the conventional step (window 1, fp32 state) at the best of bench_decode's
  candidates, and the copy bandwidth.
Each time is reported with its ideal bytes, the achieved TB/s on them and the fraction of the copy
rate, its speedup over the fp32 read of the same step (``*_speedup_vs_fp32``) and over the
conventional step (``*_vs_conv``), next to the ideal ratios: ``state_ratio`` = bytes of the fp32
state / bytes of the read format with its scales (quant.bytes_per_state), and ``*_byte_ratio`` =
ideal bytes of the fp32 step / those of this step (ring and activations included).

Ideal bytes of one step (perf.ideal_bytes's model, per row; S the fp32 state, R the state read (the
read copy with its scales, or S), e the record a step reads per committed record, e_w the record it
writes (GDN with a read copy: + v and beta, which a flush re-derives the corrections from), e_f the
record a flush reads (GDN re-deriving: k, g, v, beta), act the step's inputs and outputs):
non-flush at h: R + h e + e_w + act; flush: 2 S (+ R written) + (L-1) e_f + act; window mean:
((L - 1) non-flush mean + flush) / L. Verify + commit at h (perf.verify_ideal_bytes's model):
R + h e + T e_w + T act, flushing (h + T > L) 2 S (+ R) + h e_f + T e_w + T act.

A format whose decode or verify raises NotImplementedError on the GPU (kernels not written yet) is
reported with empty cells and the reason in the ``note`` column. Output: the CSV (default
sweeps/results/read_precision_<device>_<date>.csv), a printed table and a bar plot next to the CSV
(matplotlib, pip install -e '.[plots]'; skipped with a message without it). Every kernel is
compiled first, in parallel worker processes, into the on-disk compile cache.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import (  # noqa: E402
    NO_GPU, QUICK_CANDIDATES, SMALL_BATCH, candidate_configs, compile_target, int_list, make_parser, parse_args,
    precompile_and_copy_rate, write_rows)
from bench_verify import speculative_configs, steps_per_set  # noqa: E402
from result_files import check_out, device_tag, gpu_name  # noqa: E402
from replayssm_cute.perf import (  # noqa: E402
    DecodePool, bench_layer, compile_table_kernels, compile_pool_kernel, cursor_cycle, read_copy_arg,
    read_ideal_bytes, state_bytes, state_ratio, time_graph, verify_read_ideal_bytes)

PROG = "bench_read_precision"
STEM = "read_precision"
DEFAULT_MODELS = "nemotron-super,qwen3.5-122b"
BATCHES = "256"
QUICK_BATCHES = "256"
FORMATS = ("fp32", "fp16", "fp8", "nvfp4")  # fp32: no read copy, non-flush steps read the checkpoint
BASELINE = "fp32"
DRAFTS = 4
CONFIG_MODES = ("grid", "default")
STEPS = ("nonflush", "window_mean", "flush")
NO_MATPLOTLIB = ("matplotlib is not installed: no plot (pip install -e '.[plots]' or pip install matplotlib); "
                 "the CSV and the table are complete")


# ------------------------------------------------------------------------------------- arguments


def parse_formats(ap, text: str) -> List[str]:
    """The read formats of ``--formats`` in FORMATS order, fp32 always among them (the baseline of
    every speedup), or exit with a usage error."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = sorted(set(names) - set(FORMATS))
    if unknown or not names:
        ap.error(f"--formats: unknown read formats {unknown}; known: {', '.join(FORMATS)}")
    return [f for f in FORMATS if f in names or f == BASELINE]


def build_parser():
    ap = make_parser(__doc__, STEM, DEFAULT_MODELS, BATCHES, QUICK_BATCHES,
                     f"the first {QUICK_CANDIDATES} candidate configs per kernel")
    ap.add_argument("--formats", default=",".join(FORMATS),
                    help=f"comma-separated read formats (default {','.join(FORMATS)}; {BASELINE}, the "
                         "plain cache, is always measured)")
    ap.add_argument("--drafts", type=int, default=DRAFTS,
                    help=f"draft count T of the speculative verify + commit column (default {DRAFTS}; 0: none)")
    ap.add_argument("--accepted", help="comma-separated accepted counts a of that column (default 1,T)")
    ap.add_argument("--cursor", type=int, metavar="H",
                    help="time the non-flush step at h = H (0 <= H <= window - 2) instead of the mean over "
                         "h = 0..window-2")
    ap.add_argument("--configs", choices=CONFIG_MODES, default="grid",
                    help="launch configs per kernel: grid (default: the API's pick and bench_decode's "
                         "candidates, the best reported) or default (the API's pick only)")
    ap.add_argument("--plot", help="plot path (default: the CSV's path with .png)")
    ap.add_argument("--no-plot", action="store_true", help="write no plot")
    return ap


def parse(argv=None):
    """The checked arguments: bench_decode's (models as ModelSpecs, batches, window, output path,
    replays, ...) plus formats, drafts, accepted, cursor; ``plot`` None under --no-plot, else the
    path checked writable."""
    ap = build_parser()
    args = parse_args(ap, argv)
    L = args.window
    args.formats = parse_formats(ap, args.formats)
    if args.drafts < 0 or args.drafts > min(16, L) or L + args.drafts > 32:
        ap.error(f"--drafts: T must be 0 (none) or in 1..min(16, window {L}) with window + T <= 32")
    if args.drafts == 0:
        if args.accepted:
            ap.error("--accepted needs --drafts T >= 1")
        args.accepted = []
    else:
        accepted = int_list(ap, "--accepted", args.accepted or f"1,{args.drafts}")
        if max(accepted) > args.drafts:
            ap.error(f"--accepted: a must be in 1..T = {args.drafts}")
        args.accepted = sorted(set(accepted))
    if args.cursor is not None and not 0 <= args.cursor <= L - 2:
        ap.error(f"--cursor: a non-flush step has 0 <= h <= window - 2 = {L - 2}, got {args.cursor}")
    if args.no_plot:
        args.plot = None
    elif args.plot is not None:
        check_out(ap, "--plot", args.plot)
    return args


# ------------------------------------------------------------------------------------ byte model


# ------------------------------------------------------------------------------------ compiling


# Launch configs (rows_per_cta, num_warps, min_ctas_per_sm) for read-copy kernels at batch > 16:
# a light entry tile leaves room for more CTAs per SM, which registers must then allow.
READ_COPY_GRIDS = {
    "mamba2": [(64, 4, 0), (64, 4, 6), (64, 4, 8), (64, 2, 8), (64, 2, 12), (32, 2, 12), (32, 2, 16)],
    "gdn": [(64, 4, 0), (64, 4, 6), (64, 4, 8), (32, 2, 8), (32, 2, 12), (32, 4, 8), (128, 8, 0)],
}


def decode_configs(model, batch: int, window: int, mode: str, quick: bool = False, fmt: str = "fp32") -> list:
    """The launch configs a decode step is timed at: the API's pick (None: tuned or default, for
    the cache it gets), then with ``mode`` "grid" bench_decode's candidates, and for a read copy
    at batch > 16 READ_COPY_GRIDS (a kernel refusing a config is skipped at run time)."""
    if mode == "default":
        return [None]
    configs = [None] + candidate_configs(model, batch, window, quick)
    if fmt != "fp32" and batch > 16 and not quick:
        cls = type(bench_layer(model).config(*READ_COPY_GRIDS[model.layer][0][:2]))
        configs += [cls(rows, warps, ctas) for rows, warps, ctas in READ_COPY_GRIDS[model.layer]]
    return list(dict.fromkeys(configs))


def verify_configs(model, batch: int, drafts: int, window: int, mode: str, quick: bool = False) -> list:
    """The launch configs verify is timed at: the API's pick, then with "grid" bench_verify's."""
    if mode == "default":
        return [None]
    return list(dict.fromkeys([None] + speculative_configs(model, batch, drafts, window, quick)))


def compile_jobs(models, batches, formats, window, drafts, mode, quick) -> list:
    """(model, window, read format, T, config, batch) for every kernel the run times, in a stable
    order: the conventional steps (window 1), the decode steps of each format (T = 0), the verify
    steps (T > 0) and the sequence table's kernels of the draft cache (model None). The batch counts only where the API picks the
    config (None): by the batch itself for decode (its tuned bucket), and by batch <= SMALL_BATCH
    for verify; else 0."""
    jobs = {(m, 1, BASELINE, 0, c, 0) for m in models for b in batches for c in candidate_configs(m, b, window, quick)}
    for m in models:
        for b in batches:
            for f in formats:
                jobs |= {(m, window, f, 0, c, b if c is None else 0) for c in decode_configs(m, b, window, mode, quick, f)}
                if drafts:
                    jobs |= {(m, window, f, drafts, c, min(b, SMALL_BATCH + 1) if c is None else 0)
                             for c in verify_configs(m, b, drafts, window, mode, quick)}
    if drafts:
        jobs.add((None, window, BASELINE, drafts, None, 0))
    return sorted(jobs, key=repr)


def _compile_job(job):
    """Build one job (worker process). A kernel that cannot be built yet (a read-copy kernel not
    written, a config it refuses) is reported and left to the timed run, which notes it."""
    model, window, fmt, drafts, cfg, batch = job
    try:
        if model is None:
            compile_table_kernels(window, drafts)
        else:
            compile_pool_kernel(model, window, cfg, drafts, max(batch, 1), read_copy=read_copy_arg(fmt))
            if window > 1 and not drafts:  # the decode step's plan
                compile_table_kernels(window)
    except Exception as e:  # noqa: BLE001 - reported, the timed run records it
        if isinstance(e, ValueError) and "cannot take it" in str(e):
            return False  # a grid config this kernel refuses (nvfp4 writers want whole heads): skipped when timed
        name = "commit" if model is None else f"{model.name} {fmt} T={drafts} {_config_name(cfg)}"
        print(f"{PROG}: not built: {name}: {type(e).__name__}: {e}", flush=True)
        return False
    return True


# ------------------------------------------------------------------------------------ measuring


def _config_name(cfg) -> str:
    return "API pick" if cfg is None else str(cfg.key())


def best_config(fn_factory, configs, replays: int):
    """(us, config, note) of the config with the least time of ``time_graph(*fn_factory(cfg))``.
    A NotImplementedError (the API does not take the cache on the GPU) ends the search: (None,
    None, its message); a ValueError (a config the kernel refuses) skips that config; if none
    is left, (None, None, the first refusal)."""
    results, refused = [], []
    for cfg in configs:
        try:
            fn, n = fn_factory(cfg)
            results.append((time_graph(fn, n, replays=replays), cfg))
        except NotImplementedError as e:
            return None, None, str(e)
        except ValueError as e:
            refused.append(f"{_config_name(cfg)}: {e}")
    if not results:
        return None, None, refused[0] if refused else "no launch config to time"
    t, cfg = min(results, key=lambda r: r[0])
    return t, cfg, None


def _free(pool) -> None:
    del pool.cache, pool.inputs, pool.out
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_verify(pool, accepted: int, config, replays: int) -> float:
    """Mean us per verify + commit step of `pool`, every row accepting `accepted` drafts, over
    whole periods of the cursor cycle (bench_verify.time_verify, timed with this module's
    time_graph)."""
    L, T = pool.window, pool.drafts
    pool.cache.cursor.fill_(cursor_cycle(L, T, accepted)[0])
    return time_graph(*pool.verify_fn(accepted, steps_per_set(L, T, accepted), config), replays=replays)


def measure_decode(model, batch: int, L: int, fmt: str, configs, replays: int, cursor=None, **pool_kw) -> dict:
    """{nonflush, window_mean, flush: us or None, cfg, note} of read format `fmt`: the window mean
    at its best config, then the non-flush and flush steps at that config. `pool_kw` goes to
    DecodePool (tests: a CPU pool)."""
    pool = DecodePool(model, batch, L, read_copy=read_copy_arg(fmt), **pool_kw)
    try:
        t_mean, cfg, note = best_config(pool.window_fn, configs, replays)
        if note is not None:
            return dict(nonflush=None, window_mean=None, flush=None, cfg=None, note=f"decode: {note}")
        steps = pool.nonflush_fn(cfg) if cursor is None else pool.cursor_fn(cursor, cfg)
        t_nonflush = time_graph(*steps, replays=replays)
        t_flush = time_graph(*pool.flush_fn(cfg), replays=replays)
    finally:
        _free(pool)
    return dict(nonflush=t_nonflush, window_mean=t_mean, flush=t_flush, cfg=_config_name(cfg), note=None)


def measure_verify(model, batch: int, L: int, T: int, accepted, fmt: str, configs, replays: int,
                   **pool_kw) -> dict:
    """{us: {a: us or None}, cfg, note} of verify + commit on a cache of read format `fmt`, at the
    config with the least total time over the accepted counts (verify cannot know a)."""
    pool = DecodePool(model, batch, L, drafts=T, read_copy=read_copy_arg(fmt), **pool_kw)
    times, refused = {}, []
    try:
        for cfg in configs:
            try:
                times[cfg] = [time_verify(pool, a, cfg, replays) for a in accepted]
            except NotImplementedError as e:
                return dict(us={a: None for a in accepted}, cfg=None, note=f"verify: {e}")
            except ValueError as e:
                refused.append(f"{_config_name(cfg)}: {e}")
    finally:
        _free(pool)
    if not times:
        return dict(us={a: None for a in accepted}, cfg=None,
                    note=f"verify: {refused[0] if refused else 'no launch config to time'}")
    cfg = min(times, key=lambda c: sum(times[c]))
    return dict(us=dict(zip(accepted, times[cfg])), cfg=_config_name(cfg), note=None)


# ------------------------------------------------------------------------------------ rows


def _rate(nbytes: float, us: Optional[float], bw: float):
    """(TB/s, fraction of the copy rate) of moving `nbytes` in `us` microseconds; Nones without a time."""
    if us is None:
        return None, None
    rate = nbytes / (us * 1e-6)
    return rate / 1e12, rate / bw


def _ratio(num, den):
    return None if num is None or den is None else num / den


def make_row(model, batch: int, L: int, fmt: str, bw: float, gpu: str, conv_us: float, conv_cfg: str,
             decode: dict, verify: Optional[dict] = None, drafts: int = 0, cursor: Optional[int] = None) -> dict:
    """One CSV row from the measured times (``measure_decode``'s and ``measure_verify``'s dicts;
    missing times None): times, ideal bytes, achieved TB/s, fractions of the copy rate, ideal
    ratios and speedups over the conventional step. ``add_speedups`` adds those over fp32."""
    ideal = read_ideal_bytes(model, batch, L, fmt, cursor)
    base = read_ideal_bytes(model, batch, L, BASELINE, cursor)
    conv_tbps, conv_frac = _rate(ideal["conventional"], conv_us, bw)
    rec = dict(gpu=gpu, model=model.name, layer=model.layer, batch=batch, window=L, read_format=fmt,
               read_copy=read_copy_arg(fmt) or "", copy_tbps=bw / 1e12,
               state_bytes=state_bytes(model, fmt), state_ratio=state_ratio(model, fmt),
               nonflush_h=f"0..{L - 2}" if cursor is None else str(cursor),
               conv_us=conv_us, conv_cfg=conv_cfg, conv_tbps=conv_tbps, conv_frac_copy=conv_frac,
               decode_cfg=decode.get("cfg"))
    for step in STEPS:
        us = decode.get(step)
        tbps, frac = _rate(ideal[step], us, bw)
        rec.update({f"{step}_us": us, f"{step}_bytes": ideal[step], f"{step}_byte_ratio": base[step] / ideal[step],
                    f"{step}_tbps": tbps, f"{step}_frac_copy": frac, f"{step}_vs_conv": _ratio(conv_us, us)})
    notes = [decode.get("note")]
    if drafts:
        verify = verify or dict(us={}, cfg=None, note=None)
        rec.update(verify_drafts=drafts, verify_cfg=verify.get("cfg"))
        for a, us in sorted(verify["us"].items()):
            nbytes = verify_read_ideal_bytes(model, batch, L, drafts, a, fmt)
            tbps, frac = _rate(nbytes, us, bw)
            p = f"verify_a{a}"
            rec.update({f"{p}_us": us, f"{p}_bytes": nbytes,
                        f"{p}_byte_ratio": verify_read_ideal_bytes(model, batch, L, drafts, a, BASELINE) / nbytes,
                        f"{p}_tbps": tbps, f"{p}_frac_copy": frac, f"{p}_vs_conv": _ratio(conv_us, us)})
        notes.append(verify.get("note"))
    rec["note"] = "; ".join(n for n in notes if n) or None
    return rec


def timed_steps(row: dict) -> List[str]:
    """The step names of a row that have a ``<step>_us`` column: STEPS, then verify_a<a>."""
    verify = [k[:-len("_us")] for k in row if k.startswith("verify_a") and k.endswith("_us")]
    return list(STEPS) + sorted(verify, key=lambda s: int(s[len("verify_a"):]))


def add_speedups(rows: List[dict]) -> List[dict]:
    """Set ``<step>_speedup_vs_fp32`` in every row: the fp32 row's time of that step (same model,
    batch, window, cursor) over this row's; None where either is missing; ``note`` moves last.
    Returns ``rows``."""
    base = {(r["model"], r["batch"], r["window"], r["nonflush_h"]): r for r in rows if r["read_format"] == BASELINE}
    for r in rows:
        b = base.get((r["model"], r["batch"], r["window"], r["nonflush_h"]))
        for step in timed_steps(r):
            r[f"{step}_speedup_vs_fp32"] = _ratio(None if b is None else b.get(f"{step}_us"), r.get(f"{step}_us"))
        r["note"] = r.pop("note", None)  # the last column
    return rows


# ------------------------------------------------------------------------------------ output


def _num(v, spec: str, suffix: str = "") -> str:
    return "-" if v is None or v != v else f"{v:{spec}}{suffix}"  # v != v: NaN from a CSV


def format_table(rows: List[dict]) -> str:
    """The rows as a text table per (model, batch, window): per format the ideal state ratio, the
    non-flush step (us, speedup over fp32 against its ideal step byte ratio, TB/s, % copy), the
    window mean and flush, each verify column; notes below."""
    out, notes = [], []
    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["batch"], r["window"]), []).append(r)
    for (model, batch, L), rs in groups.items():
        r0 = rs[0]
        verify = [s for s in timed_steps(r0) if s.startswith("verify")]
        out.append(f"{model} ({r0['layer']}), batch {batch}, L = {L}, non-flush h = {r0['nonflush_h']}: "
                   f"conventional {_num(r0['conv_us'], '.1f')} us ({_num(r0['conv_frac_copy'], '.0%')} copy); "
                   f"copy {_num(r0['copy_tbps'], '.2f')} TB/s")
        head = (f"{'read':6s} {'state':>6s} | {'non-flush us':>12s} {'x fp32':>7s} {'ideal':>6s} {'TB/s':>5s} "
                f"{'copy':>5s} | {'window us':>9s} {'x fp32':>7s} {'ideal':>6s} {'copy':>5s} | {'flush us':>8s} {'copy':>5s}")
        for s in verify:
            name = f"T={r0.get('verify_drafts')} a={s[len('verify_a'):]} us"
            head += f" | {name:>13s} {'x fp32':>7s} {'ideal':>6s}"
        out.append(head)
        for r in rs:
            line = (f"{r['read_format']:6s} {_num(r['state_ratio'], '.2f', 'x'):>6s} | "
                    f"{_num(r['nonflush_us'], '.1f'):>12s} {_num(r.get('nonflush_speedup_vs_fp32'), '.2f', 'x'):>7s} "
                    f"{_num(r['nonflush_byte_ratio'], '.2f', 'x'):>6s} {_num(r['nonflush_tbps'], '.2f'):>5s} "
                    f"{_num(r['nonflush_frac_copy'], '.0%'):>5s} | "
                    f"{_num(r['window_mean_us'], '.1f'):>9s} {_num(r.get('window_mean_speedup_vs_fp32'), '.2f', 'x'):>7s} "
                    f"{_num(r['window_mean_byte_ratio'], '.2f', 'x'):>6s} {_num(r['window_mean_frac_copy'], '.0%'):>5s} | "
                    f"{_num(r['flush_us'], '.1f'):>8s} {_num(r['flush_frac_copy'], '.0%'):>5s}")
            for s in verify:
                line += (f" | {_num(r.get(f'{s}_us'), '.1f'):>13s} {_num(r.get(f'{s}_speedup_vs_fp32'), '.2f', 'x'):>7s} "
                         f"{_num(r.get(f'{s}_byte_ratio'), '.2f', 'x'):>6s}")
            out.append(line)
            if isinstance(r.get("note"), str) and r["note"]:
                notes.append(f"{model} b={batch} {r['read_format']}: {r['note']}")
        out.append("")
    out.append("state: ideal byte ratio of the read state (fp32 / format with scales); x fp32: measured speedup "
               "over the fp32 read of the same step; ideal: the step's ideal byte ratio (ring and activations "
               "included); copy: achieved rate on the ideal bytes / the copy rate")
    if notes:
        out.append("notes:")
        out.extend(f"  {n}" for n in notes)
    return "\n".join(out)


def require_matplotlib() -> Optional[str]:
    """None when matplotlib is installed, else the message to show."""
    return NO_MATPLOTLIB if importlib.util.find_spec("matplotlib") is None else None


def plot(rows: List[dict], path) -> None:
    """Bars per (model, batch): step time of each read format, the non-flush step, the window mean
    and each verify column, labelled with the speedup over fp32 and the ideal state ratio; the
    conventional step as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: Dict[tuple, List[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["batch"], r["window"]), []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 5), squeeze=False)
    for ax, ((model, batch, L), rs) in zip(axes[0], groups.items()):
        steps = ["nonflush", "window_mean"] + [s for s in timed_steps(rs[0]) if s.startswith("verify")]
        labels = {"nonflush": "non-flush step", "window_mean": f"window mean (L = {L})"}
        width = 0.8 / len(steps)
        for i, step in enumerate(steps):
            xs = [j + (i - (len(steps) - 1) / 2) * width for j in range(len(rs))]
            ys = [r.get(f"{step}_us") for r in rs]
            ys = [0 if y is None or y != y else y for y in ys]
            name = labels.get(step, f"verify T={rs[0].get('verify_drafts')} a={step[len('verify_a'):]}")
            bars = ax.bar(xs, ys, width, label=name)
            for bar, r in zip(bars, rs):
                s = r.get(f"{step}_speedup_vs_fp32")
                if s is not None and s == s and bar.get_height() > 0:
                    ax.annotate(f"{s:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=7)
        conv = rs[0].get("conv_us")
        if conv is not None and conv == conv:
            ax.axhline(conv, color="gray", ls="--", lw=1, label="conventional step (fp32, L = 1)")
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels([f"{r['read_format']}\n(state {r['state_ratio']:.2f}x)" for r in rs])
        ax.set_ylabel("us per step")
        ax.set_title(f"{model}, batch {batch}")
        ax.legend(fontsize=7)
    fig.suptitle("ReplaySSM step time by read precision\n(on the bars: speedup over the fp32 read; "
                 "under the formats: ideal state byte ratio)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def write_outputs(rows: List[dict], out: str, plot_path: Optional[str]) -> None:
    """The CSV, the printed table and (unless ``plot_path`` is None) the plot, or why not."""
    write_rows(rows, out)
    print(format_table(rows))
    print(f"wrote {out}")
    if plot_path is None:
        return
    msg = require_matplotlib()
    if msg:
        print(f"{PROG}: {msg}")
        return
    plot(rows, plot_path)
    print(f"wrote {plot_path}")


# ------------------------------------------------------------------------------------ main


def _progress_line(r: dict, accepted) -> str:
    return (f"{r['model']:16s} b={r['batch']:4d} {r['read_format']:5s} non-flush {_num(r['nonflush_us'], '8.1f')} us "
            f"({_num(r['nonflush_frac_copy'], '.0%')} copy, {_num(r.get('nonflush_speedup_vs_fp32'), '.2f')}x fp32, "
            f"ideal {r['state_ratio']:.2f}x) window mean {_num(r['window_mean_us'], '8.1f')} us "
            f"flush {_num(r['flush_us'], '8.1f')} us"
            + "".join(f" verify a={a} {_num(r.get(f'verify_a{a}_us'), '.1f')} us" for a in accepted)
            + (f"  [{r['note']}]" if r["note"] else ""))


def measure_rows(args, bw: float, gpu: str, out: Optional[str] = None, **pool_kw) -> List[dict]:
    """Every row of the run (``parse``'s args): per model and batch the conventional step, then
    each read format's decode steps and verify column; the CSV rewritten after each row when
    `out` is given. `pool_kw` goes to every DecodePool (tests: a CPU pool)."""
    L, T = args.window, args.drafts
    t0 = time.perf_counter()
    rows = []
    for m in args.models:
        for b in args.batch:
            conv = DecodePool(m, b, 1, **pool_kw)
            try:
                conv_us, conv_cfg, conv_note = best_config(conv.window_fn, candidate_configs(m, b, L, args.quick),
                                                           args.replays)
            finally:
                _free(conv)
            if conv_note:
                print(f"{m.name} b={b}: conventional step not timed: {conv_note}", flush=True)
            for fmt in args.formats:
                dec = measure_decode(m, b, L, fmt, decode_configs(m, b, L, args.configs, args.quick, fmt), args.replays,
                                     args.cursor, **pool_kw)
                ver = None
                if T:
                    ver = measure_verify(m, b, L, T, args.accepted, fmt,
                                         verify_configs(m, b, T, L, args.configs, args.quick), args.replays,
                                         **pool_kw)
                rows.append(make_row(m, b, L, fmt, bw, gpu, conv_us, _config_name(conv_cfg) if conv_us else None,
                                     dec, ver, T, args.cursor))
                add_speedups(rows)
                if out:
                    write_rows(rows, out)
                print(_progress_line(rows[-1], args.accepted) + f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
    return rows


def main(argv=None):
    args = parse(argv)
    if not (args.compile_only or torch.cuda.is_available()):
        print(NO_GPU.format(prog=PROG), file=sys.stderr)
        return 1
    arch = compile_target(PROG, args.compile_only)
    if arch is None:
        return 1
    jobs = compile_jobs(args.models, args.batch, args.formats, args.window, args.drafts, args.configs, args.quick)
    bw = precompile_and_copy_rate(jobs, args, arch, _compile_job)
    if bw is None:
        return 0
    plot_path = None if args.no_plot else (args.plot or str(Path(args.out).with_suffix(".png")))
    rows = measure_rows(args, bw, device_tag(gpu_name()), args.out)
    print()
    write_outputs(rows, args.out, plot_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
