"""Float64 reference recurrences of Mamba-2 decoding, conventional and ReplaySSM: functions of
tensors (the pool-level steps on a cache are in ``pool`` and ``pool_spec``).

Written for clarity, not speed. Every function computes in float64 on the device of its
inputs and returns float64 results.

Conventions (docs/design.md, sections 2 and 3)
--------------------------------------------------
Shapes, with ``b`` = batch rows, ``H`` = heads, ``P`` = headdim (d_v), ``N`` = dstate
(d_k), ``G`` = groups and ``h`` = number of ring records:

* state / checkpoint ``(b, H, P, N)``, N contiguous
* ``x (b, H, P)`` value, ``B (b, G, N)`` key, ``C (b, G, N)`` query; head ``hd`` uses
  group ``hd // (H // G)``
* ``dt (b, H)`` raw, ``dt_bias (H,)``, ``A (H,)`` (negative), ``D (H,)``, ``z (b, H, P)``
* ``dt = softplus(dt + dt_bias)`` when ``dt_softplus`` (softplus(x) = x for x > 20)
* ``alpha = exp(A * dt)``; ``S = alpha * S + dt * x B^T``; ``y = S C + D * x``;
  with z: ``y *= z * sigmoid(z)``
* ring records, oldest first: ``ring_x (b, h, H, P)``, ``ring_B (b, h, G, N)``,
  ``ring_dt (b, h, H)`` with dt already after bias and softplus.

ReplaySSM (standard decoding, T = 1) with window L and cursor h = committed records,
0 <= h < L: a step appends the token's record (h + 1 records); if h + 1 == L it
flushes: checkpoint = Replay(checkpoint, all h + 1 records) and the ring empties;
otherwise it computes the output from checkpoint + records without writing state,
either through the rebuilt state ("state" route) or through the output-only route

    y = gamma_h * (S_ckpt C) + sum_j w_j * x_j * (B_j . C),
    gamma_h = exp(A * sum_j dt_j),   w_j = dt_j * exp(A * sum_{i > j} dt_i),

which never forms S. Window L == 1 is conventional decoding (every step flushes).

Speculative verification (docs/design.md section 4; paper Algorithm 2): tokens carry an extra
draft axis ``(b, T, ...)``; ``mamba2_verify_output`` gives the outputs of T drafts by the
output-only form of Eq. 6 (``common``) with (q, k, v) = (C, B, dt x), and
``mamba2_snapshot_verify`` is the conventional baseline (one state read, a full state per
draft).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .common import (
    F64, causal_decays, check_window, f64, later_sums, ring_len, softplus, spread_heads, state_dot, stepped,
)

__all__ = [
    "mamba2_dt",
    "mamba2_conventional_step",
    "mamba2_replay",
    "mamba2_replay_output",
    "mamba2_replay_step",
    "mamba2_verify_output",
    "mamba2_snapshot_verify",
]

_ROUTES = ("output_only", "state")

Tensor = torch.Tensor


def _group_to_head(t: Tensor, nheads: int) -> Tensor:
    """(..., G, N) -> (..., H, N): head hd gets group hd // (H // G)."""
    return spread_heads(t, nheads, "nheads", "ngroups")


def _state_times_c(state: Tensor, C: Tensor) -> Tensor:
    """y[b, hd, p] = sum_n state[b, hd, p, n] * C[b, group(hd), n] (all float64)."""
    return state_dot(state, _group_to_head(f64(C), state.shape[1]))


def _finish_output(y: Tensor, x: Tensor, D: Optional[Tensor], z: Optional[Tensor]) -> Tensor:
    """Add the skip term D * x and apply the optional gate z * sigmoid(z)."""
    if D is not None:
        y = y + f64(D).to(y.device)[None, :, None] * f64(x)
    if z is not None:
        z64 = f64(z)
        y = y * (z64 * torch.sigmoid(z64))
    return y


