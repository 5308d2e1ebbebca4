"""Helpers shared by the float64 references of both layer types (``mamba2``, ``gdn``): the
float64 conversion, head spreading, the state-times-vector product, decay sums, the checks of
a window and a ring, the speculative decays of Eq. 6 and softplus.

Output-only form of a verify step (Eq. 6; docs/design.md section 4). Records 1..n, n = h + T,
committed first; draft s (1-based) sits at position t = h + s; gamma_{i:j} = product of the
decays of records i..j, gamma_t = gamma_{1:t}:

    o_s = gamma_{h+s} (S_ckpt q_s) + sum_{j <= h+s} gamma_{j+1:h+s} (k_j . q_s) v_j

with (q, k, v) = (C, B, dt x) for Mamba-2 and (q, k, u) for GDN. ``causal_decays`` forms the
gammas of that sum.
"""

from __future__ import annotations

from typing import Tuple

import torch

__all__ = ["softplus"]

F64 = torch.float64

Tensor = torch.Tensor


def f64(t: Tensor) -> Tensor:
    return t.to(dtype=F64)


def spread_heads(t: Tensor, n_out: int, out_name: str, in_name: str) -> Tensor:
    """(..., n_in, X) -> (..., n_out, X): output head i gets input head i // (n_out // n_in);
    n_out must be a multiple of n_in (the error names them ``out_name`` and ``in_name``)."""
    n_in = t.shape[-2]
    if n_out % n_in != 0:
        raise ValueError(f"{out_name} ({n_out}) must be a multiple of {in_name} ({n_in})")
    return t.repeat_interleave(n_out // n_in, dim=-2)


def state_dot(state: Tensor, x_h: Tensor) -> Tensor:
    """y[b, hd, p] = sum_n state[b, hd, p, n] * x_h[b, hd, n]: state (b, H, P, N) times one
    vector per head (already spread to the state's heads)."""
    return (state * x_h[:, :, None, :]).sum(dim=-1)


def check_window(window) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")


def ring_len(window: int, rings: dict) -> int:
    """h, the number of records (dim 1) that every ring tensor of ``rings`` (name -> tensor)
    holds; needs 0 <= h < window."""
    counts = [t.shape[1] for t in rings.values()]
    h = counts[0]
    if any(c != h for c in counts):
        raise ValueError(
            f"{', '.join(rings)} must hold the same number of records, got {', '.join(map(str, counts))}"
        )
    if not 0 <= h < window:
        raise ValueError(f"the ring holds h={h} records; need 0 <= h < window={window}")
    return h


def later_sums(t: Tensor) -> Tensor:
    """Exclusive suffix sums along the ring (dim 1): out[:, j] = sum_{i > j} t[:, i]."""
    later = torch.zeros_like(t)
    later[:, :-1] = torch.flip(torch.cumsum(torch.flip(t[:, 1:], dims=[1]), dim=1), dims=[1])
    return later


def causal_decays(cum: Tensor, h: int, T: int) -> Tuple[Tensor, Tensor]:
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


def stepped(state: Tensor, T: int, step) -> Tuple[Tensor, Tensor]:
    """Run ``step(S, s) -> (output, new S)`` for s = 0..T-1 from float64 ``state``; returns the
    outputs and the state after each step, stacked on a new dim 1."""
    S = f64(state)
    outs, snaps = [], []
    for s in range(T):
        o, S = step(S, s)
        outs.append(o)
        snaps.append(S)
    return torch.stack(outs, dim=1), torch.stack(snaps, dim=1)


def softplus(x: Tensor) -> Tensor:
    """softplus(x) = x for x > 20, else log1p(exp(x)). Keeps the dtype of x."""
    x = torch.as_tensor(x)
    return torch.where(x > 20, x, torch.log1p(torch.exp(x)))
