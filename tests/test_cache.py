"""Tests of Mamba2Cache and the cache-level reference step (CPU only)."""

import pytest
import torch

from replayssm_cute import reference as R
from replayssm_cute.cache import Mamba2Cache

from _inputs import F64
from _inputs import gen as _gen
from _inputs import randn as _randn
from _inputs import uniform as _uniform
H, P, N = 6, 16, 32


# ----------------------------------------------------------------------------- helpers


def assert_rel(actual, expected, rtol, what=""):
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().item()
    err = (actual.to(F64) - expected.to(F64)).abs().max().item()
    assert scale > 0, f"{what}: expected is all zeros, the check would be vacuous"
    assert err <= rtol * scale, f"{what}: max abs err {err:.3e} > {rtol:.0e} * {scale:.3e}"


def assert_fp32_rounding_of(ckpt, exact, slack_ulps=1.0, extra_rtol=0.0, what=""):
    """ckpt (fp32) is exact (float64) rounded to fp32, give or take slack_ulps ulp (plus
    extra_rtol times the largest magnitude, for inputs that are themselves rounded)."""
    err = (ckpt.to(F64) - exact).abs()
    bound = exact.abs() * (slack_ulps * 2.0**-23) + extra_rtol * exact.abs().max() + 1e-37
    assert bool((err <= bound).all()), f"{what}: checkpoint is not the fp32 rounding (max err {err.max():.3e})"


def _snapshot(cache):
    names = ["checkpoint", "ring_x", "ring_B", "ring_dt", "cursor", "origin", "arrivals"]
    return {n: getattr(cache, n).clone() for n in names if getattr(cache, n) is not None}


def _slot_equal(cache, snap, s):
    return all(torch.equal(getattr(cache, n)[s], t[s]) for n, t in snap.items())


# ----------------------------------------------------------------------------- construction


def test_layout_and_defaults():
    c = Mamba2Cache(5, H, P, N, 2, window=8, max_draft=3, dtype=torch.float16)
    assert (c.num_slots, c.nheads, c.headdim, c.dstate, c.ngroups) == (5, H, P, N, 2)
    assert (c.window, c.max_draft, c.capacity, c.pad_slot_id) == (8, 3, 11, -1)
    assert c.dtype == torch.float16 and c.device == torch.device("cpu")
    assert not c.is_conventional and c.read_copy is None
    expect = {
        "checkpoint": ((5, H, P, N), torch.float32),
        "ring_x": ((5, 11, H, P), torch.float16),
        "ring_B": ((5, 11, 2, N), torch.float16),
        "ring_dt": ((5, 11, H), torch.float32),
        "cursor": ((5,), torch.int32),
        "origin": ((5,), torch.int32),
        "arrivals": ((5,), torch.int32),
    }
    for name, (shape, dtype) in expect.items():
        t = getattr(c, name)
        assert tuple(t.shape) == shape and t.dtype == dtype, name
        assert t.is_contiguous() and t.stride()[-1] == 1, name
        assert not t.any(), name
    assert c.checkpoint.stride() == (H * P * N, P * N, N, 1)


def test_defaults_and_conventional():
    c = Mamba2Cache(3, 8, 4, 16, 1)
    assert c.window == 16 and c.max_draft == 0 and c.capacity == 16 and c.dtype == torch.bfloat16
    assert c.ring_x.dtype == torch.bfloat16
    conv = Mamba2Cache(3, 8, 4, 16, 1, window=1)
    assert conv.is_conventional and conv.capacity == 1
    assert conv.ring_x is None and conv.ring_B is None and conv.ring_dt is None
    assert conv.checkpoint.shape == (3, 8, 4, 16)


def test_repr():
    r = repr(Mamba2Cache(4, H, P, N, 2, window=5, max_draft=1, pad_slot_id=0))
    for part in ["Mamba2Cache(", "num_slots=4", "nheads=6", "headdim=16", "dstate=32", "ngroups=2",
                 "window=5", "max_draft=1", "torch.bfloat16", "pad_slot_id=0"]:
        assert part in r


BASE = dict(num_slots=4, nheads=H, headdim=P, dstate=N, ngroups=2)


