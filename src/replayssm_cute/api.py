"""Public decode entry point: validation, then the CuTe DSL kernels (CUDA) or the reference (CPU).

``decode(cache, ...)`` dispatches on the cache type. Mamba-2 arguments follow vLLM's
``selective_state_update``: ``x (b, H, P)``, ``dt`` raw
``(b, H)`` or its stride-0 expansion ``(b, H, P)``, ``A (H,)`` or ``(H, P, N)`` with strides
``(s, 0, 0)``, ``B, C (b, G, N)``, ``D`` / ``dt_bias`` ``(H,)`` or ``(H, P)`` with stride 0 on P,
optional ``z (b, H, P)``, ``dt_softplus``, optional ``out``. Each row names its pool slot in
``slot_ids (b,)`` int32; rows whose slot is the cache's pad sentinel, or outside the pool, touch
nothing: their rows of a caller's ``out`` are left as they were, and are zero in an ``out`` the
call allocates (``torch.zeros``: one memset, captured with the step in a CUDA graph).

Gated DeltaNet arguments follow vLLM's / FlashInfer's GDN decode: raw ``q, k (b, H, K)``,
``v (b, HV, V)`` (or the packed post-convolution ``mixed_qkv (b, 2 H K + HV V)`` = ``[q | k | v]``
with any row stride), raw gates ``a, b (b, HV)``, ``A_log, dt_bias (HV,)``, optional ``scale``
(default ``K ** -0.5``); the kernel L2-normalises q and k and forms the gates itself.

Everything is checked before anything is written; nothing is cast behind the caller's back.
``config`` is None or the layer's launch config (``Mamba2Config`` / ``GDNConfig``), on the CPU
path too, where the reference has no launch config and does not use it. The steps are
inference-only: while autograd records (``torch.is_grad_enabled()``), an input that requires
grad is refused, since the CPU path would pull the cache into the autograd graph; call them
under ``torch.no_grad()`` / ``torch.inference_mode()`` (then parameters that require grad are
fine) or pass detached tensors.

Speculative protocol: verify, then commit, then anything else. Between a ``verify`` and its
``commit`` every other op on that cache is refused (``Mamba2Cache`` / ``GDNCache``), and the
commit must name the verify's slot ids row for row: the CPU path checks the ids, the GPU path
the batch size only (no device->host read), ``REPLAYSSM_CUTE_DEBUG=1`` the ids too.

Set ``REPLAYSSM_CUTE_DEBUG=1`` to also check slot ids on the host (range and duplicates, and
commit's against its verify's) and the ``cu_seqlens`` of verify's packed form, which
synchronises, so it is off by default and is skipped under CUDA-graph capture.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .cache import GDNCache, Mamba2Cache, PendingVerify

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"decode: argument '{name}': expected {expected}, got {got}")


def _no_autograd(name: str, t: torch.Tensor) -> None:
    """The steps are inference-only: refuse a tensor that requires grad while autograd records
    (the CPU path would pull the cache into the graph)."""
    if t.requires_grad and torch.is_grad_enabled():
        _fail(name, f"a tensor outside autograd (the kernels are inference-only: call under torch.no_grad() or "
              f"torch.inference_mode(), or pass {name}.detach())", "requires_grad=True with grad mode on")


def _per_head(name: str, t: Optional[torch.Tensor], H: int, trailing: tuple, device) -> Optional[torch.Tensor]:
    """Accept (H,) or a stride-0 expansion (H, *trailing); return the (H,) fp32 view."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__)
    _no_autograd(name, t)
    if t.dtype != torch.float32:
        _fail(name, "dtype torch.float32", t.dtype)
    if t.device != device:
        _fail(name, f"a tensor on {device}", t.device)
    if t.dim() > 1:
        if tuple(t.shape) != (H,) + trailing or any(st != 0 for st in t.stride()[1:]):
            _fail(name, f"shape ({H},) or a stride-0 expansion of shape {(H,) + trailing}",
                  f"shape {tuple(t.shape)} strides {t.stride()}")
        t = t[(slice(None),) + (0,) * len(trailing)]
    if tuple(t.shape) != (H,):
        _fail(name, f"shape ({H},)", tuple(t.shape))
    if H > 1 and t.stride(0) != 1:
        _fail(name, "one value per head, packed (head stride 1)", f"strides {t.stride()}")
    return t


