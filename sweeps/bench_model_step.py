"""Whole-model step latency: N layer caches sharing one SequenceTable, one CUDA graph per step (GPU).

    python sweeps/bench_model_step.py --model nemotron-super                        # 40 Mamba-2 layers
    python sweeps/bench_model_step.py --model qwen3.5-122b --batches 64,256 --drafts 4
    python sweeps/bench_model_step.py --model nemotron-super --layers 4 --batches 1 --check

What it measures, per batch size b: the model's --layers caches (bf16, the model's shapes, every
layer with its own random checkpoints, rings and inputs, as perf.DecodePool makes them) share one
table; ONE CUDA graph holds a whole model step,

    plan = table.plan_decode(ids); decode(cache_i, ..., ids, plan=plan) for every layer i

or with --drafts T the speculative step, plan_verify + every layer's verify + table.commit with
a fixed accepted count (--accepted, default T) in every row. The graph is replayed back to back
over --windows whole windows of L steps (speculative: whole periods of perf.cursor_cycle, at
least L steps), so the flushes are included; CUDA events around the replays give the mean us
per model step and per layer (median of --trials). The same is measured in the same run for
the old path, N standalone caches each planning its own step (N plan launches per step, and N
commits after a verify), captured alike. Both are also given as a fraction of the device copy
bandwidth measured in the same run (bench_decode.copy_bandwidth) on the ideal bytes of N layers
(perf.ideal_bytes "window_mean" / perf.verify_ideal_bytes "verify"). Every slot is live, rows
aligned; step_state_mib is the checkpoint bytes one step streams (keep it far above the L2).

--check first runs a small case (2 layers, 4 rows, one a pad row) of the same step graph against
the same layers as CPU caches sharing a CPU table (the float64 reference backend), and exits 1 if
outputs or materialized states differ beyond the GPU tests' tolerances.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_decode import copy_bandwidth, int_list, write_rows  # noqa: E402
from bench_verify import steps_per_set  # noqa: E402
from replayssm_cute import commit, decode, verify  # noqa: E402
from replayssm_cute.models import MODELS, get_model  # noqa: E402
from replayssm_cute.perf import bench_layer, cursor_cycle, ideal_bytes, verify_ideal_bytes  # noqa: E402
from replayssm_cute.table import SequenceTable  # noqa: E402
from result_files import check_out, default_out, device_tag, gpu_name  # noqa: E402

TOL = {"mamba2": (1e-2, 2e-5), "gdn": (1.5e-2, 2e-2)}  # --check: (outputs, states), as tests/kernels


class Stack:
    """`layers` caches of `model` with `slots` slots on one shared table (`shared`), else each
    owning its table; random checkpoints and rings; per-layer inputs (perf's, ``out`` included)."""

    def __init__(self, model, layers, slots, window, drafts, shared, device="cuda", seed=0):
        layer = bench_layer(model)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.drafts, self.shared = drafts, shared
        self.table = SequenceTable(slots, window, drafts, device=device) if shared else None
        self.caches = [layer.host.cache_type(slots, model.nheads, model.headdim, model.dstate, model.ngroups,
                                             window=window, max_draft=drafts, dtype=torch.bfloat16, device=device,
                                             table=self.table) for _ in range(layers)]
        self.inputs = [layer.inputs(model, slots, gen, "cuda", drafts) for _ in range(layers)]
        for cache in self.caches:
            cache.checkpoint.copy_(0.1 * torch.randn(cache.checkpoint.shape, generator=gen, device="cuda"))
            if device == "cuda":
                layer.fill_ring(cache, gen)

    def tables(self):
        return [self.table] if self.shared else [c.table for c in self.caches]

    def step(self, ids, num_accepted=None):
        """One model step for the rows `ids` (graph-capturable)."""
        T, layers = self.drafts, list(zip(self.caches, self.inputs))
        if self.shared:
            plan = self.table.plan_verify(ids, T) if T else self.table.plan_decode(ids)
            for cache, kw in layers:
                (verify if T else decode)(cache, slot_ids=ids, plan=plan, **kw)
            if T:
                self.table.commit(plan, num_accepted)
            return
        for cache, kw in layers:
            (verify if T else decode)(cache, slot_ids=ids, **kw)
            if T:
                commit(cache, ids, num_accepted)


def capture(step, ids):
    """A CUDA graph of ``step(ids)``, after one eager ``step`` on pad rows only on a side stream
    (compiles the kernels, warms the allocator, moves no table entry)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(torch.full_like(ids, -1))
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(ids)
    return graph


def time_replays(graph, steps: int, trials: int) -> float:
    """Median over `trials` of the mean us per replay of `steps` back-to-back replays (one untimed
    round first). `steps` must bring the cursors back to where they started."""
    times = []
    for trial in range(trials + 1):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / steps)
    return sorted(times[1:])[trials // 2]


def time_stack(model, layers, batch, L, T, accepted, windows, trials, shared) -> float:
    stack = Stack(model, layers, batch, L, T, shared)
    ids = torch.arange(batch, dtype=torch.int32, device="cuda")
    num_accepted = torch.full((batch,), accepted, dtype=torch.int32, device="cuda")
    graph = capture(lambda i: stack.step(i, num_accepted), ids)
    for table in stack.tables():  # on the cursor cycle (decode: h = 0, a window returns to it)
        table.committed.fill_(cursor_cycle(L, T, accepted)[0] if T else 0)
    steps = windows * (steps_per_set(L, T, accepted) if T else L)
    us = time_replays(graph, steps, trials)
    del graph, stack
    torch.cuda.empty_cache()
    return us


def fits(model, layers, batch, L, T) -> bool:
    """Whether one stack (plus inputs, roughly) fits in 85% of the free device memory."""
    per_slot = bench_layer(model).cache(model, 1, L, "meta", T).memory_per_slot()["total"]
    return 1.1 * layers * batch * per_slot < 0.85 * torch.cuda.mem_get_info()[0]


def measure(model, layers, batch, L, T, accepted, windows, trials, bw):
    shared = time_stack(model, layers, batch, L, T, accepted, windows, trials, True)
    solo = time_stack(model, layers, batch, L, T, accepted, windows, trials, False)
    per_layer = (verify_ideal_bytes(model, batch, L, T, accepted)["verify"] if T
                 else ideal_bytes(model, batch, L)["window_mean"])
    ideal = layers * per_layer
    return dict(model=model.name, layer=model.layer, layers=layers, batch=batch, window=L, drafts=T,
                accepted=accepted if T else None, copy_tbps=bw / 1e12,
                step_state_mib=layers * batch * model.nheads * model.headdim * model.dstate * 4 / 2**20,
                shared_step_us=shared, shared_layer_us=shared / layers,
                standalone_step_us=solo, standalone_layer_us=solo / layers, standalone_vs_shared=solo / shared,
                ideal_bytes_per_step=ideal, shared_frac_copy=ideal / (shared * 1e-6) / bw,
                standalone_frac_copy=ideal / (solo * 1e-6) / bw)


def rel_err(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(model, L, T, accepted) -> bool:
    """The small case of the step graph against the same layers on the CPU (module docstring)."""
    batch, layers = 4, 2
    gpu, cpu = Stack(model, layers, batch, L, T, True), Stack(model, layers, batch, L, T, True, device="cpu")
    for g, c in zip(gpu.caches, cpu.caches):
        c.checkpoint.copy_(g.checkpoint)
    cpu.inputs = [{k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in kw.items()} for kw in gpu.inputs]
    ids = torch.tensor([0, 1, -1, 3][:batch], dtype=torch.int32, device="cuda")
    live = (ids >= 0).cpu()
    num_accepted = torch.full((batch,), accepted, dtype=torch.int32, device="cuda")
    graph = capture(lambda i: gpu.step(i, num_accepted), ids)
    out_tol, state_tol = TOL[model.layer]
    worst_out = worst_state = 0.0
    for _ in range(L + T + 1):  # a window and more: every row flushes
        graph.replay()
        cpu.step(ids.cpu(), num_accepted.cpu())
        worst_out = max(worst_out, *(rel_err(g["out"].cpu()[live], c["out"][live])
                                     for g, c in zip(gpu.inputs, cpu.inputs)))
    slots = ids[live.to(ids.device)].tolist()
    for g, c, kg, kc in zip(gpu.caches, cpu.caches, gpu.inputs, cpu.inputs):
        args = ((kg["A"],), (kc["A"],)) if model.layer == "mamba2" else ((), ())
        worst_state = max(worst_state, rel_err(g.materialize(slots, *args[0]), c.materialize(slots, *args[1])))
    ok = worst_out < out_tol and worst_state < state_tol
    print(f"check {model.name} b={batch} {layers} layers, L={L}, T={T}: outputs rel err {worst_out:.2e} "
          f"(< {out_tol:.0e}), states {worst_state:.2e} (< {state_tol:.0e}): {'ok' if ok else 'FAILED'}", flush=True)
    return ok


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="nemotron-super", help=f"model (default nemotron-super; known: "
                                                               f"{', '.join(MODELS)})")
    ap.add_argument("--layers", type=int, help="SSM layers in the step (default the model's layer count)")
    ap.add_argument("--batches", default="1,64,256", help="comma-separated batch sizes (default 1,64,256)")
    ap.add_argument("--window", type=int, default=16, help="ReplaySSM window L (default 16)")
    ap.add_argument("--drafts", type=int, default=0, help="T: time the speculative step with T drafts per row "
                                                          "(default: the standard decode step)")
    ap.add_argument("--accepted", type=int, help="accepted drafts per row at every commit (default T)")
    ap.add_argument("--windows", type=int, default=4, help="whole windows (periods) replayed per timing (default 4)")
    ap.add_argument("--trials", type=int, default=7, help="timings per figure, median reported (default 7)")
    ap.add_argument("--out", help="CSV path (default sweeps/results/model_step_<model>[_T<T>]_<device>_<date>.csv)")
    ap.add_argument("--check", action="store_true", help="first compare a small case against the float64 "
                                                         "reference (exit 1 on a mismatch)")
    args = ap.parse_args(argv)
    try:
        args.model = get_model(args.model)
    except ValueError as e:
        ap.error(f"--model: {e}")
    args.layers = args.model.num_layers if args.layers is None else args.layers
    args.batches = int_list(ap, "--batches", args.batches)
    T, L = args.drafts, args.window
    if not 2 <= L <= 32:
        ap.error("--window must be in 2..32")
    if T and not 1 <= T <= min(16, L, 32 - L):
        ap.error(f"--drafts: T must be in 1..min(16, window, 32 - window) = {min(16, L, 32 - L)}")
    args.accepted = args.accepted or T
    if T and not 1 <= args.accepted <= T:
        ap.error(f"--accepted must be in 1..T = {T}")
    if min(args.layers, args.windows, args.trials) < 1:
        ap.error("--layers, --windows and --trials must be >= 1")
    stem = f"model_step_{args.model.name}" + (f"_T{T}" if T else "")
    args.out = args.out or str(default_out(stem, device_tag(gpu_name())))
    check_out(ap, "--out", args.out)
    return args


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_model_step: no CUDA GPU found (torch.cuda.is_available() is False); this benchmark times "
              "kernels on a GPU and needs one.", file=sys.stderr)
        return 1
    m, L, T, a = args.model, args.window, args.drafts, args.accepted
    if args.check and not check(m, L, T, a):
        return 1
    bw = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write, 2 GiB)", flush=True)
    rows = []
    for b in args.batches:
        if not fits(m, args.layers, b, L, T):
            print(f"{m.name} b={b}: skipped, {args.layers} layers of {b} slots do not fit in device memory")
            continue
        rec = measure(m, args.layers, b, L, T, a, args.windows, args.trials, bw)
        rows.append(rec)
        write_rows(rows, args.out)
        print(f"{m.name} x{args.layers} b={b:4d} {'T=%d a=%d ' % (T, a) if T else ''}"
              f"shared table {rec['shared_step_us']:9.1f} us/step {rec['shared_layer_us']:7.2f} us/layer "
              f"({rec['shared_frac_copy']:.0%} copy) | standalone {rec['standalone_step_us']:9.1f} us/step "
              f"{rec['standalone_layer_us']:7.2f} us/layer ({rec['standalone_frac_copy']:.0%} copy) | "
              f"{rec['standalone_vs_shared']:.3f}x | state {rec['step_state_mib']:.0f} MiB/step", flush=True)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
