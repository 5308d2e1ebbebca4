"""Float64 reference for decoding on low-precision caches (docs/replayssm.md section 5; paper
Section 6, Algorithms 3 and 6, Appendices B.4 and E.4.1), Mamba-2 and Gated DeltaNet.

Written for clarity, not speed. Arithmetic is float64 as in ``reference``; a value is rounded
only where it is stored: a record in its ring dtype, a state copy in its format. Layouts, the
formats and the stochastic-rounding bits are those of ``replayssm_cute.cache`` (module
docstring); ``cache.read_state`` decodes a copy and ``cache._write_state_`` writes one fp32
state into every copy (SR into a low-precision checkpoint, RTN into the read copy).

Standard decoding (T = 1), per active row with h = cursor[slot] (pad rows as in ``reference``):

* non-flush (h + 1 < window): the state read is the **read copy** (or, without one, the
  checkpoint: the shared configuration), decoded exactly to float64; output and record as in
  ``reference.*_replay_step`` from that state and the h records as stored; the record is
  written at (origin + h) % capacity, cursor += 1. No state copy is written.
* flush (h + 1 >= window; every step at window 1): the state read is the **recurrence
  checkpoint**, decoded; the state after the token is rebuilt from it in float64 and its
  output computed from the rebuilt state; the rebuilt state is rounded once to fp32 and that
  one fp32 state is written into every copy (never one copy from the other); cursor = 0.
  GDN with ``flush_corrections == "rederive"`` (paper Algorithm 6) ignores the cached u_j:
  ``u_j = beta_j (v_j - alpha_j S_{j-1} k_j)`` along the recurrence from the checkpoint, with
  (k, g, v, beta) as stored, then the token's own step; "fold" folds the cached u_j
  (``reference.gdn_replay_step``).

With an fp32 checkpoint and no read copy (and GDN folding) this is ``reference.*_decode_cache_``
bit for bit: both run the same float64 step on the same values and store its fp32 rounding.

Speculative verify (``*_verify_lowprec_cache_``, paper Algorithms 3 and 6): as
``reference_spec.*_verify_cache_`` with the state read chosen by the flush rule: the
checkpoint when h + T > window (the flush step), else the read copy. The draft outputs (and
GDN draft corrections) come from that state; a flush rebuilds the committed records from the
checkpoint and writes every copy. GDN "rederive" re-derives the committed corrections from the
checkpoint first and uses them for the drafts and outputs too (``gdn_verify_lowprec_cache_``).
``reference_spec.commit_cache_`` is unchanged (it moves cursors only).
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch

from .reference import (
    _active_rows,
    _f64,
    _gdn_lead,
    _gdn_records,
    _gdn_slot_records,
    _key_to_value_heads,
    _mamba2_lead,
    _out_buffer,
    _ring_records,
    _slot_cursor,
    _slot_records,
    _spec_room,
    _state_dot,
    _write_records_,
    gdn_conventional_step,
    gdn_gates,
    gdn_replay,
    gdn_replay_step,
    mamba2_replay,
    mamba2_replay_step,
)

__all__ = [
    "read_state_f64",
    "store_state_",
    "gdn_replay_rederive",
    "mamba2_decode_lowprec_cache_",
    "gdn_decode_lowprec_cache_",
    "mamba2_materialize",
    "gdn_materialize",
    "mamba2_verify_lowprec_cache_",
    "gdn_verify_lowprec_cache_",
]

_F64 = torch.float64
Tensor = torch.Tensor


# ----------------------------------------------------------------------------- state copies


def read_state_f64(cache, slot: int, flush: bool) -> Tensor:
    """The state a step of ``slot`` reads, decoded to float64 (1, *state shape): the recurrence
    checkpoint on a flush step, else the read copy (the checkpoint when there is none)."""
    copy = "checkpoint" if flush or cache.read_copy is None else "read_copy"
    return _f64(cache.read_state([slot], copy))


def store_state_(cache, slot: int, state: Tensor) -> None:
    """A flush of ``slot``: round ``state`` (float64) once to fp32 and write that fp32 state into
    every copy (``cache._write_state_``); cursor = 0. Origin and ring are not touched."""
    cache._write_state_([slot], state.reshape((1,) + tuple(cache._state_shape)).to(torch.float32))
    cache.cursor[slot] = 0


def _gdn_raw_records(cache, slot: int, h: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The h committed records' (k, g, v, beta) of one GDN slot, oldest first, float64 as stored."""
    HV, V, K, H = cache.num_v_heads, cache.head_v_dim, cache.head_k_dim, cache.num_k_heads
    return _ring_records(cache, slot, h, (("ring_k", (H, K)), ("ring_g", (HV,)), ("ring_v", (HV, V)),
                                          ("ring_beta", (HV,))))


