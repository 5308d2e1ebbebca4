"""Pool-level float64 reference of speculative verification (docs/design.md section 4; paper
Algorithms 2 and 5), Mamba-2 and Gated DeltaNet: the verify, commit and snapshot-baseline steps
on a cache that serve as the CPU backend of ``verify``, ``commit`` and ``snapshot_verify``.

Written for clarity, not speed; every function computes in float64. Layer conventions and
shapes are those of ``mamba2`` and ``gdn`` (whose ``*_verify_output`` this module runs per row),
the pad-row rules and row machinery those of ``pool``; tokens carry an extra draft axis:
``(batch, T, ...)``.

Ring, origin and table conventions (what the GPU kernels must match)
--------------------------------------------------------------------
Per slot: ``checkpoint``, the table's ``h`` = committed records (``cache.cursor``) and
``origin``, and a ring of ``capacity = window + max_draft`` records. Committed record ``i``
(0-based, oldest first) lives at ring index ``(origin + i) % capacity``. Window ``L =
cache.window``.

* Invariant: ``0 <= h <= L`` between steps (standard decoding keeps ``h < L``; a speculative
  commit may leave ``h == L``). ``1 <= T <= min(max_draft, L)``.
* Verify (``*_verify_cache_``), per active row, with h and origin o from the step's plan (the
  table before the step):

  1. outputs of all T drafts, output-only, from the checkpoint as stored (read once), the h
     committed records as stored, and the T drafts' own values in float64 as given (GDN: as
     solved) -- the same rule as the decode reference for the current token;
  2. draft i (0-based) is written at ring index ``(o + h + i) % capacity`` (behind the
     committed records; nothing else in the ring is written);
  3. flush iff ``h + T > L`` (decided from h and T only): checkpoint = Replay(checkpoint, the h
     committed records as stored), cast to fp32. Otherwise the checkpoint is untouched.

  Verify does not touch the table.
* Commit (``commit_cache_``, ``SequenceTable.commit``) with ``1 <= a <= T`` accepted: a
  flushing row moves ``origin = (o + h) % capacity`` and sets ``h = a`` (the drafts are records
  0..a-1; one more SR write), any other row ``h += a``; nothing else is touched (drafts beyond a
  stay in the ring, unread, and the next verify overwrites them). At most L committed records.
* T = 1 with a = 1 is a decode step, valid for every ``0 <= h <= L``. For ``h <= L - 2`` it
  leaves the cache exactly as ``reference.*_decode_cache_`` does. At ``h == L - 1`` the decode
  reference flushes (folding its own token, h = 0) while the speculative rule does not
  (h = L); the next speculative step flushes the L committed records instead. Same states
  and outputs, different timing of the checkpoint write.

Draft outputs follow the output-only form of Eq. 6 (``common``); GDN draft corrections come
from the triangular solve of Eq. 10 (``gdn``).

Conventional baseline: ``*_snapshot_verify`` (``mamba2``, ``gdn``: one state read, a full state
per draft) and ``snapshot_select`` / ``snapshot_commit_cache_`` (keep snapshot a).
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence, Union

import torch

from .gdn import gdn_replay, gdn_replay_rederive, gdn_snapshot_verify, gdn_verify_output
from .mamba2 import mamba2_replay, mamba2_snapshot_verify, mamba2_verify_output
from .pool import (
    active_rows,
    check_shape,
    gdn_lead,
    gdn_raw_records,
    gdn_records,
    gdn_slot_records,
    int_values,
    mamba2_lead,
    mamba2_slot_records,
    out_buffer,
    rederives,
    slot_list,
    step_plan,
    write_records_,
)
from .state import STATE_COPIES, StateAccess, state_access

__all__ = [
    "spec_flush",
    "mamba2_verify_cache_",
    "gdn_verify_cache_",
    "commit_cache_",
    "snapshot_select",
    "mamba2_snapshot_verify_cache_",
    "gdn_snapshot_verify_cache_",
    "snapshot_commit_cache_",
    "mamba2_verify_lowprec_cache_",
    "gdn_verify_lowprec_cache_",
]

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- shared


def spec_flush(h: int, num_drafts: int, window: int) -> bool:
    """The flush rule of a verify step: flush exactly when h + T > L (h committed records)."""
    return h + num_drafts > window


def _num_drafts(cache, T: int, what: str) -> None:
    if T < 1:
        raise ValueError(f"{what} must hold at least one draft token, got T = {T}")
    if T > cache.max_draft or T > cache.window:
        raise ValueError(
            f"T = {T} draft tokens need 1 <= T <= min(max_draft={cache.max_draft}, window={cache.window}) "
            f"(ring capacity window + max_draft; at most window committed records)"
        )


def _int_list(name: str, values, n: int) -> list:
    out = int_values(name, values)
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries, expected {n} (one per row of slot_ids)")
    return out


def _ring_positions(cache, slot: int, h: int, T: int) -> Tensor:
    """Ring indices of the T draft records of a slot with h committed records."""
    o = int(cache.origin[slot])
    return torch.tensor([(o + h + i) % cache.capacity for i in range(T)], device=cache.checkpoint.device)


def _verify_rows_(
    state: StateAccess, cache, slot_ids, nrows: int, per: str, out: Tensor, T: int, records, verify, replay, plan
) -> Tensor:
    """The row loop of a cache-level verify step (``*_verify_cache_``); returns ``out``.

    For every active row r (slot s), with h and the SR write w from the step's plan
    (``pool.step_plan``: the caller's, else ``plan_verify`` on the cache's table, which then awaits
    ``commit_cache_``), flush = ``spec_flush`` and S = ``state.read(cache, s, flush)``:
    ``verify(S, recs, slice(r, r + 1))`` with recs = ``records(s, h, flush, S)`` (the committed
    records) gives (outputs, records of the T drafts as ring name -> value); outputs[0] is cast
    into ``out[r]`` and the drafts are written at ``_ring_positions``. A flush stores
    ``replay(S, *recs)`` (``state.store_``, SR write w); the commit then drops the h folded
    records by moving the origin. The table is not touched here.
    """
    rows = active_rows(cache, slot_ids, nrows, per)
    plan = step_plan(cache, slot_ids, plan, T)
    for r, s in rows:
        _, h, _, w = plan.rows[r].tolist()
        flush = spec_flush(h, T, cache.window)
        S = state.read(cache, s, flush)
        recs = records(s, h, flush, S)
        y, drafts = verify(S, recs, slice(r, r + 1))
        out[r] = y[0].to(dtype=out.dtype, device=out.device)
        write_records_(cache, s, _ring_positions(cache, s, h, T), drafts)
        if flush:
            state.store_(cache, s, replay(S, *recs)[0], w)
    return out


def _snapshot_rows_(cache, slot_ids, nrows: int, per: str, out: Tensor, snapshots: Tensor, verify_row) -> Tensor:
    """The row loop of the snapshot baseline: for every active row r (slot s),
    ``verify_row(checkpoint[s : s + 1], slice(r, r + 1)) -> (out, snapshots)`` of that row, cast
    into ``out[r]`` and ``snapshots[r]``. Returns ``out``."""
    for r, s in active_rows(cache, slot_ids, nrows, per):
        o, snaps = verify_row(cache.checkpoint[s : s + 1], slice(r, r + 1))
        out[r] = o[0].to(dtype=out.dtype, device=out.device)
        snapshots[r] = snaps[0].to(dtype=snapshots.dtype, device=snapshots.device)
    return out


# ============================================================================= Mamba-2


def mamba2_verify_cache_(
    cache,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    slot_ids: Union[Tensor, Sequence[int]],
    D: Optional[Tensor] = None,
    z: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    dt_softplus: bool = False,
    out: Optional[Tensor] = None,
    plan=None,
) -> Tensor:
    """In-place cache-level reference verify step of T draft tokens on a ``Mamba2Cache``.

    Arguments as ``reference.mamba2_decode_cache_`` with a draft axis: x (b, T, H, P), dt
    (b, T, H), B, C (b, T, G, N), z (b, T, H, P); out (b, T, H, P) in x's dtype (allocated,
    zero, if None). Needs 1 <= T <= min(max_draft, window). Pad-sentinel and out-of-pool rows
    are skipped (nothing touched, out rows untouched); two active rows naming one slot raise.

    ``plan``: the model step's (``SequenceTable.plan_verify``), else one made here on the cache's
    table (then awaiting ``commit_cache_``). Every active row, with h (0 <= h <= window) from the
    plan and o = origin[slot]: outputs of all T drafts from ``mamba2_verify_output`` (checkpoint and committed records as stored,
    drafts in float64 as given); draft i's record (x, B cast to the ring dtype, processed dt to
    fp32) written at (o + h + i) % capacity; if h + T > window, flush: checkpoint =
    Replay(checkpoint, the h committed records) in fp32. The table is not touched: the commit
    moves it (origin past the folded records, h = accepted).
    A cache with low-precision state reads and writes its state copies as
    ``mamba2_verify_lowprec_cache_`` describes.
    """
    return _mamba2_verify_(state_access(cache), cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out,
                           plan)


def _mamba2_verify_(state: StateAccess, cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out,
                    plan=None) -> Tensor:
    """``mamba2_verify_cache_`` with the slots' state reached through ``state``."""
    b, T = mamba2_lead(cache, x, dt, A, B, C, D, z, dt_bias, drafts=True)
    _num_drafts(cache, T, "x")
    out = out_buffer(out, x, (b, T, cache.nheads, cache.headdim))

    def verify(ckpt, recs, row):
        y, dt_d = mamba2_verify_output(
            ckpt, *recs, x[row], dt[row], A, B[row], C[row], D, None if z is None else z[row], dt_bias, dt_softplus
        )
        return y, {"ring_x": x[row][0], "ring_B": B[row][0], "ring_dt": dt_d[0]}

    return _verify_rows_(
        state, cache, slot_ids, b, "x", out, T, lambda s, h, flush, ckpt: mamba2_slot_records(cache, s, h), verify,
        lambda ckpt, rec_x, rec_B, rec_dt: mamba2_replay(ckpt, rec_x, rec_B, rec_dt, A), plan,
    )