def _activation(name: str, t: torch.Tensor, shape: tuple, dtype, device, aligned: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(name, "a torch.Tensor", type(t).__name__)
    _no_autograd(name, t)
    if tuple(t.shape) != shape:
        _fail(name, f"shape {shape}", tuple(t.shape))
    if t.dtype != dtype:
        _fail(name, f"dtype {dtype} (the cache's activation dtype; no implicit casts)", t.dtype)
    if t.device != device:
        _fail(name, f"a tensor on {device}", t.device)
    # The kernels take any batch stride but need the inner dims packed.
    inner = [1]
    for d in reversed(shape[2:]):
        inner.insert(0, inner[0] * d)
    if shape[0] > 0 and tuple(t.stride()[1:]) != tuple(inner[-(len(shape) - 1):]) and t.numel() > 0:
        _fail(name, f"inner dims contiguous (strides (*, {', '.join(map(str, inner[-(len(shape) - 1):]))}))",
              f"strides {t.stride()}")
    # Rows load as 16-byte vectors on the GPU: base and batch stride must be 16-byte aligned.
    if aligned and device.type == "cuda" and (t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16):
        _fail(name, "a 16-byte aligned base address and batch stride",
              f"address {t.data_ptr():#x}, batch stride {t.stride(0)} elements")
    return t


def _check_slots(cache, slot_ids: torch.Tensor) -> None:
    """Debug mode: host-side slot checks (synchronises)."""
    ids = slot_ids.tolist()
    live = [s for s in ids if s != cache.pad_slot_id]
    bad = [s for s in live if not 0 <= s < cache.num_slots or (cache.pad_slot_id == 0 and s == 0)]
    if bad:
        raise IndexError(f"decode: slot_ids {bad[:8]} outside the pool of {cache.num_slots} slots "
                         f"(pad sentinel {cache.pad_slot_id})")
    if len(set(live)) != len(live):
        raise ValueError("decode: slot_ids name the same slot twice in one step")


def debug_enabled() -> bool:
    return os.environ.get("REPLAYSSM_CUTE_DEBUG", "0") not in ("", "0")


def _debug_host_checks(device) -> bool:
    """Debug mode's host-side checks run now: debug on and no CUDA graph being captured (they
    read device tensors back, which synchronises)."""
    return debug_enabled() and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _check_config(cache, config) -> None:
    """``config`` is None or the launch config class of the cache's layer, on every path (the CPU
    reference has no launch config and ignores a valid one). Imports the kernels' module, and
    with it cutlass, only when a config is given."""
    if config is None:
        return
    if isinstance(cache, Mamba2Cache):
        from .kernels.mamba2.decode import Mamba2Config as launch_config
    else:
        from .kernels.gdn.decode import GDNConfig as launch_config
    if not isinstance(config, launch_config):
        _fail("config", f"None or a {launch_config.__name__} (the launch config of the {type(cache).__name__}'s "
              f"GPU kernels)", f"{type(config).__name__} {config!r}")


def _dispatch(op: str, cache, mamba2_fn, gdn_fn, args, kwargs):
    """``op`` on ``cache``: its Mamba-2 or GDN implementation, once no verify awaits its commit
    there (the protocol: verify, then commit, then anything else) and ``config`` (keyword-only
    in every op) is None or the layer's launch config."""
    if isinstance(cache, Mamba2Cache):
        fn = mamba2_fn
    elif isinstance(cache, GDNCache):
        fn = gdn_fn
    else:
        raise TypeError(f"{op}: argument 'cache': expected a Mamba2Cache or a GDNCache, got {type(cache).__name__}")
    cache._refuse_while_verify_pending(op)
    _check_config(cache, kwargs.get("config"))
    return _named(op, fn, cache, *args, **kwargs)


def decode(cache, *args, **kwargs):
    """One decode step for a batch of rows; returns ``out``.

    With a :class:`Mamba2Cache`::

        decode(cache, x, dt, A, B, C, slot_ids, D=None, z=None, dt_bias=None, dt_softplus=False,
               out=None, *, config=None)  -> out (b, H, P)

    With a :class:`GDNCache`::

        decode(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, *, scale=None, out=None,
               mixed_qkv=None, config=None)  -> out (b, HV, V)

    (pass ``q = k = v = None`` and ``mixed_qkv`` for the packed layout). Window 1 is conventional
    decoding (state load, update, store), window L > 1 is ReplaySSM standard decoding. ``config``
    overrides the launch configuration (a ``Mamba2Config`` / ``GDNConfig``, anything else is
    refused; unused on the CPU path); by default the tuned one for the batch size's bucket
    (``replayssm_cute.tuning``; verify alike), else the analytical choice for it.

    Skipped rows (pad sentinel, out of pool) keep their rows of a caller's ``out`` and are zero
    in an ``out`` allocated here. Inference-only: with grad mode on, an input that requires grad
    is refused (call under ``torch.no_grad()`` / ``torch.inference_mode()``). Refused between a
    :func:`verify` and its :func:`commit`.
    """
    return _dispatch("decode", cache, _decode_mamba2, _decode_gdn, args, kwargs)


def _slot_ids(slot_ids, b: int, device) -> torch.Tensor:
    if not isinstance(slot_ids, torch.Tensor) or slot_ids.dtype != torch.int32 or tuple(slot_ids.shape) != (b,):
        _fail("slot_ids", f"an int32 tensor of shape ({b},)",
              f"{getattr(slot_ids, 'dtype', type(slot_ids).__name__)} {tuple(getattr(slot_ids, 'shape', ()))}")
    if slot_ids.device != device or not slot_ids.is_contiguous():
        _fail("slot_ids", f"a contiguous tensor on {device}", f"{slot_ids.device}, strides {slot_ids.stride()}")
    return slot_ids


def _check_device(cache, device, low_precision_kernel: bool = False) -> None:
    """A CUDA cache; a low-precision one (checkpoint_format / read_copy / flush_corrections) only
    where the op has its GPU kernel (``low_precision_kernel``)."""
    if device.type != "cuda":
        _fail("cache", "a cache on a CUDA device or the CPU", device)
    if not low_precision_kernel and not getattr(cache, "is_plain", True):
        raise NotImplementedError(
            "argument 'cache': this operation runs low-precision and two-precision caches on the CPU "
            "reference only (replayssm_cute.reference_lowprec); its GPU kernel for them is not written yet"
        )


def _mamba2_inputs(cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out, drafts: bool):
    """Validated Mamba-2 arguments; with `drafts` every token tensor has a draft axis after batch."""
    H, P, N, G = cache.nheads, cache.headdim, cache.dstate, cache.ngroups
    device = cache.checkpoint.device
    rank = 4 if drafts else 3
    if not isinstance(x, torch.Tensor) or x.dim() != rank:
        _fail("x", "a (batch, T, nheads, headdim) tensor" if drafts else "a (batch, nheads, headdim) tensor",
              getattr(x, "shape", type(x).__name__))
    lead = tuple(x.shape[:rank - 2])  # (b,) or (b, T)
    if x.dtype not in _ACT_DTYPES:
        _fail("x", f"one of {_ACT_DTYPES}", x.dtype)
    act = cache.dtype
    x = _activation("x", x, lead + (H, P), act, device)
    if not isinstance(dt, torch.Tensor):
        _fail("dt", "a torch.Tensor", type(dt).__name__)
    if dt.dim() == rank:
        if tuple(dt.shape) != lead + (H, P) or dt.stride(-1) != 0:
            _fail("dt", f"shape {lead + (H,)} or a stride-0 expansion of shape {lead + (H, P)}",
                  f"shape {tuple(dt.shape)} strides {dt.stride()}")
        dt = dt[..., 0]
    if dt.dtype not in (act, torch.float32):
        _fail("dt", f"dtype {act} or torch.float32", dt.dtype)
    dt = _activation("dt", dt, lead + (H,), dt.dtype, device, aligned=False)
    if A is None:
        _fail("A", "a tensor", None)
    A = _per_head("A", A, H, (P, N), device)
    D = _per_head("D", D, H, (P,), device)
    dt_bias = _per_head("dt_bias", dt_bias, H, (P,), device)
    B = _activation("B", B, lead + (G, N), act, device)
    C = _activation("C", C, lead + (G, N), act, device)
    if z is not None:
        z = _activation("z", z, lead + (H, P), act, device)
    slot_ids = _slot_ids(slot_ids, lead[0], device)
    if out is None:  # zeros: the rows a step skips must not come back as stale memory
        out = torch.zeros(lead + (H, P), dtype=act, device=device)
    else:
        out = _activation("out", out, lead + (H, P), act, device)
    if not isinstance(dt_softplus, bool):
        _fail("dt_softplus", "a bool", type(dt_softplus).__name__)
    if _debug_host_checks(device):
        _check_slots(cache, slot_ids)
    return x, dt, A, B, C, slot_ids, D, z, dt_bias, out


def _decode_mamba2(cache, x, dt, A, B, C, slot_ids, D=None, z=None, dt_bias=None, dt_softplus=False,
                   out=None, *, config=None):
    x, dt, A, B, C, slot_ids, D, z, dt_bias, out = _mamba2_inputs(
        cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out, drafts=False)
    b = x.shape[0]
    device = cache.checkpoint.device
    if b == 0:
        return out

    if device.type == "cpu":
        from .reference import mamba2_decode_cache_

        return mamba2_decode_cache_(cache, x, dt, A, B, C, slot_ids, D=D, z=z, dt_bias=dt_bias,
                                    dt_softplus=dt_softplus, out=out)
    _check_device(cache, device, low_precision_kernel=True)

    from .kernels_host import checkpoint_arg, mamba2_decode_kernel, state_copy_args

    kernel = mamba2_decode_kernel(cache, dt.dtype, D is not None, z is not None, dt_bias is not None,
                                  dt_softplus, b, config)
    kernel(checkpoint_arg(cache), x, dt, A, B, C, D, z, dt_bias, slot_ids, out, *_ring_args(cache),
           *state_copy_args(cache))
    return out


def _ring_args(cache, names=("ring_x", "ring_B", "ring_dt")) -> tuple:
    """The ring tensors `names`, cursor, origin and arrivals of a ReplaySSM cache; at window 1
    only arrivals, and only when SR writes need a per-slot write counter advanced."""
    if cache.window > 1:
        return tuple(getattr(cache, n) for n in names) + (cache.cursor, cache.origin, cache.arrivals)
    return (None,) * (len(names) + 2) + (cache.arrivals if cache.sr_counter is not None else None,)


def _varlen_shape(cache, slot_ids, cu_seqlens, num_drafts) -> tuple:
    """(batch, T) of a packed verify call, from tensor metadata only, so it captures in a CUDA
    graph: batch from slot_ids, cu_seqlens (batch + 1,) int32 on the cache's device, T =
    num_drafts. Debug mode also reads cu_seqlens back (synchronises) to check every row holds
    exactly T tokens."""
    device = cache.checkpoint.device
    if not isinstance(slot_ids, torch.Tensor) or slot_ids.dim() != 1:
        _fail("slot_ids", "an int32 tensor of shape (batch,)", getattr(slot_ids, "shape", type(slot_ids).__name__))
    bsz = slot_ids.shape[0]
    if not isinstance(cu_seqlens, torch.Tensor):
        _fail("cu_seqlens", f"an int32 tensor of shape ({bsz + 1},) (batch + 1) alongside num_drafts",
              type(cu_seqlens).__name__)
    if cu_seqlens.dtype != torch.int32:
        _fail("cu_seqlens", "dtype torch.int32", cu_seqlens.dtype)
    if tuple(cu_seqlens.shape) != (bsz + 1,):
        _fail("cu_seqlens", f"shape ({bsz + 1},) (batch + 1, batch = len(slot_ids))", tuple(cu_seqlens.shape))
    if cu_seqlens.device != device:
        _fail("cu_seqlens", f"a tensor on {device}", cu_seqlens.device)
    if isinstance(num_drafts, bool) or not isinstance(num_drafts, int):
        _fail("num_drafts", "a Python int (the T every row was drafted with) alongside cu_seqlens",
              type(num_drafts).__name__)
    if not 1 <= num_drafts <= min(cache.max_draft, cache.window):
        _fail("num_drafts", f"1 <= num_drafts <= min(max_draft {cache.max_draft}, window {cache.window})",
              num_drafts)
    if _debug_host_checks(device):
        bounds = cu_seqlens.tolist()
        wrong = [(i, n) for i, n in enumerate(e - s for s, e in zip(bounds, bounds[1:])) if n != num_drafts]
        if bounds[0] != 0 or wrong:
            got = f"cu_seqlens[0] = {bounds[0]}" if bounds[0] != 0 else f"row {wrong[0][0]} with {wrong[0][1]} tokens"
            _fail("cu_seqlens", f"arange(batch + 1) * {num_drafts}: every row verifies exactly num_drafts = "
                  f"{num_drafts} tokens (rows with fewer are not supported)", got)
    return bsz, num_drafts


def _unpack_tokens(name: str, t, bsz: int, T: int, optional: bool = False):
    """Zero-copy view of packed tokens (bsz * T, ...) as (bsz, T, ...): row r's tokens are packed
    rows r * T .. r * T + T - 1. The draft axis of the view must be packed, so tokens must follow
    one another with no gap; inner dims are left to the dense checks."""
    if t is None and optional:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        _fail(name, f"a packed (total_tokens, ...) tensor, total_tokens = batch * num_drafts = {bsz * T}",
              getattr(t, "shape", type(t).__name__))
    if t.shape[0] != bsz * T:
        _fail(name, f"total_tokens = batch {bsz} * num_drafts {T} = {bsz * T} packed tokens on axis 0",
              f"shape {tuple(t.shape)}")
    # One token's extent: its elements span this many, stride-0 (expanded) dims spanning none.
    token_stride = max(1, 1 + sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:])))
    if bsz * T > 1 and t.stride(0) != token_stride:
        _fail(name, f"tokens packed back to back (token stride {token_stride}; copy a column slice with "
              f".contiguous())", f"strides {t.stride()}")
    return t.as_strided((bsz, T) + tuple(t.shape[1:]), (T * token_stride, token_stride) + tuple(t.stride()[1:]),
                        t.storage_offset())


