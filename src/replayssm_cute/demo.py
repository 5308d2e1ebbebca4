"""ReplaySSM decode demo: check against a float64 recurrence, then time it against conventional decode.

    python -m replayssm_cute.demo --model nemotron-super [--batch 8] [--window 16] [--windows 3] [--tp 1]
    python -m replayssm_cute.demo --model qwen3.5-4b ...    (a Gated DeltaNet model)

On a CUDA GPU: two caches of one layer (conventional, window 1; ReplaySSM, window L) get the same
random prefill states; rows are staggered over ring positions (row r starts at h = r mod L, by
r mod L warm-up steps in which the rows not yet due are padding); then --windows full windows run
on both caches. Every step's outputs of both kernels are checked against the float64 plain
recurrence, and the states are checked after flushes and at the end. Then both kernels are timed
(a CUDA graph of L steps, each step over several slot sets so the pool of >= 512 MiB cannot stay
in L2; the median over replays) and reported per step with their bandwidth on ideal bytes.
Mamba-2 and Gated DeltaNet models alike (the layer type comes from the model registry). Each
kernel's launch config is printed with where it came from: a tuned config (the shipped H200 file
or your own tuned-config file, replayssm_cute.runtime.tuning) or the analytical default.

Without a GPU: the same staggered check runs on CPU caches through `replayssm_cute.decode` (the
PyTorch reference path, float32 cache so the check is tight) at batch 2, then the model's kernels
are compiled for $CUTE_DSL_ARCH (default sm_90a), each with its compile time.

Arguments are checked before anything runs (--window 2..32: the kernels keep one ring record per
lane). Exit status: 0 when every check passes, 1 when a check fails, 2 (with one line on stderr)
on bad arguments or an unknown model.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

MAX_WINDOW = 32  # ring capacity: the kernels keep one record per lane


# --------------------------------------------------------------------------------------- checks


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


class _DemoLayer:
    """What the staggered check needs of `model`'s layer, from its adapter (replayssm_cute.layers):
    caches, random weights, one token's random inputs, the decode call, the float64 recurrence and
    the tolerances."""

    def __init__(self, model, gen, dev):
        from .layers import LAYERS

        self.host = LAYERS[model.layer]
        self.model, self.name, self.kind = model, model.layer, self.host.titles[0]
        self.dims = (model.nheads, model.headdim, model.dstate, model.ngroups)
        self.state_dims, self.out_dims = self.host.row_shapes(self.dims)
        self.params = self.host.random_params(self.dims, gen, dev)

    def cache(self, slots, window, dtype, dev):
        from .layers import model_cache

        return model_cache(self.model, slots, window, dev, dtype=dtype)

    def token(self, batch, dtype, gen, dev):
        return self.host.random_tokens(self.dims, (batch,), dtype, gen, dev)

    def decode(self, cache, t, slot_ids, out):
        from .api import decode

        decode(cache, slot_ids=slot_ids, out=out, **t, **self.params)

    def reference(self, state, t):
        return self.host.conventional_reference(state, t, self.params)

    def materialize(self, cache, slots):
        return self.host.materialize(cache, slots, self.params)

    def tolerances(self, window, dtype):
        """(outputs, states, note): the layer's ``check_tolerances``."""
        return self.host.check_tolerances(window, dtype)


