"""The public ops (decode, verify, commit, snapshot_verify): validation, then the CuTe DSL kernels
(CUDA) or the reference (CPU).

Each op dispatches on the cache type to its layer's adapter (replayssm_cute.layers: argument
checks, CPU reference, kernel lookup and arguments); what every layer shares (the protocol,
``config``, devices, verify's packed form, commit) is checked here. Mamba-2 arguments follow vLLM's
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

Model steps: the layer caches of a model share one ``SequenceTable`` (``table=``); each step
plans once (``table.plan_decode`` / ``plan_verify``), every layer runs with ``plan=``, and a
speculative step ends with one ``table.commit`` (replayssm_cute.table). A cache made without a
table plans and commits its own steps, as below.

Speculative protocol: verify, then commit, then anything else. Between a ``verify`` and its
``commit`` every other op on that cache is refused (``Mamba2Cache`` / ``GDNCache``), and the
commit must name the verify's slot ids row for row: the CPU path checks the ids, the GPU path
the batch size only (no device->host read), ``REPLAYSSM_CUTE_DEBUG=1`` the ids too.

Set ``REPLAYSSM_CUTE_DEBUG=1`` to also check slot ids on the host (range and duplicates, and
commit's against its verify's) and the ``cu_seqlens`` of verify's packed form, which
synchronises, so it is off by default and is skipped under CUDA-graph capture.
"""

from __future__ import annotations

import torch

from . import checks
from .layers import EXPECTED_CACHE, layer_of
from .runtime import launch
from .table import StepPlan


def _check_config(layer, cache, op: str, config) -> None:
    """``config`` is None or a launch config class of the cache's layer for ``op`` (decode also
    takes the pipelined kernel's), on every path (the CPU reference has no launch config and
    ignores a valid one). Imports the kernels' modules, and with them cutlass, only when a config
    is given."""
    if config is None:
        return
    classes = layer.launch_configs(op)
    if not isinstance(config, classes):
        names = " or ".join(c.__name__ for c in classes)
        checks.fail("config", f"None or a {names} (a launch config of the {type(cache).__name__}'s GPU {op} "
                    f"kernels)", f"{type(config).__name__} {config!r}")


def _dispatch(op: str, cache, run, args, kwargs):
    """``op`` on ``cache``: ``run(layer, cache, *args, **kwargs)`` with the adapter of the cache's
    layer type (replayssm_cute.layers), once no verify awaits its commit there (the protocol:
    verify, then commit, then anything else) and ``config`` (keyword-only in every op) is None
    or the layer's launch config."""
    layer = layer_of(cache)
    if layer is None:
        raise TypeError(f"{op}: argument 'cache': expected {EXPECTED_CACHE}, got {type(cache).__name__}")
    plan = kwargs.get("plan")
    if not (op == "verify" and plan is not None and plan is cache.table.pending):  # a model step's verify
        cache._refuse_while_verify_pending(op)
    _check_config(layer, cache, op, kwargs.get("config"))
    return _named(op, run, layer, cache, *args, **kwargs)


def decode(cache, *args, **kwargs):
    """One decode step for a batch of rows; returns ``out``.

    With a :class:`Mamba2Cache`::

        decode(cache, x, dt, A, B, C, slot_ids, D=None, z=None, dt_bias=None, dt_softplus=False,
               out=None, *, config=None, plan=None)  -> out (b, H, P)

    With a :class:`GDNCache`::

        decode(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, *, scale=None, out=None,
               mixed_qkv=None, config=None, plan=None)  -> out (b, HV, V)

    (pass ``q = k = v = None`` and ``mixed_qkv`` for the packed layout). Window 1 is conventional
    decoding (state load, update, store), window L > 1 is ReplaySSM standard decoding. ``config``
    overrides the launch configuration (a ``Mamba2Config`` / ``GDNConfig``, anything else is
    refused; unused on the CPU path); by default the tuned one for the batch size's bucket
    (``replayssm_cute.runtime.tuning``; verify alike), else the analytical choice for it.

    ``plan``: a model step's ``table.plan_decode(slot_ids)`` (replayssm_cute.table), made once for
    every layer of the model from this same ``slot_ids`` tensor; required on a cache made with
    ``table=``, where one layer's step must not move the others' positions. Without it a cache
    that owns its table plans its own step (one more small launch; the table advances with it).

    Skipped rows (pad sentinel, out of pool) keep their rows of a caller's ``out`` and are zero
    in an ``out`` allocated here. Inference-only: with grad mode on, an input that requires grad
    is refused (call under ``torch.no_grad()`` / ``torch.inference_mode()``). Refused between a
    :func:`verify` and its :func:`commit`.
    """
    return _dispatch("decode", cache, _decode, args, kwargs)