def verify(cache, *args, **kwargs):
    """Speculative verification of T draft tokens per row; returns ``out`` (b, T, ...).

    With a :class:`Mamba2Cache` (``max_draft >= T``)::

        verify(cache, x, dt, A, B, C, slot_ids, D=None, z=None, dt_bias=None, dt_softplus=False,
               out=None, *, config=None)  -> out (b, T, H, P)

    With a :class:`GDNCache`::

        verify(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, *, scale=None, out=None,
               config=None)  -> out (b, T, HV, V)

    with every token tensor laid out (b, T, ...) as decode's. Each row's T outputs come from its
    checkpoint and committed records without writing a state; the drafts' records are appended
    behind the committed ones; a row with h + T > window first folds its committed records into
    the checkpoint (one state write).

    Protocol: verify, then commit, then anything else. Follow every verify with one
    :func:`commit` of the same ``slot_ids``, row for row: between the two, a slot's cursor,
    origin and SR write counter are internal, so every other op on the cache (decode, another
    verify, load_prefill, materialize, read_state) is refused until the commit. Rows verify
    skips are zero in an ``out`` it allocates; inference-only and ``config`` as :func:`decode`.

    On a cache with low-precision state the outputs read the read copy (else the checkpoint),
    and a folding row reads the recurrence checkpoint and writes every copy from the one fp32
    result (SR checkpoint, RTN read copy; GDN re-derives the committed corrections first when
    ``flush_corrections == "rederive"``), as ``reference_lowprec.*_verify_lowprec_cache_``.

    Packed (varlen) form, as serving engines lay out drafts: pass ``cu_seqlens`` (an int32 tensor
    (b + 1,) on the cache's device) and ``num_drafts`` (the Python int T every row was drafted
    with; kernels are compiled per T) as keywords, with every token tensor and ``out`` laid out
    (total_tokens, ...), row i's tokens at cu_seqlens[i]:cu_seqlens[i + 1]; ``out`` comes back
    packed. Every row must hold exactly T tokens (cu_seqlens = arange(b + 1) * T); the tokens are
    viewed as (b, T, ...) without a copy, so they must be packed back to back (a column slice of
    a wider buffer needs ``.contiguous()``). cu_seqlens is never read on the host (CUDA-graph
    capturable): total_tokens == b * T is checked from shapes, and ``REPLAYSSM_CUTE_DEBUG=1``
    also checks cu_seqlens == arange(b + 1) * T, which synchronises.
    """
    return _dispatch("verify", cache, _verify_mamba2, _verify_gdn, args, kwargs)


