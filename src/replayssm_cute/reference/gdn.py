"""Float64 reference recurrences of Gated DeltaNet decoding, conventional and ReplaySSM:
functions of tensors (the pool-level steps on a cache are in ``pool`` and ``pool_spec``).

Written for clarity, not speed. Every function computes in float64 on the device of its
inputs and returns float64 results.

Conventions (docs/design.md, sections 2 and 3): ``HV`` value heads of size ``V``, ``H`` key
heads of size ``K`` and value head ``hv`` reads key head ``hv // (HV // H)``:

* state / checkpoint ``(b, HV, V, K)``, K contiguous
* ``q, k (b, H, K)``, ``v (b, HV, V)``, raw gates ``a, b (b, HV)``, ``A_log (HV,)``,
  ``dt_bias (HV,)``
* q and k are L2-normalised (``x / sqrt(sum x^2 + 1e-6)``), then ``q *= scale``
  (default ``K ** -0.5``)
* ``g = -exp(A_log) * softplus(a + dt_bias)``, ``alpha = exp(g)``, ``beta = sigmoid(b)``
* ``u = beta * (v - alpha * S k)``; ``S = alpha * S + u k^T``; ``o = S q``
* ring records, oldest first: ``ring_u (b, h, HV, V)``, ``ring_k (b, h, H, K)`` (normalised
  keys), ``ring_g (b, h, HV)`` (log decay g); caches that re-derive corrections at a flush
  (paper Algorithm 6, ``gdn_replay_rederive``) also keep ``ring_v (b, h, HV, V)`` and
  ``ring_beta (b, h, HV)``.

The ReplaySSM step needs the state before the token only through ``S k`` and ``S q``, both
read output-only from checkpoint + ring (``gdn_replay_output``). ReplaySSM with window L and
cursor h follows the rules of ``mamba2`` (a flush when h + 1 == L).

Speculative verification (docs/design.md section 4; paper Algorithm 5, Eq. 6, 10 and 11):
tokens carry an extra draft axis ``(b, T, ...)``. Outputs follow the output-only form of Eq. 6
(``common``) with (q, k, v) = (q, k, u); the draft corrections (Eq. 10) come from one T x T
unit-lower-triangular solve per (row, value head):

    u_s + beta_s sum_{j<s} A_js u_j = beta_s R_s,   A_js = gamma_{h+j+1:h+s} (k_{h+j} . k_{h+s})
    R_s = v_s - gamma_{h+s} (S_ckpt k_s) - sum_{j <= h} gamma_{j+1:h+s} (k_j . k_s) u_j

(the paper's ``U_d (I + A B_d) = R B_d`` with the draft axis as rows). ``gdn_snapshot_verify``
is the conventional baseline (one state read, a full state per draft).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .common import (
    F64, causal_decays, check_window, f64, later_sums, ring_len, softplus, spread_heads, state_dot, stepped,
)

__all__ = [
    "gdn_gates",
    "gdn_normalize",
    "gdn_conventional_step",
    "gdn_replay",
    "gdn_replay_rederive",
    "gdn_replay_output",
    "gdn_replay_step",
    "gdn_draft_corrections",
    "gdn_verify_output",
    "gdn_snapshot_verify",
]

Tensor = torch.Tensor


def _key_to_value_heads(t: Tensor, num_v_heads: int) -> Tensor:
    """(..., H, K) -> (..., HV, K): value head hv gets key head hv // (HV // H)."""
    return spread_heads(t, num_v_heads, "num_v_heads", "num_k_heads")


def _state_times(state: Tensor, x: Tensor) -> Tensor:
    """o[b, hv, v] = sum_k state[b, hv, v, k] * x[b, key_head(hv), k] (all float64)."""
    return state_dot(state, _key_to_value_heads(f64(x), state.shape[1]))