@pytest.mark.parametrize(
    "changes,exc,match",
    [
        (dict(num_slots=0), ValueError, "num_slots"),
        (dict(num_slots=2.0), TypeError, "num_slots"),
        (dict(nheads=0), ValueError, "nheads"),
        (dict(nheads=True), TypeError, "nheads"),
        (dict(headdim=-1), ValueError, "headdim"),
        (dict(dstate=0), ValueError, "dstate"),
        (dict(ngroups=0), ValueError, "ngroups"),
        (dict(ngroups=4), ValueError, "multiple of ngroups"),
        (dict(window=0), ValueError, "window"),
        (dict(window="16"), TypeError, "window"),
        (dict(max_draft=-1), ValueError, "max_draft"),
        (dict(max_draft=17), ValueError, "max_draft"),
        (dict(window=1, max_draft=2), ValueError, "max_draft"),
        (dict(dtype=torch.float64), ValueError, "dtype"),
        (dict(dtype=torch.int8), ValueError, "dtype"),
        (dict(dtype="bfloat16"), TypeError, "dtype"),
        (dict(pad_slot_id=1), ValueError, "pad_slot_id"),
        (dict(pad_slot_id=-2), ValueError, "pad_slot_id"),
        (dict(pad_slot_id=0, num_slots=1), ValueError, "num_slots"),
        (dict(device="not-a-device"), TypeError, "device"),
    ],
)
def test_constructor_validation(changes, exc, match):
    kw = dict(BASE, **changes)
    pos = [kw.pop(k) for k in ["num_slots", "nheads", "headdim", "dstate", "ngroups"]]
    with pytest.raises(exc, match=match):
        Mamba2Cache(*pos, **kw)


def test_constructor_accepts_edge_values():
    Mamba2Cache(1, 6, 16, 32, 6, window=1)
    Mamba2Cache(2, 6, 16, 32, 1, window=2, max_draft=16, dtype=torch.float32, pad_slot_id=0)


@pytest.mark.parametrize(
    "shape,window,max_draft,dtype",
    [((128, 64, 128, 8), 16, 0, torch.bfloat16), ((96, 80, 128, 8), 13, 4, torch.float16),
     ((6, 16, 32, 2), 5, 16, torch.float32), ((6, 16, 32, 3), 1, 0, torch.bfloat16)],
)
def test_memory_per_slot(shape, window, max_draft, dtype):
    Hh, Pp, Nn, G = shape
    c = Mamba2Cache(3, Hh, Pp, Nn, G, window=window, max_draft=max_draft, dtype=dtype)
    m = c.memory_per_slot()
    cap = window + max_draft
    act = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4}[dtype]
    ring = window > 1
    assert m["checkpoint"] == 4 * Hh * Pp * Nn
    assert m["ring_x"] == (cap * Hh * Pp * act if ring else 0)
    assert m["ring_B"] == (cap * G * Nn * act if ring else 0)
    assert m["ring_dt"] == (cap * Hh * 4 if ring else 0)
    assert m["cursor"] == m["origin"] == m["arrivals"] == 4
    assert m["total"] == sum(v for k, v in m.items() if k != "total")
    allocated = sum(t.numel() * t.element_size() for t in _snapshot(c).values())
    assert allocated == 3 * m["total"]


def test_memory_nemotron_super_numbers():
    m = Mamba2Cache(1, 128, 64, 128, 8, window=16).memory_per_slot()
    assert m["checkpoint"] == 4_194_304
    assert m["ring_x"] == 262_144 and m["ring_B"] == 32_768 and m["ring_dt"] == 8_192
    assert m["total"] == 4_194_304 + 262_144 + 32_768 + 8_192 + 12


# ----------------------------------------------------------------------------- from_state


