"""Pool-level float64 reference of decoding: the steps on a ``Mamba2Cache`` / ``GDNCache`` that
serve as the CPU backend of ``decode`` and ``materialize``, and the row machinery (slot ids,
argument checks, ring reads and writes) that ``pool_spec`` shares.

Written for clarity, not speed. Every step runs the layer recurrences of ``mamba2`` and ``gdn``
in float64, one active row at a time, on the values the cache stores (converted exactly to
float64), and writes the cache and ``out`` in their own dtypes. Per slot: ``checkpoint``,
the table's ``h`` = committed records and ``origin``, and a ring of ``capacity`` records; committed
record ``i`` (0-based, oldest first) lives at ring index ``(origin + i) % capacity``. The
cache-level semantics are documented on ``mamba2_decode_cache_`` and ``gdn_decode_cache_``; a
slot's state is reached as ``state`` describes (the fp32 checkpoint of a plain cache, else the
state copies).
"""

from __future__ import annotations

import operator
from typing import Optional, Sequence, Tuple, Union

import torch

from .common import F64, f64
from .gdn import gdn_conventional_step, gdn_gates, gdn_replay, gdn_replay_rederive, gdn_replay_step
from .mamba2 import mamba2_replay, mamba2_replay_step
from .state import STATE_COPIES, StateAccess, state_access

__all__ = [
    "mamba2_decode_cache_",
    "mamba2_materialize",
    "gdn_decode_cache_",
    "gdn_materialize",
    "mamba2_decode_lowprec_cache_",
    "gdn_decode_lowprec_cache_",
]

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- rows and checks


def int_values(name: str, values) -> list:
    """A 1-D integer tensor or a sequence of ints (named ``name`` in errors) as Python ints."""
    if isinstance(values, Tensor):
        if values.dim() != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {values.dtype}")
        return [int(v) for v in values.tolist()]
    return [operator.index(v) for v in values]


def slot_list(slot_ids: Union[Tensor, Sequence[int]]) -> list:
    return int_values("slot_ids", slot_ids)


def active_rows(cache, slot_ids, nrows: int, per: str) -> list:
    """(row, slot) of the rows that decode: pad-sentinel and out-of-pool ids are skipped."""
    ids = slot_list(slot_ids)
    if len(ids) != nrows:
        raise ValueError(f"slot_ids has {len(ids)} entries, expected {nrows} (one per row of {per})")
    active = [(r, s) for r, s in enumerate(ids) if s != cache.pad_slot_id and 0 <= s < cache.num_slots]
    used = [s for _, s in active]
    if len(set(used)) != len(used):
        raise ValueError(f"slot_ids names a slot more than once among active rows: {ids}")
    return active


def check_shape(name: str, t: Optional[Tensor], shape: tuple) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_shapes(*specs: Tuple[str, Optional[Tensor], tuple]) -> None:
    """``check_shape(name, t, shape)`` for each (name, t, shape), in order."""
    for name, t, shape in specs:
        check_shape(name, t, shape)


def out_buffer(out: Optional[Tensor], like: Tensor, shape: tuple) -> Tensor:
    """``out`` checked to have ``shape``, or zeros like ``like`` when ``out`` is None."""
    if out is None:
        return torch.zeros_like(like)
    check_shape("out", out, shape)
    return out


def mamba2_lead(cache, x, dt, A, B, C, D, z, dt_bias, drafts: bool = False) -> tuple:
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


def _require(name: str, t) -> None:
    if t is None:
        raise ValueError(f"{name} is required (got None)")


def gdn_lead(cache, q, k, v, a, b, A_log, dt_bias, drafts: bool = False, check_v: bool = True) -> tuple:
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


def slot_cursor(cache, slot: int, allow_full: bool = False) -> int:
    """cursor[slot], checked: 0 <= h < window, or 0 <= h <= window with ``allow_full`` (after a
    speculative commit a slot may hold exactly L committed records; see ``pool_spec``)."""
    h = int(cache.cursor[slot])
    if not (0 <= h <= cache.window if allow_full else 0 <= h < cache.window):
        bound = f"[0, window={cache.window}]" if allow_full else f"[0, window={cache.window})"
        raise RuntimeError(f"cache.cursor[{slot}] = {h} is outside {bound}; the cache is corrupt")
    return h