def _verify_mamba2(cache, x, dt, A, B, C, slot_ids, D=None, z=None, dt_bias=None, dt_softplus=False,
                   out=None, *, config=None, cu_seqlens=None, num_drafts=None):
    if cache.max_draft < 1:
        _fail("cache", "a cache with room for drafts (max_draft >= 1)", f"max_draft {cache.max_draft}")
    packed_out = out
    if cu_seqlens is not None or num_drafts is not None:
        bsz, T = _varlen_shape(cache, slot_ids, cu_seqlens, num_drafts)
        x, dt, B, C = (_unpack_tokens(n, t, bsz, T) for n, t in (("x", x), ("dt", dt), ("B", B), ("C", C)))
        z, out = (_unpack_tokens(n, t, bsz, T, optional=True) for n, t in (("z", z), ("out", out)))
    x, dt, A, B, C, slot_ids, D, z, dt_bias, out = _mamba2_inputs(
        cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out, drafts=True)
    b, T = x.shape[:2]
    if not 1 <= T <= min(cache.max_draft, cache.window):
        _fail("x", f"1 <= T <= min(max_draft {cache.max_draft}, window {cache.window}) drafts", T)
    device = cache.checkpoint.device
    if b > 0 and device.type == "cpu":
        from .reference_spec import mamba2_verify_cache_

        mamba2_verify_cache_(cache, x, dt, A, B, C, slot_ids, D=D, z=z, dt_bias=dt_bias,
                             dt_softplus=dt_softplus, out=out)
    elif b > 0:
        _check_device(cache, device, low_precision_kernel=True)
        from .kernels_host import checkpoint_arg, mamba2_verify_kernel, state_copy_args

        kernel = mamba2_verify_kernel(cache, T, dt.dtype, D is not None, z is not None, dt_bias is not None,
                                      dt_softplus, b, config)
        kernel(checkpoint_arg(cache), x, dt, A, B, C, D, z, dt_bias, slot_ids, out, cache.ring_x, cache.ring_B,
               cache.ring_dt, cache.cursor, cache.origin, *state_copy_args(cache))
    _await_commit(cache, T, slot_ids)
    return _verify_result(out, packed_out, cu_seqlens)


