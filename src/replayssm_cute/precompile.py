"""Build every kernel a model needs into the compile cache, with no GPU required.

    python -m replayssm_cute.precompile --model nemotron-super [--arch sm_90a|sm_100a|sm_103a]
        [--window 16] [--dtypes bf16,fp16] [--with-z] [--drafts 2,4,8] [--read-copies fp16,fp8,nvfp4]
        [--dump-ptx DIR]

A server that runs this at build time starts warm: `decode` (and with --drafts, `verify` and
`commit`) finds its kernels on disk. The variants are those `decode` asks for with the engines'
usual arguments, for the conventional step (window 1) and ReplaySSM (--window), each with its
small-batch and large-batch launch config:

* Mamba-2 models: D and dt_bias given, dt_softplus on, no z (--with-z adds the gated variants),
  dt in the activation dtype, pad sentinel -1.
* Gated DeltaNet models (Qwen3.5, Qwen3-Next): q, k, v and the raw gates a, b in the activation
  dtype, A_log and dt_bias fp32, the default q scale K ** -0.5, no v / beta records, pad
  sentinel -1. --with-z is an error for them: the GDN output gate (RMSNorm, silu(z)) is applied
  outside the kernel, so there is no gated variant.

--drafts T1,T2,... (default: none) adds what speculative decoding needs on a cache built with
max_draft = max(T) and the same window, for either layer type: the standard decode kernels on
that cache (its ring is window + max_draft records, a different kernel from the window-only
cache's), the verify kernel for each draft count T with the launch configs verify picks for small
and large batches, and the commit kernel for each T. Each T needs 1 <= T <= min(16, window), and
window + max(T) <= 32. --dump-ptx covers these kernels too.

--read-copies F1,F2,... (default: none) adds the ReplaySSM decode kernels (--window) of caches
with those low-precision read copies next to an fp32 checkpoint (GDN: keeping v and beta and
re-deriving at a flush, the cache's defaults), with the launch configs decode picks for them;
with --drafts also their draft caches' decode and verify kernels.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional

_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_BATCHES = (1, 1024)  # one batch size for each side of the small / large launch-config split
_MAX_DRAFTS = 16  # the verify kernels' limit (and Mamba2Cache's max_draft)
_MAX_CAPACITY = 32  # window + max_draft: one lane per ring record


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


READ_COPIES = ("fp16", "fp8", "nvfp4")


def read_copy_variants(model, window: int, dtypes, read_copies, pad_slot_id: int = -1):
    """(label, shape, config) for the ReplaySSM decode kernels `decode` builds on caches with each
    read copy of `read_copies` next to an fp32 checkpoint (GDNCache's defaults with a read copy:
    v and beta kept, corrections re-derived at a flush), the engines' usual arguments otherwise
    (mamba2_variants / gdn_variants), each with the small- and large-batch launch config."""
    import torch

    from . import kernels_host as kh

    out = []
    for dname in dtypes:
        dtype = getattr(torch, _DTYPES[dname])
        for fmt in read_copies:
            if model.layer == "gdn":
                shape = kh.gdn_shape(model.nheads, model.headdim, model.dstate, model.ngroups, window, window, dtype,
                                     dtype, torch.float32, torch.float32, None, True, pad_slot_id, "fp32", fmt, True)
                configs = {kh.default_gdn_config(model.headdim, b, window, shape, fmt == "nvfp4") for b in _BATCHES}
            else:
                shape = kh.mamba2_shape(model.nheads, model.headdim, model.dstate, model.ngroups, window, window,
                                        dtype, dtype, True, False, True, True, pad_slot_id, "fp32", fmt)
                configs = {kh.default_mamba2_config(model.headdim, b, window, fmt == "nvfp4", shape) for b in _BATCHES}
            for cfg in sorted(configs, key=lambda c: c.key()):
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
        if not 1 <= T <= _MAX_DRAFTS:
            return f"--drafts: draft count {T} is outside 1..{_MAX_DRAFTS}"
        if T > window:
            return (f"--drafts: draft count {T} is above the window {window} (a verify step of T "
                    f"drafts needs T <= window)")
    if window + max(drafts) > _MAX_CAPACITY:
        return (f"--drafts: window {window} + max draft count {max(drafts)} = {window + max(drafts)} "
                f"ring records, above {_MAX_CAPACITY} (one lane per record)")
    return None


def _option_error(model, with_z: bool, window: Optional[int] = None, drafts=None):
    """Why the options do not apply to `model`, or None. Needs no cutlass import."""
    if model.layer not in ("mamba2", "gdn"):
        return f"{model.name}: unknown layer type {model.layer!r}"
    if with_z and model.layer == "gdn":
        return (f"--with-z: {model.name} is a gdn model; its output gate (RMSNorm, silu(z)) is "
                f"applied outside the kernel, so it has no z variants")
    if drafts is not None:
        return _drafts_error(model, 16 if window is None else window, drafts)
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


class DraftVariant(NamedTuple):
    """One kernel that speculative decoding needs (``draft_variants``)."""

    label: str
    kind: str  # "decode" (on the draft cache), "verify" or "commit"
    shape: object  # Mamba2Shape / GDNShape, or CommitShape for "commit"
    config: object  # launch config; None for "commit"
    num_drafts: int  # T of a verify / commit kernel; 0 for "decode"


def draft_variants(model, window: int, drafts, dtypes, with_z: bool = False, pad_slot_id: int = -1,
                   read_copy=None):
    """Every kernel that speculative decoding with `drafts` draft counts needs at this model shape,
    on a cache with max_draft = max(drafts) and `window`: the decode kernels on that cache (its
    capacity differs from the window-only cache's), one verify kernel per (dtype, T, launch config)
    and one commit kernel per T. Launch configs: the defaults decode and verify pick for small and
    large batches. Arguments as `mamba2_variants` / `gdn_variants` (the engines' usual ones).
    ``read_copy``: those of a cache with that read copy next to an fp32 checkpoint (GDN keeping v
    and beta, re-deriving at a flush), without the commit kernels (the plain cache's).
    Raises ValueError (naming --drafts) when the draft counts do not apply."""
    import torch

    drafts = sorted(set(drafts))
    reason = _option_error(model, with_z, window, drafts)
    if reason is not None:
        raise ValueError(reason)
    from . import kernels_host as kh
    from .kernels.commit import CommitShape

    layer = model.layer
    max_draft = max(drafts)
    capacity = window + max_draft
    whole_head = read_copy == "nvfp4"
    if layer == "gdn":
        from .kernels.gdn.verify import GDNVerify as Verify

        def make_shape(dtype):
            return kh.gdn_shape(model.nheads, model.headdim, model.dstate, model.ngroups, window, capacity,
                                dtype, dtype, torch.float32, torch.float32, None, read_copy is not None,
                                pad_slot_id, "fp32", read_copy, read_copy is not None)

        def decode_config(batch, shape):
            return kh.default_gdn_config(model.headdim, batch, window, shape, whole_head)

        def verify_config(batch, shape):
            return kh.default_gdn_verify_config(model.headdim, batch, whole_head)
    else:
        from .kernels.mamba2.verify import Mamba2Verify as Verify

        def make_shape(dtype):
            return kh.mamba2_shape(model.nheads, model.headdim, model.dstate, model.ngroups, window,
                                   capacity, dtype, dtype, True, with_z, True, True, pad_slot_id, "fp32", read_copy)

        def decode_config(batch, shape):
            return kh.default_mamba2_config(model.headdim, batch, window, whole_head, shape)

        def verify_config(batch, shape):
            return kh.default_mamba2_verify_config(model.headdim, batch, whole_head)

    def configs(choose, shape):
        return sorted({choose(b, shape) for b in _BATCHES}, key=lambda c: c.key())

    cache = f"L{window}_maxdraft{max_draft}" + (f"_read_{read_copy}" if read_copy else "")
    out = []
    for dname in dtypes:
        shape = make_shape(getattr(torch, _DTYPES[dname]))
        for cfg in configs(decode_config, shape):
            reason = cfg.check(shape)
            if reason is not None:
                raise ValueError(f"--drafts: the decode kernel on a cache of max_draft {max_draft} "
                                 f"cannot take {cfg}: {reason}")
            out.append(DraftVariant(f"{layer}_replay_{cache}_{dname}_{config_label(cfg)}", "decode",
                                    shape, cfg, 0))
        for T in drafts:
            for cfg in configs(verify_config, shape):
                reason = Verify.check(shape, cfg, T)
                if reason is not None:
                    raise ValueError(f"--drafts: the verify kernel cannot take T = {T} with {cfg}: {reason}")
                out.append(DraftVariant(f"{layer}_verify_{cache}_T{T}_{dname}_{config_label(cfg)}",
                                        "verify", shape, cfg, T))
    for T in drafts if read_copy is None else []:
        out.append(DraftVariant(f"{layer}_commit_{cache}_T{T}", "commit",
                                CommitShape(window, capacity, T, pad_slot_id), None, T))
    return out


def _torch_dtype(cute_dtype):
    from .kernels_host import _CUTE_DTYPE_NAMES

    return next(t for t, name in _CUTE_DTYPE_NAMES.items() if name == cute_dtype.__name__)


def _cache_like(shape):
    """What the kernels_host lookups read from a cache, for a Mamba2Shape, a GDNShape or a
    CommitShape: the verify and commit kernels are built through the very calls verify / commit
    make, so the compile-cache keys are theirs."""
    from types import SimpleNamespace

    fields = dict(window=shape.window, capacity=shape.capacity, pad_slot_id=shape.pad_slot_id,
                  checkpoint_format=getattr(shape, "checkpoint_format", "fp32"),
                  read_copy_format=getattr(shape, "read_copy", None),
                  flush_corrections="rederive" if getattr(shape, "rederive", False) else "fold",
                  sr_counter=True if getattr(shape, "stochastic", False) else None)  # commit: SR checkpoints
    if hasattr(shape, "nheads"):  # Mamba2Shape
        fields.update(nheads=shape.nheads, headdim=shape.headdim, dstate=shape.dstate,
                      ngroups=shape.ngroups, dtype=_torch_dtype(shape.act_dtype))
    elif hasattr(shape, "num_v_heads"):  # GDNShape
        fields.update(num_v_heads=shape.num_v_heads, head_v_dim=shape.head_v_dim,
                      head_k_dim=shape.head_k_dim, num_k_heads=shape.num_k_heads,
                      keep_v_beta=shape.keep_v_beta, dtype=_torch_dtype(shape.act_dtype))
    return SimpleNamespace(**fields)


def compile_draft_variant(layer: str, variant: DraftVariant):
    """Build one of `draft_variants` into the compile cache (or load it); returns the kernel."""
    from . import kernels_host

    s = variant.shape
    if variant.kind == "decode":
        return compile_variant(layer, s, variant.config)
    if variant.kind == "verify" and layer == "gdn":
        return kernels_host.gdn_verify_kernel(
            _cache_like(s), variant.num_drafts, _torch_dtype(s.gate_dtype), _torch_dtype(s.A_log_dtype),
            _torch_dtype(s.dt_bias_dtype), s.scale or None, 1, variant.config)
    if variant.kind == "verify":
        return kernels_host.mamba2_verify_kernel(
            _cache_like(s), variant.num_drafts, _torch_dtype(s.dt_dtype), s.has_D, s.has_z,
            s.has_dt_bias, s.dt_softplus, 1, variant.config)
    if variant.kind == "commit":
        return kernels_host.commit_kernel(_cache_like(s), variant.num_drafts)
    raise ValueError(f"unknown kernel kind {variant.kind!r}")


def _write_ptx(build, path: Path) -> None:
    """build(options) compiles with the given options; its PTX goes to `path`."""
    import shlex
    import tempfile

    from .compile_cache import compile_options

    # --keep-ptx also writes a copy into the DSL's dump dir (by default the current directory);
    # a scratch folder keeps that from littering wherever precompile was started.
    with tempfile.TemporaryDirectory(prefix="replayssm_cute_ptx_") as scratch:
        options = compile_options("--keep-ptx", f"--dump-dir {shlex.quote(scratch)}")
        Path(path).write_text(build(options).__ptx__)


def dump_ptx(layer: str, shape, config, path: Path) -> None:
    """Compile one variant once more with --keep-ptx and write its PTX to `path`."""
    import importlib

    module = importlib.import_module(f"{__package__}.kernels.{layer}.decode")
    _write_ptx(lambda options: module.compile_decode(shape, config, options), path)


def dump_draft_ptx(layer: str, variant: DraftVariant, path: Path) -> None:
    """Compile one of `draft_variants` once more with --keep-ptx and write its PTX to `path`."""
    import importlib

    if variant.kind == "decode":
        return dump_ptx(layer, variant.shape, variant.config, path)
    if variant.kind == "verify":
        module = importlib.import_module(f"{__package__}.kernels.{layer}.verify")
        return _write_ptx(lambda options: module.compile_verify(
            variant.shape, variant.config, variant.num_drafts, options), path)
    if variant.kind == "commit":
        from .kernels.commit import compile_commit

        return _write_ptx(lambda options: compile_commit(variant.shape, options), path)
    raise ValueError(f"unknown kernel kind {variant.kind!r}")


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
    parser.add_argument("--drafts", metavar="T1,T2,...",
                        help="also the speculative kernels for these draft counts (default: none): "
                             "decode and verify on a cache of max_draft = max(T), and commit")
    parser.add_argument("--read-copies", metavar="F1,F2,...", default="",
                        help=f"also the decode kernels of caches with these read copies ({', '.join(READ_COPIES)})")
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
    read_copies = [r.strip() for r in args.read_copies.split(",") if r.strip()]
    for r in read_copies:
        if r not in READ_COPIES:
            parser.error(f"--read-copies: unknown read copy {r!r}; use {', '.join(READ_COPIES)}")
    if not 2 <= args.window <= 32:
        parser.error("--window must be in 2..32 (window 1 is the conventional kernel, always built; "
                     "the kernel keeps one record per lane)")
    drafts = None
    if args.drafts is not None:
        drafts, reason = parse_drafts(args.drafts)
        if reason is not None:
            parser.error(reason)
    reason = _option_error(model, args.with_z, args.window, drafts)
    if reason is not None:
        parser.error(reason)
    if args.arch:
        if "cutlass" in sys.modules and os.environ.get("CUTE_DSL_ARCH") != args.arch:
            raise RuntimeError("--arch must be chosen before cutlass is imported")
        os.environ["CUTE_DSL_ARCH"] = args.arch

    from .compile_cache import target_arch

    arch = target_arch()
    layer = model.layer
    jobs = [(label, lambda s=shape, c=cfg: compile_variant(layer, s, c),
             lambda path, s=shape, c=cfg: dump_ptx(layer, s, c, path))
            for label, shape, cfg in variants(model, args.window, dtypes, with_z=args.with_z)
            + read_copy_variants(model, args.window, dtypes, read_copies)]
    if drafts is not None:
        try:
            spec = [v for r in [None] + read_copies
                    for v in draft_variants(model, args.window, drafts, dtypes, with_z=args.with_z, read_copy=r)]
        except ValueError as e:
            parser.error(str(e))
        jobs += [(v.label, lambda v=v: compile_draft_variant(layer, v),
                  lambda path, v=v: dump_draft_ptx(layer, v, path)) for v in spec]
    print(f"precompile {model.name} for {arch}: {len(jobs)} kernels")
    if args.dump_ptx:
        Path(args.dump_ptx).mkdir(parents=True, exist_ok=True)
    for label, build, ptx in jobs:
        t0 = time.perf_counter()
        build()
        line = f"  {label:44s} {time.perf_counter() - t0:6.1f} s"
        if args.dump_ptx:
            path = Path(args.dump_ptx) / f"{label}.{arch}.ptx"
            ptx(path)
            line += f"  -> {path}"
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
