"""Checks shared by the Mamba-2 and GDN cache tests (tests/cache/test_mamba2_cache.py,
test_gdn_cache.py); slot_equal also serves tests/reference/test_spec_reference.py, and
check_aligned_flush the kernels' GPU tests (tests/kernels/test_*_gpu.py)."""

import pytest
import torch

from tests.helpers.inputs import F64
from tests.helpers.inputs import randn as _randn
from tests.helpers.numerics import assert_rel

# bytes per element of the activation dtypes a cache may hold
ACT_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}


def snapshot(cache, rings):
    """Clones of every allocated cache tensor: the checkpoint, the rings named in `rings`, and
    the cursor and origin."""
    names = ("checkpoint", *rings, "cursor", "origin")
    return {n: getattr(cache, n).clone() for n in names if getattr(cache, n) is not None}


def slot_equal(cache, snap, s):
    return all(torch.equal(getattr(cache, n)[s], t[s]) for n, t in snap.items())


# ----------------------------------------------------------------------------- construction


def check_layout(c, expect):
    """Every tensor of `expect` (name -> (shape, dtype), plus the int32 per-slot counters) has
    that shape and dtype, is contiguous with a unit inner stride, and is all zeros."""
    n = c.num_slots
    expect = dict(expect, cursor=((n,), torch.int32), origin=((n,), torch.int32))
    for name, (shape, dtype) in expect.items():
        t = getattr(c, name)
        assert tuple(t.shape) == shape and t.dtype == dtype, name
        assert t.is_contiguous() and t.stride()[-1] == 1, name
        assert not t.any(), name


# constructor cases common to both caches, in the order the tests list them
WINDOW_CASES = [
    (dict(window=0), ValueError, "window"),
    (dict(window="16"), TypeError, "window"),
    (dict(max_draft=-1), ValueError, "max_draft"),
    (dict(max_draft=17), ValueError, "max_draft"),
    (dict(window=1, max_draft=2), ValueError, "max_draft"),
]
DTYPE_PAD_DEVICE_CASES = [
    (dict(dtype=torch.float64), ValueError, "dtype"),
    (dict(dtype=torch.int8), ValueError, "dtype"),
    (dict(dtype="bfloat16"), TypeError, "dtype"),
    (dict(pad_slot_id=1), ValueError, "pad_slot_id"),
    (dict(pad_slot_id=-2), ValueError, "pad_slot_id"),
    (dict(pad_slot_id=0, num_slots=1), ValueError, "num_slots"),
    (dict(device="not-a-device"), TypeError, "device"),
]


def check_constructor_rejects(cls, base, positional, changes, exc, match):
    """cls(*positional of base+changes, **the rest) raises exc matching `match`."""
    kw = dict(base, **changes)
    pos = [kw.pop(k) for k in positional]
    with pytest.raises(exc, match=match):
        cls(*pos, **kw)


def check_memory_totals(c, m, rings):
    """The per-slot counters take 4 bytes each, the total adds the parts up, and the tensors
    the cache allocated are exactly num_slots times the total."""
    assert m["cursor"] == m["origin"] == m["sr_counter"] == 4  # the cache's own sequence table
    assert m["total"] == sum(v for k, v in m.items() if k != "total")
    allocated = sum(t.numel() * t.element_size() for t in snapshot(c, rings).values()) + c.table.sr_writes.nbytes
    assert allocated == c.num_slots * m["total"]


# ----------------------------------------------------------------------------- load_prefill


def check_load_prefill(c, g, rings):
    """On a 5-slot cache with cursors and origins set: load_prefill of slots 3 and 1 stores the
    checkpoints (as fp32) and clears their cursor and origin, leaving the other slots alone;
    a bf16 state loads as fp32. Returns the float64 state loaded into slots 3, 1."""
    state_shape = tuple(c.checkpoint.shape[1:])
    c.cursor.copy_(torch.tensor([1, 2, 3, 1, 2], dtype=torch.int32))
    c.origin.copy_(torch.tensor([5, 4, 3, 2, 1], dtype=torch.int32))
    snap = snapshot(c, rings)
    state = torch.randn(2, *state_shape, generator=g, dtype=F64)
    c.load_prefill(torch.tensor([3, 1]), state)
    assert torch.equal(c.checkpoint[3], state[0].float())
    assert torch.equal(c.checkpoint[1], state[1].float())
    assert c.cursor.tolist() == [1, 0, 3, 0, 2]
    assert c.origin.tolist() == [5, 0, 3, 0, 1]
    for s in (0, 2, 4):
        assert slot_equal(c, snap, s)
    bf = torch.randn(1, *state_shape, generator=g).bfloat16()
    c.load_prefill([4], bf)
    assert torch.equal(c.checkpoint[4], bf[0].float())
    assert c.checkpoint.dtype == torch.float32
    return state