def _decode(layer, cache, *args, config=None, plan=None, **kwargs):
    inputs = layer.inputs(**layer.decode_args(cache, *args, **kwargs), drafts=False)
    b = getattr(inputs, layer.tokens).shape[0]
    device = cache.checkpoint.device
    _check_plan(cache, plan, inputs.slot_ids, 0)
    if b == 0:
        return inputs.out
    if device.type == "cpu":
        return layer.decode_reference(cache, inputs, plan)
    _check_device(cache, device, low_precision_kernel=True)
    kernel = launch.launcher(layer.decode_kernel, layer.shape(cache, layer.static_inputs(inputs)), 0, b, config)
    if plan is None and (cache.window > 1 or cache.sr_counter is not None):
        plan = cache.table.plan_decode(inputs.slot_ids)
    kernel(*layer.decode_kernel_args(cache, inputs, plan))
    return inputs.out


def _check_plan(cache, plan, slot_ids, num_drafts: int) -> None:
    """``plan`` is None on a cache that owns its table (the op plans its own step), else the
    latest plan of the cache's table for this op (``plan_decode``; ``plan_verify`` with T =
    ``num_drafts``, awaiting its commit) made from this very ``slot_ids`` tensor."""
    table = cache.table
    op = "plan_verify(slot_ids, num_drafts)" if num_drafts else "plan_decode(slot_ids)"
    if plan is None:
        if not cache.owns_table:
            checks.fail("plan", f"the model step's table.{op} (the cache shares a SequenceTable: a step on one "
                        f"layer must not move the positions of the others)", None)
        return
    if not isinstance(plan, StepPlan) or plan.table is not table:
        checks.fail("plan", f"None or a StepPlan of the cache's SequenceTable (table.{op})",
                    type(plan).__name__ if not isinstance(plan, StepPlan) else "a plan of another table")
    if plan.num_drafts != num_drafts:
        checks.fail("plan", f"a plan of table.{op}", f"a plan with num_drafts {plan.num_drafts}")
    latest = table.pending if num_drafts else table.last_plan
    if plan is not latest:
        checks.fail("plan", f"the table's latest {op} (positions move with every plan)", "a stale plan")
    if slot_ids is not plan.slot_ids and (slot_ids.data_ptr() != plan.slot_ids.data_ptr()
                                          or slot_ids.shape != plan.slot_ids.shape):
        checks.fail("slot_ids", "the slot ids the plan was made from (the same tensor)", "another tensor")


def _check_device(cache, device, low_precision_kernel: bool = False) -> None:
    """A CUDA cache; a low-precision one (checkpoint_format / read_copy / flush_corrections) only
    where the op has its GPU kernel (``low_precision_kernel``)."""
    if device.type != "cuda":
        checks.fail("cache", "a cache on a CUDA device or the CPU", device)
    if not low_precision_kernel and not getattr(cache, "is_plain", True):
        raise NotImplementedError(
            "argument 'cache': this operation runs low-precision and two-precision caches on the CPU "
            "reference only (replayssm_cute.reference.state); its GPU kernel for them is not written yet"
        )