def staggered_check(model, batch: int, window: int, windows: int, dtype, device, seed: int = 0) -> dict:
    """Run the staggered multi-window check on a conventional and a ReplaySSM cache of
    `model`'s layer (Mamba-2 or GDN).

    Returns the worst errors seen and ``failures`` (a list of strings, empty when all passed).
    """
    import torch

    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    slots = torch.randperm(batch, generator=gen, device=dev).to(torch.int32)
    # (slots, heads, d_v, d_k) for both layers: Mamba-2 (H, P, N), GDN (HV, V, K)
    init = torch.randn(batch, model.nheads, model.headdim, model.dstate, generator=gen, device=dev) * 0.1
    layer = _DemoLayer(model, gen, dev)
    caches = {
        "conventional": layer.cache(batch, 1, dtype, dev),
        "replayssm": layer.cache(batch, window, dtype, dev),
    }
    for c in caches.values():
        c.load_prefill(slots, init)
    ref_state = init.double()

    out_tol, replay_state_tol, note = layer.tolerances(window, dtype)
    state_tol = {"conventional": layer.tolerances(1, dtype)[1], "replayssm": replay_state_tol}
    rows = torch.arange(batch, device=dev)
    sidx = slots.long()
    warm = window - 1
    res = {"out_err": {k: 0.0 for k in caches}, "flush_err": 0.0, "flushes": 0,
           "conv_state_err": 0.0, "final_err": {}, "steps": warm + windows * window, "failures": [],
           "failed": 0, "kind": layer.kind, "out_tol": out_tol, "state_tol": state_tol,
           "note": note}
    fails = res["failures"]

    def fail(msg):
        res["failed"] += 1
        if len(fails) < 8:  # the first few are enough to see what went wrong
            fails.append(msg)

    for step in range(res["steps"]):
        # Warm-up step k < L-1: rows with r % L <= k are padding, so row r ends up at h = r % L.
        live = (rows % window) > step if step < warm else torch.ones_like(rows, dtype=torch.bool)
        step_slots = torch.where(live, slots, torch.full_like(slots, -1))
        token = layer.token(batch, dtype, gen, dev)
        h_before = caches["replayssm"].cursor[sidx].clone()
        fill = torch.randn((batch,) + layer.out_dims, generator=gen, device=dev).to(dtype)
        outs = {}
        for name, c in caches.items():
            outs[name] = fill.clone()
            layer.decode(c, token, step_slots, outs[name])
        y_ref, new_state = layer.reference(ref_state, token)
        ref_state[live] = new_state[live]
        for name, out in outs.items():
            e = _rel(out[live], y_ref[live])
            res["out_err"][name] = max(res["out_err"][name], e)
            if not e < out_tol:
                fail(f"step {step}: {name} outputs off by {e:.2e} (tolerance {out_tol:.0e})")
            if not torch.equal(out[~live], fill[~live]):
                fail(f"step {step}: {name} wrote the outputs of padding rows")
        e = _rel(caches["conventional"].checkpoint[sidx][live], ref_state[live])
        res["conv_state_err"] = max(res["conv_state_err"], e)
        if not e < state_tol["conventional"]:
            fail(f"step {step}: conventional state off by {e:.2e}")
        flushed = live & (h_before + 1 == window)
        if flushed.any():
            res["flushes"] += int(flushed.sum())
            e = _rel(caches["replayssm"].checkpoint[sidx][flushed], ref_state[flushed])
            res["flush_err"] = max(res["flush_err"], e)
            if not e < state_tol["replayssm"]:
                fail(f"step {step}: ReplaySSM checkpoint after flush off by {e:.2e}")
    for name, c in caches.items():
        e = _rel(layer.materialize(c, slots), ref_state)
        res["final_err"][name] = e
        if not e < state_tol[name]:
            fail(f"end: {name} state (materialized) off by {e:.2e}")
    return res


def _print_check(res, batch, window, windows, dtype_name) -> None:
    tol = res["state_tol"]
    tols = (f"{tol['conventional']:.0e}" if tol["conventional"] == tol["replayssm"] else
            f"conventional {tol['conventional']:.0e}, ReplaySSM {tol['replayssm']:.0e}")
    print(f"check: {res['kind']} layer, batch {batch}, {dtype_name} activations, {window - 1} staggered "
          f"warm-up steps + {windows} windows of {window} = {res['steps']} steps, against the float64 "
          f"recurrence")
    print(f"  outputs, max relative L2 error: conventional {res['out_err']['conventional']:.2e}, "
          f"ReplaySSM {res['out_err']['replayssm']:.2e} (tolerance {res['out_tol']:.0e})")
    print(f"  states:  conventional every step {res['conv_state_err']:.2e}; ReplaySSM checkpoint "
          f"after {res['flushes']} row flushes {res['flush_err']:.2e}; at the end (materialized) "
          f"conventional {res['final_err']['conventional']:.2e}, ReplaySSM "
          f"{res['final_err']['replayssm']:.2e} (tolerance {tols})")
    if res["note"]:
        print(f"  {res['note']}")
    for f in res["failures"]:
        print(f"  FAILED: {f}")
    if res["failed"] > len(res["failures"]):
        print(f"  ... {res['failed'] - len(res['failures'])} more failed checks")


# --------------------------------------------------------------------------------------- launch configs


def _decode_kernel_shape(layer, cache):
    """(Kernel, Shape) of `layer`'s decode call on `cache`: the serving engines' usual arguments,
    as its ``decode`` passes them (the adapter's ``engine_inputs``)."""
    from .layers import LAYERS

    host = LAYERS[layer.name]
    return host.decode_kernel, host.shape(cache, host.engine_inputs(cache.dtype))


def _config_source(tuned: bool, gpu: bool) -> str:
    """Where a picked launch config came from, in words."""
    from .runtime import tuning

    if tuned:
        user = tuning.user_file()
        return f"tuned (H200 file or {user})" if user.is_file() else "tuned (H200 file)"
    if not gpu:
        return "analytical default (no GPU: tuned configs apply on the GPU they were measured on)"
    if not tuning.tuned_enabled():
        return f"analytical default ({tuning.ENV_DISABLE}=0)"
    return "analytical default"


