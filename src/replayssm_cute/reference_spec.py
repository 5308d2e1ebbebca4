"""Float64 reference for speculative verification (docs/design.md section 4; paper
Algorithms 2 and 5, Eq. 6, 10 and 11), Mamba-2 and Gated DeltaNet.

Written for clarity, not speed; every function computes in float64. Layer conventions,
shapes and the pad-row rules are those of ``reference`` (whose helpers this module reuses);
tokens carry an extra draft axis: ``(batch, T, ...)``.

Ring, origin and cursor conventions (what the GPU kernels must match)
---------------------------------------------------------------------
Per slot: ``checkpoint``, cursor ``h`` = committed records, ``origin`` and a ring of
``capacity = window + max_draft`` records. Committed record ``i`` (0-based, oldest first)
lives at ring index ``(origin + i) % capacity``. Window ``L = cache.window``.

* Invariant: ``0 <= h <= L`` between steps (standard decoding keeps ``h < L``; a speculative
  commit may leave ``h == L``). ``1 <= T <= min(max_draft, L)``.
* Verify (``*_verify_cache_``), per active row, with h and origin o read before the step:

  1. outputs of all T drafts, output-only, from the checkpoint as stored (read once), the h
     committed records as stored, and the T drafts' own values in float64 as given (GDN: as
     solved) -- the same rule as the decode reference for the current token;
  2. draft i (0-based) is written at ring index ``(o + h + i) % capacity`` (behind the
     committed records; nothing else in the ring is written);
  3. flush iff ``h + T > L`` (decided from h and T only): checkpoint = Replay(checkpoint, the h
     committed records as stored), cast to fp32; ``origin = (o + h) % capacity``; ``cursor = 0``.
     The drafts are then records 0..T-1. Otherwise checkpoint, origin and cursor are untouched.

  After verify ``cursor + T <= L`` always.
* Commit (``commit_cache_``): ``cursor += a`` with ``1 <= a <= T``; nothing else is touched
  (drafts beyond a stay in the ring, unread, and the next verify overwrites them). Since
  ``cursor + T <= L`` after verify, ``cursor <= L`` after commit: at most L committed records.
* T = 1 with a = 1 is a decode step, valid for every ``0 <= h <= L``. For ``h <= L - 2`` it
  leaves the cache exactly as ``reference.*_decode_cache_`` does. At ``h == L - 1`` the decode
  reference flushes (folding its own token, cursor 0) while the speculative rule does not
  (cursor L); the next speculative step flushes the L committed records instead. Same states
  and outputs, different timing of the checkpoint write.

Output-only form (Eq. 6). Records 1..n, n = h + T, committed first; draft s (1-based) sits at
position t = h + s; gamma_{i:j} = product of the decays of records i..j, gamma_t = gamma_{1:t}:

    o_s = gamma_{h+s} (S_ckpt q_s) + sum_{j <= h+s} gamma_{j+1:h+s} (k_j . q_s) v_j

with (q, k, v) = (C, B, dt x) for Mamba-2 and (q, k, u) for GDN. GDN draft corrections (Eq.
10) come from one T x T unit-lower-triangular solve per (row, value head):

    u_s + beta_s sum_{j<s} A_js u_j = beta_s R_s,   A_js = gamma_{h+j+1:h+s} (k_{h+j} . k_{h+s})
    R_s = v_s - gamma_{h+s} (S_ckpt k_s) - sum_{j <= h} gamma_{j+1:h+s} (k_j . k_s) u_j

(the paper's ``U_d (I + A B_d) = R B_d`` with the draft axis as rows).

Conventional baseline: ``*_snapshot_verify`` (one state read, a full state per draft) and
``snapshot_select`` / ``snapshot_commit_cache_`` (keep snapshot a).
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence, Tuple, Union

import torch

from .reference import (
    _StateAccess,
    _active_rows,
    _check_shape,
    _f64,
    _finish_output,
    _gdn_lead,
    _gdn_raw_records,
    _gdn_records,
    _gdn_slot_records,
    _group_to_head,
    _int_values,
    _key_to_value_heads,
    _mamba2_lead,
    _out_buffer,
    _rederive,
    _slot_cursor,
    _slot_list,
    _slot_records,
    _state_access,
    _write_records_,
    gdn_conventional_step,
    gdn_gates,
    gdn_normalize,
    gdn_replay,
    gdn_replay_rederive,
    mamba2_conventional_step,
    mamba2_dt,
    mamba2_replay,
)

__all__ = [
    "spec_flush",
    "mamba2_verify_output",
    "gdn_draft_corrections",
    "gdn_verify_output",
    "mamba2_verify_cache_",
    "gdn_verify_cache_",
    "commit_cache_",
    "mamba2_snapshot_verify",
    "gdn_snapshot_verify",
    "snapshot_select",
    "mamba2_snapshot_verify_cache_",
    "gdn_snapshot_verify_cache_",
    "snapshot_commit_cache_",
]

_F64 = torch.float64
Tensor = torch.Tensor


# ----------------------------------------------------------------------------- shared


def spec_flush(h: int, num_drafts: int, window: int) -> bool:
    """The flush rule of a verify step: flush exactly when h + T > L (h committed records)."""
    return h + num_drafts > window


def _causal_decays(cum: Tensor, h: int, T: int) -> Tuple[Tensor, Tensor]:
    """Decay factors of Eq. 6 from log-cumulative decays.

    cum (b, n + 1, Hh): cum[:, i] = log of the product of the decays of records 1..i (cum[:, 0]
    = 0), n = h + T. Returns
      D (b, T, Hh):    D[:, s] = gamma_{h+s+1}              (0-based draft s: position h+s+1)
      W (b, n, T, Hh): W[:, j, s] = gamma_{j+2:h+s+1} for 0-based record j <= h + s, else 0
    i.e. W[:, j, s] = exp(cum[h+s+1] - cum[j+1]) under the causal mask (1 on the diagonal).
    """
    n = cum.shape[1] - 1
    dev = cum.device
    pos = h + torch.arange(1, T + 1, device=dev)  # 1-based position of each draft
    cum_t = cum[:, pos]  # (b, T, Hh)
    D = torch.exp(cum_t)
    expo = cum_t[:, None, :, :] - cum[:, 1:, None, :]  # (b, n, T, Hh)
    causal = torch.arange(n, device=dev)[:, None] < pos[None, :]  # (n, T): record j <= position
    W = torch.exp(expo.masked_fill(~causal[None, :, :, None], float("-inf")))
    return D, W


def _per_value_head(t: Tensor, num_v_heads: int) -> Tensor:
    """(..., H) per key head -> (..., HV): value head hv gets key head hv // (HV // H)."""
    return _key_to_value_heads(t[..., None], num_v_heads)[..., 0]