def _varlen_shape(cache, slot_ids, cu_seqlens, num_drafts, token_name: str, total_tokens) -> tuple:
    """(batch, T) of a packed verify call, from tensor metadata only, so it captures in a CUDA
    graph: batch from slot_ids, cu_seqlens (batch + 1,) int32 on the cache's device, T =
    num_drafts, the most tokens a row holds. ``total_tokens``, axis 0 of the packed token tensor
    ``token_name``, is batch * T when every row holds T, else between batch and batch * T (rows
    of 1..T tokens); None where that tensor is not one (its own check says so). Debug mode also
    reads cu_seqlens back (synchronises) to check the rows."""
    device = cache.checkpoint.device
    if not isinstance(slot_ids, torch.Tensor) or slot_ids.dim() != 1:
        checks.fail("slot_ids", "an int32 tensor of shape (batch,)",
                    getattr(slot_ids, "shape", type(slot_ids).__name__))
    bsz = slot_ids.shape[0]
    if not isinstance(cu_seqlens, torch.Tensor):
        checks.fail("cu_seqlens", f"an int32 tensor of shape ({bsz + 1},) (batch + 1) alongside num_drafts",
                    type(cu_seqlens).__name__)
    if cu_seqlens.dtype != torch.int32:
        checks.fail("cu_seqlens", "dtype torch.int32", cu_seqlens.dtype)
    if tuple(cu_seqlens.shape) != (bsz + 1,):
        checks.fail("cu_seqlens", f"shape ({bsz + 1},) (batch + 1, batch = len(slot_ids))", tuple(cu_seqlens.shape))
    if cu_seqlens.device != device:
        checks.fail("cu_seqlens", f"a tensor on {device}", cu_seqlens.device)
    if isinstance(num_drafts, bool) or not isinstance(num_drafts, int):
        checks.fail("num_drafts", "a Python int (the most drafts a row holds; kernels are compiled per T) "
                    "alongside cu_seqlens", type(num_drafts).__name__)
    if not 1 <= num_drafts <= min(cache.max_draft, cache.window):
        checks.fail("num_drafts", f"1 <= num_drafts <= min(max_draft {cache.max_draft}, window {cache.window})",
                    num_drafts)
    if total_tokens is not None and not bsz <= total_tokens <= bsz * num_drafts:
        checks.fail(token_name, f"batch {bsz} to batch * num_drafts = {bsz * num_drafts} packed tokens "
                    f"on axis 0 (rows of 1..num_drafts tokens)", f"{total_tokens} tokens")
    if total_tokens is not None and checks.debug_host_checks(device):
        bounds = cu_seqlens.tolist()
        counts = [e - s for s, e in zip(bounds, bounds[1:])]
        if total_tokens == bsz * num_drafts:
            wrong = [(i, n) for i, n in enumerate(counts) if n != num_drafts]
            rule = (f"arange(batch + 1) * {num_drafts}: with batch * num_drafts tokens every row verifies "
                    f"exactly num_drafts = {num_drafts} tokens")
        else:
            wrong = [(i, n) for i, n in enumerate(counts) if not 1 <= n <= num_drafts]
            rule = f"rows of 1..num_drafts = {num_drafts} tokens from cu_seqlens[0] = 0 to cu_seqlens[-1] = {total_tokens}"
        if bounds[0] != 0 or wrong or bounds[-1] != total_tokens:
            got = (f"cu_seqlens[0] = {bounds[0]}" if bounds[0] != 0 else
                   f"row {wrong[0][0]} with {wrong[0][1]} tokens" if wrong else f"cu_seqlens[-1] = {bounds[-1]}")
            checks.fail("cu_seqlens", rule, got)
    return bsz, num_drafts


def _draft_rows(cu_seqlens, bsz: int, T: int, total: int):
    """Where uneven packed rows go in the (batch, T) layout the kernels take, on the device with
    no host read (graph-capturable): (source (batch * T,), the packed token each draft position
    takes, a row's last token repeated past its count so every draft is a real input; target
    (total,), each packed token's flat draft position; counts (batch,) int32). Indices are
    clamped into range, so bad cu_seqlens (refused in debug mode) cannot read out of bounds."""
    cu = cu_seqlens.long()
    counts = cu[1:] - cu[:-1]
    t = torch.arange(T, device=cu.device)
    source = (cu[:-1, None] + torch.minimum(t[None, :], (counts - 1).clamp(min=0)[:, None])).clamp(0, total - 1)
    token = torch.arange(total, device=cu.device)
    row = torch.searchsorted(cu[1:].contiguous(), token, right=True).clamp(max=bsz - 1)
    target = row * T + (token - cu[row]).clamp(0, T - 1)
    return source.flatten(), target, counts.to(torch.int32)