def test_from_state_shares_storage():
    g = _gen(1)
    state = _randn(g, 4, H, P, N).float()
    c = Mamba2Cache.from_state(state, 2)
    assert c.checkpoint is state
    assert c.is_conventional and c.ring_x is None
    assert (c.num_slots, c.nheads, c.headdim, c.dstate, c.ngroups) == (4, H, P, N, 2)
    assert c.cursor.shape == (4,) and c.cursor.dtype == torch.int32
    before = state.clone()
    A = -_uniform(g, 1, 2, H)
    y = R.mamba2_decode_cache_(c, _randn(g, 1, H, P), _uniform(g, 0.01, 0.1, 1, H), A,
                               _randn(g, 1, 2, N), _randn(g, 1, 2, N), [2])
    assert not torch.equal(state[2], before[2]), "decoding did not update the engine's tensor"
    assert torch.equal(state[[0, 1, 3]], before[[0, 1, 3]])
    assert y.shape == (1, H, P)
    state[0].fill_(3.0)
    assert bool((c.checkpoint[0] == 3.0).all())

    c2 = Mamba2Cache.from_state(state, 3, window=4, max_draft=2, dtype=torch.float16, pad_slot_id=0)
    assert c2.checkpoint.data_ptr() == state.data_ptr()
    assert c2.ring_x.shape == (4, 6, H, P) and c2.ring_x.dtype == torch.float16
    assert c2.pad_slot_id == 0 and c2.capacity == 6


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: torch.zeros(2, H, P, N, dtype=torch.float16), ValueError, "float32"),
        (lambda: torch.zeros(2, H, N, P).transpose(2, 3), ValueError, "contiguous"),
        (lambda: torch.zeros(H, P, N), ValueError, "shape"),
        (lambda: [[0.0]], TypeError, "state"),
    ],
)
def test_from_state_validation(make, exc, match):
    with pytest.raises(exc, match=match):
        Mamba2Cache.from_state(make(), 2)
    with pytest.raises(ValueError, match="multiple of ngroups"):
        Mamba2Cache.from_state(torch.zeros(2, H, P, N), 4)


# ----------------------------------------------------------------------------- load_prefill


def test_load_prefill_sets_checkpoint_and_clears_cursor():
    g = _gen(2)
    c = Mamba2Cache(5, H, P, N, 2, window=4, max_draft=2)
    c.cursor.copy_(torch.tensor([1, 2, 3, 1, 2], dtype=torch.int32))
    c.origin.copy_(torch.tensor([5, 4, 3, 2, 1], dtype=torch.int32))
    snap = _snapshot(c)
    state = torch.randn(2, H, P, N, generator=g, dtype=F64)
    c.load_prefill(torch.tensor([3, 1]), state)
    assert torch.equal(c.checkpoint[3], state[0].float())
    assert torch.equal(c.checkpoint[1], state[1].float())
    assert c.cursor.tolist() == [1, 0, 3, 0, 2]
    assert c.origin.tolist() == [5, 0, 3, 0, 1]
    for s in (0, 2, 4):
        assert _slot_equal(c, snap, s)
    bf = torch.randn(1, H, P, N, generator=g).bfloat16()
    c.load_prefill([4], bf)
    assert torch.equal(c.checkpoint[4], bf[0].float())
    assert c.checkpoint.dtype == torch.float32


@pytest.mark.parametrize(
    "ids,state,exc,match",
    [
        ([0], torch.zeros(2, H, P, N), ValueError, "state must have shape"),
        ([0], torch.zeros(1, H, P, N + 1), ValueError, "state must have shape"),
        ([5], torch.zeros(1, H, P, N), ValueError, "slot_ids"),
        ([-1], torch.zeros(1, H, P, N), ValueError, "slot_ids"),
        ([1, 1], torch.zeros(2, H, P, N), ValueError, "more than once"),
        (torch.tensor([1.0]), torch.zeros(1, H, P, N), TypeError, "slot_ids"),
        (torch.tensor([[1]]), torch.zeros(1, H, P, N), ValueError, "slot_ids"),
        ([1], torch.zeros(1, H, P, N, dtype=torch.int32), TypeError, "state"),
        ([1], "state", TypeError, "state"),
    ],
)
def test_load_prefill_validation(ids, state, exc, match):
    c = Mamba2Cache(5, H, P, N, 2, window=4)
    with pytest.raises(exc, match=match):
        c.load_prefill(ids, state)


def test_load_prefill_rejects_reserved_slot_zero():
    c = Mamba2Cache(3, H, P, N, 2, window=4, pad_slot_id=0)
    with pytest.raises(ValueError, match="reserved"):
        c.load_prefill([0], torch.zeros(1, H, P, N))
    c.load_prefill([1, 2], torch.ones(2, H, P, N))
    assert not c.checkpoint[0].any()


# ----------------------------------------------------------------------------- cache decode