def _num_drafts(cache, T: int, what: str) -> None:
    if T < 1:
        raise ValueError(f"{what} must hold at least one draft token, got T = {T}")
    if T > cache.max_draft or T > cache.window:
        raise ValueError(
            f"T = {T} draft tokens need 1 <= T <= min(max_draft={cache.max_draft}, window={cache.window}) "
            f"(ring capacity window + max_draft; at most window committed records)"
        )


def _int_list(name: str, values, n: int) -> list:
    out = _int_values(name, values)
    if len(out) != n:
        raise ValueError(f"{name} has {len(out)} entries, expected {n} (one per row of slot_ids)")
    return out


def _ring_positions(cache, slot: int, h: int, T: int) -> Tensor:
    """Ring indices of the T draft records of a slot with h committed records."""
    o = int(cache.origin[slot])
    return torch.tensor([(o + h + i) % cache.capacity for i in range(T)], device=cache.checkpoint.device)


def _verify_rows_(
    state: _StateAccess, cache, slot_ids, nrows: int, per: str, out: Tensor, T: int, records, verify, replay
) -> Tensor:
    """The row loop of a cache-level verify step (``*_verify_cache_``); returns ``out``.

    For every active row r (slot s), with h = cursor[s] (0 <= h <= window), flush =
    ``spec_flush`` and S = ``state.read(cache, s, flush)``: ``verify(S, recs, slice(r, r + 1))``
    with recs = ``records(s, h, flush, S)`` (the committed records) gives (outputs, records of
    the T drafts as ring name -> value); outputs[0] is cast into ``out[r]`` and the drafts are
    written at ``_ring_positions``. A flush stores ``replay(S, *recs)`` (``state.store_``) and
    drops the h committed records by moving the origin.
    """
    for r, s in _active_rows(cache, slot_ids, nrows, per):
        h = _slot_cursor(cache, s, allow_full=True)
        flush = spec_flush(h, T, cache.window)
        S = state.read(cache, s, flush)
        recs = records(s, h, flush, S)
        y, drafts = verify(S, recs, slice(r, r + 1))
        out[r] = y[0].to(dtype=out.dtype, device=out.device)
        _write_records_(cache, s, _ring_positions(cache, s, h, T), drafts)
        if flush:
            state.store_(cache, s, replay(S, *recs)[0])
            cache.origin[s] = (int(cache.origin[s]) + h) % cache.capacity
    return out


