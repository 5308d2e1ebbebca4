"""Build every kernel a model needs into the compile cache, with no GPU required.

    python -m replayssm_cute.precompile --model nemotron-super [--arch sm_90a|sm_100a|sm_103a]
        [--window 16] [--dtypes bf16,fp16] [--dump-ptx DIR]

A server that runs this at build time starts warm: `decode` finds the kernels on disk. The
variants are those `decode` asks for with the engines' usual arguments (D and dt_bias given,
dt_softplus on, no z, dt in the activation dtype, pad sentinel -1) for the conventional step
(window 1) and ReplaySSM (--window), each with its small-batch and large-batch launch config.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def mamba2_variants(model, window: int, dtypes, with_z: bool = False, pad_slot_id: int = -1):
    """(label, shape, config) for every kernel `decode` needs at this model shape."""
    import torch

    from .kernels_host import default_mamba2_config, mamba2_shape

    out = []
    for dname in dtypes:
        dtype = getattr(torch, _DTYPES[dname])
        for L in sorted({1, window}):
            shape = mamba2_shape(model.nheads, model.headdim, model.dstate, model.ngroups, L, L,
                                 dtype, dtype, True, with_z, True, True, pad_slot_id)
            configs = {default_mamba2_config(model.headdim, b, L) for b in (1, 1024)}
            for cfg in sorted(configs, key=lambda c: c.key()):
                mode = "conventional" if L == 1 else f"replay_L{L}"
                label = f"mamba2_{mode}_{dname}_rows{cfg.rows_per_cta}"
                out.append((label, shape, cfg))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replayssm_cute.precompile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model registry name")
    parser.add_argument("--arch", choices=["sm_90a", "sm_100a", "sm_103a"],
                        help="target (default: $CUTE_DSL_ARCH, else the current GPU)")
    parser.add_argument("--window", type=int, default=16, help="ReplaySSM window L (default 16)")
    parser.add_argument("--dtypes", default="bf16", help="activation dtypes, comma separated")
    parser.add_argument("--with-z", action="store_true", help="also the gated (z) variants")
    parser.add_argument("--dump-ptx", metavar="DIR", help="write each kernel's PTX into DIR")
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
    if not 2 <= args.window <= 32:
        parser.error("--window must be in 2..32 (window 1 is the conventional kernel, always built; "
                     "the kernel keeps one record per lane)")
    if model.layer != "mamba2":
        parser.error(f"{model.name} is a {model.layer} model; its kernels are not in this release yet")
    if args.arch:
        if "cutlass" in sys.modules and os.environ.get("CUTE_DSL_ARCH") != args.arch:
            raise RuntimeError("--arch must be chosen before cutlass is imported")
        os.environ["CUTE_DSL_ARCH"] = args.arch

    from .compile_cache import compile_options, target_arch
    from .kernels_host import compile_mamba2

    arch = target_arch()
    variants = mamba2_variants(model, args.window, dtypes, with_z=args.with_z)
    print(f"precompile {model.name} for {arch}: {len(variants)} kernels")
    if args.dump_ptx:
        Path(args.dump_ptx).mkdir(parents=True, exist_ok=True)
    for label, shape, cfg in variants:
        t0 = time.perf_counter()
        compile_mamba2(shape, cfg)
        line = f"  {label:44s} {time.perf_counter() - t0:6.1f} s"
        if args.dump_ptx:
            from .kernels.mamba2.decode import compile_decode

            fn = compile_decode(shape, cfg, compile_options("--keep-ptx"))
            path = Path(args.dump_ptx) / f"{label}.{arch}.ptx"
            path.write_text(fn.__ptx__)
            line += f"  -> {path}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
