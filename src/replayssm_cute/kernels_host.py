"""Host side of the kernels: torch -> CuTe dtypes, launch configs (analytical defaults, or the tuned
ones of replayssm_cute.tuning), compiled-kernel lookup.

Kept apart from api.py so that importing the package never imports cutlass; only the first CUDA
call (or precompile) does.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from .tuning import batch_bucket, tuned_fields

_CUTE_DTYPE_NAMES = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32"}
_fast: dict = {}


def cute_dtype(dtype: torch.dtype):
    import cutlass

    return getattr(cutlass, _CUTE_DTYPE_NAMES[dtype])


def default_mamba2_config(headdim: int, batch: int, window: int, whole_head: bool = False, shape=None):
    """What the autotuner finds on the H200 (tuned/h200.json, every batch bucket of four Mamba-2
    shapes), for shapes it has not tuned. ReplaySSM: the whole head in one CTA of 4 warps (16-20
    rows each, one ring walk per head) with registers capped for 4 CTAs per SM, half the head at
    batch 1 (1.3-1.5x over the 16-row tiles of the old default at batch 2-16). Conventional: 8-row
    tiles over 2 warps (1-3% over larger tiles at every batch). ``whole_head``: a CTA per head
    (the writer of an nvfp4 copy needs the whole state's amax). With `shape` of an fp16 / fp8
    read copy at larger batch: a head per CTA in 32-row warps, registers capped for 8 CTAs per
    SM (sweeps/bench_read_precision.py: 1.07x over (64, 4) for fp16 at batch 256), nvfp4 alike.
    With `shape`, the first choice its check takes."""
    from .kernels.mamba2.decode import Mamba2Config

    def takes(cfg):
        return headdim % cfg.rows_per_cta == 0 and cfg.rows_per_cta % cfg.num_warps == 0 and (
            shape is None or cfg.check(shape) is None)

    if shape is not None and shape.read_copy is not None and batch > 16 and headdim % 32 == 0:
        light = Mamba2Config(rows_per_cta=headdim, num_warps=headdim // 32, min_ctas_per_sm=8)
        if light.check(shape) is None:
            return light
    if whole_head:
        return Mamba2Config(rows_per_cta=headdim, num_warps=4 if headdim % 4 == 0 else 1)
    if window > 1:
        rows = headdim // 2 if batch == 1 and headdim % 8 == 0 else headdim
        choices = [Mamba2Config(rows, 4, 4), Mamba2Config(64, 4), Mamba2Config(32, 2)]
    else:
        choices = [Mamba2Config(8, 2), Mamba2Config(16, 4)]
    for cfg in choices:
        if takes(cfg):
            return cfg
    return Mamba2Config(rows_per_cta=16, num_warps=4)


def mamba2_shape(nheads, headdim, dstate, ngroups, window, capacity, act_dtype, dt_dtype,
                 has_D, has_z, has_dt_bias, dt_softplus, pad_slot_id, checkpoint_format="fp32", read_copy=None):
    from .kernels.mamba2.decode import Mamba2Shape

    return Mamba2Shape(nheads, headdim, dstate, ngroups, window, capacity, cute_dtype(act_dtype),
                       cute_dtype(dt_dtype), has_D, has_z, has_dt_bias, dt_softplus, pad_slot_id,
                       checkpoint_format, read_copy)


def state_copy_args(cache) -> tuple:
    """The kernels' trailing state-copy arguments of ``cache`` (kernels/state_io.py): checkpoint
    scale and state scale, read copy data, scale and state scale, SR seed and counter (None where
    the configuration has none); fp8 / E4M3 codes as uint8 views."""
    def codes(t):
        return t.view(torch.uint8) if t is not None and t.dtype == torch.float8_e4m3fn else t

    return (codes(getattr(cache, "checkpoint_scale", None)), getattr(cache, "checkpoint_state_scale", None),
            codes(cache.read_copy), codes(getattr(cache, "read_copy_scale", None)),
            getattr(cache, "read_copy_state_scale", None), cache.sr_seed, cache.sr_counter)


def checkpoint_arg(cache) -> torch.Tensor:
    """The checkpoint as the kernels take it (fp8 codes as uint8)."""
    t = cache.checkpoint
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _compiled(name, key, build):
    """Compiled kernel for a tensor-free key from the memory / disk cache; `build(options)`
    compiles it on a miss."""
    from .compile_cache import compile_options, get_compiled

    return get_compiled(name, key, lambda: build(compile_options()))


def _cached_kernel(op, fast_key, config, make_shape, default_config, check, compile_fn, tuned_as=None):
    """The callable memoised on `fast_key`; on a miss: the static shape, then `config`, else the
    tuned config of `tuned_as` = (kernel, num_drafts, batch bucket) if there is one the shape
    takes (``_tuned_or_default``), else the default for it; its check (errors name `op` and the
    argument at fault), then compile."""
    kernel = _fast.get(fast_key)
    if kernel is None:
        shape = make_shape()
        cfg = config
        if cfg is None:
            cfg = default_config(shape)
            if tuned_as is not None:
                cfg = _tuned_or_default(cfg, shape, check, *tuned_as)
        reason = check(shape, cfg)
        if reason is not None:
            arg = "config" if config is not None else "cache"
            raise ValueError(f"{op}: argument '{arg}': the GPU kernel cannot take it: {reason}")
        kernel = _fast[fast_key] = compile_fn(shape, cfg)
    return kernel


def _tuned_or_default(default, shape, check, kernel, num_drafts, bucket):
    """The tuned launch config of `kernel` for `shape`, T = `num_drafts` and this batch bucket
    (replayssm_cute.tuning) if one is cached and passes `check`, else `default`."""
    fields = tuned_fields(kernel, shape, num_drafts, bucket)
    if fields is None:
        return default
    try:
        tuned = dataclasses.replace(default, **fields)
    except TypeError:  # a field this version's config class does not have (a stale file)
        return default
    try:
        reason = check(shape, tuned)
    except Exception as e:  # a check that fails on a file's values must not fail the decode too
        warnings.warn(f"tuned configs: ignoring the tuned config {tuned} of {kernel}: {type(e).__name__}: {e}",
                      RuntimeWarning, stacklevel=2)
        return default
    return tuned if reason is None else default


def forget_picked_configs() -> None:
    """Drop the memoised kernels so that the next calls pick their configs again (after the
    tuned configs changed); the compiled kernels stay in the compile cache."""
    _fast.clear()


def compile_mamba2(shape, config):
    """Compiled kernel for (shape, config) from the memory / disk cache, building it on a miss."""
    from .kernels.mamba2.decode import compile_decode

    return _compiled("mamba2_decode", shape.key() + config.key(),
                     lambda options: compile_decode(shape, config, options))


def _mamba2_cache_shape(cache, dt_dtype, has_D, has_z, has_dt_bias, dt_softplus, window=None, capacity=None):
    return mamba2_shape(cache.nheads, cache.headdim, cache.dstate, cache.ngroups,
                        cache.window if window is None else window,
                        cache.capacity if capacity is None else capacity, cache.dtype, dt_dtype, has_D,
                        has_z, has_dt_bias, dt_softplus, cache.pad_slot_id, cache.checkpoint_format,
                        cache.read_copy_format)


def _whole_head(cache) -> bool:
    return "nvfp4" in (cache.checkpoint_format, cache.read_copy_format)


def _launch_choice(kernel: str, cache, inputs: tuple, num_drafts: int, bucket: int):
    """(make_shape, default_config, check) of `kernel` (a tuning.KERNELS name) on `cache`: the
    static shape from the call's `inputs` (Mamba-2: dt_dtype, has_D, has_z, has_dt_bias,
    dt_softplus; GDN: gate_dtype, A_log_dtype, dt_bias_dtype, scale), the analytical default at
    batch bucket `bucket` for a shape, and the kernel's check of (shape, config) with T =
    `num_drafts`. One place for the choice that the kernel lookups and ``picked_config`` make."""
    layer, step = kernel.split("_")
    whole_head = _whole_head(cache)
    if layer == "mamba2":
        def make_shape():
            return _mamba2_cache_shape(cache, *inputs)
        if step == "decode":
            def default_config(shape):
                return default_mamba2_config(cache.headdim, bucket, cache.window, whole_head, shape)
        else:
            def default_config(shape):
                return default_mamba2_verify_config(cache.headdim, bucket, whole_head)
    else:
        def make_shape():
            return _gdn_cache_shape(cache, *inputs)
        if step == "decode":
            def default_config(shape):
                return default_gdn_config(cache.head_v_dim, bucket, cache.window, shape, whole_head)
        else:
            def default_config(shape):
                return default_gdn_verify_config(cache.head_v_dim, bucket, whole_head)
    if step == "decode":
        def check(shape, cfg):
            return cfg.check(shape)
    else:
        if layer == "mamba2":
            from .kernels.mamba2.verify import Mamba2Verify as Verify
        else:
            from .kernels.gdn.verify import GDNVerify as Verify

        def check(shape, cfg):
            return Verify.check(shape, cfg, num_drafts)
    return make_shape, default_config, check


def mamba2_decode_kernel(cache, dt_dtype, has_D, has_z, has_dt_bias, dt_softplus, batch, config=None):
    """The callable for one decode step of `cache` (memoised on a tensor-free tuple)."""
    bucket = batch_bucket(batch)
    fast_key = (cache.nheads, cache.headdim, cache.dstate, cache.ngroups, cache.window,
                cache.capacity, cache.dtype, dt_dtype, has_D, has_z, has_dt_bias, dt_softplus,
                cache.pad_slot_id, cache.checkpoint_format, cache.read_copy_format, bucket, config)
    inputs = (dt_dtype, has_D, has_z, has_dt_bias, dt_softplus)
    return _cached_kernel(
        "decode", fast_key, config, *_launch_choice("mamba2_decode", cache, inputs, 0, bucket),
        lambda shape, cfg: compile_mamba2(shape, cfg),
        ("mamba2_decode", 0, bucket))


def default_gdn_config(head_v_dim: int, batch: int, window: int, shape=None, whole_head: bool = False):
    """What the autotuner finds on the H200 (tuned/h200.json, every batch bucket of two GDN
    shapes), for shapes it has not tuned. ReplaySSM: 64-row tiles over 4 warps at batch <= 16
    (1.5-1.7x over the 16-row tiles of the old default), the whole head over 8 warps above (one
    ring walk per head). Conventional: 8-row tiles over 2 warps (1-2% over larger tiles). With
    `shape`, the first choice that fits it (shared memory for large K). ``whole_head``: a CTA per
    head (the writer of an nvfp4 copy needs the whole state's amax), 16 rows per warp; also the
    best measured for fp16 / fp8 read copies at larger batch (sweeps/bench_read_precision.py,
    batch 256)."""
    from .kernels.gdn.decode import GDNConfig

    if shape is not None and shape.read_copy is not None and batch > 16 and head_v_dim % 16 == 0:
        whole_head = GDNConfig(rows_per_cta=head_v_dim, num_warps=head_v_dim // 16).check(shape) is None
    if whole_head:
        return GDNConfig(rows_per_cta=head_v_dim, num_warps=max(1, head_v_dim // 16))
    if window == 1:
        choices = [(8, 2, 0), (16, 2, 0)]
    elif batch <= 16:
        choices = [(64, 4, 0), (32, 2, 0), (16, 2, 0)]
    else:
        choices = [(128, 8, 0), (64, 4, 6), (32, 2, 0), (16, 2, 0)]
    for rows, warps, ctas in choices:
        if head_v_dim % rows == 0:
            cfg = GDNConfig(rows_per_cta=rows, num_warps=warps, min_ctas_per_sm=ctas)
            if shape is None or cfg.check(shape) is None:
                return cfg
    return GDNConfig(rows_per_cta=16, num_warps=1)


def gdn_shape(num_v_heads, head_v_dim, head_k_dim, num_k_heads, window, capacity, act_dtype,
              gate_dtype, A_log_dtype, dt_bias_dtype, scale, keep_v_beta, pad_slot_id, checkpoint_format="fp32",
              read_copy=None, rederive=False):
    from .kernels.gdn.decode import GDNShape

    return GDNShape(num_v_heads, head_v_dim, head_k_dim, num_k_heads, window, capacity,
                    cute_dtype(act_dtype), cute_dtype(gate_dtype), cute_dtype(A_log_dtype),
                    cute_dtype(dt_bias_dtype), float(scale or 0.0), keep_v_beta, pad_slot_id,
                    checkpoint_format, read_copy, rederive)


def compile_gdn(shape, config):
    """Compiled GDN kernel for (shape, config) from the memory / disk cache, building it on a miss."""
    from .kernels.gdn.decode import compile_decode

    return _compiled("gdn_decode", shape.key() + config.key(),
                     lambda options: compile_decode(shape, config, options))


def _gdn_cache_shape(cache, gate_dtype, A_log_dtype, dt_bias_dtype, scale, window=None, capacity=None):
    return gdn_shape(cache.num_v_heads, cache.head_v_dim, cache.head_k_dim, cache.num_k_heads,
                     cache.window if window is None else window,
                     cache.capacity if capacity is None else capacity, cache.dtype, gate_dtype,
                     A_log_dtype, dt_bias_dtype, scale, cache.keep_v_beta, cache.pad_slot_id,
                     cache.checkpoint_format, cache.read_copy_format, _rederives(cache))


def _rederives(cache) -> bool:
    return cache.window > 1 and getattr(cache, "flush_corrections", "fold") == "rederive"


def gdn_decode_kernel(cache, gate_dtype, A_log_dtype, dt_bias_dtype, scale, batch, config=None):
    """The callable for one GDN decode step of `cache` (memoised on a tensor-free tuple)."""
    bucket = batch_bucket(batch)
    fast_key = ("gdn", cache.num_v_heads, cache.head_v_dim, cache.head_k_dim, cache.num_k_heads,
                cache.window, cache.capacity, cache.dtype, gate_dtype, A_log_dtype, dt_bias_dtype,
                scale, cache.keep_v_beta, cache.pad_slot_id, cache.checkpoint_format, cache.read_copy_format,
                _rederives(cache), bucket, config)
    inputs = (gate_dtype, A_log_dtype, dt_bias_dtype, scale)
    return _cached_kernel(
        "decode", fast_key, config, *_launch_choice("gdn_decode", cache, inputs, 0, bucket),
        lambda shape, cfg: compile_gdn(shape, cfg),
        ("gdn_decode", 0, bucket))


def mamba2_verify_kernel(cache, num_drafts, dt_dtype, has_D, has_z, has_dt_bias, dt_softplus, batch, config=None):
    """The callable for one verify step of `num_drafts` drafts on a Mamba-2 `cache` (memoised)."""
    from .kernels.mamba2.verify import compile_verify

    bucket = batch_bucket(batch)
    fast_key = ("mamba2_verify", num_drafts, cache.nheads, cache.headdim, cache.dstate, cache.ngroups,
                cache.window, cache.capacity, cache.dtype, dt_dtype, has_D, has_z, has_dt_bias,
                dt_softplus, cache.pad_slot_id, cache.checkpoint_format, cache.read_copy_format, bucket, config)
    inputs = (dt_dtype, has_D, has_z, has_dt_bias, dt_softplus)
    return _cached_kernel(
        "verify", fast_key, config, *_launch_choice("mamba2_verify", cache, inputs, num_drafts, bucket),
        lambda shape, cfg: _compiled("mamba2_verify", shape.key() + cfg.key() + (num_drafts,),
                                     lambda options: compile_verify(shape, cfg, num_drafts, options)),
        ("mamba2_verify", num_drafts, bucket))


def default_mamba2_verify_config(headdim: int, batch: int, whole_head: bool = False):
    """Verify tiles 16 rows per warp (the MMA's M): one warp per CTA at batch <= 2, where more
    CTAs per row hide latency, else the whole head (up to 4 warps) so the per-CTA dot GEMM and
    staging are shared by more rows (tuned on the H200, Nemotron-3-Super T = 4 and 8: 1.1-1.25x
    over one-warp CTAs at batch 4-16). ``whole_head``: a CTA per head at any batch (an nvfp4
    copy's writer)."""
    from .kernels.mamba2.decode import Mamba2Config

    if whole_head:
        return Mamba2Config(rows_per_cta=headdim, num_warps=headdim // 16)
    if batch > 2:
        for rows in (64, 32):
            if headdim % rows == 0:
                return Mamba2Config(rows_per_cta=rows, num_warps=rows // 16)
    return Mamba2Config(rows_per_cta=16, num_warps=1)


def commit_kernel(cache, num_drafts):
    """The callable of the commit step after a verify of `num_drafts` drafts (memoised)."""
    from .kernels.commit import CommitShape, compile_commit

    stochastic = cache.sr_counter is not None
    fast_key = ("commit", cache.window, cache.capacity, num_drafts, cache.pad_slot_id, stochastic)
    kernel = _fast.get(fast_key)
    if kernel is None:
        shape = CommitShape(cache.window, cache.capacity, num_drafts, cache.pad_slot_id, stochastic)
        kernel = _fast[fast_key] = _compiled("commit", shape.key(), lambda options: compile_commit(shape, options))
    return kernel


def gdn_verify_kernel(cache, num_drafts, gate_dtype, A_log_dtype, dt_bias_dtype, scale, batch, config=None):
    """The callable for one verify step of `num_drafts` drafts on a GDN `cache` (memoised)."""
    from .kernels.gdn.verify import compile_verify

    bucket = batch_bucket(batch)
    fast_key = ("gdn_verify", num_drafts, cache.num_v_heads, cache.head_v_dim, cache.head_k_dim,
                cache.num_k_heads, cache.window, cache.capacity, cache.dtype, gate_dtype, A_log_dtype,
                dt_bias_dtype, scale, cache.keep_v_beta, cache.pad_slot_id, cache.checkpoint_format,
                cache.read_copy_format, _rederives(cache), bucket, config)
    inputs = (gate_dtype, A_log_dtype, dt_bias_dtype, scale)
    return _cached_kernel(
        "verify", fast_key, config, *_launch_choice("gdn_verify", cache, inputs, num_drafts, bucket),
        lambda shape, cfg: _compiled("gdn_verify", shape.key() + cfg.key() + (num_drafts,),
                                     lambda options: compile_verify(shape, cfg, num_drafts, options)),
        ("gdn_verify", num_drafts, bucket))


def default_gdn_verify_config(head_v_dim: int, batch: int, whole_head: bool = False):
    """As ``default_mamba2_verify_config``: 16 rows per warp, one warp per CTA at small batch,
    else the whole head in one CTA where it fits in 8 warps (one dot GEMM and one staging per
    head: 1.16-1.18x faster than 64-row tiles at Qwen3.5-122B, batch 256, T = 4 and 8), and at any
    batch for an nvfp4 copy's writer."""
    from .kernels.gdn.decode import GDNConfig

    if whole_head:
        return GDNConfig(rows_per_cta=head_v_dim, num_warps=head_v_dim // 16)
    if batch > 16:
        for rows in (128, 64, 32):
            if head_v_dim % rows == 0:
                return GDNConfig(rows_per_cta=rows, num_warps=rows // 16)
    return GDNConfig(rows_per_cta=16, num_warps=1)


def mamba2_snapshot_kernel(cache, num_drafts, dt_dtype, has_D, has_z, has_dt_bias, dt_softplus, batch, config=None):
    """The callable of the conventional speculative baseline (state snapshot per draft) on a
    conventional Mamba-2 `cache` (memoised)."""
    from .kernels.mamba2.decode import Mamba2Config
    from .kernels.mamba2.snapshot import Mamba2Snapshot, compile_snapshot

    fast_key = ("mamba2_snapshot", num_drafts, cache.nheads, cache.headdim, cache.dstate, cache.ngroups,
                cache.dtype, dt_dtype, has_D, has_z, has_dt_bias, dt_softplus, cache.pad_slot_id,
                batch <= 16, config)
    return _cached_kernel(
        "snapshot_verify", fast_key, config,
        lambda: _mamba2_cache_shape(cache, dt_dtype, has_D, has_z, has_dt_bias, dt_softplus, window=1, capacity=1),
        # at most 8 rows per warp: a warp keeps its rows in registers
        lambda shape: Mamba2Config(16, 4) if batch <= 16 or cache.headdim % 32 else Mamba2Config(32, 4),
        lambda shape, cfg: Mamba2Snapshot.check(shape, cfg, num_drafts),
        lambda shape, cfg: _compiled("mamba2_snapshot", shape.key() + cfg.key() + (num_drafts,),
                                     lambda options: compile_snapshot(shape, cfg, num_drafts, options)))


def gdn_snapshot_kernel(cache, num_drafts, gate_dtype, A_log_dtype, dt_bias_dtype, scale, batch, config=None):
    """The callable of the conventional speculative baseline (state snapshot per draft) on a
    conventional GDN `cache` (memoised)."""
    from .kernels.gdn.snapshot import GDNSnapshot, compile_snapshot

    fast_key = ("gdn_snapshot", num_drafts, cache.num_v_heads, cache.head_v_dim, cache.head_k_dim,
                cache.num_k_heads, cache.dtype, gate_dtype, A_log_dtype, dt_bias_dtype, scale,
                cache.pad_slot_id, batch <= 16, config)
    return _cached_kernel(
        "snapshot_verify", fast_key, config,
        lambda: _gdn_cache_shape(cache, gate_dtype, A_log_dtype, dt_bias_dtype, scale, window=1, capacity=1),
        lambda shape: default_gdn_snapshot_config(cache.head_v_dim, batch),
        lambda shape, cfg: GDNSnapshot.check(shape, cfg, num_drafts),
        lambda shape, cfg: _compiled("gdn_snapshot", shape.key() + cfg.key() + (num_drafts,),
                                     lambda options: compile_snapshot(shape, cfg, num_drafts, options)))


def default_gdn_snapshot_config(head_v_dim: int, batch: int):
    """At most 8 rows per warp (a warp keeps its rows in registers across the drafts): 16-row
    tiles at batch <= 16, where more CTAs per row hide latency, else 32-row tiles where they
    divide head_v_dim."""
    from .kernels.gdn.decode import GDNConfig

    return GDNConfig(16, 4) if batch <= 16 or head_v_dim % 32 else GDNConfig(32, 4)


def picked_config(kernel: str, cache, batch: int, *inputs, num_drafts: int = 0):
    """(config, tuned): the launch config that ``kernel`` runs with for `cache` at `batch` when
    the caller passes no ``config``, and whether it is a tuned one (replayssm_cute.tuning: the
    shipped H200 file or the user's file) rather than the analytical default. The same choice as
    the ``*_kernel`` functions above make, without compiling anything (it imports cutlass).

    kernel: "mamba2_decode", "gdn_decode", "mamba2_verify" or "gdn_verify"; `inputs` are the
    arguments that its ``*_kernel`` function takes between the cache (or num_drafts) and the batch:
    Mamba-2 (dt_dtype, has_D, has_z, has_dt_bias, dt_softplus), GDN (gate_dtype, A_log_dtype,
    dt_bias_dtype, scale). `num_drafts`: T for verify.
    """
    if kernel not in ("mamba2_decode", "gdn_decode", "mamba2_verify", "gdn_verify"):
        raise ValueError(f"picked_config: argument 'kernel': expected mamba2_decode, gdn_decode, "
                         f"mamba2_verify or gdn_verify, got {kernel!r}")
    if kernel.endswith("_decode"):
        num_drafts = 0
    bucket = batch_bucket(batch)
    make_shape, default_config, check = _launch_choice(kernel, cache, inputs, num_drafts, bucket)
    shape = make_shape()
    default = default_config(shape)
    picked = _tuned_or_default(default, shape, check, kernel, num_drafts, bucket)
    return picked, picked is not default