def _stepped(state: Tensor, T: int, step) -> Tuple[Tensor, Tensor]:
    """Run ``step(S, s) -> (output, new S)`` for s = 0..T-1 from float64 ``state``; returns the
    outputs and the state after each step, stacked on a new dim 1."""
    S = _f64(state)
    outs, snaps = [], []
    for s in range(T):
        o, S = step(S, s)
        outs.append(o)
        snaps.append(S)
    return torch.stack(outs, dim=1), torch.stack(snaps, dim=1)


def _snapshot_rows_(cache, slot_ids, nrows: int, per: str, out: Tensor, snapshots: Tensor, verify_row) -> Tensor:
    """The row loop of the snapshot baseline: for every active row r (slot s),
    ``verify_row(checkpoint[s : s + 1], slice(r, r + 1)) -> (out, snapshots)`` of that row, cast
    into ``out[r]`` and ``snapshots[r]``. Returns ``out``."""
    for r, s in _active_rows(cache, slot_ids, nrows, per):
        o, snaps = verify_row(cache.checkpoint[s : s + 1], slice(r, r + 1))
        out[r] = o[0].to(dtype=out.dtype, device=out.device)
        snapshots[r] = snaps[0].to(dtype=snapshots.dtype, device=snapshots.device)
    return out


# ============================================================================= Mamba-2