def mamba2_verify_lowprec_cache_(cache, x, dt, A, B, C, slot_ids, D=None, z=None, dt_bias=None, dt_softplus=False,
                                 out=None, plan=None) -> Tensor:
    """``mamba2_verify_cache_`` on any ``Mamba2Cache`` (paper Algorithm 3): the
    outputs read the checkpoint when h + T > window, else the read copy; a flush writes every
    copy. Arguments and effects otherwise as there."""
    return _mamba2_verify_(STATE_COPIES, cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out, plan)


# ============================================================================= Gated DeltaNet


def gdn_verify_cache_(
    cache,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    slot_ids: Union[Tensor, Sequence[int]],
    scale: Optional[float] = None,
    out: Optional[Tensor] = None,
    plan=None,
) -> Tensor:
    """In-place cache-level reference verify step of T draft tokens on a ``GDNCache``.

    Arguments as ``reference.gdn_decode_cache_`` with a draft axis: q, k (batch, T, H, K), v
    (batch, T, HV, V), a, b (batch, T, HV); out (batch, T, HV, V) in v's dtype (allocated,
    zero, if None). Needs 1 <= T <= min(max_draft, window). Pad rows as in the decode reference.

    ``plan`` as ``mamba2_verify_cache_``. Every active row, with h (0 <= h <= window) from the
    plan and o = origin[slot]: outputs and draft corrections from ``gdn_verify_output`` (checkpoint and committed records as
    stored; drafts in float64); draft i's record (u cast to fp16, normalised k to the ring
    dtype, g to fp32, and v / beta when the cache keeps them) written at (o + h + i) %
    capacity; if h + T > window, flush: checkpoint = Replay(checkpoint, the h committed records)
    in fp32. The table is not touched (``commit_cache_`` moves it). A cache with low-precision state or
    re-derived flush corrections reads and writes its state copies and re-derives as
    ``gdn_verify_lowprec_cache_`` describes.
    """
    return _gdn_verify_(state_access(cache), cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out, plan)