def load_prefill_cases(shape, wrong_shape):
    """(ids, state, exc, match) that load_prefill rejects on a 5-slot cache with state `shape`;
    `wrong_shape` is a per-slot shape it must not accept."""
    return [
        ([0], torch.zeros(2, *shape), ValueError, "state must have shape"),
        ([0], torch.zeros(1, *wrong_shape), ValueError, "state must have shape"),
        ([5], torch.zeros(1, *shape), ValueError, "slot_ids"),
        ([-1], torch.zeros(1, *shape), ValueError, "slot_ids"),
        ([1, 1], torch.zeros(2, *shape), ValueError, "more than once"),
        (torch.tensor([1.0]), torch.zeros(1, *shape), TypeError, "slot_ids"),
        (torch.tensor([[1]]), torch.zeros(1, *shape), ValueError, "slot_ids"),
        ([1], torch.zeros(1, *shape, dtype=torch.int32), TypeError, "state"),
        ([1], "state", TypeError, "state"),
    ]


def check_load_prefill_rejects(c, rings, ids, state, exc, match):
    snap = snapshot(c, rings)
    with pytest.raises(exc, match=match):
        c.load_prefill(ids, state)
    assert all(torch.equal(getattr(c, n), t) for n, t in snap.items())


def check_reserved_slot_zero(c):
    """With pad_slot_id == 0, slot 0 cannot be loaded and stays zero."""
    state_shape = tuple(c.checkpoint.shape[1:])
    with pytest.raises(ValueError, match="reserved"):
        c.load_prefill([0], torch.zeros(1, *state_shape))
    c.load_prefill([1, 2], torch.ones(2, *state_shape))
    assert not c.checkpoint[0].any()


def check_materialize_fresh_slots(cache, S, *args):
    """cache.materialize(ids, *args) of slots 2, 1 just loaded with S (float64, fp32-exact), on
    a 3-slot cache with pad_slot_id == 0: slot 3 is rejected; the reserved slot 0, the pad
    sentinel, is skipped as decode skips it (its row comes back zero)."""
    cache.load_prefill([2, 1], S)
    assert torch.equal(cache.materialize(torch.tensor([1, 2]), *args), S.flip(0).float().to(F64))
    assert torch.equal(cache.materialize([2, 2], *args), S[[0, 0]])
    with pytest.raises(ValueError, match="slot_ids"):
        cache.materialize([3], *args)
    assert torch.equal(cache.materialize([0, 1], *args), torch.cat([torch.zeros_like(S[:1]), S[1:]]))


# ----------------------------------------------------------------------------- cache decode