def mamba2_verify_output(
    checkpoint: Tensor,
    ring_x: Tensor,
    ring_B: Tensor,
    ring_dt: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor] = None,
    z: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    dt_softplus: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Outputs of T draft tokens, output-only (Eq. 6), for rows that all hold the same h.

    checkpoint (b, H, P, N); committed records, oldest first: ring_x (b, h, H, P), ring_B
    (b, h, G, N), ring_dt (b, h, H) (processed dt); drafts: x (b, T, H, P), dt (b, T, H) raw,
    B, C (b, T, G, N), z (b, T, H, P). Never forms a state:

        y_s = gamma_{h+s} (S_ckpt C_s) + sum_{j <= h+s} W_js dt_j x_j (B_j . C_s) + D x_s,
        W_js = exp(A * sum_{i in (j, h+s]} dt_i),  gamma_{h+s} = exp(A * sum_{i <= h+s} dt_i)

    then y_s *= z_s * sigmoid(z_s) where given. B_j . C_s is formed once per group.
    Returns (y (b, T, H, P), processed draft dt (b, T, H)), float64.
    """
    ckpt = _f64(checkpoint)
    bsz, H, P, _ = ckpt.shape
    h, T = ring_x.shape[1], x.shape[1]
    dev = ckpt.device
    dt_d = mamba2_dt(dt, dt_bias, dt_softplus)  # (b, T, H)
    X = torch.cat([_f64(ring_x), _f64(x)], dim=1)  # (b, n, H, P)
    Bk = torch.cat([_f64(ring_B), _f64(B)], dim=1)  # (b, n, G, N)
    DT = torch.cat([_f64(ring_dt), dt_d], dim=1)  # (b, n, H)
    C64 = _f64(C)  # (b, T, G, N)

    A64 = _f64(A).to(dev)
    cum = torch.zeros((bsz, h + T + 1, H), dtype=_F64, device=dev)
    cum[:, 1:] = A64 * torch.cumsum(DT, dim=1)
    Dg, W = _causal_decays(cum, h, T)  # (b, T, H), (b, n, T, H)

    kq = torch.einsum("bjgn,bsgn->bjsg", Bk, C64)  # (b, n, T, G): B_j . C_s per group
    kq_h = kq.repeat_interleave(H // kq.shape[-1], dim=-1)  # (b, n, T, H)
    y_ring = torch.einsum("bjsh,bjhp->bshp", W * kq_h * DT[:, :, None, :], X)
    y_ckpt = torch.einsum("bhpn,bshn->bshp", ckpt, _group_to_head(C64, H))  # S_ckpt C_s
    y = Dg[..., None] * y_ckpt + y_ring

    y = _finish_output(
        y.reshape(bsz * T, H, P), x.reshape(bsz * T, H, P), D, None if z is None else z.reshape(bsz * T, H, P)
    )
    return y.reshape(bsz, T, H, P), dt_d


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
) -> Tensor:
    """In-place cache-level reference verify step of T draft tokens on a ``Mamba2Cache``.

    Arguments as ``reference.mamba2_decode_cache_`` with a draft axis: x (b, T, H, P), dt
    (b, T, H), B, C (b, T, G, N), z (b, T, H, P); out (b, T, H, P) in x's dtype (allocated,
    zero, if None). Needs 1 <= T <= min(max_draft, window). Pad-sentinel and out-of-pool rows
    are skipped (nothing touched, out rows untouched); two active rows naming one slot raise.

    Every active row, with h = cursor[slot] (0 <= h <= window) and o = origin[slot]: outputs
    of all T drafts from ``mamba2_verify_output`` (checkpoint and committed records as stored,
    drafts in float64 as given); draft i's record (x, B cast to the ring dtype, processed dt to
    fp32) written at (o + h + i) % capacity; if h + T > window, flush: checkpoint =
    Replay(checkpoint, the h committed records) in fp32, origin = (o + h) % capacity, cursor
    = 0. Cursors are not advanced: ``commit_cache_`` does that. ``arrivals`` is not touched.
    A cache with low-precision state reads and writes its state copies as
    ``reference_lowprec.mamba2_verify_lowprec_cache_`` describes.
    """
    return _mamba2_verify_(_state_access(cache), cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out)


def _mamba2_verify_(state: _StateAccess, cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out) -> Tensor:
    """``mamba2_verify_cache_`` with the slots' state reached through ``state``."""
    b, T = _mamba2_lead(cache, x, dt, A, B, C, D, z, dt_bias, drafts=True)
    _num_drafts(cache, T, "x")
    out = _out_buffer(out, x, (b, T, cache.nheads, cache.headdim))

    def verify(ckpt, recs, row):
        y, dt_d = mamba2_verify_output(
            ckpt, *recs, x[row], dt[row], A, B[row], C[row], D, None if z is None else z[row], dt_bias, dt_softplus
        )
        return y, {"ring_x": x[row][0], "ring_B": B[row][0], "ring_dt": dt_d[0]}

    return _verify_rows_(
        state, cache, slot_ids, b, "x", out, T, lambda s, h, flush, ckpt: _slot_records(cache, s, h), verify,
        lambda ckpt, rec_x, rec_B, rec_dt: mamba2_replay(ckpt, rec_x, rec_B, rec_dt, A),
    )


# ============================================================================= Gated DeltaNet


def gdn_draft_corrections(
    checkpoint: Tensor,
    ring_u: Tensor,
    ring_k: Tensor,
    ring_g: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
) -> Tensor:
    """Draft corrections u_1..u_T (b, T, HV, V) by one T x T triangular solve (Eq. 10), float64.

    checkpoint (b, HV, V, K); committed records ring_u (b, h, HV, V), ring_k (b, h, H, K)
    (normalised), ring_g (b, h, HV); drafts: k (b, T, H, K) normalised keys, v (b, T, HV, V),
    log decays g (b, T, HV), beta (b, T, HV). Per (row, value head), with draft s at position
    h + s:

        R_s = v_s - gamma_{h+s} (S_ckpt k_s) - sum_{j <= h} gamma_{j+1:h+s} (k_j . k_s) u_j
        M u = beta R,  M_ss = 1,  M_sj = beta_s gamma_{h+j+1:h+s} (k_{h+j} . k_{h+s}) (j < s)

    M is unit lower triangular; the checkpoint enters only through S_ckpt k_s.
    """
    ckpt = _f64(checkpoint)
    h, T = ring_u.shape[1], k.shape[1]
    K_all = torch.cat([_f64(ring_k), _f64(k)], dim=1)  # (b, n, H, K)
    Dg, W = _causal_decays(_log_cumsum(ring_g, g), h, T)
    return _gdn_solve(ckpt, _f64(ring_u), K_all, v, beta, Dg, W)