def _await_commit(cache, T: int, slot_ids: torch.Tensor) -> None:
    """Record the verify step that has run for its commit: T, the batch and, on a CPU cache or
    in debug mode outside capture, its slot ids read on the host (never on the normal GPU path,
    which stays free of device->host reads)."""
    device = slot_ids.device
    host_ids = tuple(slot_ids.tolist()) if device.type == "cpu" or _debug_host_checks(device) else None
    cache.pending_verify = PendingVerify(T, slot_ids.shape[0], host_ids)


def _verify_result(out, packed_out, cu_seqlens):
    """verify's return value: the caller's packed ``out`` (or the allocated one viewed packed)
    in the packed form, else ``out`` (b, T, ...)."""
    if cu_seqlens is None:
        return out
    return packed_out if packed_out is not None else out.flatten(0, 1)


def _named(op: str, fn, *args, **kwargs):
    """Run fn; argument errors from the shared validators name `op` instead of decode."""
    try:
        return fn(*args, **kwargs)
    except ValueError as e:
        msg = str(e)
        if msg.startswith("decode: "):
            raise ValueError(f"{op}: {msg[len('decode: '):]}") from None
        raise


def commit(cache, slot_ids, num_accepted):
    """Accept the first ``num_accepted[r]`` (1..T) drafts of each row of the pending :func:`verify`.

    ``slot_ids`` must be the verify's, row for row (the same values in the same order), and
    ``num_accepted`` an int32 tensor (b,) on the device, so a verify + commit step captures in one
    CUDA graph. Rejected drafts are dropped by moving the cursor (nothing is copied); after a
    flush the origin moves past the folded records (and, with an SR checkpoint, the slot's write
    counter advances past the verify step's write). Pad rows are skipped.

    What is checked where: the batch size against the verify's everywhere (tensor metadata). The
    CPU path compares the slot ids with the verify's and refuses num_accepted outside 1..T;
    ``REPLAYSSM_CUTE_DEBUG=1`` does both on the host on the GPU path too (it synchronises; skipped
    under CUDA-graph capture). The normal GPU path reads nothing back and assumes both: the
    commit kernel moves the cursor of whichever slot each row names, so a commit naming other
    slots would advance slots never verified over stale records and leave the verified ones
    without their drafts, and a count outside 1..T would corrupt the cursor.
    """
    return _named("commit", _commit, cache, slot_ids, num_accepted)