def _gdn_verify_(state: StateAccess, cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out, plan=None) -> Tensor:
    """``gdn_verify_cache_`` with the slots' state reached through ``state``."""
    bsz, T = gdn_lead(cache, q, k, v, a, b, A_log, dt_bias, drafts=True)
    _num_drafts(cache, T, "v")
    out = out_buffer(out, v, (bsz, T, cache.num_v_heads, cache.head_v_dim))

    def verify(ckpt, recs, row):
        o, u_d, kn, g, beta = gdn_verify_output(
            ckpt, *recs, q[row], k[row], v[row], a[row], b[row], A_log, dt_bias, scale
        )
        return o, gdn_records(cache, u_d[0], kn[0], g[0], v[row][0], beta[0])

    def records(s, h, flush, ckpt):
        recs = gdn_slot_records(cache, s, h)
        if flush and rederives(cache):  # Algorithm 6: the checkpoint's own corrections, for drafts and fold
            recs = (gdn_replay_rederive(ckpt, *gdn_raw_records(cache, s, h))[1],) + recs[1:]
        return recs

    return _verify_rows_(state, cache, slot_ids, bsz, "v", out, T, records, verify, gdn_replay, plan)


def gdn_verify_lowprec_cache_(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale=None, out=None,
                              plan=None) -> Tensor:
    """``gdn_verify_cache_`` on any ``GDNCache`` (paper Algorithm 6): the draft
    corrections and outputs come from the checkpoint when h + T > window, else from the read
    copy with the cached committed corrections; a flush folds the committed records and writes
    every copy.

    With ``flush_corrections == "rederive"`` a flush step first re-derives the committed
    corrections from the checkpoint (``reference.gdn_replay_rederive``, Algorithm 6 line 8) and
    uses them for the draft corrections and outputs as well as for the fold, so nothing a flush
    step returns or stores depends on the read copy (as in the decode flush). The paper's line
    order solves the drafts (line 4) with the cached corrections before re-deriving; the
    re-derivation reads only S_ckpt k_j of the same pass over the checkpoint, so a kernel
    can take either order. "fold" uses the cached corrections throughout."""
    return _gdn_verify_(STATE_COPIES, cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out, plan)