def _log_cumsum(ring_g: Tensor, g: Tensor) -> Tensor:
    """cum (b, n + 1, HV): cum[:, i] = sum of the log decays of records 1..i, cum[:, 0] = 0."""
    g_all = torch.cat([_f64(ring_g), _f64(g)], dim=1)  # (b, n, HV)
    cum = torch.zeros((g_all.shape[0], g_all.shape[1] + 1, g_all.shape[2]), dtype=_F64, device=g_all.device)
    cum[:, 1:] = torch.cumsum(g_all, dim=1)
    return cum


def _gdn_solve(ckpt: Tensor, U_c: Tensor, K_all: Tensor, v: Tensor, beta: Tensor, Dg: Tensor, W: Tensor) -> Tensor:
    """Eq. 10 given the decays (``_causal_decays``): U_c (b, h, HV, V) committed corrections,
    K_all (b, h + T, H, K) committed then draft keys. Returns U_d (b, T, HV, V)."""
    HV = ckpt.shape[1]
    h = U_c.shape[1]
    T = K_all.shape[1] - h
    dev = ckpt.device
    kd = K_all[:, h:]
    kk = torch.einsum("bjhk,bshk->bjsh", K_all, kd)  # (b, n, T, H): k_j . k_s per key head
    Wkk = W * _per_value_head(kk, HV)  # (b, n, T, HV)
    Sk = torch.einsum("bhvk,bshk->bshv", ckpt, _key_to_value_heads(kd, HV))  # S_ckpt k_s
    R = _f64(v) - Dg[..., None] * Sk - torch.einsum("bjsh,bjhv->bshv", Wkk[:, :h], U_c)

    beta64 = _f64(beta)  # (b, T, HV)
    strict = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev), diagonal=-1)  # [s, j]: j < s
    A_sj = Wkk[:, h:].permute(0, 3, 2, 1)  # (b, HV, T(s), T(j)): gamma_{h+j+1:h+s} k_{h+j}.k_{h+s}
    M = torch.eye(T, dtype=_F64, device=dev) + beta64.permute(0, 2, 1)[..., None] * A_sj * strict
    rhs = (beta64[..., None] * R).permute(0, 2, 1, 3)  # (b, HV, T, V)
    U = torch.linalg.solve_triangular(M, rhs, upper=False, unitriangular=True)
    return U.permute(0, 2, 1, 3).contiguous()  # (b, T, HV, V)


