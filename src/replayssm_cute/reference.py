"""Float64 reference for Mamba-2 decoding, conventional and ReplaySSM.

Written for clarity, not speed. Every function computes in float64 on the device of
its inputs and returns float64 results (``mamba2_decode_cache_`` writes into the
cache and into ``out`` in their own dtypes).

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

Cache-level semantics (``mamba2_decode_cache_``) are documented on that function.

Gated DeltaNet (``gdn_*``; docs/design.md, sections 2 and 3) uses ``HV`` value heads of
size ``V``, ``H`` key heads of size ``K`` and value head ``hv`` reads key head
``hv // (HV // H)``:

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
read output-only from checkpoint + ring (``gdn_replay_output``).
"""

from __future__ import annotations

import operator
from typing import Callable, NamedTuple, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    "softplus",
    "mamba2_dt",
    "mamba2_conventional_step",
    "mamba2_replay",
    "mamba2_replay_output",
    "mamba2_replay_step",
    "mamba2_decode_cache_",
    "mamba2_materialize",
    "gdn_gates",
    "gdn_normalize",
    "gdn_conventional_step",
    "gdn_replay",
    "gdn_replay_rederive",
    "gdn_replay_output",
    "gdn_replay_step",
    "gdn_decode_cache_",
    "gdn_materialize",
]

_F64 = torch.float64
_ROUTES = ("output_only", "state")

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- helpers


def _f64(t: Tensor) -> Tensor:
    return t.to(dtype=_F64)