def _unpack_tokens(name: str, t, bsz: int, T: int, optional: bool = False):
    """Zero-copy view of packed tokens (bsz * T, ...) as (bsz, T, ...): row r's tokens are packed
    rows r * T .. r * T + T - 1. The draft axis of the view must be packed, so tokens must follow
    one another with no gap; inner dims are left to the dense checks."""
    if t is None and optional:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        checks.fail(name, f"a packed (total_tokens, ...) tensor, total_tokens = batch * num_drafts = {bsz * T}",
                    getattr(t, "shape", type(t).__name__))
    if t.shape[0] != bsz * T:
        checks.fail(name, f"total_tokens = batch {bsz} * num_drafts {T} = {bsz * T} packed tokens on axis 0",
                    f"shape {tuple(t.shape)}")
    # One token's extent: its elements span this many, stride-0 (expanded) dims spanning none.
    token_stride = max(1, 1 + sum((n - 1) * s for n, s in zip(t.shape[1:], t.stride()[1:])))
    if bsz * T > 1 and t.stride(0) != token_stride:
        checks.fail(name, f"tokens packed back to back (token stride {token_stride}; copy a column slice with "
                    f".contiguous())", f"strides {t.stride()}")
    return t.as_strided((bsz, T) + tuple(t.shape[1:]), (T * token_stride, token_stride) + tuple(t.stride()[1:]),
                        t.storage_offset())


def verify(cache, *args, **kwargs):
    """Speculative verification of T draft tokens per row; returns ``out`` (b, T, ...).

    With a :class:`Mamba2Cache` (``max_draft >= T``)::

        verify(cache, x, dt, A, B, C, slot_ids, D=None, z=None, dt_bias=None, dt_softplus=False,
               out=None, *, config=None, plan=None)  -> out (b, T, H, P)

    With a :class:`GDNCache`::

        verify(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, *, scale=None, out=None,
               config=None, plan=None)  -> out (b, T, HV, V)

    with every token tensor laid out (b, T, ...) as decode's. Each row's T outputs come from its
    checkpoint and committed records without writing a state; the drafts' records are appended
    behind the committed ones; a row with h + T > window first folds its committed records into
    the checkpoint (one state write).

    Protocol: verify, then commit, then anything else. Follow every verify with one
    :func:`commit` of the same ``slot_ids``, row for row: between the two, a slot's cursor,
    origin and SR write counter are internal, so every other op on the cache (decode, another
    verify, load_prefill, materialize, read_state) is refused until the commit. In a model step
    (``plan`` = ``table.plan_verify(slot_ids, T)``, required on a cache made with ``table=``)
    every layer verifies with the one plan, then ``table.commit(plan, num_accepted)`` moves the
    table once for all of them. Rows verify
    skips are zero in an ``out`` it allocates; inference-only and ``config`` as :func:`decode`.

    On a cache with low-precision state the outputs read the read copy (else the checkpoint),
    and a folding row reads the recurrence checkpoint and writes every copy from the one fp32
    result (SR checkpoint, RTN read copy; GDN re-derives the committed corrections first when
    ``flush_corrections == "rederive"``), as ``reference.*_verify_lowprec_cache_``.

    Packed (varlen) form, as serving engines lay out drafts: pass ``cu_seqlens`` (an int32 tensor
    (b + 1,) on the cache's device) and ``num_drafts`` (the Python int T, the most tokens a row
    holds; kernels are compiled per T) as keywords, with every token tensor and ``out`` laid out
    (total_tokens, ...), row i's tokens at cu_seqlens[i]:cu_seqlens[i + 1]; ``out`` comes back
    packed. cu_seqlens is never read on the host (CUDA-graph capturable). With total_tokens ==
    b * T every row holds T tokens and they are viewed as (b, T, ...) without a copy, so they
    must be packed back to back (a column slice of a wider buffer needs ``.contiguous()``). With
    b <= total_tokens < b * T rows hold 1..T tokens: they are gathered on the device into (b, T,
    ...), each row's last token standing in for its missing drafts (no draft's output sees a
    later one, and commit accepts at most the row's count, which the CPU path and debug mode
    check), and the rows' own outputs are scattered back. ``REPLAYSSM_CUTE_DEBUG=1`` also reads
    cu_seqlens back (synchronises) and checks its rows.
    """
    return _dispatch("verify", cache, _verify, args, kwargs)