def gdn_verify_output(
    checkpoint: Tensor,
    ring_u: Tensor,
    ring_k: Tensor,
    ring_g: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Outputs of T GDN draft tokens, output-only (Eq. 10-11), for rows that all hold the same h.

    checkpoint (b, HV, V, K); committed records ring_u (b, h, HV, V), ring_k (b, h, H, K),
    ring_g (b, h, HV); drafts q, k (b, T, H, K), v (b, T, HV, V), a, b (b, T, HV) raw. q and k
    are normalised (q scaled) and the gates formed as in ``reference``; the corrections come
    from ``gdn_draft_corrections``; then, with U = [committed u, draft u]:

        o_s = gamma_{h+s} (S_ckpt q_s) + sum_{j <= h+s} gamma_{j+1:h+s} (k_j . q_s) u_j

    The checkpoint enters only through S_ckpt k_s and S_ckpt q_s (one pass over it).
    Returns (o (b, T, HV, V), u (b, T, HV, V), normalised k (b, T, H, K), g (b, T, HV),
    beta (b, T, HV)), float64: the outputs and the draft records.
    """
    ckpt = _f64(checkpoint)
    HV = ckpt.shape[1]
    h, T = ring_u.shape[1], v.shape[1]
    qn, kn = gdn_normalize(q, k, scale)  # (b, T, H, K)
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # (b, T, HV)
    K_all = torch.cat([_f64(ring_k), kn], dim=1)  # (b, n, H, K)
    Dg, W = _causal_decays(_log_cumsum(ring_g, g), h, T)  # shared by Eq. 10 and Eq. 11
    U_c = _f64(ring_u)
    u_d = _gdn_solve(ckpt, U_c, K_all, v, beta, Dg, W)  # = gdn_draft_corrections(...)
    U_all = torch.cat([U_c, u_d], dim=1)  # (b, n, HV, V)

    kq = torch.einsum("bjhk,bshk->bjsh", K_all, qn)  # (b, n, T, H)
    Sq = torch.einsum("bhvk,bshk->bshv", ckpt, _key_to_value_heads(qn, HV))  # S_ckpt q_s
    o = Dg[..., None] * Sq + torch.einsum("bjsh,bjhv->bshv", W * _per_value_head(kq, HV), U_all)
    return o, u_d, kn, g, beta


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
) -> Tensor:
    """In-place cache-level reference verify step of T draft tokens on a ``GDNCache``.

    Arguments as ``reference.gdn_decode_cache_`` with a draft axis: q, k (batch, T, H, K), v
    (batch, T, HV, V), a, b (batch, T, HV); out (batch, T, HV, V) in v's dtype (allocated,
    zero, if None). Needs 1 <= T <= min(max_draft, window). Pad rows as in the decode reference.

    Every active row, with h = cursor[slot] (0 <= h <= window) and o = origin[slot]: outputs
    and draft corrections from ``gdn_verify_output`` (checkpoint and committed records as
    stored; drafts in float64); draft i's record (u cast to fp16, normalised k to the ring
    dtype, g to fp32, and v / beta when the cache keeps them) written at (o + h + i) %
    capacity; if h + T > window, flush: checkpoint = Replay(checkpoint, the h committed records)
    in fp32, origin = (o + h) % capacity, cursor = 0. Cursors are not advanced (see
    ``commit_cache_``). ``arrivals`` is not touched. A cache with low-precision state or
    re-derived flush corrections reads and writes its state copies and re-derives as
    ``reference_lowprec.gdn_verify_lowprec_cache_`` describes.
    """
    return _gdn_verify_(_state_access(cache), cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out)


def _gdn_verify_(state: _StateAccess, cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out) -> Tensor:
    """``gdn_verify_cache_`` with the slots' state reached through ``state``."""
    bsz, T = _gdn_lead(cache, q, k, v, a, b, A_log, dt_bias, drafts=True)
    _num_drafts(cache, T, "v")
    out = _out_buffer(out, v, (bsz, T, cache.num_v_heads, cache.head_v_dim))

    def verify(ckpt, recs, row):
        o, u_d, kn, g, beta = gdn_verify_output(
            ckpt, *recs, q[row], k[row], v[row], a[row], b[row], A_log, dt_bias, scale
        )
        return o, _gdn_records(cache, u_d[0], kn[0], g[0], v[row][0], beta[0])

    def records(s, h, flush, ckpt):
        recs = _gdn_slot_records(cache, s, h)
        if flush and _rederive(cache):  # Algorithm 6: the checkpoint's own corrections, for drafts and fold
            recs = (gdn_replay_rederive(ckpt, *_gdn_raw_records(cache, s, h))[1],) + recs[1:]
        return recs

    return _verify_rows_(state, cache, slot_ids, bsz, "v", out, T, records, verify, gdn_replay)


# ============================================================================= commit