class DecodeDriver:
    """Runs decode steps on a cache and checks every step against a plain recurrence: the
    skeleton shared by the Mamba-2 and GDN cache tests. A subclass supplies the model through
    ``batch``, ``decode``, ``step``, ``check_flush``, ``check_record`` and ``materialize``.

    Slot active_slots[i] joins at step offsets[i] (so rows sit at different ring positions).
    Every batch also holds pad rows and out-of-range slot ids, in shuffled order. Each step:
    skipped rows of ``out`` and slots not in the batch are untouched, the origin never moves;
    a flush (h + 1 == window) sets cursor 0, writes no ring and the recurrence continues from
    the stored checkpoint; otherwise the cursor advances, the checkpoint is not written and
    only ring index (origin + h) % capacity is; ``materialize`` matches the recurrence.
    """

    rings = ()  # names of the cache's ring tensors
    out_name = "y"  # the output's name in failure messages

    def __init__(self, cache, g):
        self.cache, self.g = cache, g

    def batch(self, b):
        """Random inputs of one step of b rows, then an ``out`` buffer: (inputs, out)."""
        raise NotImplementedError

    def decode(self, inputs, ids, out):
        """The cache-level reference step on rows `ids`, writing `out`; returns its result."""
        raise NotImplementedError

    def step(self, inputs, r, S_prev):
        """(output (1, ...), state after the token) of row r by the plain recurrence."""
        raise NotImplementedError

    def check_flush(self, s, S_new, what):
        """The checkpoint stored by slot s's flush against the recurrence's state S_new."""
        raise NotImplementedError

    def check_record(self, inputs, r, s, pos, S_prev, S_new, what):
        """Check the record stored at ring index pos; return the state to continue from."""
        raise NotImplementedError

    def materialize(self, live):
        raise NotImplementedError

    def run(self, *, steps_after_join, offsets, active_slots, origins=None, rtol, mat_rtol):
        """Returns the number of flushes per slot; checks it is (steps the slot ran) // window."""
        cache, g = self.cache, self.g
        L, cap = cache.window, cache.capacity
        S0 = _randn(g, len(active_slots), *cache.checkpoint.shape[1:])
        cache.load_prefill(active_slots, S0)
        if origins is not None:
            for s, o in zip(active_slots, origins):
                cache.origin[s] = o
        conv = {s: S0[i : i + 1].float().to(F64) for i, s in enumerate(active_slots)}
        flushes = {s: 0 for s in active_slots}
        never_used = [s for s in range(cache.num_slots) if s not in active_slots]
        initial = snapshot(cache, self.rings)
        skip_ids = [cache.pad_slot_id, cache.pad_slot_id, cache.num_slots, cache.num_slots + 3, -5]
        if cache.pad_slot_id == 0:
            skip_ids.append(-1)

        total_steps = max(offsets) + steps_after_join
        for step in range(total_steps):
            live = [s for s, off in zip(active_slots, offsets) if step >= off]
            ids = live + skip_ids[: 1 + step % len(skip_ids)]
            perm = torch.randperm(len(ids), generator=g).tolist()
            ids = [ids[i] for i in perm]
            inputs, out = self.batch(len(ids))
            out_before = out.clone()
            before = snapshot(cache, self.rings)

            ret = self.decode(inputs, torch.tensor(ids), out)
            assert ret is out

            for r, s in enumerate(ids):
                if s not in live:
                    assert torch.equal(out[r], out_before[r]), f"skipped row {r} (slot {s}) was written"
                    continue
                S_prev = conv[s]
                y_conv, S_new = self.step(inputs, r, S_prev)
                assert_rel(out[r : r + 1], y_conv, rtol, f"{self.out_name} step {step} slot {s}")
                h = int(before["cursor"][s])
                o = int(before["origin"][s])
                assert int(cache.origin[s]) == o, "origin moved"
                if h + 1 == L:
                    flushes[s] += 1
                    assert int(cache.cursor[s]) == 0
                    self.check_flush(s, S_new, f"flush step {step} slot {s}")
                    for n in self.rings:
                        if n in before:
                            assert torch.equal(getattr(cache, n)[s], before[n][s]), f"flush wrote {n}"
                    conv[s] = cache.checkpoint[s : s + 1].to(F64)  # continue from the stored checkpoint
                else:
                    assert int(cache.cursor[s]) == h + 1
                    assert torch.equal(cache.checkpoint[s], before["checkpoint"][s]), "non-flush wrote checkpoint"
                    pos = (o + h) % cap
                    conv[s] = self.check_record(inputs, r, s, pos, S_prev, S_new, f"step {step} slot {s}")
                    others = [i for i in range(cap) if i != pos]
                    for n in self.rings:
                        if n in before:
                            assert torch.equal(getattr(cache, n)[s, others], before[n][s, others]), n
            for s in range(cache.num_slots):
                if s not in live:
                    assert slot_equal(cache, before, s), f"slot {s} not in the batch was touched"
            if live:
                mat = self.materialize(live)
                assert mat.dtype == F64
                assert_rel(mat, torch.cat([conv[s] for s in live]), mat_rtol, f"materialize step {step}")
        for s in never_used:
            assert slot_equal(cache, initial, s), f"unused slot {s} changed"
        for s, off in zip(active_slots, offsets):
            assert flushes[s] == (total_steps - off) // L, f"slot {s} flushed {flushes[s]} times"
        return flushes


def check_aligned_flush(step, window, live, flushed, oob_row):
    """Rows decoded from the same ring position (no staggered warm-up): at each window's last step
    every live row flushes but the out-of-pool one (it skips steps, so its position drifts)."""
    if step % window != window - 1:
        return
    in_step = live.clone()
    if oob_row is not None:
        in_step[oob_row] = False
    assert torch.equal(flushed & in_step, in_step), f"step {step}: aligned rows must flush together"