def _commit(cache, slot_ids, num_accepted):
    if not isinstance(cache, (Mamba2Cache, GDNCache)):
        raise TypeError(f"commit: argument 'cache': expected a Mamba2Cache or a GDNCache, got {type(cache).__name__}")
    pending = cache.pending_verify
    if pending is None:
        raise ValueError("commit: argument 'cache': no verify step to commit (call verify first)")
    T, b = pending.num_drafts, pending.batch
    device = cache.checkpoint.device
    if isinstance(slot_ids, torch.Tensor) and slot_ids.dim() == 1 and slot_ids.shape[0] != b:
        _fail("slot_ids", f"the {b} slot ids of the pending verify, row for row", f"{slot_ids.shape[0]} ids")
    slot_ids = _slot_ids(slot_ids, b, device)
    if (not isinstance(num_accepted, torch.Tensor) or num_accepted.dtype != torch.int32
            or tuple(num_accepted.shape) != (b,) or num_accepted.device != device or not num_accepted.is_contiguous()):
        _fail("num_accepted", f"a contiguous int32 tensor of shape ({b},) on {device}",
              f"{getattr(num_accepted, 'dtype', type(num_accepted).__name__)} {tuple(getattr(num_accepted, 'shape', ()))}")
    host_checks = _debug_host_checks(device)
    if pending.slot_ids is not None and (device.type == "cpu" or host_checks):
        ids = tuple(slot_ids.tolist())
        if ids != pending.slot_ids:
            _fail("slot_ids", f"the slot ids of the pending verify, row for row ({_preview(pending.slot_ids)}): "
                  f"each row's num_accepted applies to the drafts that row verified", _preview(ids))
    if host_checks:
        _check_slots(cache, slot_ids)
        live = [i for i, s_ in enumerate(slot_ids.tolist()) if s_ != cache.pad_slot_id and 0 <= s_ < cache.num_slots]
        bad = [a for i, a in enumerate(num_accepted.tolist()) if i in live and not 1 <= a <= T]
        if bad:
            raise ValueError(f"commit: argument 'num_accepted': expected values in [1, {T}], got {bad[:8]}")
    if b > 0 and device.type == "cpu":
        from .reference_spec import commit_cache_

        commit_cache_(cache, slot_ids, num_accepted, num_drafts=T)
    elif b > 0:
        _check_device(cache, device, low_precision_kernel=True)
        from .kernels_host import commit_kernel

        commit_kernel(cache, T)(slot_ids, num_accepted, cache.cursor, cache.origin, cache.sr_counter)
    cache.pending_verify = None  # consumed, once the commit has run


def _preview(ids) -> str:
    """Slot ids for an error message: the first 8."""
    return str(list(ids[:8]))[:-1] + (", ...]" if len(ids) > 8 else "]")


def _gdn_param(name: str, t, HV: int, act, device) -> torch.Tensor:
    """A_log / dt_bias: (HV,) packed, fp32 or the activation dtype (read as is, in fp32)."""
    if not isinstance(t, torch.Tensor):
        _fail(name, f"a ({HV},) tensor", type(t).__name__)
    _no_autograd(name, t)
    if tuple(t.shape) != (HV,):
        _fail(name, f"shape ({HV},)", tuple(t.shape))
    if t.dtype not in (torch.float32, act):
        _fail(name, f"dtype torch.float32 or {act}", t.dtype)
    if t.device != device:
        _fail(name, f"a tensor on {device}", t.device)
    if HV > 1 and t.stride(0) != 1:
        _fail(name, "one value per head, packed (head stride 1)", f"strides {t.stride()}")
    return t


def _split_mixed_qkv(mixed_qkv, H: int, K: int, HV: int, V: int, act, device):
    """Views q (b, H, K), k (b, H, K), v (b, HV, V) into vLLM's packed [q | k | v] rows."""
    width = 2 * H * K + HV * V
    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != width:
        _fail("mixed_qkv", f"a (batch, {width}) tensor ([q | k | v] = 2 * {H} * {K} + {HV} * {V})",
              getattr(mixed_qkv, "shape", type(mixed_qkv).__name__))
    _no_autograd("mixed_qkv", mixed_qkv)
    if mixed_qkv.dtype != act:
        _fail("mixed_qkv", f"dtype {act} (the cache's activation dtype; no implicit casts)", mixed_qkv.dtype)
    if mixed_qkv.device != device:
        _fail("mixed_qkv", f"a tensor on {device}", mixed_qkv.device)
    if mixed_qkv.stride(1) != 1:
        _fail("mixed_qkv", "a packed last dim (stride 1); any row stride", f"strides {mixed_qkv.stride()}")
    b, rs, off = mixed_qkv.shape[0], mixed_qkv.stride(0), mixed_qkv.storage_offset()
    q = mixed_qkv.as_strided((b, H, K), (rs, K, 1), off)
    k = mixed_qkv.as_strided((b, H, K), (rs, K, 1), off + H * K)
    v = mixed_qkv.as_strided((b, HV, V), (rs, V, 1), off + 2 * H * K)
    return q, k, v