def _drive(cache, *, seed, steps_after_join, offsets, active_slots, dt_mode, act_dtype, rtol, ckpt_rtol,
           use_dz=True, origins=None):
    """Run decode steps on `cache` and check every step against the conventional recurrence.

    Slot active_slots[i] joins at step offsets[i] (so rows sit at different ring positions).
    Every batch also holds pad rows and out-of-range slot ids, in shuffled order.
    Activations hold values representable in act_dtype but are passed as float64 (so the
    stored records are exact and the float64 output is not rounded).
    dt_mode "exact": dt is processed (softplus of U(-4,-3)-shifted values) beforehand and
    rounded to fp32, so records are exact; "softplus": raw dt, dt_bias, dt_softplus=True.
    Returns the number of flushes per slot; checks it is (steps the slot ran) // window.
    """
    g = _gen(seed)
    L, G, cap = cache.window, cache.ngroups, cache.capacity
    A = -_uniform(g, 1.0, 2.0, H)
    dt_bias = _uniform(g, -4.0, -3.0, H)
    D = _randn(g, H) if use_dz else None

    S0 = _randn(g, len(active_slots), H, P, N)
    cache.load_prefill(active_slots, S0)
    if origins is not None:
        for s, o in zip(active_slots, origins):
            cache.origin[s] = o
    conv = {s: S0[i : i + 1].clone() for i, s in enumerate(active_slots)}
    flushes = {s: 0 for s in active_slots}
    never_used = [s for s in range(cache.num_slots) if s not in active_slots]
    initial = _snapshot(cache)
    skip_ids = [cache.pad_slot_id, cache.pad_slot_id, cache.num_slots, cache.num_slots + 3, -5]
    if cache.pad_slot_id == 0:
        skip_ids.append(-1)

    total_steps = max(offsets) + steps_after_join
    for step in range(total_steps):
        live = [s for s, off in zip(active_slots, offsets) if step >= off]
        ids = live + skip_ids[: 1 + step % len(skip_ids)]
        perm = torch.randperm(len(ids), generator=g).tolist()
        ids = [ids[i] for i in perm]
        b = len(ids)

        x = _randn(g, b, H, P).to(act_dtype).to(F64)
        B = _randn(g, b, G, N).to(act_dtype).to(F64)
        C = _randn(g, b, G, N).to(act_dtype).to(F64)
        z = _randn(g, b, H, P).to(act_dtype).to(F64) if use_dz else None
        raw = _randn(g, b, H)
        if dt_mode == "exact":
            dt = R.softplus(raw + dt_bias).float().to(F64)
            kw = dict(dt_bias=None, dt_softplus=False)
        else:
            dt = raw.float()
            kw = dict(dt_bias=dt_bias.float(), dt_softplus=True)
        out = _randn(g, b, H, P)
        out_before = out.clone()
        before = _snapshot(cache)

        ret = R.mamba2_decode_cache_(cache, x, dt, A, B, C, torch.tensor(ids), D=D, z=z, out=out, **kw)
        assert ret is out

        assert not cache.arrivals.any()
        for r, s in enumerate(ids):
            if s not in live:
                assert torch.equal(out[r], out_before[r]), f"skipped row {r} (slot {s}) was written"
                continue
            y_conv, S_new = R.mamba2_conventional_step(
                conv[s], x[r : r + 1], dt[r : r + 1], A, B[r : r + 1], C[r : r + 1], D,
                None if z is None else z[r : r + 1], **kw,
            )
            assert_rel(out[r : r + 1], y_conv, rtol, f"y step {step} slot {s}")
            h = int(before["cursor"][s])
            o = int(before["origin"][s])
            assert int(cache.origin[s]) == o, "origin moved"
            if h + 1 == L:
                flushes[s] += 1
                assert int(cache.cursor[s]) == 0
                assert_fp32_rounding_of(cache.checkpoint[s : s + 1], S_new, extra_rtol=ckpt_rtol,
                                        what=f"flush step {step} slot {s}")
                for n in ("ring_x", "ring_B", "ring_dt"):
                    if n in before:
                        assert torch.equal(getattr(cache, n)[s], before[n][s]), f"flush wrote {n}"
                conv[s] = cache.checkpoint[s : s + 1].to(F64)  # continue from the stored checkpoint
            else:
                assert int(cache.cursor[s]) == h + 1
                assert torch.equal(cache.checkpoint[s], before["checkpoint"][s]), "non-flush wrote checkpoint"
                pos = (o + h) % cap
                assert torch.equal(cache.ring_x[s, pos], x[r].to(cache.dtype))
                assert torch.equal(cache.ring_B[s, pos], B[r].to(cache.dtype))
                assert torch.equal(cache.ring_dt[s, pos], R.mamba2_dt(dt[r], kw["dt_bias"], kw["dt_softplus"]).float())
                others = [i for i in range(cap) if i != pos]
                for n in ("ring_x", "ring_B", "ring_dt"):
                    assert torch.equal(getattr(cache, n)[s, others], before[n][s, others])
                conv[s] = S_new
        for s in range(cache.num_slots):
            if s not in live:
                assert _slot_equal(cache, before, s), f"slot {s} not in the batch was touched"
        if live:
            mat = cache.materialize(live, A)
            assert mat.dtype == F64
            assert_rel(mat, torch.cat([conv[s] for s in live]), rtol, f"materialize step {step}")
    for s in never_used:
        assert _slot_equal(cache, initial, s), f"unused slot {s} changed"
    for s, off in zip(active_slots, offsets):
        assert flushes[s] == (total_steps - off) // L, f"slot {s} flushed {flushes[s]} times"
    return flushes