def mamba2_dt(dt: Tensor, dt_bias: Optional[Tensor] = None, dt_softplus: bool = False) -> Tensor:
    """Processed dt in float64, shape (b, H): dt + dt_bias, then softplus if asked."""
    out = f64(dt)
    if dt_bias is not None:
        out = out + f64(dt_bias).to(out.device)
    if dt_softplus:
        out = softplus(out)
    return out


def mamba2_conventional_step(
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
    """One conventional decode step. Returns (y (b, H, P), new_state (b, H, P, N)), float64.

    alpha = exp(A * dt); S = alpha * S + dt * x B^T; y = S C + D * x; y *= z * sigmoid(z).
    """
    S = f64(state)
    H = S.shape[1]
    dt64 = mamba2_dt(dt, dt_bias, dt_softplus)  # (b, H)
    alpha = torch.exp(f64(A)[None, :] * dt64)  # (b, H)
    B_h = _group_to_head(f64(B), H)  # (b, H, N)
    dtx = dt64[:, :, None] * f64(x)  # (b, H, P)
    new_state = alpha[:, :, None, None] * S + dtx[:, :, :, None] * B_h[:, :, None, :]
    y = _finish_output(_state_times_c(new_state, C), x, D, z)
    return y, new_state


def mamba2_replay(checkpoint: Tensor, ring_x: Tensor, ring_B: Tensor, ring_dt: Tensor, A: Tensor) -> Tensor:
    """Fold the h records (oldest first) into the checkpoint: the state after them, float64.

    For each record j in order: S = exp(A * dt_j) * S + dt_j * x_j B_j^T.
    ring_dt is already after bias and softplus.
    """
    S = f64(checkpoint).clone()
    H = S.shape[1]
    A64 = f64(A)[None, :]
    for j in range(ring_x.shape[1]):
        dt_j = f64(ring_dt[:, j])  # (b, H)
        B_h = _group_to_head(f64(ring_B[:, j]), H)  # (b, H, N)
        dtx = dt_j[:, :, None] * f64(ring_x[:, j])  # (b, H, P)
        S = torch.exp(A64 * dt_j)[:, :, None, None] * S + dtx[:, :, :, None] * B_h[:, :, None, :]
    return S


def mamba2_replay_output(
    checkpoint: Tensor, ring_x: Tensor, ring_B: Tensor, ring_dt: Tensor, A: Tensor, C: Tensor
) -> Tensor:
    """Output (b, H, P) of the state Replay(checkpoint, records), without D or z, float64.

    Output-only route; never forms the state:
        y = gamma_h * (S_ckpt C) + sum_j w_j * x_j * (B_j . C)
        gamma_h = exp(A * sum_j dt_j),  w_j = dt_j * exp(A * sum_{i > j} dt_i)
    The dot products B_j . C are computed once per group and shared by its heads.
    """
    S0 = f64(checkpoint)
    H = S0.shape[1]
    ngroups = C.shape[1]
    A64 = f64(A)[None, None, :]  # (1, 1, H)
    dt = f64(ring_dt)  # (b, h, H)

    w = dt * torch.exp(A64 * later_sums(dt))  # (b, h, H); exponent A * sum_{i > j} dt_i
    gamma = torch.exp(A64[:, 0] * dt.sum(dim=1))  # (b, H)

    kq = (f64(ring_B) * f64(C)[:, None]).sum(dim=-1)  # (b, h, G): B_j . C per group
    kq_h = kq.repeat_interleave(H // ngroups, dim=2)  # (b, h, H)

    y_ckpt = _state_times_c(S0, C)  # (b, H, P)
    y_ring = ((w * kq_h)[..., None] * f64(ring_x)).sum(dim=1)  # (b, H, P)
    return gamma[:, :, None] * y_ckpt + y_ring


def mamba2_replay_step(
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
    *,
    window: int,
    route: str = "output_only",
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One ReplaySSM decode step (T = 1) for a batch whose rows all hold the same h.

    The ring tensors hold the h committed records before this token (0 <= h < window),
    oldest first; h is ``ring_x.shape[1]`` and is shared by every row of the batch
    (``mamba2_decode_cache_`` handles rows at different ring positions, one row at a time).

    The token's record (x, B, processed dt) is appended, giving h + 1 records. Then:
      * h + 1 == window: flush. new_checkpoint = Replay(checkpoint, all h + 1 records) and
        y = new_checkpoint C (the route is irrelevant); the returned rings are empty.
      * otherwise: the checkpoint is returned unchanged (a float64 copy) and y comes from
        ``route``: "output_only" (``mamba2_replay_output``) or "state" (rebuild S, y = S C).
    Then y += D * x and y *= z * sigmoid(z) where given.

    Returns (y, new_checkpoint, new_ring_x, new_ring_B, new_ring_dt), all float64; the new
    rings hold h + 1 records (non-flush) or 0 records (flush), new_ring_dt after softplus.
    """
    check_window(window)
    if route not in _ROUTES:
        raise ValueError(f"route must be one of {_ROUTES}, got {route!r}")
    h = ring_len(window, {"ring_x": ring_x, "ring_B": ring_B, "ring_dt": ring_dt})

    dt64 = mamba2_dt(dt, dt_bias, dt_softplus)  # (b, H)
    all_x = torch.cat([f64(ring_x), f64(x)[:, None]], dim=1)
    all_B = torch.cat([f64(ring_B), f64(B)[:, None]], dim=1)
    all_dt = torch.cat([f64(ring_dt), dt64[:, None]], dim=1)
    ckpt = f64(checkpoint)

    if h + 1 == window:
        new_ckpt = mamba2_replay(ckpt, all_x, all_B, all_dt, A)
        y = _state_times_c(new_ckpt, C)
        all_x, all_B, all_dt = all_x[:, :0], all_B[:, :0], all_dt[:, :0]
    else:
        new_ckpt = ckpt.clone()
        if route == "state":
            y = _state_times_c(mamba2_replay(ckpt, all_x, all_B, all_dt, A), C)
        else:
            y = mamba2_replay_output(ckpt, all_x, all_B, all_dt, A, C)

    y = _finish_output(y, x, D, z)
    return y, new_ckpt, all_x, all_B, all_dt


# ----------------------------------------------------------------------------- speculative verify


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
    ckpt = f64(checkpoint)
    bsz, H, P, _ = ckpt.shape
    h, T = ring_x.shape[1], x.shape[1]
    dev = ckpt.device
    dt_d = mamba2_dt(dt, dt_bias, dt_softplus)  # (b, T, H)
    X = torch.cat([f64(ring_x), f64(x)], dim=1)  # (b, n, H, P)
    Bk = torch.cat([f64(ring_B), f64(B)], dim=1)  # (b, n, G, N)
    DT = torch.cat([f64(ring_dt), dt_d], dim=1)  # (b, n, H)
    C64 = f64(C)  # (b, T, G, N)

    A64 = f64(A).to(dev)
    cum = torch.zeros((bsz, h + T + 1, H), dtype=F64, device=dev)
    cum[:, 1:] = A64 * torch.cumsum(DT, dim=1)
    Dg, W = causal_decays(cum, h, T)  # (b, T, H), (b, n, T, H)

    kq = torch.einsum("bjgn,bsgn->bjsg", Bk, C64)  # (b, n, T, G): B_j . C_s per group
    kq_h = kq.repeat_interleave(H // kq.shape[-1], dim=-1)  # (b, n, T, H)
    y_ring = torch.einsum("bjsh,bjhp->bshp", W * kq_h * DT[:, :, None, :], X)
    y_ckpt = torch.einsum("bhpn,bshn->bshp", ckpt, _group_to_head(C64, H))  # S_ckpt C_s
    y = Dg[..., None] * y_ckpt + y_ring

    y = _finish_output(
        y.reshape(bsz * T, H, P), x.reshape(bsz * T, H, P), D, None if z is None else z.reshape(bsz * T, H, P)
    )
    return y.reshape(bsz, T, H, P), dt_d


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
    return stepped(
        state, x.shape[1],
        lambda S, s: mamba2_conventional_step(
            S, x[:, s], dt[:, s], A, B[:, s], C[:, s], D, None if z is None else z[:, s], dt_bias, dt_softplus
        ),
    )