def _spec_room(cache) -> bool:
    """True when the cache has ring room for drafts (max_draft > 0): only then can a
    speculative commit leave a slot with h == window committed records."""
    return getattr(cache, "max_draft", 0) > 0


def rederives(cache) -> bool:
    """True when the cache's flushes re-derive the committed corrections (paper Algorithm 6)."""
    return getattr(cache, "flush_corrections", "fold") == "rederive"


# ----------------------------------------------------------------------------- ring records


def _ring_records(cache, slot: int, h: int, rings: Sequence[Tuple[str, tuple]]) -> Tuple[Tensor, ...]:
    """The h committed records of one slot, oldest first: one float64 (1, h, *shape) tensor per
    (ring name, record shape) in ``rings``. Record i lives at ring index (origin + i) % capacity;
    values are read as stored and converted exactly to float64."""
    dev = cache.checkpoint.device
    if h == 0:
        return tuple(torch.zeros((1, 0) + shape, dtype=F64, device=dev) for _, shape in rings)
    origin = int(cache.origin[slot])
    idx = torch.tensor([(origin + i) % cache.capacity for i in range(h)], device=dev)
    return tuple(f64(getattr(cache, name)[slot].index_select(0, idx)).unsqueeze(0) for name, _ in rings)


def mamba2_slot_records(cache, slot: int, h: int) -> Tuple[Tensor, Tensor, Tensor]:
    """The h committed records of one slot, oldest first, as float64 (1, h, ...) tensors.

    Record i lives at ring index (origin + i) % capacity. Values are read as stored
    (activation dtype for x and B, fp32 for dt) and converted exactly to float64.
    """
    H, P, N, G = cache.nheads, cache.headdim, cache.dstate, cache.ngroups
    return _ring_records(cache, slot, h, (("ring_x", (H, P)), ("ring_B", (G, N)), ("ring_dt", (H,))))


def gdn_slot_records(cache, slot: int, h: int) -> Tuple[Tensor, Tensor, Tensor]:
    """The h committed records of one GDN slot, oldest first, as float64 (1, h, ...) tensors.

    Record i lives at ring index (origin + i) % capacity; values are read as stored (u fp16,
    k in the activation dtype, g fp32) and converted exactly to float64.
    """
    HV, V, K, H = cache.num_v_heads, cache.head_v_dim, cache.head_k_dim, cache.num_k_heads
    return _ring_records(cache, slot, h, (("ring_u", (HV, V)), ("ring_k", (H, K)), ("ring_g", (HV,))))