@pytest.mark.parametrize(
    "window,G,max_draft,pad,origins",
    [
        (16, 2, 0, -1, None),
        (3, 1, 2, 0, [4, 3, 0, 2, 1]),
        (5, 2, 3, -1, [7, 6, 5, 1, 0]),
        (16, 1, 4, 0, [19, 3, 17, 0, 10]),
        (1, 2, 0, -1, None),
        (1, 1, 0, 0, None),
    ],
)
def test_cache_decode_exact_against_conventional(window, G, max_draft, pad, origins):
    cache = Mamba2Cache(8, H, P, N, G, window=window, max_draft=max_draft, dtype=torch.float32, pad_slot_id=pad)
    active = [0, 2, 3, 5, 6] if pad == -1 else [1, 2, 3, 5, 6]
    offsets = [0, 1, 2, 4, 7]
    flushes = _drive(cache, seed=window * 100 + G * 10 + max_draft, steps_after_join=5 * window + 2,
                     offsets=offsets, active_slots=active, dt_mode="exact", act_dtype=F64,
                     rtol=1e-10, ckpt_rtol=0.0, origins=origins)
    assert min(flushes.values()) == 5 if window > 1 else min(flushes.values()) == 5 * window + 2


@pytest.mark.parametrize("window,G,act_dtype", [(5, 2, torch.bfloat16), (16, 3, torch.float16), (3, 1, torch.float32)])
def test_cache_decode_softplus_path(window, G, act_dtype):
    """Raw dt with dt_bias and softplus; records hold dt rounded to fp32, so the tolerance
    covers that rounding (inputs are already in the ring dtype, so x and B are exact)."""
    cache = Mamba2Cache(6, H, P, N, G, window=window, max_draft=1, dtype=act_dtype)
    flushes = _drive(cache, seed=7 + window, steps_after_join=5 * window + 1, offsets=[0, 3, 1],
                     active_slots=[4, 0, 2], dt_mode="softplus", act_dtype=act_dtype,
                     rtol=1e-6, ckpt_rtol=1e-6)
    assert min(flushes.values()) == 5


def test_cache_decode_without_d_and_z():
    cache = Mamba2Cache(4, H, P, N, 2, window=4, dtype=torch.float32)
    flushes = _drive(cache, seed=3, steps_after_join=21, offsets=[0, 2], active_slots=[1, 3],
                     dt_mode="exact", act_dtype=F64, rtol=1e-10, ckpt_rtol=0.0, use_dz=False)
    assert min(flushes.values()) == 5