def _rederive(cache) -> bool:
    return getattr(cache, "flush_corrections", "fold") == "rederive"


# ----------------------------------------------------------------------------- layer math


def gdn_replay_rederive(
    checkpoint: Tensor, ring_k: Tensor, ring_g: Tensor, ring_v: Tensor, ring_beta: Tensor
) -> Tuple[Tensor, Tensor]:
    """Fold h records into the checkpoint re-deriving each correction on the way (paper
    Algorithm 6, line 8): for j in order, with S the state before record j,

        u_j = beta_j (v_j - alpha_j S k_j);  S = alpha_j S + u_j k_j^T,  alpha_j = exp(g_j)

    checkpoint (b, HV, V, K); ring_k (b, h, H, K) normalised keys, ring_g (b, h, HV), ring_v
    (b, h, HV, V), ring_beta (b, h, HV). Returns (state after the h records, u (b, h, HV, V)),
    float64. The cached corrections are not read.
    """
    S = _f64(checkpoint).clone()
    HV = S.shape[1]
    us = []
    for j in range(ring_k.shape[1]):
        alpha = torch.exp(_f64(ring_g[:, j]))  # (b, HV)
        k_v = _key_to_value_heads(_f64(ring_k[:, j]), HV)  # (b, HV, K)
        u = _f64(ring_beta[:, j])[:, :, None] * (_f64(ring_v[:, j]) - alpha[:, :, None] * _state_dot(S, k_v))
        S = alpha[:, :, None, None] * S + u[:, :, :, None] * k_v[:, :, None, :]
        us.append(u)
    U = torch.stack(us, dim=1) if us else torch.zeros(S.shape[:1] + (0,) + S.shape[1:3], dtype=_F64, device=S.device)
    return S, U


# ----------------------------------------------------------------------------- decode