# ============================================================================= commit


def commit_cache_(
    cache,
    slot_ids: Union[Tensor, Sequence[int]],
    num_accepted: Union[Tensor, Sequence[int]],
    *,
    num_drafts: Optional[int] = None,
) -> None:
    """Commit the accepted drafts of the verify step pending on the cache's table
    (``SequenceTable.commit``): per active row with h from the verify's plan, a folding row (h + T
    > window) moves its origin past the h folded records and keeps its a accepted drafts (h = a,
    one more SR write), any other row h += a.

    Works on a ``Mamba2Cache`` or a ``GDNCache``. ``slot_ids`` must be the verify's, row for row;
    ``num_accepted`` holds one int a per row (a tensor or a sequence), 1 <= a <= T for every
    active row (pad and out-of-pool rows are skipped and their a ignored); ``num_drafts``, when
    given, must be the verify's T. Drafts beyond a stay in the ring and are never read.
    Everything is validated before anything is written.
    """
    if cache.is_conventional:
        raise ValueError("commit_cache_ needs a ReplaySSM cache with draft room (window > 1, max_draft >= 1)")
    plan = cache.table.pending
    if plan is None:
        raise ValueError("commit_cache_: no verify step awaits its commit on the cache's table (verify first)")
    ids = slot_list(slot_ids)
    acc = _int_list("num_accepted", num_accepted, len(ids))
    T = plan.num_drafts
    if num_drafts is not None and operator.index(num_drafts) != T:
        raise ValueError(f"num_drafts = {num_drafts} is not the pending verify's T = {T}")
    if tuple(ids) != tuple(plan.rows[:, 0].tolist()):
        raise ValueError(f"slot_ids {ids[:8]} are not the pending verify's, row for row")
    for r, s in active_rows(cache, ids, len(ids), "slot_ids"):
        if not 1 <= acc[r] <= T:
            raise ValueError(f"num_accepted[{r}] = {acc[r]} (slot {s}) must be in [1, {T}]")
    cache.table.commit(plan, torch.tensor(acc, dtype=torch.int32, device=cache.table.device))


# ============================================================================= conventional baseline


def snapshot_select(snapshots: Tensor, num_accepted: Union[Tensor, Sequence[int]]) -> Tensor:
    """The committed state of each row: snapshots[r, a_r - 1], 1 <= a_r <= T. (b, ...)."""
    T = snapshots.shape[1]
    acc = _int_list("num_accepted", num_accepted, snapshots.shape[0])
    for r, a in enumerate(acc):
        if not 1 <= a <= T:
            raise ValueError(f"num_accepted[{r}] = {a} must be in [1, T={T}]")
    return torch.stack([snapshots[r, a - 1] for r, a in enumerate(acc)]) if acc else snapshots[:, 0]


def _check_conventional(cache) -> None:
    if not cache.is_conventional:
        raise ValueError(
            "the snapshot baseline runs on a conventional cache (window == 1: the checkpoint is the state)"
        )
    if not getattr(cache, "is_plain", True):
        raise NotImplementedError(
            "the snapshot baseline on a low-precision state (checkpoint_format != 'fp32') is not implemented: "
            "it would need low-precision snapshots and an SR write per kept snapshot"
        )