def _gdn_inputs(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out, mixed_qkv, drafts: bool):
    """Validated GDN arguments; with `drafts` every token tensor has a draft axis after batch."""
    HV, V, K, H = cache.num_v_heads, cache.head_v_dim, cache.head_k_dim, cache.num_k_heads
    device = cache.checkpoint.device
    act = cache.dtype
    if mixed_qkv is not None:
        if drafts:
            _fail("mixed_qkv", "None for verify (pass q, k, v laid out (batch, T, ...))", "a tensor")
        if q is not None or k is not None or v is not None:
            _fail("mixed_qkv", "q, k and v to be None when mixed_qkv is given", "both")
        q, k, v = _split_mixed_qkv(mixed_qkv, H, K, HV, V, act, device)
    rank = 4 if drafts else 3
    if not isinstance(v, torch.Tensor) or v.dim() != rank:
        _fail("v", f"a (batch, T, {HV}, {V}) tensor" if drafts else f"a (batch, {HV}, {V}) tensor (or mixed_qkv)",
              getattr(v, "shape", type(v).__name__))
    lead = tuple(v.shape[:rank - 2])  # (b,) or (b, T)
    # Scalar loads on the GPU: any batch stride and alignment, inner dims packed.
    q = _activation("q", q, lead + (H, K), act, device, aligned=False)
    k = _activation("k", k, lead + (H, K), act, device, aligned=False)
    v = _activation("v", v, lead + (HV, V), act, device, aligned=False)
    if not isinstance(a, torch.Tensor) or a.dtype not in (act, torch.float32):
        _fail("a", f"a {lead + (HV,)} tensor of dtype {act} or torch.float32", getattr(a, "dtype", type(a).__name__))
    a = _activation("a", a, lead + (HV,), a.dtype, device, aligned=False)
    b = _activation("b", b, lead + (HV,), a.dtype, device, aligned=False)
    A_log = _gdn_param("A_log", A_log, HV, act, device)
    dt_bias = _gdn_param("dt_bias", dt_bias, HV, act, device)
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not 0 < scale < float("inf")):
        _fail("scale", "None or a positive finite float", scale)
    slot_ids = _slot_ids(slot_ids, lead[0], device)
    if out is None:  # zeros: the rows a step skips must not come back as stale memory
        out = torch.zeros(lead + (HV, V), dtype=act, device=device)
    else:
        out = _activation("out", out, lead + (HV, V), act, device, aligned=False)
    if _debug_host_checks(device):
        _check_slots(cache, slot_ids)
    return q, k, v, a, b, A_log, dt_bias, slot_ids, out


def _decode_gdn(cache, q=None, k=None, v=None, a=None, b=None, A_log=None, dt_bias=None, slot_ids=None,
                *, scale=None, out=None, mixed_qkv=None, config=None):
    q, k, v, a, b, A_log, dt_bias, slot_ids, out = _gdn_inputs(
        cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out, mixed_qkv, drafts=False)
    bsz = v.shape[0]
    device = cache.checkpoint.device
    if bsz == 0:
        return out

    if device.type == "cpu":
        from .reference import gdn_decode_cache_

        return gdn_decode_cache_(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale=scale, out=out)
    _check_device(cache, device, low_precision_kernel=True)

    from .kernels_host import checkpoint_arg, gdn_decode_kernel, state_copy_args

    kernel = gdn_decode_kernel(cache, a.dtype, A_log.dtype, dt_bias.dtype, scale, bsz, config)
    kernel(checkpoint_arg(cache), q, k, v, a, b, A_log, dt_bias, slot_ids, out,
           *_ring_args(cache, ("ring_u", "ring_k", "ring_g", "ring_v", "ring_beta")), *state_copy_args(cache))
    return out


def _verify_gdn(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, *, scale=None, out=None, config=None,
                cu_seqlens=None, num_drafts=None):
    if cache.max_draft < 1:
        _fail("cache", "a cache with room for drafts (max_draft >= 1)", f"max_draft {cache.max_draft}")
    packed_out = out
    if cu_seqlens is not None or num_drafts is not None:
        bsz, T = _varlen_shape(cache, slot_ids, cu_seqlens, num_drafts)
        q, k, v, a, b = (_unpack_tokens(n, t, bsz, T) for n, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b)))
        out = _unpack_tokens("out", out, bsz, T, optional=True)
    q, k, v, a, b, A_log, dt_bias, slot_ids, out = _gdn_inputs(
        cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out, None, drafts=True)
    bsz, T = v.shape[:2]
    if not 1 <= T <= min(cache.max_draft, cache.window):
        _fail("v", f"1 <= T <= min(max_draft {cache.max_draft}, window {cache.window}) drafts", T)
    device = cache.checkpoint.device
    if bsz > 0 and device.type == "cpu":
        from .reference_spec import gdn_verify_cache_

        gdn_verify_cache_(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale=scale, out=out)
    elif bsz > 0:
        _check_device(cache, device, low_precision_kernel=True)
        from .kernels_host import checkpoint_arg, gdn_verify_kernel, state_copy_args

        kernel = gdn_verify_kernel(cache, T, a.dtype, A_log.dtype, dt_bias.dtype, scale, bsz, config)
        kernel(checkpoint_arg(cache), q, k, v, a, b, A_log, dt_bias, slot_ids, out, cache.ring_u, cache.ring_k,
               cache.ring_g, cache.ring_v, cache.ring_beta, cache.cursor, cache.origin, *state_copy_args(cache))
    _await_commit(cache, T, slot_ids)
    return _verify_result(out, packed_out, cu_seqlens)


