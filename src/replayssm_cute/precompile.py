"""Build every kernel a model needs into the compile cache, with no GPU required.

    python -m replayssm_cute.precompile --model nemotron-super [--arch sm_90a|sm_100a|sm_103a]
        [--window 16] [--dtypes bf16,fp16] [--with-z] [--dump-ptx DIR]

A server that runs this at build time starts warm: `decode` finds the kernels on disk. The
variants are those `decode` asks for with the engines' usual arguments, for the conventional
step (window 1) and ReplaySSM (--window), each with its small-batch and large-batch launch config:

* Mamba-2 models: D and dt_bias given, dt_softplus on, no z (--with-z adds the gated variants),
  dt in the activation dtype, pad sentinel -1.
* Gated DeltaNet models (Qwen3.5, Qwen3-Next): q, k, v and the raw gates a, b in the activation
  dtype, A_log and dt_bias fp32, the default q scale K ** -0.5, no v / beta records, pad
  sentinel -1. --with-z is an error for them: the GDN output gate (RMSNorm, silu(z)) is applied
  outside the kernel, so there is no gated variant.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_BATCHES = (1, 1024)  # one batch size for each side of the small / large launch-config split


def config_label(config) -> str:
    """rows{R}_warps{W}[_ctas{C}]: a launch config in a variant's label (unique per config)."""
    label = f"rows{config.rows_per_cta}_warps{config.num_warps}"
    if config.min_ctas_per_sm:
        label += f"_ctas{config.min_ctas_per_sm}"
    return label


def _layer_variants(layer: str, window: int, dtypes, make_shape, default_config):
    """(label, shape, config) for window 1 and `window`, each dtype, each default launch config.

    make_shape(dtype, L) builds the static shape; default_config(batch, L, shape) the launch
    config decode picks for it.
    """
    import torch

    out = []
    for dname in dtypes:
        dtype = getattr(torch, _DTYPES[dname])
        for L in sorted({1, window}):
            shape = make_shape(dtype, L)
            configs = {default_config(b, L, shape) for b in _BATCHES}
            for cfg in sorted(configs, key=lambda c: c.key()):
                mode = "conventional" if L == 1 else f"replay_L{L}"
                out.append((f"{layer}_{mode}_{dname}_{config_label(cfg)}", shape, cfg))
    return out


def mamba2_variants(model, window: int, dtypes, with_z: bool = False, pad_slot_id: int = -1):
    """(label, shape, config) for every Mamba-2 kernel `decode` needs at this model shape."""
    from .kernels_host import default_mamba2_config, mamba2_shape

    return _layer_variants(
        "mamba2", window, dtypes,
        lambda dtype, L: mamba2_shape(model.nheads, model.headdim, model.dstate, model.ngroups, L, L,
                                      dtype, dtype, True, with_z, True, True, pad_slot_id),
        lambda batch, L, shape: default_mamba2_config(model.headdim, batch, L))


def gdn_variants(model, window: int, dtypes, pad_slot_id: int = -1):
    """(label, shape, config) for every GDN kernel `decode` needs at this model shape.

    ModelSpec fields for a GDN layer: nheads = HV value heads, headdim = V, dstate = K,
    ngroups = H key heads. The gates a, b come in the activation dtype, A_log and dt_bias fp32,
    the q scale is the default (scale=None); caches without v / beta records (keep_v_beta off).
    """
    import torch

    from .kernels_host import default_gdn_config, gdn_shape

    return _layer_variants(
        "gdn", window, dtypes,
        lambda dtype, L: gdn_shape(model.nheads, model.headdim, model.dstate, model.ngroups, L, L,
                                   dtype, dtype, torch.float32, torch.float32, None, False,
                                   pad_slot_id),
        lambda batch, L, shape: default_gdn_config(model.headdim, batch, L, shape))


def _option_error(model, with_z: bool):
    """Why the options do not apply to `model`, or None. Needs no cutlass import."""
    if model.layer not in ("mamba2", "gdn"):
        return f"{model.name}: unknown layer type {model.layer!r}"
    if with_z and model.layer == "gdn":
        return (f"--with-z: {model.name} is a gdn model; its output gate (RMSNorm, silu(z)) is "
                f"applied outside the kernel, so it has no z variants")
    return None


def variants(model, window: int, dtypes, with_z: bool = False):
    """The variants of `model`'s layer type (mamba2_variants or gdn_variants)."""
    reason = _option_error(model, with_z)
    if reason is not None:
        raise ValueError(reason)
    if model.layer == "gdn":
        return gdn_variants(model, window, dtypes)
    return mamba2_variants(model, window, dtypes, with_z=with_z)


def compile_variant(layer: str, shape, config):
    """Build one variant into the compile cache (or load it); returns the compiled kernel."""
    from . import kernels_host

    return getattr(kernels_host, f"compile_{layer}")(shape, config)


def dump_ptx(layer: str, shape, config, path: Path) -> None:
    """Compile one variant once more with --keep-ptx and write its PTX to `path`."""
    import importlib
    import shlex
    import tempfile

    from .compile_cache import compile_options

    module = importlib.import_module(f"{__package__}.kernels.{layer}.decode")
    # --keep-ptx also writes a copy into the DSL's dump dir (by default the current directory);
    # a scratch folder keeps that from littering wherever precompile was started.
    with tempfile.TemporaryDirectory(prefix="replayssm_cute_ptx_") as scratch:
        options = compile_options("--keep-ptx", f"--dump-dir {shlex.quote(scratch)}")
        fn = module.compile_decode(shape, config, options)
        Path(path).write_text(fn.__ptx__)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m replayssm_cute.precompile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model registry name")
    parser.add_argument("--arch", choices=["sm_90a", "sm_100a", "sm_103a"],
                        help="target (default: $CUTE_DSL_ARCH, else the current GPU)")
    parser.add_argument("--window", type=int, default=16, help="ReplaySSM window L (default 16)")
    parser.add_argument("--dtypes", default="bf16", help="activation dtypes, comma separated")
    parser.add_argument("--with-z", action="store_true",
                        help="also the gated (z) variants (Mamba-2 only; an error for GDN models, "
                             "whose output gate is outside the kernel)")
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
    reason = _option_error(model, args.with_z)
    if reason is not None:
        parser.error(reason)
    if args.arch:
        if "cutlass" in sys.modules and os.environ.get("CUTE_DSL_ARCH") != args.arch:
            raise RuntimeError("--arch must be chosen before cutlass is imported")
        os.environ["CUTE_DSL_ARCH"] = args.arch

    from .compile_cache import target_arch

    arch = target_arch()
    kernel_variants = variants(model, args.window, dtypes, with_z=args.with_z)
    print(f"precompile {model.name} for {arch}: {len(kernel_variants)} kernels")
    if args.dump_ptx:
        Path(args.dump_ptx).mkdir(parents=True, exist_ok=True)
    for label, shape, cfg in kernel_variants:
        t0 = time.perf_counter()
        compile_variant(model.layer, shape, cfg)
        line = f"  {label:44s} {time.perf_counter() - t0:6.1f} s"
        if args.dump_ptx:
            path = Path(args.dump_ptx) / f"{label}.{arch}.ptx"
            dump_ptx(model.layer, shape, cfg, path)
            line += f"  -> {path}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