def launch_config_line(layer, cache, batch: int, gpu: bool) -> str:
    """`layer`'s decode kernel on `cache` at `batch`: its launch config and where it came from."""
    from .runtime.launch import picked_config

    kernel, shape = _decode_kernel_shape(layer, cache)
    config, tuned = picked_config(kernel, shape, batch)
    fields = ", ".join(f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config))
    return f"{kernel.name} ({fields}): {_config_source(tuned, gpu)}"


# --------------------------------------------------------------------------------------- GPU


def _gpu_demo(model, shard, args) -> int:
    import torch

    from .runtime.compile_cache import target_arch
    from .runtime.launch import launcher

    L, batch = args.window, args.batch
    dev = torch.device("cuda")
    print(f"GPU: {torch.cuda.get_device_name(dev)}; kernels for {target_arch()}; launch configs "
          f"at batch {batch}:")
    layer = _DemoLayer(shard, torch.Generator(device=dev), dev)
    for w, name in ((1, "conventional"), (L, f"ReplaySSM L={L}")):
        probe = layer.cache(1, w, torch.bfloat16, dev)
        t0 = time.perf_counter()
        launcher(*_decode_kernel_shape(layer, probe), 0, batch)
        print(f"  {name:18s} kernel ready in {time.perf_counter() - t0:5.1f} s "
              f"(compiled, or loaded from the disk cache)")
        print(f"  {'':18s} {launch_config_line(layer, probe, batch, gpu=True)}")
        del probe

    res = staggered_check(shard, batch, L, args.windows, torch.bfloat16, dev, seed=args.seed)
    _print_check(res, batch, L, args.windows, "bf16")
    torch.cuda.empty_cache()

    from .perf import DecodePool, ideal_bytes, time_graph

    ideal = ideal_bytes(shard, batch, L)
    timings = {}
    for w, key in ((1, "conventional"), (L, "window_mean")):
        pool = DecodePool(shard, batch, w, stagger=True, seed=args.seed + 1)
        fn, launches = pool.window_fn()
        if w == 1:  # time the conventional step over as many steps as a ReplaySSM window
            run_once, n = fn, launches
            fn, launches = (lambda: [run_once() for _ in range(L)]), n * L
        nsets = pool.nsets
        timings[key] = time_graph(fn, launches, replays=args.replays)
        del pool, fn
        torch.cuda.empty_cache()
    pool_mib = nsets * batch * shard.nheads * shard.headdim * shard.dstate * 4 / 2**20
    print(f"timing: CUDA graph of {L} steps, each over {nsets} slot sets of {batch} rows "
          f"({pool_mib:.0f} MiB of states), median of {args.replays} replays, CUDA events")
    t_conv, t_rep = timings["conventional"], timings["window_mean"]
    bw_conv = ideal["conventional"] / (t_conv * 1e-6) / 1e12
    bw_rep = ideal["window_mean"] / (t_rep * 1e-6) / 1e12
    print(f"  conventional             {t_conv:9.2f} us/step  {bw_conv:5.2f} TB/s on ideal bytes")
    print(f"  ReplaySSM (window mean)  {t_rep:9.2f} us/step  {bw_rep:5.2f} TB/s on ideal bytes")
    print(f"  ReplaySSM is {t_conv / t_rep:.2f}x the speed of conventional decoding "
          f"(conventional / ReplaySSM time)")
    if res["failures"]:
        print(f"summary: CHECKS FAILED ({res['failed']} failed checks); "
              f"ReplaySSM {t_rep:.2f} us vs conventional {t_conv:.2f} us per step")
        return 1
    print(f"summary: all checks passed; {shard.name} batch {batch}, L={L}: ReplaySSM {t_rep:.2f} us "
          f"vs conventional {t_conv:.2f} us per step per layer ({t_conv / t_rep:.2f}x)")
    return 0


# --------------------------------------------------------------------------------------- CPU