def _check_snapshots(snapshots, shape: tuple) -> None:
    if not isinstance(snapshots, Tensor):
        raise TypeError(f"snapshots must be a torch.Tensor, got {type(snapshots).__name__}")
    check_shape("snapshots", snapshots, shape)


def mamba2_snapshot_verify_cache_(
    cache,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    slot_ids: Union[Tensor, Sequence[int]],
    snapshots: Tensor,
    D: Optional[Tensor] = None,
    z: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    dt_softplus: bool = False,
    out: Optional[Tensor] = None,
) -> Tensor:
    """Cache-level conventional speculative baseline on a conventional ``Mamba2Cache``
    (window == 1). Tokens as in ``mamba2_verify_cache_``; snapshots (b, T, H, P, N), any float
    dtype, indexed by row. Every active row reads checkpoint[slot] once and writes
    snapshots[r, s] = state after draft s (cast) for every s; the cache is not written (the
    commit, ``snapshot_commit_cache_``, copies the accepted snapshot). Pad rows skipped (their
    snapshot and out rows untouched). Returns out (b, T, H, P), x's dtype."""
    _check_conventional(cache)
    H, P, N = cache.nheads, cache.headdim, cache.dstate
    b, T = mamba2_lead(cache, x, dt, A, B, C, D, z, dt_bias, drafts=True)
    if T < 1:
        raise ValueError("x must hold at least one draft token")
    _check_snapshots(snapshots, (b, T, H, P, N))
    out = out_buffer(out, x, (b, T, H, P))
    return _snapshot_rows_(
        cache, slot_ids, b, "x", out, snapshots,
        lambda ckpt, row: mamba2_snapshot_verify(
            ckpt, x[row], dt[row], A, B[row], C[row], D, None if z is None else z[row], dt_bias, dt_softplus
        ),
    )


def gdn_snapshot_verify_cache_(
    cache,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    slot_ids: Union[Tensor, Sequence[int]],
    snapshots: Tensor,
    scale: Optional[float] = None,
    out: Optional[Tensor] = None,
) -> Tensor:
    """Cache-level conventional speculative baseline on a conventional ``GDNCache`` (window ==
    1); as ``mamba2_snapshot_verify_cache_``, with snapshots (batch, T, HV, V, K)."""
    _check_conventional(cache)
    HV, V, K = cache.num_v_heads, cache.head_v_dim, cache.head_k_dim
    bsz, T = gdn_lead(cache, q, k, v, a, b, A_log, dt_bias, drafts=True, check_v=False)
    if T < 1:
        raise ValueError("v must hold at least one draft token")
    _check_snapshots(snapshots, (bsz, T, HV, V, K))
    out = out_buffer(out, v, (bsz, T, HV, V))
    return _snapshot_rows_(
        cache, slot_ids, bsz, "v", out, snapshots,
        lambda ckpt, row: gdn_snapshot_verify(ckpt, q[row], k[row], v[row], a[row], b[row], A_log, dt_bias, scale),
    )


def snapshot_commit_cache_(
    cache,
    slot_ids: Union[Tensor, Sequence[int]],
    num_accepted: Union[Tensor, Sequence[int]],
    snapshots: Tensor,
) -> None:
    """Commit of the snapshot baseline: checkpoint[slot_ids[r]] = snapshots[r, a_r - 1] (cast
    to the checkpoint dtype) for every active row, 1 <= a_r <= T = snapshots.shape[1]. Pad
    rows skipped (their a ignored). Validated before anything is written. (An engine can avoid
    this copy by pointing the slot at the snapshot; the reference copies.)"""
    _check_conventional(cache)
    ids = slot_list(slot_ids)
    acc = _int_list("num_accepted", num_accepted, len(ids))
    if not isinstance(snapshots, Tensor) or snapshots.dim() != 2 + len(cache._state_shape):
        raise ValueError(f"snapshots must be a (batch, T, {', '.join(map(str, cache._state_shape))}) tensor")
    _check_snapshots(snapshots, (len(ids), snapshots.shape[1]) + tuple(cache._state_shape))
    T = snapshots.shape[1]
    active = active_rows(cache, ids, len(ids), "slot_ids")
    for r, s in active:
        if not 1 <= acc[r] <= T:
            raise ValueError(f"num_accepted[{r}] = {acc[r]} (slot {s}) must be in [1, T={T}]")
    for r, s in active:
        cache.checkpoint[s] = snapshots[r, acc[r] - 1].to(dtype=cache.checkpoint.dtype, device=cache.checkpoint.device)