def gdn_raw_records(cache, slot: int, h: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The h committed records' (k, g, v, beta) of one GDN slot, oldest first, float64 as stored."""
    HV, V, K, H = cache.num_v_heads, cache.head_v_dim, cache.head_k_dim, cache.num_k_heads
    return _ring_records(cache, slot, h, (("ring_k", (H, K)), ("ring_g", (HV,)), ("ring_v", (HV, V)),
                                          ("ring_beta", (HV,))))


def gdn_records(cache, u: Tensor, k: Tensor, g: Tensor, v: Tensor, beta: Tensor) -> dict:
    """Ring name -> value of a GDN record (u, normalised k, g; v and beta when the cache keeps them)."""
    records = {"ring_u": u, "ring_k": k, "ring_g": g}
    if cache.ring_v is not None:
        records.update(ring_v=v, ring_beta=beta)
    return records


def write_records_(cache, slot: int, pos, records: dict) -> None:
    """ring[slot, pos] = value, cast to that ring's dtype and device, for each (ring name, value)."""
    for name, value in records.items():
        ring = getattr(cache, name)
        ring[slot, pos] = value.to(dtype=ring.dtype, device=ring.device)


# ----------------------------------------------------------------------------- row loops


def step_plan(cache, slot_ids, plan, num_drafts: int):
    """The plan a reference step runs with: ``plan`` when the caller made it (a model step; its
    slot ids must be the step's), else a fresh one from the cache's table (a standalone step:
    ``plan_decode``, which advances the table, or ``plan_verify``). Made once the arguments are
    checked, since a decode plan writes the table."""
    ids = torch.tensor(slot_list(slot_ids), dtype=torch.int32, device=cache.table.device)
    if plan is None:
        table = cache.table
        return table.plan_decode(ids) if num_drafts == 0 else table.plan_verify(ids, num_drafts)
    if plan.table is not cache.table or plan.num_drafts != num_drafts or plan.rows[:, 0].tolist() != ids.tolist():
        raise ValueError("plan: expected a plan of this cache's table for these slot ids and draft count")
    return plan


def _decode_rows_(state: StateAccess, cache, slot_ids, nrows: int, per: str, out: Tensor, step, plan) -> Tensor:
    """The row loop of a cache-level decode step (``*_decode_cache_``); returns ``out``.

    For every active row r (slot s), with h and the SR write w from the step's plan (``step_plan``;
    h == window admitted with draft room) and flush = h + 1 >= window: ``step(state.read(cache, s,
    flush), s, h, slice(r, r + 1), window)`` gives (y, new_checkpoint, record) for ``window =
    max(cache.window, h + 1)`` (h == window after a speculative commit: flush all); y[0] is cast
    into ``out[r]``. Then a flush stores new_checkpoint (``state.store_``, SR write w); otherwise
    ``record()`` (ring name -> value of the token's record) is written at ring index (origin + h)
    % capacity. The table moved when the plan was made.
    """
    rows = active_rows(cache, slot_ids, nrows, per)
    plan = step_plan(cache, slot_ids, plan, 0)
    for r, s in rows:
        _, h, origin, w = plan.rows[r].tolist()
        flush = h + 1 >= cache.window
        y, new_ckpt, record = step(state.read(cache, s, flush), s, h, slice(r, r + 1), max(cache.window, h + 1))
        out[r] = y[0].to(dtype=out.dtype, device=out.device)
        if flush:
            state.store_(cache, s, new_ckpt[0], w)
        else:
            write_records_(cache, s, (origin + h) % cache.capacity, record())
    return out


def _materialize(cache, slot_ids, state_shape: tuple, replay) -> Tensor:
    """Float64 (n, *state_shape): for each named slot, ``replay(checkpoint, slot, h)`` from the
    checkpoint a flush reads (``state_access``); a row naming the pad sentinel is skipped, as
    decode skips it, and stays zero. Other slot ids must lie in [0, num_slots); h == window is
    admitted with draft room."""
    state = state_access(cache)
    ids = slot_list(slot_ids)
    out = torch.zeros((len(ids),) + state_shape, dtype=F64, device=cache.checkpoint.device)
    for i, s in enumerate(ids):
        if s == cache.pad_slot_id:
            continue
        if not 0 <= s < cache.num_slots:
            raise ValueError(f"slot id {s} is outside [0, num_slots={cache.num_slots})")
        h = slot_cursor(cache, s, allow_full=_spec_room(cache))
        out[i] = replay(state.read(cache, s, True), s, h)[0]
    return out


# ============================================================================= Mamba-2


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
    plan=None,
) -> Tensor:
    """In-place cache-level reference step (T = 1) on a ``Mamba2Cache``; returns ``out``.

    Row r uses slot ``slot_ids[r]``. A row is skipped (no cache tensor touched, ``out[r]``
    untouched; zeros when ``out`` is allocated here) if its slot id equals
    ``cache.pad_slot_id`` or lies outside ``[0, num_slots)``. Two active rows naming the same
    slot raise ValueError. ``plan``: the model step's (``SequenceTable.plan_decode``), else the
    cache's table plans (and advances) here. Every active row, independently, with h from the plan:

      * reads the slot's checkpoint and its h records at ring index (origin + i) % capacity,
        as stored (ring dtype, converted to float64), and runs ``mamba2_replay_step`` in
        float64 (output-only route). The current token's own contribution uses x, B and dt
        as given, in float64 (dt processed with dt_bias / softplus in float64);
      * non-flush (h + 1 < window): writes the record at (origin + h) % capacity (x and B
        cast to the ring dtype, processed dt cast to fp32); the checkpoint is
        not written;
      * flush (h + 1 >= window; h == window only after a speculative commit): writes the new
        checkpoint (cast to fp32); the flushing token's record is folded, not stored.

    window == 1 (conventional cache, no ring): every step is a flush. The table moves with the
    plan (h + 1, or 0 after a flush), not here. ``out`` has x's shape and dtype (allocated if None); row r gets y cast to it.

    A cache with low-precision state (``not cache.is_plain``) reads and writes its state
    copies as ``mamba2_decode_lowprec_cache_`` describes.
    """
    return _mamba2_decode_(state_access(cache), cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out,
                           plan)