def _verify(layer, cache, *args, config=None, cu_seqlens=None, num_drafts=None, plan=None, **kwargs):
    named = layer.verify_args(cache, *args, **kwargs)
    if cache.max_draft < 1:
        checks.fail("cache", "a cache with room for drafts (max_draft >= 1)", f"max_draft {cache.max_draft}")
    packed_out = named["out"]
    scatter = draft_counts = None  # uneven rows: where each packed output comes from, and the rows' counts
    if cu_seqlens is not None or num_drafts is not None:
        total, lead = _packed_total(named, layer.packed_tokens + layer.packed_optional_tokens)
        bsz, T = _varlen_shape(cache, named["slot_ids"], cu_seqlens, num_drafts, lead, total)
        if total is None or total == bsz * T:  # every row holds T tokens: zero-copy views
            for name in layer.packed_tokens:
                named[name] = _unpack_tokens(name, named[name], bsz, T)
            for name in layer.packed_optional_tokens + ("out",):
                named[name] = _unpack_tokens(name, named[name], bsz, T, optional=True)
        else:  # rows of 1..T tokens: gathered into (b, T), each row's last token standing in for its missing drafts
            gather, scatter, draft_counts = _draft_rows(cu_seqlens, bsz, T, total)
            for name in layer.packed_tokens + layer.packed_optional_tokens + ("out",):
                named[name] = _gather_drafts(name, named[name], gather, bsz, T, total)
    inputs = layer.inputs(**named, drafts=True)
    b, T = getattr(inputs, layer.tokens).shape[:2]
    if not 1 <= T <= min(cache.max_draft, cache.window):
        checks.fail(layer.tokens, f"1 <= T <= min(max_draft {cache.max_draft}, window {cache.window}) drafts", T)
    _check_plan(cache, plan, inputs.slot_ids, T)
    device = cache.checkpoint.device
    if device.type != "cpu":
        _check_device(cache, device, low_precision_kernel=True)
    kernel = None
    if b > 0 and device.type != "cpu":
        kernel = launch.launcher(layer.verify_kernel, layer.shape(cache, layer.static_inputs(inputs)), T, b, config)
    if plan is None and (device.type != "cpu" or b == 0 or draft_counts is not None):
        # a standalone verify: its own plan, which then awaits commit(cache, ...)
        plan = cache.table.plan_verify(inputs.slot_ids, T, draft_counts=draft_counts)
    if b > 0 and device.type == "cpu":
        layer.verify_reference(cache, inputs, plan)
    elif b > 0:
        kernel(*layer.verify_kernel_args(cache, inputs, plan))
    return _verify_result(inputs.out, packed_out, cu_seqlens, scatter)


def _packed_total(named: dict, names: tuple):
    """(total_tokens, a token tensor that has it) of packed token tensors: the axis-0 length most
    of them share (so the one that differs is the one an error names), None if none is a tensor."""
    totals = [(t.shape[0], n) for n in names if isinstance(t := named.get(n), torch.Tensor) and t.dim() >= 2]
    if not totals:
        return None, names[0]
    lengths = [n for n, _ in totals]
    total = max(lengths, key=lengths.count)  # the first of the most common
    return total, next(name for n, name in totals if n == total)


def _gather_drafts(name: str, t, gather, bsz: int, T: int, total: int):
    """Packed tokens (total, ...) of uneven rows as a new (b, T, ...) tensor (``_draft_rows``); for
    a caller's ``out`` the copy verify writes (checked by verify as any out), holding the caller's
    values where verify skips a row, so that copying it back leaves those rows as they were."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[0] != total:
        checks.fail(name, f"a packed (total_tokens, ...) tensor, total_tokens = {total} as the other token tensors",
                    getattr(t, "shape", type(t).__name__))
    if t.device != gather.device:
        checks.fail(name, f"a tensor on {gather.device}", t.device)
    return t.index_select(0, gather).view((bsz, T) + tuple(t.shape[1:]))


def _verify_result(out, packed_out, cu_seqlens, scatter):
    """verify's return value: in the packed form the caller's packed ``out`` (or the allocated
    one viewed packed); with rows of fewer than T tokens, the rows' own outputs (``scatter``,
    from ``_draft_rows``) copied there or returned; else ``out`` (b, T, ...)."""
    if cu_seqlens is None:
        return out
    if scatter is not None:
        rows_own = out.flatten(0, 1).index_select(0, scatter)
        return rows_own if packed_out is None else packed_out.copy_(rows_own)
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
    CPU path compares the slot ids with the verify's and refuses num_accepted outside 1..T (a
    packed verify of rows with fewer drafts: outside 1..the row's count);
    ``REPLAYSSM_CUTE_DEBUG=1`` does both on the host on the GPU path too (it synchronises; skipped
    under CUDA-graph capture). The commit kernel takes its rows from the verify's plan, so it
    moves exactly the slots verify read, whatever ``slot_ids`` holds; the normal GPU path reads
    nothing back and assumes the counts lie in 1..T (one outside would corrupt the positions).
    On a cache made with ``table=`` use ``table.commit(plan, num_accepted)`` (once per model step).
    """
    return _named("commit", _commit, cache, slot_ids, num_accepted)