def _per_value_head(t: Tensor, num_v_heads: int) -> Tensor:
    """(..., H) per key head -> (..., HV): value head hv gets key head hv // (HV // H)."""
    return _key_to_value_heads(t[..., None], num_v_heads)[..., 0]


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> Tuple[Tensor, Tensor]:
    """Gates of one token, float64 (bsz, HV) each: (g, beta).

    g = -exp(A_log) * softplus(a + dt_bias) (the log of the decay alpha = exp(g)),
    beta = sigmoid(b).
    """
    a64 = f64(a)
    g = -torch.exp(f64(A_log).to(a64.device)) * softplus(a64 + f64(dt_bias).to(a64.device))
    beta = torch.sigmoid(f64(b))
    return g, beta


def gdn_normalize(q: Tensor, k: Tensor, scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """L2-normalise q and k over K in float64 (x / sqrt(sum x^2 + 1e-6)), then q *= scale.

    scale defaults to K ** -0.5. Returns float64 (q, k) with the input shapes (bsz, H, K).
    """
    q64, k64 = f64(q), f64(k)
    qn = q64 / torch.sqrt((q64 * q64).sum(dim=-1, keepdim=True) + 1e-6)
    kn = k64 / torch.sqrt((k64 * k64).sum(dim=-1, keepdim=True) + 1e-6)
    if scale is None:
        scale = q64.shape[-1] ** -0.5
    return qn * scale, kn


def gdn_conventional_step(
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
    """One conventional GDN decode step. Returns (o (bsz, HV, V), new_state (bsz, HV, V, K)),
    float64.

    alpha = exp(g); u = beta * (v - alpha * S k); S = alpha * S + u k^T; o = S q,
    with q, k normalised (``gdn_normalize``) and g, beta from ``gdn_gates``.
    """
    S = f64(state)
    HV = S.shape[1]
    qn, kn = gdn_normalize(q, k, scale)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    alpha = torch.exp(g)  # (bsz, HV)
    k_v = _key_to_value_heads(kn, HV)  # (bsz, HV, K)
    Sk = state_dot(S, k_v)  # (bsz, HV, V)
    u = beta[:, :, None] * (f64(v) - alpha[:, :, None] * Sk)
    new_state = alpha[:, :, None, None] * S + u[:, :, :, None] * k_v[:, :, None, :]
    return _state_times(new_state, qn), new_state


def gdn_replay(checkpoint: Tensor, ring_u: Tensor, ring_k: Tensor, ring_g: Tensor) -> Tensor:
    """Fold the h records (oldest first) into the checkpoint: the state after them, float64.

    For each record j in order: S = exp(g_j) * S + u_j k_j^T (k_j the normalised key of the
    value head's key head).
    """
    S = f64(checkpoint).clone()
    HV = S.shape[1]
    for j in range(ring_u.shape[1]):
        alpha_j = torch.exp(f64(ring_g[:, j]))  # (bsz, HV)
        k_v = _key_to_value_heads(f64(ring_k[:, j]), HV)  # (bsz, HV, K)
        S = alpha_j[:, :, None, None] * S + f64(ring_u[:, j])[:, :, :, None] * k_v[:, :, None, :]
    return S


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
    S = f64(checkpoint).clone()
    HV = S.shape[1]
    us = []
    for j in range(ring_k.shape[1]):
        alpha = torch.exp(f64(ring_g[:, j]))  # (b, HV)
        k_v = _key_to_value_heads(f64(ring_k[:, j]), HV)  # (b, HV, K)
        u = f64(ring_beta[:, j])[:, :, None] * (f64(ring_v[:, j]) - alpha[:, :, None] * state_dot(S, k_v))
        S = alpha[:, :, None, None] * S + u[:, :, :, None] * k_v[:, :, None, :]
        us.append(u)
    U = torch.stack(us, dim=1) if us else torch.zeros(S.shape[:1] + (0,) + S.shape[1:3], dtype=F64, device=S.device)
    return S, U


def gdn_replay_output(checkpoint: Tensor, ring_u: Tensor, ring_k: Tensor, ring_g: Tensor, x: Tensor) -> Tensor:
    """S x (bsz, HV, V) for S = Replay(checkpoint, records), float64, without forming S.

    x (bsz, H, K) is one vector per key head (a normalised key or query). Output-only route:
        S x = gamma_h * (S_ckpt x) + sum_j gamma_{j+1:h} * u_j * (k_j . x)
        gamma_h = exp(sum_j g_j),  gamma_{j+1:h} = exp(sum_{i > j} g_i)
    The dot products k_j . x are computed once per key head and shared by its value heads.
    """
    S0 = f64(checkpoint)
    HV = S0.shape[1]
    g = f64(ring_g)  # (bsz, h, HV)

    w = torch.exp(later_sums(g))  # (bsz, h, HV): gamma_{j+1:h} = exp(sum_{i > j} g_i)
    gamma = torch.exp(g.sum(dim=1))  # (bsz, HV)

    kx = (f64(ring_k) * f64(x)[:, None]).sum(dim=-1)  # (bsz, h, H): k_j . x per key head
    kx_v = _key_to_value_heads(kx[..., None], HV)[..., 0]  # (bsz, h, HV)

    y_ckpt = _state_times(S0, x)  # (bsz, HV, V)
    y_ring = ((w * kx_v)[..., None] * f64(ring_u)).sum(dim=1)  # (bsz, HV, V)
    return gamma[:, :, None] * y_ckpt + y_ring


def gdn_replay_step(
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
    *,
    window: int,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One ReplaySSM GDN decode step (T = 1) for a batch whose rows all hold the same h.

    The ring tensors hold the h committed records before this token (0 <= h < window),
    oldest first; h is ``ring_u.shape[1]``, shared by every row (``gdn_decode_cache_``
    handles rows at different ring positions, one row at a time). With S the state before
    the token (never formed; ``gdn_replay_output`` gives S k and S q):

        u = beta * (v - alpha * S k);  append (u, k, g);  o = alpha * (S q) + u * (k . q)

    (q, k normalised, q scaled.) Then, if h + 1 == window: flush, new_checkpoint =
    Replay(checkpoint, all h + 1 records) and the returned rings are empty; otherwise the
    checkpoint is returned unchanged (a float64 copy) and the rings hold h + 1 records.

    Returns (o (bsz, HV, V), new_checkpoint, new_ring_u, new_ring_k, new_ring_g), float64;
    new_ring_k holds normalised keys, new_ring_g the log decays g.
    """
    check_window(window)
    h = ring_len(window, {"ring_u": ring_u, "ring_k": ring_k, "ring_g": ring_g})

    ckpt = f64(checkpoint)
    HV = ckpt.shape[1]
    qn, kn = gdn_normalize(q, k, scale)
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # (bsz, HV)
    alpha = torch.exp(g)

    # The state before the token enters only through S k and S q.
    Sk = gdn_replay_output(ckpt, ring_u, ring_k, ring_g, kn)
    Sq = gdn_replay_output(ckpt, ring_u, ring_k, ring_g, qn)
    u = beta[:, :, None] * (f64(v) - alpha[:, :, None] * Sk)  # (bsz, HV, V)
    kq_v = _key_to_value_heads((kn * qn).sum(dim=-1, keepdim=True), HV)  # (bsz, HV, 1)
    o = alpha[:, :, None] * Sq + u * kq_v

    all_u = torch.cat([f64(ring_u), u[:, None]], dim=1)
    all_k = torch.cat([f64(ring_k), kn[:, None]], dim=1)
    all_g = torch.cat([f64(ring_g), g[:, None]], dim=1)
    if h + 1 == window:
        new_ckpt = gdn_replay(ckpt, all_u, all_k, all_g)
        all_u, all_k, all_g = all_u[:, :0], all_k[:, :0], all_g[:, :0]
    else:
        new_ckpt = ckpt.clone()
    return o, new_ckpt, all_u, all_k, all_g


# ----------------------------------------------------------------------------- speculative verify


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
    ckpt = f64(checkpoint)
    h, T = ring_u.shape[1], k.shape[1]
    K_all = torch.cat([f64(ring_k), f64(k)], dim=1)  # (b, n, H, K)
    Dg, W = causal_decays(_log_cumsum(ring_g, g), h, T)
    return _gdn_solve(ckpt, f64(ring_u), K_all, v, beta, Dg, W)


def _log_cumsum(ring_g: Tensor, g: Tensor) -> Tensor:
    """cum (b, n + 1, HV): cum[:, i] = sum of the log decays of records 1..i, cum[:, 0] = 0."""
    g_all = torch.cat([f64(ring_g), f64(g)], dim=1)  # (b, n, HV)
    cum = torch.zeros((g_all.shape[0], g_all.shape[1] + 1, g_all.shape[2]), dtype=F64, device=g_all.device)
    cum[:, 1:] = torch.cumsum(g_all, dim=1)
    return cum


def _gdn_solve(ckpt: Tensor, U_c: Tensor, K_all: Tensor, v: Tensor, beta: Tensor, Dg: Tensor, W: Tensor) -> Tensor:
    """Eq. 10 given the decays (``causal_decays``): U_c (b, h, HV, V) committed corrections,
    K_all (b, h + T, H, K) committed then draft keys. Returns U_d (b, T, HV, V)."""
    HV = ckpt.shape[1]
    h = U_c.shape[1]
    T = K_all.shape[1] - h
    dev = ckpt.device
    kd = K_all[:, h:]
    kk = torch.einsum("bjhk,bshk->bjsh", K_all, kd)  # (b, n, T, H): k_j . k_s per key head
    Wkk = W * _per_value_head(kk, HV)  # (b, n, T, HV)
    Sk = torch.einsum("bhvk,bshk->bshv", ckpt, _key_to_value_heads(kd, HV))  # S_ckpt k_s
    R = f64(v) - Dg[..., None] * Sk - torch.einsum("bjsh,bjhv->bshv", Wkk[:, :h], U_c)

    beta64 = f64(beta)  # (b, T, HV)
    strict = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev), diagonal=-1)  # [s, j]: j < s
    A_sj = Wkk[:, h:].permute(0, 3, 2, 1)  # (b, HV, T(s), T(j)): gamma_{h+j+1:h+s} k_{h+j}.k_{h+s}
    M = torch.eye(T, dtype=F64, device=dev) + beta64.permute(0, 2, 1)[..., None] * A_sj * strict
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
    are normalised (q scaled) and the gates formed as in ``gdn_conventional_step``; the
    corrections come from ``gdn_draft_corrections``; then, with U = [committed u, draft u]:

        o_s = gamma_{h+s} (S_ckpt q_s) + sum_{j <= h+s} gamma_{j+1:h+s} (k_j . q_s) u_j

    The checkpoint enters only through S_ckpt k_s and S_ckpt q_s (one pass over it).
    Returns (o (b, T, HV, V), u (b, T, HV, V), normalised k (b, T, H, K), g (b, T, HV),
    beta (b, T, HV)), float64: the outputs and the draft records.
    """
    ckpt = f64(checkpoint)
    HV = ckpt.shape[1]
    h, T = ring_u.shape[1], v.shape[1]
    qn, kn = gdn_normalize(q, k, scale)  # (b, T, H, K)
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # (b, T, HV)
    K_all = torch.cat([f64(ring_k), kn], dim=1)  # (b, n, H, K)
    Dg, W = causal_decays(_log_cumsum(ring_g, g), h, T)  # shared by Eq. 10 and Eq. 11
    U_c = f64(ring_u)
    u_d = _gdn_solve(ckpt, U_c, K_all, v, beta, Dg, W)  # = gdn_draft_corrections(...)
    U_all = torch.cat([U_c, u_d], dim=1)  # (b, n, HV, V)

    kq = torch.einsum("bjhk,bshk->bjsh", K_all, qn)  # (b, n, T, H)
    Sq = torch.einsum("bhvk,bshk->bshv", ckpt, _key_to_value_heads(qn, HV))  # S_ckpt q_s
    o = Dg[..., None] * Sq + torch.einsum("bjsh,bjhv->bshv", W * _per_value_head(kq, HV), U_all)
    return o, u_d, kn, g, beta


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
    return stepped(
        state, v.shape[1],
        lambda S, s: gdn_conventional_step(S, q[:, s], k[:, s], v[:, s], a[:, s], b[:, s], A_log, dt_bias, scale),
    )
