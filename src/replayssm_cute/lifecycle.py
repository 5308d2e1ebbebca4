"""A sequence's life in the pool, for every layer of a model at once, on the device.

What an engine does between decode steps, with no host read (each call captures in a CUDA graph):

* ``reset_slots(table, caches, slot_ids, states)``: after a prefill, each layer's prefill state
  becomes its checkpoint (every copy: SR into a low-precision checkpoint, RTN into the read copy)
  and the sequence starts with no committed records;
* ``fork_slots(table, caches, src, dst)``: slot ``dst[i]`` becomes a copy of slot ``src[i]`` in
  every layer (checkpoint and its copies, ring, table entry): prefix caching, beam or parallel
  sampling;
* ``materialize_states(cache, slot_ids, A=None)``: one layer's current state of each slot in
  fp32, in the conventional layout (slots, *state shape), for code that expects a plain state.

Rows whose slot id is the pad sentinel or lies outside the pool are skipped, as a decode step
skips them. Two live rows naming one slot (or, for a fork, a slot that is both a source and a
destination) are the caller's error, as in a decode step; ``REPLAYSSM_CUTE_DEBUG=1`` refuses them.
Every call is refused while a verify step awaits its commit on the table.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import checks
from .layers import EXPECTED_CACHE, layer_of
from .table import SequenceTable, scatter_rows

__all__ = ["reset_slots", "fork_slots", "materialize_states"]


def _caches(op: str, table, caches) -> list:
    """`caches` checked: a non-empty sequence of layer caches that share `table`."""
    if not isinstance(table, SequenceTable):
        raise TypeError(f"{op}: argument 'table': expected a SequenceTable, got {type(table).__name__}")
    caches = list(caches) if isinstance(caches, (list, tuple)) else None
    if not caches:
        raise TypeError(f"{op}: argument 'caches': expected a non-empty list of layer caches sharing the table")
    for i, cache in enumerate(caches):
        if layer_of(cache) is None:
            raise TypeError(f"{op}: argument 'caches': entry {i}: expected {EXPECTED_CACHE}, got "
                            f"{type(cache).__name__}")
        if cache.table is not table:
            raise ValueError(f"{op}: argument 'caches': entry {i} does not share the table (made without table=)")
    table._refuse_while_pending(op)
    return caches


def reset_slots(table: SequenceTable, caches: Sequence, slot_ids: torch.Tensor, states: Sequence) -> None:
    """Hand prefill states over: for each live row i, every layer's checkpoint of slot
    ``slot_ids[i]`` = ``states[layer][i]`` (cast to fp32, then written into every copy as
    ``load_prefill`` does, the SR bits of the slot's next write), no committed records, origin 0.

    ``caches``: every layer cache sharing ``table``; ``states``: one floating tensor per cache,
    (b, *that cache's state shape) on the table's device. On the device, graph-capturable.
    """
    caches = _caches("reset_slots", table, caches)
    ids = table.slot_tensor(slot_ids, "slot_ids")
    if not isinstance(states, (list, tuple)) or len(states) != len(caches):
        raise TypeError(f"reset_slots: argument 'states': expected a list of {len(caches)} tensors, one per cache")
    for i, (cache, state) in enumerate(zip(caches, states)):
        shape = (ids.shape[0],) + tuple(cache._state_shape)
        if (not isinstance(state, torch.Tensor) or not state.dtype.is_floating_point
                or tuple(state.shape) != shape or state.device != table.device):
            checks.fail(f"states[{i}]", f"a floating tensor of shape {shape} on {table.device}",
                        f"{getattr(state, 'dtype', type(state).__name__)} {tuple(getattr(state, 'shape', ()))} on "
                        f"{getattr(state, 'device', None)}")
        checks.no_autograd(f"states[{i}]", state)
    if checks.debug_host_checks(table.device):
        table.check_distinct(ids, "reset_slots")
    target, row, any_live = scatter_rows(ids, table.live(ids))
    writes = table.sr_writes[target]
    for cache, state in zip(caches, states):
        cache.write_rows_(target, state[row], writes, write=any_live)
    table.reset(ids)
    table.sr_writes.index_put_((target,), torch.where(any_live, writes + 1, writes))


def _slot_tensors(cache) -> list:
    """Every per-slot tensor of a cache (its state copies with their scales, and its rings)."""
    names = [n for n, t in vars(cache).items() if isinstance(t, torch.Tensor) and n != "sr_seed"]
    return [getattr(cache, n) for n in names if getattr(cache, n).shape[:1] == (cache.num_slots,)]


def fork_slots(table: SequenceTable, caches: Sequence, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Slot ``dst[i]`` becomes a copy of slot ``src[i]`` in every layer: checkpoint and its copies,
    ring (committed records and all) and table entry, bit for bit. Rows where either id is pad or
    outside the pool are skipped. On the device, graph-capturable."""
    caches = _caches("fork_slots", table, caches)
    src = table.slot_tensor(src, "src")
    dst = table.slot_tensor(dst, "dst", src.shape[0])
    if checks.debug_host_checks(table.device):  # no slot both a source and a destination, or named twice
        table.check_distinct(torch.cat([src, dst]), "fork_slots")
    target, row, any_live = scatter_rows(dst, table.live(src) & table.live(dst))
    source = torch.where(any_live, src[row], target)
    for cache in caches:
        for t in _slot_tensors(cache):
            t = t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            t.index_put_((target,), t[source])
    table.fork(src, dst)


def materialize_states(cache, slot_ids: torch.Tensor, A: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The current state of each named slot of one layer, float32 (b, *state shape) on the
    cache's device: its recurrence checkpoint (decoded) with its committed records folded in,
    as the next flush folds them (in float64, rounded once). Skipped rows come back zero.
    ``A``: a Mamba-2 layer's decay rates as ``Mamba2Cache.materialize`` takes them; None for GDN.
    On the device, graph-capturable."""
    layer = layer_of(cache)
    if layer is None:
        raise TypeError(f"materialize_states: argument 'cache': expected {EXPECTED_CACHE}, got {type(cache).__name__}")
    cache._refuse_while_verify_pending("materialize_states")
    table = cache.table
    ids = table.slot_tensor(slot_ids, "slot_ids")
    live = table.live(ids)
    safe = torch.where(live, ids, 0).long()
    fmt, data, scales = cache._copy("checkpoint")
    state = data[safe] if fmt is None else fmt.decode(data[safe], tuple(t[safe] for t in scales))
    if cache.window > 1:
        # Every ring position in record order; a position past the slot's h reads as zeros,
        # which every layer's replay takes as no record.
        record = torch.arange(cache.capacity, device=ids.device)
        alive = record[None, :] < table.committed[safe][:, None].long()
        position = (table.origin[safe][:, None].long() + record[None, :]) % cache.capacity
        records = []
        for name in layer.replay_rings(cache):
            ring = getattr(cache, name)[safe[:, None], position]
            records.append(torch.where(alive.view(alive.shape + (1,) * (ring.dim() - 2)), ring, 0))
        state = layer.replay(cache, state, tuple(records), A)
    elif A is not None and layer.name == "mamba2":
        cache._decay_rates(A)  # checked, as for a ReplaySSM cache
    return torch.where(live.view((-1,) + (1,) * (state.dim() - 1)), state.to(torch.float32), 0.0)