def _commit(cache, slot_ids, num_accepted):
    if layer_of(cache) is None:
        raise TypeError(f"commit: argument 'cache': expected {EXPECTED_CACHE}, got {type(cache).__name__}")
    pending = cache.pending_verify
    if pending is None:
        raise ValueError("commit: argument 'cache': no verify step to commit (call verify first)")
    b = pending.batch
    device = cache.checkpoint.device
    if isinstance(slot_ids, torch.Tensor) and slot_ids.dim() == 1 and slot_ids.shape[0] != b:
        checks.fail("slot_ids", f"the {b} slot ids of the pending verify, row for row", f"{slot_ids.shape[0]} ids")
    slot_ids = checks.slot_ids(slot_ids, b, device)
    checks.row_counts("num_accepted", num_accepted, b, device)
    if pending.host_ids is not None and (device.type == "cpu" or checks.debug_host_checks(device)):
        ids = tuple(slot_ids.tolist())
        if ids != pending.host_ids:
            checks.fail("slot_ids", f"the slot ids of the pending verify, row for row ({_preview(pending.host_ids)}): "
                        f"each row's num_accepted applies to the drafts that row verified", _preview(ids))
    if checks.debug_host_checks(device):
        checks.slots_in_pool(cache, slot_ids)
    if device.type != "cpu":
        _check_device(cache, device, low_precision_kernel=True)
    cache.table.commit(pending, num_accepted)  # rows from the verify's plan, so its slots, whatever slot_ids says


def _preview(ids) -> str:
    """Slot ids for an error message: the first 8."""
    return str(list(ids[:8]))[:-1] + (", ...]" if len(ids) > 8 else "]")


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
    return _dispatch("snapshot_verify", cache, _snapshot_verify, args, kwargs)


def _snapshot_verify(layer, cache, *args, config=None, **kwargs):
    named = layer.snapshot_verify_args(cache, *args, **kwargs)
    snapshots = named.pop("snapshots")
    _check_conventional(cache)
    inputs = layer.inputs(**named, drafts=True)
    b, T = getattr(inputs, layer.tokens).shape[:2]
    _check_snapshots(cache, snapshots, b, T, layer.tokens)
    device = cache.checkpoint.device
    if b == 0:
        return inputs.out
    if device.type == "cpu":
        return layer.snapshot_reference(cache, inputs, snapshots)
    _check_device(cache, device)
    kernel = launch.launcher(layer.snapshot_kernel, layer.shape(cache, layer.static_inputs(inputs)), T, b, config)
    kernel(*layer.snapshot_kernel_args(cache, inputs, snapshots))
    return inputs.out


def _check_conventional(cache) -> None:
    if cache.window != 1:
        checks.fail("cache", f"a conventional {type(cache).__name__} (window 1)", f"window {cache.window}")


def _check_snapshots(cache, snapshots, b: int, T: int, tokens: str) -> None:
    """The draft count (named after the token tensor `tokens`) and the snapshot buffer."""
    if not 1 <= T <= 16:
        checks.fail(tokens, "1 <= T <= 16 drafts", T)
    device = cache.checkpoint.device
    shape = (b, T) + tuple(cache.checkpoint.shape[1:])
    if not isinstance(snapshots, torch.Tensor):
        checks.fail("snapshots", f"a contiguous float32 tensor of shape {shape} on {device}", type(snapshots).__name__)
    checks.no_autograd("snapshots", snapshots)
    if (tuple(snapshots.shape) != shape or snapshots.dtype != torch.float32 or snapshots.device != device
            or not snapshots.is_contiguous()):
        checks.fail("snapshots", f"a contiguous float32 tensor of shape {shape} on {device}",
                    f"{snapshots.dtype} {tuple(snapshots.shape)} on {snapshots.device}, strides {snapshots.stride()}")