def commit_cache_(
    cache,
    slot_ids: Union[Tensor, Sequence[int]],
    num_accepted: Union[Tensor, Sequence[int]],
    *,
    num_drafts: Optional[int] = None,
) -> None:
    """Commit the accepted drafts of the last verify step: cursor[slot] += a, nothing else.

    Works on a ``Mamba2Cache`` or a ``GDNCache``. ``num_accepted`` holds one int a per row of
    ``slot_ids`` (a tensor or a sequence); rows skipped by verify (pad sentinel, out of pool)
    are skipped here too and their a is ignored. Every active row needs 1 <= a <=
    max_draft (and a <= num_drafts when given: the T of the verify step) and cursor + a <=
    window (at most L committed records; verify leaves cursor + T <= window). Drafts beyond a
    stay in the ring and are never read; a flush's dropped prefix was already skipped by
    verify moving the origin. Everything is validated before anything is written.
    """
    if cache.is_conventional:
        raise ValueError("commit_cache_ needs a ReplaySSM cache with draft room (window > 1, max_draft >= 1)")
    ids = _slot_list(slot_ids)
    acc = _int_list("num_accepted", num_accepted, len(ids))
    if num_drafts is not None:
        _num_drafts(cache, operator.index(num_drafts), "num_drafts")
    limit = cache.max_draft if num_drafts is None else num_drafts
    plan = []
    for r, s in _active_rows(cache, ids, len(ids), "slot_ids"):
        a = acc[r]
        h = _slot_cursor(cache, s, allow_full=True)
        if not 1 <= a <= limit:
            raise ValueError(f"num_accepted[{r}] = {a} (slot {s}) must be in [1, {limit}]")
        if h + a > cache.window:
            raise ValueError(
                f"slot {s}: cursor {h} + accepted {a} > window {cache.window}; a verify step leaves "
                f"cursor + T <= window, so this commit does not follow one with T >= {a}"
            )
        plan.append((s, h + a))
    for s, h_new in plan:
        cache.cursor[s] = h_new


# ============================================================================= conventional baseline


def mamba2_snapshot_verify(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Optional[Tensor] = None,
    z: Optional[Tensor] = None,
    dt_bias: Optional[Tensor] = None,
    dt_softplus: bool = False,
) -> Tuple[Tensor, Tensor]:
    """Conventional speculative verify: state (b, H, P, N) read once, T tokens (b, T, ...)
    stepped with the recurrence, the full state stored after each. Returns (y (b, T, H, P),
    snapshots (b, T, H, P, N)), float64; snapshots[:, s] = state after draft s (0-based)."""
    return _stepped(
        state, x.shape[1],
        lambda S, s: mamba2_conventional_step(
            S, x[:, s], dt[:, s], A, B[:, s], C[:, s], D, None if z is None else z[:, s], dt_bias, dt_softplus
        ),
    )


def gdn_snapshot_verify(
    state: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    A_log: Tensor,
    dt_bias: Tensor,
    scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Conventional GDN speculative verify: state (b, HV, V, K) read once, T tokens stepped
    with the recurrence, a full state stored after each. Returns (o (b, T, HV, V), snapshots
    (b, T, HV, V, K)), float64."""
    return _stepped(
        state, v.shape[1],
        lambda S, s: gdn_conventional_step(S, q[:, s], k[:, s], v[:, s], a[:, s], b[:, s], A_log, dt_bias, scale),
    )


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
    _check_shape("snapshots", snapshots, shape)


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
    b, T = _mamba2_lead(cache, x, dt, A, B, C, D, z, dt_bias, drafts=True)
    if T < 1:
        raise ValueError("x must hold at least one draft token")
    _check_snapshots(snapshots, (b, T, H, P, N))
    out = _out_buffer(out, x, (b, T, H, P))
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
    bsz, T = _gdn_lead(cache, q, k, v, a, b, A_log, dt_bias, drafts=True, check_v=False)
    if T < 1:
        raise ValueError("v must hold at least one draft token")
    _check_snapshots(snapshots, (bsz, T, HV, V, K))
    out = _out_buffer(out, v, (bsz, T, HV, V))
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
    ids = _slot_list(slot_ids)
    acc = _int_list("num_accepted", num_accepted, len(ids))
    if not isinstance(snapshots, Tensor) or snapshots.dim() != 2 + len(cache._state_shape):
        raise ValueError(f"snapshots must be a (batch, T, {', '.join(map(str, cache._state_shape))}) tensor")
    _check_snapshots(snapshots, (len(ids), snapshots.shape[1]) + tuple(cache._state_shape))
    T = snapshots.shape[1]
    active = _active_rows(cache, ids, len(ids), "slot_ids")
    for r, s in active:
        if not 1 <= acc[r] <= T:
            raise ValueError(f"num_accepted[{r}] = {acc[r]} (slot {s}) must be in [1, T={T}]")
    for r, s in active:
        cache.checkpoint[s] = snapshots[r, acc[r] - 1].to(dtype=cache.checkpoint.dtype, device=cache.checkpoint.device)