def _cpu_demo(model, shard, args) -> int:
    arch = os.environ.get("CUTE_DSL_ARCH") or "sm_90a"
    if "cutlass" not in sys.modules:
        os.environ["CUTE_DSL_ARCH"] = arch
    elif os.environ.get("CUTE_DSL_ARCH") != arch:
        print("demo: cutlass was imported before CUTE_DSL_ARCH could be set; set it yourself",
              file=sys.stderr)
        return 2
    print(f"no CUDA GPU found: running the PyTorch reference path on the CPU and compiling the "
          f"kernels for {arch} (CUTE_DSL_ARCH, default sm_90a)")
    from .runtime.compile_cache import SUPPORTED_ARCHS

    if arch not in SUPPORTED_ARCHS:
        print(f"demo: CUTE_DSL_ARCH={arch!r} is not supported; use one of {', '.join(SUPPORTED_ARCHS)}",
              file=sys.stderr)
        return 2
    import torch

    L = args.window
    batch = min(args.batch, 2)
    t0 = time.perf_counter()
    res = staggered_check(shard, batch, L, args.windows, torch.float32, "cpu", seed=args.seed)
    _print_check(res, batch, L, args.windows, "fp32")
    print(f"  (reference path, {time.perf_counter() - t0:.1f} s)")

    layer = _DemoLayer(shard, torch.Generator(), "cpu")
    print(f"launch configs decode would pick on a GPU at batch {args.batch} (bf16 activations):")
    for w, name in ((1, "conventional"), (L, f"ReplaySSM L={L}")):
        probe = layer.cache(1, w, torch.bfloat16, "cpu")
        print(f"  {name:18s} {launch_config_line(layer, probe, args.batch, gpu=False)}")
        del probe

    from .precompile import compile_variant
    from .precompile import variants as kernel_variants

    variants = kernel_variants(shard, L, ["bf16"])
    print(f"compile: {len(variants)} kernels for {arch} (compiled, or loaded from the disk cache; "
          f"not run without a GPU)")
    compile_failures = []
    t_all = time.perf_counter()
    for label, shape, cfg in variants:
        t1 = time.perf_counter()
        try:
            compile_variant(shard.layer, shape, cfg)
        except Exception as e:  # report every kernel, then fail
            compile_failures.append(label)
            print(f"  {label:40s} FAILED: {type(e).__name__}: {e}")
            continue
        print(f"  {label:40s} {time.perf_counter() - t1:6.1f} s")
    print(f"  total {time.perf_counter() - t_all:.1f} s")
    if res["failures"] or compile_failures:
        what = []
        if res["failures"]:
            what.append(f"{res['failed']} failed checks")
        if compile_failures:
            what.append(f"{len(compile_failures)} kernels failed to compile")
        print(f"summary: FAILED ({', '.join(what)})")
        return 1
    print(f"summary: all checks passed on the CPU reference path; {len(variants)} kernels compiled "
          f"for {arch}. Run on a GPU to check and time the kernels themselves.")
    return 0


# --------------------------------------------------------------------------------------- main


def _check_args(args):
    """(why the arguments cannot run, None, None) or (None, model, its tensor-parallel shard).
    Needs no cutlass import and runs nothing."""
    from .models import get_model

    for name, low in (("batch", 1), ("windows", 1), ("tp", 1), ("replays", 1)):
        if getattr(args, name) < low:
            return f"--{name} must be >= {low}, got {getattr(args, name)}", None, None
    if not 2 <= args.window <= MAX_WINDOW:
        return (f"--window must be in 2..{MAX_WINDOW}, got {args.window} (window 1 is the "
                f"conventional step, which the demo always runs; the kernels keep one ring record "
                f"per lane)"), None, None
    try:
        model = get_model(args.model)
    except ValueError as e:
        return str(e), None, None
    from .layers import LAYERS

    if model.layer not in LAYERS:
        return (f"{model.name} is a {model.layer} model; the demo knows {', '.join(sorted(LAYERS))} "
                f"layers"), None, None
    try:
        return None, model, model.shard(args.tp)
    except ValueError as e:
        return str(e), None, None


def main(argv=None) -> int:
    from .models import MODELS

    ap = argparse.ArgumentParser(prog="python -m replayssm_cute.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help=f"one of: {', '.join(MODELS)}")
    ap.add_argument("--batch", type=int, default=8, help="decode rows (default 8; 2 on the CPU)")
    ap.add_argument("--window", type=int, default=16, help=f"ReplaySSM window L in 2..{MAX_WINDOW} (default 16)")
    ap.add_argument("--windows", type=int, default=3, help="full windows to check (default 3)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: one shard's heads")
    ap.add_argument("--replays", type=int, default=15, help="timed graph replays (GPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    reason, model, shard = _check_args(args)
    if reason is not None:  # before anything runs: one line, exit status 2
        print(f"demo: {reason}", file=sys.stderr)
        return 2

    import torch

    t0 = time.perf_counter()
    from .layers import LAYERS

    host = LAYERS[shard.layer]
    dims = f"{host.titles[0]} layer shard {host.dims_text((shard.nheads, shard.headdim, shard.dstate, shard.ngroups))}"
    print(f"{model.name}, tp {args.tp}: {dims} ({model.num_layers} SSM layers); state "
          f"{shard.nheads * shard.headdim * shard.dstate * 4 / 2**20:.1f} MiB per sequence per layer; "
          f"window L={args.window}")
    if torch.cuda.is_available():
        rc = _gpu_demo(model, shard, args)
    else:
        rc = _cpu_demo(model, shard, args)
    print(f"done in {time.perf_counter() - t0:.1f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