def _mamba2_decode_(state: StateAccess, cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out,
                    plan=None) -> Tensor:
    """``mamba2_decode_cache_`` with the slots' state reached through ``state``."""
    (b,) = mamba2_lead(cache, x, dt, A, B, C, D, z, dt_bias)
    out = out_buffer(out, x, (b, cache.nheads, cache.headdim))

    def step(S, s, h, row, window):
        y, new_ckpt, _, _, new_dt = mamba2_replay_step(
            S, *mamba2_slot_records(cache, s, h), x[row], dt[row], A, B[row], C[row], D, None if z is None else z[row],
            dt_bias, dt_softplus, window=window, route="output_only",
        )
        return y, new_ckpt, lambda: {"ring_x": x[row][0], "ring_B": B[row][0], "ring_dt": new_dt[0, -1]}

    return _decode_rows_(state, cache, slot_ids, b, "x", out, step, plan)


def mamba2_decode_lowprec_cache_(cache, x, dt, A, B, C, slot_ids, D=None, z=None, dt_bias=None, dt_softplus=False,
                                 out=None, plan=None) -> Tensor:
    """In-place reference decode step (T = 1) on any ``Mamba2Cache`` (the rules of
    ``reference.state``); arguments, pad rows and ``out`` as ``mamba2_decode_cache_``. Returns
    ``out``."""
    return _mamba2_decode_(STATE_COPIES, cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out, plan)


def mamba2_materialize(cache, slot_ids: Union[Tensor, Sequence[int]], A: Tensor) -> Tensor:
    """Current state of each named slot, float64 (n, H, P, N): checkpoint (decoded, for a
    low-precision one) + replay of its committed records (read as stored). Rows naming the pad
    sentinel are zero; other slot ids must lie in [0, num_slots). ``A`` (H,). A cache with draft
    room (max_draft > 0) admits h == window (left by a speculative commit)."""
    return _materialize(
        cache, slot_ids, (cache.nheads, cache.headdim, cache.dstate),
        lambda ckpt, s, h: mamba2_replay(ckpt, *mamba2_slot_records(cache, s, h), A),
    )