def _spread_heads(t: Tensor, n_out: int, out_name: str, in_name: str) -> Tensor:
    """(..., n_in, X) -> (..., n_out, X): output head i gets input head i // (n_out // n_in);
    n_out must be a multiple of n_in (the error names them ``out_name`` and ``in_name``)."""
    n_in = t.shape[-2]
    if n_out % n_in != 0:
        raise ValueError(f"{out_name} ({n_out}) must be a multiple of {in_name} ({n_in})")
    return t.repeat_interleave(n_out // n_in, dim=-2)


def _state_dot(state: Tensor, x_h: Tensor) -> Tensor:
    """y[b, hd, p] = sum_n state[b, hd, p, n] * x_h[b, hd, n]: state (b, H, P, N) times one
    vector per head (already spread to the state's heads)."""
    return (state * x_h[:, :, None, :]).sum(dim=-1)


def _group_to_head(t: Tensor, nheads: int) -> Tensor:
    """(..., G, N) -> (..., H, N): head hd gets group hd // (H // G)."""
    return _spread_heads(t, nheads, "nheads", "ngroups")


def _state_times_c(state: Tensor, C: Tensor) -> Tensor:
    """y[b, hd, p] = sum_n state[b, hd, p, n] * C[b, group(hd), n] (all float64)."""
    return _state_dot(state, _group_to_head(_f64(C), state.shape[1]))


def _finish_output(y: Tensor, x: Tensor, D: Optional[Tensor], z: Optional[Tensor]) -> Tensor:
    """Add the skip term D * x and apply the optional gate z * sigmoid(z)."""
    if D is not None:
        y = y + _f64(D).to(y.device)[None, :, None] * _f64(x)
    if z is not None:
        z64 = _f64(z)
        y = y * (z64 * torch.sigmoid(z64))
    return y


def _int_values(name: str, values) -> list:
    """A 1-D integer tensor or a sequence of ints (named ``name`` in errors) as Python ints."""
    if isinstance(values, Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {values.dtype}")
        return [int(v) for v in values.tolist()]
    return [operator.index(v) for v in values]


def _slot_list(slot_ids: Union[Tensor, Sequence[int]]) -> list:
    return _int_values("slot_ids", slot_ids)


def _active_rows(cache, slot_ids, nrows: int, per: str) -> list:
    """(row, slot) of the rows that decode: pad-sentinel and out-of-pool ids are skipped."""
    ids = _slot_list(slot_ids)
    if len(ids) != nrows:
        raise ValueError(f"slot_ids has {len(ids)} entries, expected {nrows} (one per row of {per})")
    active = [(r, s) for r, s in enumerate(ids) if s != cache.pad_slot_id and 0 <= s < cache.num_slots]
    used = [s for _, s in active]
    if len(set(used)) != len(used):
        raise ValueError(f"slot_ids names a slot more than once among active rows: {ids}")
    return active


def _check_shape(name: str, t: Optional[Tensor], shape: tuple) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_shapes(*specs: Tuple[str, Optional[Tensor], tuple]) -> None:
    """``_check_shape(name, t, shape)`` for each (name, t, shape), in order."""
    for name, t, shape in specs:
        _check_shape(name, t, shape)


def _out_buffer(out: Optional[Tensor], like: Tensor, shape: tuple) -> Tensor:
    """``out`` checked to have ``shape``, or zeros like ``like`` when ``out`` is None."""
    if out is None:
        return torch.zeros_like(like)
    _check_shape("out", out, shape)
    return out


def _mamba2_lead(cache, x, dt, A, B, C, D, z, dt_bias, drafts: bool = False) -> tuple:
    """Check a Mamba-2 token batch against ``cache``; returns its leading dims: (b,), or
    (b, T) with ``drafts`` (a draft axis)."""
    H, P, N, G = cache.nheads, cache.headdim, cache.dstate, cache.ngroups
    if not isinstance(x, Tensor) or x.dim() != (4 if drafts else 3):
        raise ValueError(f"x must be a (batch, {'T, ' if drafts else ''}{H}, {P}) tensor")
    lead = tuple(x.shape[:-2])
    _check_shapes(
        ("x", x, lead + (H, P)), ("dt", dt, lead + (H,)), ("A", A, (H,)), ("B", B, lead + (G, N)),
        ("C", C, lead + (G, N)), ("D", D, (H,)), ("z", z, lead + (H, P)), ("dt_bias", dt_bias, (H,)),
    )
    return lead


def _ring_records(cache, slot: int, h: int, rings: Sequence[Tuple[str, tuple]]) -> Tuple[Tensor, ...]:
    """The h committed records of one slot, oldest first: one float64 (1, h, *shape) tensor per
    (ring name, record shape) in ``rings``. Record i lives at ring index (origin + i) % capacity;
    values are read as stored and converted exactly to float64."""
    dev = cache.checkpoint.device
    if h == 0:
        return tuple(torch.zeros((1, 0) + shape, dtype=_F64, device=dev) for _, shape in rings)
    origin = int(cache.origin[slot])
    idx = torch.tensor([(origin + i) % cache.capacity for i in range(h)], device=dev)
    return tuple(_f64(getattr(cache, name)[slot].index_select(0, idx)).unsqueeze(0) for name, _ in rings)


def _slot_records(cache, slot: int, h: int) -> Tuple[Tensor, Tensor, Tensor]:
    """The h committed records of one slot, oldest first, as float64 (1, h, ...) tensors.

    Record i lives at ring index (origin + i) % capacity. Values are read as stored
    (activation dtype for x and B, fp32 for dt) and converted exactly to float64.
    """
    H, P, N, G = cache.nheads, cache.headdim, cache.dstate, cache.ngroups
    return _ring_records(cache, slot, h, (("ring_x", (H, P)), ("ring_B", (G, N)), ("ring_dt", (H,))))


def _write_records_(cache, slot: int, pos, records: dict) -> None:
    """ring[slot, pos] = value, cast to that ring's dtype and device, for each (ring name, value)."""
    for name, value in records.items():
        ring = getattr(cache, name)
        ring[slot, pos] = value.to(dtype=ring.dtype, device=ring.device)


def _store_checkpoint_(cache, slot: int, new_ckpt: Tensor) -> None:
    """A flush: the slot's checkpoint = new_ckpt (cast to its dtype) and cursor = 0."""
    cache.checkpoint[slot] = new_ckpt.to(dtype=cache.checkpoint.dtype)
    cache.cursor[slot] = 0


class _StateAccess(NamedTuple):
    """How a cache-level step reaches a slot's state: ``read(cache, slot, flush)`` gives the state
    (1, *state shape) a step starts from (``flush``: the step folds the ring into the checkpoint);
    ``store_(cache, slot, state)`` stores the float64 state a flush built and sets cursor = 0."""

    read: Callable[[object, int, bool], Tensor]
    store_: Callable[[object, int, Tensor], None]


# A plain cache: its fp32 checkpoint, read and written as is.
_PLAIN_CHECKPOINT = _StateAccess(lambda cache, slot, flush: cache.checkpoint[slot : slot + 1], _store_checkpoint_)


def _state_access(cache) -> _StateAccess:
    """The fp32 checkpoint of a plain cache, else the state copies of ``reference_lowprec``."""
    if getattr(cache, "is_plain", True):
        return _PLAIN_CHECKPOINT
    from .reference_lowprec import STATE_COPIES

    return STATE_COPIES


def _decode_rows_(state: _StateAccess, cache, slot_ids, nrows: int, per: str, out: Tensor, step) -> Tensor:
    """The row loop of a cache-level decode step (``*_decode_cache_``); returns ``out``.

    For every active row r (slot s), with h = cursor[s] (h == window admitted with draft room)
    and flush = h + 1 >= window: ``step(state.read(cache, s, flush), s, h, slice(r, r + 1),
    window)`` gives (y, new_checkpoint, record) for ``window = max(cache.window, h + 1)`` (h ==
    window after a speculative commit: flush all); y[0] is cast into ``out[r]``. Then a flush
    stores new_checkpoint (``state.store_``); otherwise ``record()`` (ring name -> value of the
    token's record) is written at ring index (origin + h) % capacity and cursor = h + 1.
    """
    for r, s in _active_rows(cache, slot_ids, nrows, per):
        h = _slot_cursor(cache, s, allow_full=_spec_room(cache))
        flush = h + 1 >= cache.window
        y, new_ckpt, record = step(state.read(cache, s, flush), s, h, slice(r, r + 1), max(cache.window, h + 1))
        out[r] = y[0].to(dtype=out.dtype, device=out.device)
        if flush:
            state.store_(cache, s, new_ckpt[0])
        else:
            _write_records_(cache, s, (int(cache.origin[s]) + h) % cache.capacity, record())
            cache.cursor[s] = h + 1
    return out


def _materialize(cache, slot_ids, state_shape: tuple, replay) -> Tensor:
    """Float64 (n, *state_shape): for each named slot, ``replay(checkpoint, slot, h)`` from the
    checkpoint a flush reads (``_state_access``); a row naming the pad sentinel is skipped, as
    decode skips it, and stays zero. Other slot ids must lie in [0, num_slots); h == window is
    admitted with draft room."""
    state = _state_access(cache)
    ids = _slot_list(slot_ids)
    out = torch.zeros((len(ids),) + state_shape, dtype=_F64, device=cache.checkpoint.device)
    for i, s in enumerate(ids):
        if s == cache.pad_slot_id:
            continue
        if not 0 <= s < cache.num_slots:
            raise ValueError(f"slot id {s} is outside [0, num_slots={cache.num_slots})")
        h = _slot_cursor(cache, s, allow_full=_spec_room(cache))
        out[i] = replay(state.read(cache, s, True), s, h)[0]
    return out


def _slot_cursor(cache, slot: int, allow_full: bool = False) -> int:
    """cursor[slot], checked: 0 <= h < window, or 0 <= h <= window with ``allow_full`` (after a
    speculative commit a slot may hold exactly L committed records; see reference_spec)."""
    h = int(cache.cursor[slot])
    if not (0 <= h <= cache.window if allow_full else 0 <= h < cache.window):
        bound = f"[0, window={cache.window}]" if allow_full else f"[0, window={cache.window})"
        raise RuntimeError(f"cache.cursor[{slot}] = {h} is outside {bound}; the cache is corrupt")
    return h


def _spec_room(cache) -> bool:
    """True when the cache has ring room for drafts (max_draft > 0): only then can a
    speculative commit leave a slot with h == window committed records."""
    return getattr(cache, "max_draft", 0) > 0


def _check_window(window) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")


def _ring_len(window: int, rings: dict) -> int:
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


def _later_sums(t: Tensor) -> Tensor:
    """Exclusive suffix sums along the ring (dim 1): out[:, j] = sum_{i > j} t[:, i]."""
    later = torch.zeros_like(t)
    later[:, :-1] = torch.flip(torch.cumsum(torch.flip(t[:, 1:], dims=[1]), dim=1), dims=[1])
    return later


# ----------------------------------------------------------------------------- layer math


def softplus(x: Tensor) -> Tensor:
    """softplus(x) = x for x > 20, else log1p(exp(x)). Keeps the dtype of x."""
    x = torch.as_tensor(x)
    return torch.where(x > 20, x, torch.log1p(torch.exp(x)))


def mamba2_dt(dt: Tensor, dt_bias: Optional[Tensor] = None, dt_softplus: bool = False) -> Tensor:
    """Processed dt in float64, shape (b, H): dt + dt_bias, then softplus if asked."""
    out = _f64(dt)
    if dt_bias is not None:
        out = out + _f64(dt_bias).to(out.device)
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
    S = _f64(state)
    H = S.shape[1]
    dt64 = mamba2_dt(dt, dt_bias, dt_softplus)  # (b, H)
    alpha = torch.exp(_f64(A)[None, :] * dt64)  # (b, H)
    B_h = _group_to_head(_f64(B), H)  # (b, H, N)
    dtx = dt64[:, :, None] * _f64(x)  # (b, H, P)
    new_state = alpha[:, :, None, None] * S + dtx[:, :, :, None] * B_h[:, :, None, :]
    y = _finish_output(_state_times_c(new_state, C), x, D, z)
    return y, new_state


def mamba2_replay(checkpoint: Tensor, ring_x: Tensor, ring_B: Tensor, ring_dt: Tensor, A: Tensor) -> Tensor:
    """Fold the h records (oldest first) into the checkpoint: the state after them, float64.

    For each record j in order: S = exp(A * dt_j) * S + dt_j * x_j B_j^T.
    ring_dt is already after bias and softplus.
    """
    S = _f64(checkpoint).clone()
    H = S.shape[1]
    A64 = _f64(A)[None, :]
    for j in range(ring_x.shape[1]):
        dt_j = _f64(ring_dt[:, j])  # (b, H)
        B_h = _group_to_head(_f64(ring_B[:, j]), H)  # (b, H, N)
        dtx = dt_j[:, :, None] * _f64(ring_x[:, j])  # (b, H, P)
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
    S0 = _f64(checkpoint)
    H = S0.shape[1]
    ngroups = C.shape[1]
    A64 = _f64(A)[None, None, :]  # (1, 1, H)
    dt = _f64(ring_dt)  # (b, h, H)

    w = dt * torch.exp(A64 * _later_sums(dt))  # (b, h, H); exponent A * sum_{i > j} dt_i
    gamma = torch.exp(A64[:, 0] * dt.sum(dim=1))  # (b, H)

    kq = (_f64(ring_B) * _f64(C)[:, None]).sum(dim=-1)  # (b, h, G): B_j . C per group
    kq_h = kq.repeat_interleave(H // ngroups, dim=2)  # (b, h, H)

    y_ckpt = _state_times_c(S0, C)  # (b, H, P)
    y_ring = ((w * kq_h)[..., None] * _f64(ring_x)).sum(dim=1)  # (b, H, P)
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
    _check_window(window)
    if route not in _ROUTES:
        raise ValueError(f"route must be one of {_ROUTES}, got {route!r}")
    h = _ring_len(window, {"ring_x": ring_x, "ring_B": ring_B, "ring_dt": ring_dt})

    dt64 = mamba2_dt(dt, dt_bias, dt_softplus)  # (b, H)
    all_x = torch.cat([_f64(ring_x), _f64(x)[:, None]], dim=1)
    all_B = torch.cat([_f64(ring_B), _f64(B)[:, None]], dim=1)
    all_dt = torch.cat([_f64(ring_dt), dt64[:, None]], dim=1)
    ckpt = _f64(checkpoint)

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


# ----------------------------------------------------------------------------- cache level


def mamba2_decode_cache_(
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
    """In-place cache-level reference step (T = 1) on a ``Mamba2Cache``; returns ``out``.

    Row r uses slot ``slot_ids[r]``. A row is skipped (no cache tensor touched, ``out[r]``
    untouched; zeros when ``out`` is allocated here) if its slot id equals
    ``cache.pad_slot_id`` or lies outside ``[0, num_slots)``. Two active rows naming the same
    slot raise ValueError. Every active row, independently, with h = cursor[slot]:

      * reads the slot's checkpoint and its h records at ring index (origin + i) % capacity,
        as stored (ring dtype, converted to float64), and runs ``mamba2_replay_step`` in
        float64 (output-only route). The current token's own contribution uses x, B and dt
        as given, in float64 (dt processed with dt_bias / softplus in float64);
      * non-flush (h + 1 < window): writes the record at (origin + h) % capacity (x and B
        cast to the ring dtype, processed dt cast to fp32), cursor += 1; the checkpoint is
        not written;
      * flush (h + 1 >= window; h == window only after a speculative commit): writes the new
        checkpoint (cast to fp32), cursor = 0,
        origin unchanged; the flushing token's record is folded, not stored.

    window == 1 (conventional cache, no ring): every step is a flush. ``arrivals`` is not
    touched. ``out`` has x's shape and dtype (allocated if None); row r gets y cast to it.

    A cache with low-precision state (``not cache.is_plain``) reads and writes its state
    copies as ``reference_lowprec.mamba2_decode_lowprec_cache_`` describes.
    """
    return _mamba2_decode_(_state_access(cache), cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out)


def _mamba2_decode_(state: _StateAccess, cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out) -> Tensor:
    """``mamba2_decode_cache_`` with the slots' state reached through ``state``."""
    (b,) = _mamba2_lead(cache, x, dt, A, B, C, D, z, dt_bias)
    out = _out_buffer(out, x, (b, cache.nheads, cache.headdim))

    def step(S, s, h, row, window):
        y, new_ckpt, _, _, new_dt = mamba2_replay_step(
            S, *_slot_records(cache, s, h), x[row], dt[row], A, B[row], C[row], D, None if z is None else z[row],
            dt_bias, dt_softplus, window=window, route="output_only",
        )
        return y, new_ckpt, lambda: {"ring_x": x[row][0], "ring_B": B[row][0], "ring_dt": new_dt[0, -1]}

    return _decode_rows_(state, cache, slot_ids, b, "x", out, step)


def mamba2_materialize(cache, slot_ids: Union[Tensor, Sequence[int]], A: Tensor) -> Tensor:
    """Current state of each named slot, float64 (n, H, P, N): checkpoint (decoded, for a
    low-precision one) + replay of its committed records (read as stored). Rows naming the pad
    sentinel are zero; other slot ids must lie in [0, num_slots). ``A`` (H,). A cache with draft
    room (max_draft > 0) admits h == window (left by a speculative commit)."""
    return _materialize(
        cache, slot_ids, (cache.nheads, cache.headdim, cache.dstate),
        lambda ckpt, s, h: mamba2_replay(ckpt, *_slot_records(cache, s, h), A),
    )


# ============================================================================= Gated DeltaNet


def _key_to_value_heads(t: Tensor, num_v_heads: int) -> Tensor:
    """(..., H, K) -> (..., HV, K): value head hv gets key head hv // (HV // H)."""
    return _spread_heads(t, num_v_heads, "num_v_heads", "num_k_heads")


def _state_times(state: Tensor, x: Tensor) -> Tensor:
    """o[b, hv, v] = sum_k state[b, hv, v, k] * x[b, key_head(hv), k] (all float64)."""
    return _state_dot(state, _key_to_value_heads(_f64(x), state.shape[1]))


def _require(name: str, t) -> None:
    if t is None:
        raise ValueError(f"{name} is required (got None)")


def gdn_gates(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> Tuple[Tensor, Tensor]:
    """Gates of one token, float64 (bsz, HV) each: (g, beta).

    g = -exp(A_log) * softplus(a + dt_bias) (the log of the decay alpha = exp(g)),
    beta = sigmoid(b).
    """
    a64 = _f64(a)
    g = -torch.exp(_f64(A_log).to(a64.device)) * softplus(a64 + _f64(dt_bias).to(a64.device))
    beta = torch.sigmoid(_f64(b))
    return g, beta


def gdn_normalize(q: Tensor, k: Tensor, scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """L2-normalise q and k over K in float64 (x / sqrt(sum x^2 + 1e-6)), then q *= scale.

    scale defaults to K ** -0.5. Returns float64 (q, k) with the input shapes (bsz, H, K).
    """
    q64, k64 = _f64(q), _f64(k)
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
    S = _f64(state)
    HV = S.shape[1]
    qn, kn = gdn_normalize(q, k, scale)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    alpha = torch.exp(g)  # (bsz, HV)
    k_v = _key_to_value_heads(kn, HV)  # (bsz, HV, K)
    Sk = _state_dot(S, k_v)  # (bsz, HV, V)
    u = beta[:, :, None] * (_f64(v) - alpha[:, :, None] * Sk)
    new_state = alpha[:, :, None, None] * S + u[:, :, :, None] * k_v[:, :, None, :]
    return _state_times(new_state, qn), new_state


def gdn_replay(checkpoint: Tensor, ring_u: Tensor, ring_k: Tensor, ring_g: Tensor) -> Tensor:
    """Fold the h records (oldest first) into the checkpoint: the state after them, float64.

    For each record j in order: S = exp(g_j) * S + u_j k_j^T (k_j the normalised key of the
    value head's key head).
    """
    S = _f64(checkpoint).clone()
    HV = S.shape[1]
    for j in range(ring_u.shape[1]):
        alpha_j = torch.exp(_f64(ring_g[:, j]))  # (bsz, HV)
        k_v = _key_to_value_heads(_f64(ring_k[:, j]), HV)  # (bsz, HV, K)
        S = alpha_j[:, :, None, None] * S + _f64(ring_u[:, j])[:, :, :, None] * k_v[:, :, None, :]
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


def gdn_replay_output(checkpoint: Tensor, ring_u: Tensor, ring_k: Tensor, ring_g: Tensor, x: Tensor) -> Tensor:
    """S x (bsz, HV, V) for S = Replay(checkpoint, records), float64, without forming S.

    x (bsz, H, K) is one vector per key head (a normalised key or query). Output-only route:
        S x = gamma_h * (S_ckpt x) + sum_j gamma_{j+1:h} * u_j * (k_j . x)
        gamma_h = exp(sum_j g_j),  gamma_{j+1:h} = exp(sum_{i > j} g_i)
    The dot products k_j . x are computed once per key head and shared by its value heads.
    """
    S0 = _f64(checkpoint)
    HV = S0.shape[1]
    g = _f64(ring_g)  # (bsz, h, HV)

    w = torch.exp(_later_sums(g))  # (bsz, h, HV): gamma_{j+1:h} = exp(sum_{i > j} g_i)
    gamma = torch.exp(g.sum(dim=1))  # (bsz, HV)

    kx = (_f64(ring_k) * _f64(x)[:, None]).sum(dim=-1)  # (bsz, h, H): k_j . x per key head
    kx_v = _key_to_value_heads(kx[..., None], HV)[..., 0]  # (bsz, h, HV)

    y_ckpt = _state_times(S0, x)  # (bsz, HV, V)
    y_ring = ((w * kx_v)[..., None] * _f64(ring_u)).sum(dim=1)  # (bsz, HV, V)
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
    _check_window(window)
    h = _ring_len(window, {"ring_u": ring_u, "ring_k": ring_k, "ring_g": ring_g})

    ckpt = _f64(checkpoint)
    HV = ckpt.shape[1]
    qn, kn = gdn_normalize(q, k, scale)
    g, beta = gdn_gates(a, b, A_log, dt_bias)  # (bsz, HV)
    alpha = torch.exp(g)

    # The state before the token enters only through S k and S q.
    Sk = gdn_replay_output(ckpt, ring_u, ring_k, ring_g, kn)
    Sq = gdn_replay_output(ckpt, ring_u, ring_k, ring_g, qn)
    u = beta[:, :, None] * (_f64(v) - alpha[:, :, None] * Sk)  # (bsz, HV, V)
    kq_v = _key_to_value_heads((kn * qn).sum(dim=-1, keepdim=True), HV)  # (bsz, HV, 1)
    o = alpha[:, :, None] * Sq + u * kq_v

    all_u = torch.cat([_f64(ring_u), u[:, None]], dim=1)
    all_k = torch.cat([_f64(ring_k), kn[:, None]], dim=1)
    all_g = torch.cat([_f64(ring_g), g[:, None]], dim=1)
    if h + 1 == window:
        new_ckpt = gdn_replay(ckpt, all_u, all_k, all_g)
        all_u, all_k, all_g = all_u[:, :0], all_k[:, :0], all_g[:, :0]
    else:
        new_ckpt = ckpt.clone()
    return o, new_ckpt, all_u, all_k, all_g


def _gdn_slot_records(cache, slot: int, h: int) -> Tuple[Tensor, Tensor, Tensor]:
    """The h committed records of one GDN slot, oldest first, as float64 (1, h, ...) tensors.

    Record i lives at ring index (origin + i) % capacity; values are read as stored (u fp16,
    k in the activation dtype, g fp32) and converted exactly to float64.
    """
    HV, V, K, H = cache.num_v_heads, cache.head_v_dim, cache.head_k_dim, cache.num_k_heads
    return _ring_records(cache, slot, h, (("ring_u", (HV, V)), ("ring_k", (H, K)), ("ring_g", (HV,))))


def _gdn_raw_records(cache, slot: int, h: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The h committed records' (k, g, v, beta) of one GDN slot, oldest first, float64 as stored."""
    HV, V, K, H = cache.num_v_heads, cache.head_v_dim, cache.head_k_dim, cache.num_k_heads
    return _ring_records(cache, slot, h, (("ring_k", (H, K)), ("ring_g", (HV,)), ("ring_v", (HV, V)),
                                          ("ring_beta", (HV,))))


def _rederive(cache) -> bool:
    """True when the cache's flushes re-derive the committed corrections (paper Algorithm 6)."""
    return getattr(cache, "flush_corrections", "fold") == "rederive"


def _gdn_lead(cache, q, k, v, a, b, A_log, dt_bias, drafts: bool = False, check_v: bool = True) -> tuple:
    """Check a GDN token batch against ``cache``; returns its leading dims: (bsz,), or
    (bsz, T) with ``drafts`` (a draft axis). ``check_v=False`` checks v's rank only."""
    HV, V, K, H = cache.num_v_heads, cache.head_v_dim, cache.head_k_dim, cache.num_k_heads
    if not isinstance(v, Tensor) or v.dim() != (4 if drafts else 3):
        raise ValueError(f"v must be a (batch, {'T, ' if drafts else ''}{HV}, {V}) tensor")
    lead = tuple(v.shape[:-2])
    for name, t in (("q", q), ("k", k), ("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        _require(name, t)
    specs = (
        ("q", q, lead + (H, K)), ("k", k, lead + (H, K)), ("v", v, lead + (HV, V)), ("a", a, lead + (HV,)),
        ("b", b, lead + (HV,)), ("A_log", A_log, (HV,)), ("dt_bias", dt_bias, (HV,)),
    )
    _check_shapes(*(spec for spec in specs if check_v or spec[0] != "v"))
    return lead


def _gdn_records(cache, u: Tensor, k: Tensor, g: Tensor, v: Tensor, beta: Tensor) -> dict:
    """Ring name -> value of a GDN record (u, normalised k, g; v and beta when the cache keeps them)."""
    records = {"ring_u": u, "ring_k": k, "ring_g": g}
    if cache.ring_v is not None:
        records.update(ring_v=v, ring_beta=beta)
    return records


def gdn_decode_cache_(
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
    """In-place cache-level reference GDN step (T = 1) on a ``GDNCache``; returns ``out``.

    Row r uses slot ``slot_ids[r]``. A row is skipped (no cache tensor touched, ``out[r]``
    untouched; zeros when ``out`` is allocated here) if its slot id equals
    ``cache.pad_slot_id`` or lies outside ``[0, num_slots)``. Two active rows naming the same
    slot raise ValueError. Every active row, independently, with h = cursor[slot]:

      * reads the slot's checkpoint and its h records at ring index (origin + i) % capacity,
        as stored (u fp16, k activation dtype, g fp32, converted to float64), and runs
        ``gdn_replay_step`` in float64. The current token uses q, k, v, a, b as given, in
        float64 (its u, normalised k and g are exact);
      * non-flush (h + 1 < window): writes the record at (origin + h) % capacity: u cast to
        fp16, the normalised k to the activation dtype, g to fp32 (and, when the cache keeps
        them, v to the activation dtype and beta to fp32); cursor += 1; the checkpoint is
        not written;
      * flush (h + 1 >= window; h == window only after a speculative commit): writes the new
        checkpoint (cast to fp32), cursor = 0,
        origin unchanged; the flushing token's record is folded, not stored.

    window == 1 (conventional cache, no ring): every step is a flush. ``arrivals`` is not
    touched. ``out`` has v's shape and dtype (allocated if None); row r gets o cast to it.

    A cache with low-precision state or re-derived flush corrections (``not cache.is_plain``)
    reads and writes its state copies as ``reference_lowprec.gdn_decode_lowprec_cache_``
    describes; a "rederive" flush rebuilds the state before the token with
    ``gdn_replay_rederive`` from the checkpoint and the records' (k, g, v, beta), then takes the
    token's step (``gdn_conventional_step``: u from that state, o = S_new q).
    """
    return _gdn_decode_(_state_access(cache), cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out)


def _gdn_decode_(state: _StateAccess, cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out) -> Tensor:
    """``gdn_decode_cache_`` with the slots' state reached through ``state``."""
    (bsz,) = _gdn_lead(cache, q, k, v, a, b, A_log, dt_bias)
    out = _out_buffer(out, v, (bsz, cache.num_v_heads, cache.head_v_dim))

    def step(S, s, h, row, window):
        if h + 1 >= cache.window and _rederive(cache):
            S_h, _ = gdn_replay_rederive(S, *_gdn_raw_records(cache, s, h))
            o, new_ckpt = gdn_conventional_step(S_h, q[row], k[row], v[row], a[row], b[row], A_log, dt_bias, scale)
            return o, new_ckpt, None  # a flush stores no record
        o, new_ckpt, new_u, new_k, new_g = gdn_replay_step(
            S, *_gdn_slot_records(cache, s, h), q[row], k[row], v[row], a[row], b[row], A_log, dt_bias, scale,
            window=window,
        )

        def record():
            _, beta = gdn_gates(a[row], b[row], A_log, dt_bias)
            return _gdn_records(cache, new_u[0, -1], new_k[0, -1], new_g[0, -1], v[row][0], beta[0])

        return o, new_ckpt, record

    return _decode_rows_(state, cache, slot_ids, bsz, "v", out, step)


def gdn_materialize(cache, slot_ids: Union[Tensor, Sequence[int]]) -> Tensor:
    """Current state of each named GDN slot, float64 (n, HV, V, K): checkpoint (decoded, for a
    low-precision one) + its committed records, folded as the next flush will (corrections
    re-derived with ``flush_corrections == "rederive"``, else the cached ones, read as stored).
    Rows naming the pad sentinel are zero; other slot ids must lie in [0, num_slots). A cache
    with draft room (max_draft > 0) admits h == window (left by a speculative commit)."""

    def replay(ckpt, s, h):
        if _rederive(cache):
            return gdn_replay_rederive(ckpt, *_gdn_raw_records(cache, s, h))[0]
        return gdn_replay(ckpt, *_gdn_slot_records(cache, s, h))

    return _materialize(cache, slot_ids, (cache.num_v_heads, cache.head_v_dim, cache.head_k_dim), replay)