def test_cache_decode_rounds_only_stored_records():
    """fp32 inputs into a bf16 ring: the current token uses x and B exactly, records are
    read back rounded to bf16."""
    g = _gen(11)
    G, L = 2, 3
    cache = Mamba2Cache(2, H, P, N, G, window=L, dtype=torch.bfloat16)
    A = -_uniform(g, 1.0, 2.0, H)
    S0 = _randn(g, 1, H, P, N)
    cache.load_prefill([1], S0)
    toks = [dict(x=_randn(g, 1, H, P), B=_randn(g, 1, G, N), C=_randn(g, 1, G, N),
                 dt=R.softplus(_randn(g, 1, H) - 3.5).float().to(F64)) for _ in range(L)]
    for t in toks:  # the inputs must not be bf16-representable, or the test proves nothing
        assert not torch.equal(t["x"].bfloat16().double(), t["x"])

    def rnd(t):
        return t.bfloat16().to(F64)

    S_rounded = S0  # state built from stored (rounded) records
    S_exact = S0
    for i, t in enumerate(toks):
        y = R.mamba2_decode_cache_(cache, t["x"].float(), t["dt"], A, t["B"].float(), t["C"].float(), [1])
        assert y.dtype == torch.float32
        y_expect, S_full = R.mamba2_conventional_step(S_rounded, t["x"], t["dt"], A, t["B"], t["C"])
        y_all_exact, S_exact = R.mamba2_conventional_step(S_exact, t["x"], t["dt"], A, t["B"], t["C"])
        assert_rel(y, y_expect, 1e-6, f"token {i}")  # out is fp32: 1e-6 covers its rounding
        if i > 0:  # earlier records were rounded: using them exactly would be a visible difference
            assert (y.double() - y_all_exact).abs().max() > 1e-4 * y_all_exact.abs().max()
        if i + 1 < L:
            assert torch.equal(cache.ring_x[1, i], t["x"].bfloat16()[0])
            assert torch.equal(cache.ring_B[1, i], t["B"].bfloat16()[0])
            _, S_rounded = R.mamba2_conventional_step(S_rounded, rnd(t["x"]), t["dt"], A, rnd(t["B"]), t["C"])
        else:  # flush: the last token is folded exactly
            assert_fp32_rounding_of(cache.checkpoint[1:2], S_full, what="flush")
    assert int(cache.cursor[1]) == 0


def test_cache_decode_out_allocation_and_pad_rows():
    g = _gen(12)
    cache = Mamba2Cache(3, H, P, N, 2, window=4, pad_slot_id=0)
    A = -_uniform(g, 1.0, 2.0, H)
    x = _randn(g, 3, H, P).bfloat16()
    args = (x, _uniform(g, 0.01, 0.1, 3, H), A, _randn(g, 3, 2, N).bfloat16(), _randn(g, 3, 2, N).bfloat16())
    cache.load_prefill([1, 2], _randn(g, 2, H, P, N))
    y = R.mamba2_decode_cache_(cache, *args, torch.tensor([2, 0, 1], dtype=torch.int32))
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert not y[1].any() and y[0].abs().sum() > 0 and y[2].abs().sum() > 0
    assert cache.cursor.tolist() == [0, 1, 1]


def test_cache_decode_argument_errors():
    g = _gen(13)
    cache = Mamba2Cache(4, H, P, N, 2, window=4)
    A = -_uniform(g, 1.0, 2.0, H)
    x, dt = _randn(g, 2, H, P), _uniform(g, 0.01, 0.1, 2, H)
    B, C = _randn(g, 2, 2, N), _randn(g, 2, 2, N)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="more than once"):
        R.mamba2_decode_cache_(cache, x, dt, A, B, C, [1, 1])
    with pytest.raises(ValueError, match="slot_ids"):
        R.mamba2_decode_cache_(cache, x, dt, A, B, C, [1])
    with pytest.raises(ValueError, match="B must have shape"):
        R.mamba2_decode_cache_(cache, x, dt, A, B[:, :1], C, [1, 2])
    with pytest.raises(ValueError, match="out must have shape"):
        R.mamba2_decode_cache_(cache, x, dt, A, B, C, [1, 2], out=torch.zeros(3, H, P))
    for n, t in snap.items():
        assert torch.equal(getattr(cache, n), t), n
    R.mamba2_decode_cache_(cache, x, dt, A, B, C, [-1, -1])  # several pad rows are fine
    cache.cursor[2] = 4  # corrupt: h must stay below window
    with pytest.raises(RuntimeError, match="cursor"):
        R.mamba2_decode_cache_(cache, x, dt, A, B, C, [2, -1])


def test_materialize_validation_and_fresh_slots():
    g = _gen(14)
    cache = Mamba2Cache(3, H, P, N, 2, window=4, pad_slot_id=0)
    A = -_uniform(g, 1.0, 2.0, H)
    S = _randn(g, 2, H, P, N)
    cache.load_prefill([2, 1], S)
    assert torch.equal(cache.materialize(torch.tensor([1, 2]), A), S.flip(0).float().to(F64))
    assert torch.equal(cache.materialize([2, 2], A), S[[0, 0]])
    with pytest.raises(ValueError, match="slot_ids"):
        cache.materialize([3], A)
    with pytest.raises(ValueError, match="reserved"):
        cache.materialize([0], A)