def snapshot_verify(cache, *args, **kwargs):
    """The conventional speculative baseline on a conventional cache (window 1). With a
    :class:`Mamba2Cache`::

        snapshot_verify(cache, x, dt, A, B, C, slot_ids, snapshots, D=None, z=None, dt_bias=None,
                        dt_softplus=False, out=None, *, config=None)  -> out (b, T, H, P)

    With a :class:`GDNCache`::

        snapshot_verify(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, snapshots, *, scale=None,
                        out=None, config=None)  -> out (b, T, HV, V)

    Each row's state is read once and the state after each of its T drafts (1 <= T <= 16) is
    written to ``snapshots[row, t]`` (a contiguous fp32 tensor (b, T) + the state's shape: (H, P,
    N) or (HV, V, K)); the cache is not written (the accepted snapshot becomes the state by copy
    or pointer switch). Tokens as :func:`verify`; pad rows leave their ``snapshots`` rows and
    their rows of a caller's ``out`` untouched (zero in an ``out`` allocated here). ``config`` and
    inference-only as :func:`decode`."""
    return _dispatch("snapshot_verify", cache, _snapshot_verify_mamba2, _snapshot_verify_gdn, args, kwargs)


def _check_conventional(cache) -> None:
    if cache.window != 1:
        _fail("cache", f"a conventional {type(cache).__name__} (window 1)", f"window {cache.window}")


def _check_snapshots(cache, snapshots, b: int, T: int, tokens: str) -> None:
    """The draft count (named after the token tensor `tokens`) and the snapshot buffer."""
    if not 1 <= T <= 16:
        _fail(tokens, "1 <= T <= 16 drafts", T)
    device = cache.checkpoint.device
    shape = (b, T) + tuple(cache.checkpoint.shape[1:])
    if not isinstance(snapshots, torch.Tensor):
        _fail("snapshots", f"a contiguous float32 tensor of shape {shape} on {device}", type(snapshots).__name__)
    _no_autograd("snapshots", snapshots)
    if (tuple(snapshots.shape) != shape or snapshots.dtype != torch.float32 or snapshots.device != device
            or not snapshots.is_contiguous()):
        _fail("snapshots", f"a contiguous float32 tensor of shape {shape} on {device}",
              f"{snapshots.dtype} {tuple(snapshots.shape)} on {snapshots.device}, strides {snapshots.stride()}")


def _snapshot_verify_mamba2(cache, x, dt, A, B, C, slot_ids, snapshots, D=None, z=None, dt_bias=None,
                            dt_softplus=False, out=None, *, config=None):
    _check_conventional(cache)
    x, dt, A, B, C, slot_ids, D, z, dt_bias, out = _mamba2_inputs(
        cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out, drafts=True)

    def reference():
        from .reference_spec import mamba2_snapshot_verify_cache_

        return mamba2_snapshot_verify_cache_(cache, x, dt, A, B, C, slot_ids, snapshots, D=D, z=z,
                                             dt_bias=dt_bias, dt_softplus=dt_softplus, out=out)

    def launch(b, T):
        from .kernels_host import mamba2_snapshot_kernel

        kernel = mamba2_snapshot_kernel(cache, T, dt.dtype, D is not None, z is not None, dt_bias is not None,
                                        dt_softplus, b, config)
        kernel(cache.checkpoint, x, dt, A, B, C, D, z, dt_bias, slot_ids, out, snapshots)

    return _run_snapshot_verify(cache, snapshots, x, "x", out, reference, launch)


def _snapshot_verify_gdn(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, snapshots, *, scale=None, out=None,
                         config=None):
    _check_conventional(cache)
    q, k, v, a, b, A_log, dt_bias, slot_ids, out = _gdn_inputs(
        cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out, None, drafts=True)

    def reference():
        from .reference_spec import gdn_snapshot_verify_cache_

        return gdn_snapshot_verify_cache_(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, snapshots,
                                          scale=scale, out=out)

    def launch(bsz, T):
        from .kernels_host import gdn_snapshot_kernel

        kernel = gdn_snapshot_kernel(cache, T, a.dtype, A_log.dtype, dt_bias.dtype, scale, bsz, config)
        kernel(cache.checkpoint, q, k, v, a, b, A_log, dt_bias, slot_ids, out, snapshots)

    return _run_snapshot_verify(cache, snapshots, v, "v", out, reference, launch)


def _run_snapshot_verify(cache, snapshots, tokens: torch.Tensor, name: str, out, reference, launch):
    """snapshot_verify once the tokens are validated: check ``snapshots`` against the (b, T) of
    ``tokens`` (the token tensor called ``name``); then nothing for an empty batch, ``reference()``
    on the CPU, else ``launch(b, T)`` on the GPU. Returns ``out``."""
    b, T = tokens.shape[:2]
    _check_snapshots(cache, snapshots, b, T, name)
    device = cache.checkpoint.device
    if b == 0:
        return out
    if device.type == "cpu":
        return reference()
    _check_device(cache, device)
    launch(b, T)
    return out