def mamba2_decode_lowprec_cache_(
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
    """In-place reference decode step (T = 1) on any ``Mamba2Cache`` (module docstring);
    arguments, pad rows and ``out`` as ``reference.mamba2_decode_cache_``. Returns ``out``."""
    (b,) = _mamba2_lead(cache, x, dt, A, B, C, D, z, dt_bias)
    out = _out_buffer(out, x, (b, cache.nheads, cache.headdim))
    for r, s in _active_rows(cache, slot_ids, b, "x"):
        row = slice(r, r + 1)
        h = _slot_cursor(cache, s, allow_full=_spec_room(cache))
        flush = h + 1 >= cache.window
        y, new_ckpt, _, _, new_dt = mamba2_replay_step(
            read_state_f64(cache, s, flush), *_slot_records(cache, s, h), x[row], dt[row], A, B[row], C[row], D,
            None if z is None else z[row], dt_bias, dt_softplus, window=max(cache.window, h + 1), route="output_only",
        )
        out[r] = y[0].to(dtype=out.dtype, device=out.device)
        if flush:
            store_state_(cache, s, new_ckpt[0])
        else:
            pos = (int(cache.origin[s]) + h) % cache.capacity
            _write_records_(cache, s, pos, {"ring_x": x[row][0], "ring_B": B[row][0], "ring_dt": new_dt[0, -1]})
            cache.cursor[s] = h + 1
    return out


def gdn_decode_lowprec_cache_(
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
    """In-place reference GDN decode step (T = 1) on any ``GDNCache`` (module docstring);
    arguments, pad rows and ``out`` as ``reference.gdn_decode_cache_``. Returns ``out``.

    A flush with ``cache.flush_corrections == "rederive"`` rebuilds the state before the token
    with ``gdn_replay_rederive`` from the decoded checkpoint and the records' (k, g, v, beta),
    then takes the token's step (``reference.gdn_conventional_step``: u from that state,
    o = S_new q); with "fold" it is ``reference.gdn_replay_step`` from the decoded checkpoint.
    """
    (bsz,) = _gdn_lead(cache, q, k, v, a, b, A_log, dt_bias)
    out = _out_buffer(out, v, (bsz, cache.num_v_heads, cache.head_v_dim))
    for r, s in _active_rows(cache, slot_ids, bsz, "v"):
        row = slice(r, r + 1)
        h = _slot_cursor(cache, s, allow_full=_spec_room(cache))
        flush = h + 1 >= cache.window
        S = read_state_f64(cache, s, flush)
        if flush and _rederive(cache):
            S_h, _ = gdn_replay_rederive(S, *_gdn_raw_records(cache, s, h))
            o, new_ckpt = gdn_conventional_step(S_h, q[row], k[row], v[row], a[row], b[row], A_log, dt_bias, scale)
        else:
            o, new_ckpt, new_u, new_k, new_g = gdn_replay_step(
                S, *_gdn_slot_records(cache, s, h), q[row], k[row], v[row], a[row], b[row], A_log, dt_bias, scale,
                window=max(cache.window, h + 1),
            )
        out[r] = o[0].to(dtype=out.dtype, device=out.device)
        if flush:
            store_state_(cache, s, new_ckpt[0])
        else:
            _, beta = gdn_gates(a[row], b[row], A_log, dt_bias)
            pos = (int(cache.origin[s]) + h) % cache.capacity
            _write_records_(cache, s, pos, _gdn_records(cache, new_u[0, -1], new_k[0, -1], new_g[0, -1], v[row][0],
                                                        beta[0]))
            cache.cursor[s] = h + 1
    return out


# ----------------------------------------------------------------------------- materialize


def _materialize(cache, slot_ids, state_shape: tuple, replay) -> Tensor:
    """Float64 (n, *state_shape): ``replay(slot, h, decoded checkpoint)`` for each named slot."""
    ids = [int(s) for s in (slot_ids.tolist() if isinstance(slot_ids, Tensor) else slot_ids)]
    out = torch.empty((len(ids),) + state_shape, dtype=_F64, device=cache.device)
    for i, s in enumerate(ids):
        h = _slot_cursor(cache, s, allow_full=_spec_room(cache))
        out[i] = replay(s, h, _f64(cache.read_state([s], "checkpoint")))[0]
    return out


def mamba2_materialize(cache, slot_ids: Union[Tensor, Sequence[int]], A: Tensor) -> Tensor:
    """Current state of each named slot, float64 (n, H, P, N): the decoded recurrence checkpoint
    + replay of the committed records (as stored)."""
    return _materialize(
        cache, slot_ids, (cache.nheads, cache.headdim, cache.dstate),
        lambda s, h, ckpt: mamba2_replay(ckpt, *_slot_records(cache, s, h), A),
    )


def gdn_materialize(cache, slot_ids: Union[Tensor, Sequence[int]]) -> Tensor:
    """Current state of each named GDN slot, float64 (n, HV, V, K): the decoded recurrence
    checkpoint + the committed records, folded as the next flush will (re-derived corrections
    with ``flush_corrections == "rederive"``, else the cached ones)."""

    def replay(s, h, ckpt):
        if _rederive(cache):
            return gdn_replay_rederive(ckpt, *_gdn_raw_records(cache, s, h))[0]
        return gdn_replay(ckpt, *_gdn_slot_records(cache, s, h))

    return _materialize(cache, slot_ids, (cache.num_v_heads, cache.head_v_dim, cache.head_k_dim), replay)


# ----------------------------------------------------------------------------- speculative verify


def _verify_rows_(cache, slot_ids, nrows: int, per: str, out: Tensor, T: int, records, verify, replay) -> Tensor:
    """The row loop of a low-precision verify step: as ``reference_spec._verify_rows_`` with the
    state read by the flush rule (``read_state_f64``) and a flush writing every copy.
    ``records(slot, h, flush, S)`` gives the committed records the outputs use and
    ``replay(S, records)`` the state after them (S the decoded state read)."""
    from .reference_spec import _ring_positions, spec_flush

    for r, s in _active_rows(cache, slot_ids, nrows, per):
        h = _slot_cursor(cache, s, allow_full=True)
        flush = spec_flush(h, T, cache.window)
        S = read_state_f64(cache, s, flush)
        recs = records(s, h, flush, S)
        y, drafts = verify(S, recs, slice(r, r + 1))
        out[r] = y[0].to(dtype=out.dtype, device=out.device)
        _write_records_(cache, s, _ring_positions(cache, s, h, T), drafts)
        if flush:
            store_state_(cache, s, replay(S, recs)[0])
            cache.origin[s] = (int(cache.origin[s]) + h) % cache.capacity
    return out


def mamba2_verify_lowprec_cache_(
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
    """``reference_spec.mamba2_verify_cache_`` on any ``Mamba2Cache`` (paper Algorithm 3): the
    outputs read the checkpoint when h + T > window, else the read copy; a flush writes every
    copy. Arguments and effects otherwise as there."""
    from .reference_spec import _num_drafts, mamba2_verify_output

    b, T = _mamba2_lead(cache, x, dt, A, B, C, D, z, dt_bias, drafts=True)
    _num_drafts(cache, T, "x")
    out = _out_buffer(out, x, (b, T, cache.nheads, cache.headdim))

    def verify(ckpt, recs, row):
        y, dt_d = mamba2_verify_output(
            ckpt, *recs, x[row], dt[row], A, B[row], C[row], D, None if z is None else z[row], dt_bias, dt_softplus
        )
        return y, {"ring_x": x[row][0], "ring_B": B[row][0], "ring_dt": dt_d[0]}

    return _verify_rows_(cache, slot_ids, b, "x", out, T, lambda s, h, flush, S: _slot_records(cache, s, h), verify,
                         lambda S, recs: mamba2_replay(S, *recs, A))


def gdn_verify_lowprec_cache_(
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
    """``reference_spec.gdn_verify_cache_`` on any ``GDNCache`` (paper Algorithm 6): the draft
    corrections and outputs come from the checkpoint when h + T > window, else from the read
    copy with the cached committed corrections; a flush folds the committed records and writes
    every copy.

    With ``flush_corrections == "rederive"`` a flush step first re-derives the committed
    corrections from the checkpoint (``gdn_replay_rederive``, Algorithm 6 line 8) and uses them
    for the draft corrections and outputs as well as for the fold, so nothing a flush step
    returns or stores depends on the read copy (as in the decode flush). The paper's line
    order solves the drafts (line 4) with the cached corrections before re-deriving; the
    re-derivation reads only S_ckpt k_j of the same pass over the checkpoint, so a kernel
    can take either order. "fold" uses the cached corrections throughout."""
    from .reference_spec import _num_drafts, gdn_verify_output

    bsz, T = _gdn_lead(cache, q, k, v, a, b, A_log, dt_bias, drafts=True)
    _num_drafts(cache, T, "v")
    out = _out_buffer(out, v, (bsz, T, cache.num_v_heads, cache.head_v_dim))

    def verify(ckpt, recs, row):
        o, u_d, kn, g, beta = gdn_verify_output(ckpt, *recs, q[row], k[row], v[row], a[row], b[row], A_log,
                                                dt_bias, scale)
        return o, _gdn_records(cache, u_d[0], kn[0], g[0], v[row][0], beta[0])

    def records(s, h, flush, S):
        recs = _gdn_slot_records(cache, s, h)
        if flush and _rederive(cache):
            recs = (gdn_replay_rederive(S, *_gdn_raw_records(cache, s, h))[1],) + recs[1:]
        return recs

    return _verify_rows_(cache, slot_ids, bsz, "v", out, T, records, verify, lambda S, recs: gdn_replay(S, *recs))