# ============================================================================= Gated DeltaNet


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
    plan=None,
) -> Tensor:
    """In-place cache-level reference GDN step (T = 1) on a ``GDNCache``; returns ``out``.

    Row r uses slot ``slot_ids[r]``. A row is skipped (no cache tensor touched, ``out[r]``
    untouched; zeros when ``out`` is allocated here) if its slot id equals
    ``cache.pad_slot_id`` or lies outside ``[0, num_slots)``. Two active rows naming the same
    slot raise ValueError. ``plan``: the model step's (``SequenceTable.plan_decode``), else the
    cache's table plans (and advances) here. Every active row, independently, with h from the plan:

      * reads the slot's checkpoint and its h records at ring index (origin + i) % capacity,
        as stored (u fp16, k activation dtype, g fp32, converted to float64), and runs
        ``gdn_replay_step`` in float64. The current token uses q, k, v, a, b as given, in
        float64 (its u, normalised k and g are exact);
      * non-flush (h + 1 < window): writes the record at (origin + h) % capacity: u cast to
        fp16, the normalised k to the activation dtype, g to fp32 (and, when the cache keeps
        them, v to the activation dtype and beta to fp32); the checkpoint is
        not written;
      * flush (h + 1 >= window; h == window only after a speculative commit): writes the new
        checkpoint (cast to fp32); the flushing token's record is folded, not stored.

    window == 1 (conventional cache, no ring): every step is a flush. The table moves with the
    plan (h + 1, or 0 after a flush), not here. ``out`` has v's shape and dtype (allocated if None); row r gets o cast to it.

    A cache with low-precision state or re-derived flush corrections (``not cache.is_plain``)
    reads and writes its state copies as ``gdn_decode_lowprec_cache_`` describes; a "rederive"
    flush rebuilds the state before the token with ``gdn_replay_rederive`` from the checkpoint
    and the records' (k, g, v, beta), then takes the token's step (``gdn_conventional_step``: u
    from that state, o = S_new q).
    """
    return _gdn_decode_(state_access(cache), cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out, plan)


def _gdn_decode_(state: StateAccess, cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out, plan=None) -> Tensor:
    """``gdn_decode_cache_`` with the slots' state reached through ``state``."""
    (bsz,) = gdn_lead(cache, q, k, v, a, b, A_log, dt_bias)
    out = out_buffer(out, v, (bsz, cache.num_v_heads, cache.head_v_dim))

    def step(S, s, h, row, window):
        if h + 1 >= cache.window and rederives(cache):
            S_h, _ = gdn_replay_rederive(S, *gdn_raw_records(cache, s, h))
            o, new_ckpt = gdn_conventional_step(S_h, q[row], k[row], v[row], a[row], b[row], A_log, dt_bias, scale)
            return o, new_ckpt, None  # a flush stores no record
        o, new_ckpt, new_u, new_k, new_g = gdn_replay_step(
            S, *gdn_slot_records(cache, s, h), q[row], k[row], v[row], a[row], b[row], A_log, dt_bias, scale,
            window=window,
        )

        def record():
            _, beta = gdn_gates(a[row], b[row], A_log, dt_bias)
            return gdn_records(cache, new_u[0, -1], new_k[0, -1], new_g[0, -1], v[row][0], beta[0])

        return o, new_ckpt, record

    return _decode_rows_(state, cache, slot_ids, bsz, "v", out, step, plan)


def gdn_decode_lowprec_cache_(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale=None, out=None,
                              plan=None) -> Tensor:
    """In-place reference GDN decode step (T = 1) on any ``GDNCache`` (the rules of
    ``reference.state``); arguments, pad rows and ``out`` as ``gdn_decode_cache_``. Returns
    ``out``.

    A flush with ``cache.flush_corrections == "rederive"`` rebuilds the state before the token
    with ``gdn_replay_rederive`` from the decoded checkpoint and the records' (k, g, v, beta),
    then takes the token's step (``gdn_conventional_step``: u from that state, o = S_new q);
    with "fold" it is ``gdn_replay_step`` from the decoded checkpoint.
    """
    return _gdn_decode_(STATE_COPIES, cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out, plan)


def gdn_materialize(cache, slot_ids: Union[Tensor, Sequence[int]]) -> Tensor:
    """Current state of each named GDN slot, float64 (n, HV, V, K): checkpoint (decoded, for a
    low-precision one) + its committed records, folded as the next flush will (corrections
    re-derived with ``flush_corrections == "rederive"``, else the cached ones, read as stored).
    Rows naming the pad sentinel are zero; other slot ids must lie in [0, num_slots). A cache
    with draft room (max_draft > 0) admits h == window (left by a speculative commit)."""

    def replay(ckpt, s, h):
        if rederives(cache):
            return gdn_replay_rederive(ckpt, *gdn_raw_records(cache, s, h))[0]
        return gdn_replay(ckpt, *gdn_slot_records(cache, s, h))

    return _materialize(cache, slot_ids, (cache.num_v_heads, cache.head_v_dim, cache.head_k_dim), replay)
