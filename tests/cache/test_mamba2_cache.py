"""Tests of Mamba2Cache and the cache-level reference step (CPU only)."""

import pytest
import torch

from replayssm_cute import reference as R
from replayssm_cute.cache import Mamba2Cache

from tests.helpers import cache_checks as checks
from tests.helpers.cache_checks import DecodeDriver
from tests.helpers.inputs import F64
from tests.helpers.inputs import gen as _gen
from tests.helpers.inputs import randn as _randn
from tests.helpers.inputs import uniform as _uniform
from tests.helpers.numerics import assert_rel

H, P, N = 6, 16, 32
_RINGS = ("ring_x", "ring_B", "ring_dt")


# ----------------------------------------------------------------------------- helpers


def assert_fp32_rounding_of(ckpt, exact, slack_ulps=1.0, extra_rtol=0.0, what=""):
    """ckpt (fp32) is exact (float64) rounded to fp32, give or take slack_ulps ulp (plus
    extra_rtol times the largest magnitude, for inputs that are themselves rounded)."""
    err = (ckpt.to(F64) - exact).abs()
    bound = exact.abs() * (slack_ulps * 2.0**-23) + extra_rtol * exact.abs().max() + 1e-37
    assert bool((err <= bound).all()), f"{what}: checkpoint is not the fp32 rounding (max err {err.max():.3e})"


def _snapshot(cache):
    return checks.snapshot(cache, _RINGS)


# ----------------------------------------------------------------------------- construction


def test_layout_and_defaults():
    c = Mamba2Cache(5, H, P, N, 2, window=8, max_draft=3, dtype=torch.float16)
    assert (c.num_slots, c.nheads, c.headdim, c.dstate, c.ngroups) == (5, H, P, N, 2)
    assert (c.window, c.max_draft, c.capacity, c.pad_slot_id) == (8, 3, 11, -1)
    assert c.dtype == torch.float16 and c.device == torch.device("cpu")
    assert not c.is_conventional and c.read_copy is None
    checks.check_layout(c, {
        "checkpoint": ((5, H, P, N), torch.float32),
        "ring_x": ((5, 11, H, P), torch.float16),
        "ring_B": ((5, 11, 2, N), torch.float16),
        "ring_dt": ((5, 11, H), torch.float32),
    })
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
        *checks.WINDOW_CASES,
        *checks.DTYPE_PAD_DEVICE_CASES,
    ],
)
def test_constructor_validation(changes, exc, match):
    positional = ["num_slots", "nheads", "headdim", "dstate", "ngroups"]
    checks.check_constructor_rejects(Mamba2Cache, BASE, positional, changes, exc, match)


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
    act = checks.ACT_BYTES[dtype]
    ring = window > 1
    assert m["checkpoint"] == 4 * Hh * Pp * Nn
    assert m["ring_x"] == (cap * Hh * Pp * act if ring else 0)
    assert m["ring_B"] == (cap * G * Nn * act if ring else 0)
    assert m["ring_dt"] == (cap * Hh * 4 if ring else 0)
    checks.check_memory_totals(c, m, _RINGS)


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
    checks.check_load_prefill(Mamba2Cache(5, H, P, N, 2, window=4, max_draft=2), g, _RINGS)


@pytest.mark.parametrize("ids,state,exc,match", checks.load_prefill_cases((H, P, N), (H, P, N + 1)))
def test_load_prefill_validation(ids, state, exc, match):
    checks.check_load_prefill_rejects(Mamba2Cache(5, H, P, N, 2, window=4), _RINGS, ids, state, exc, match)


def test_load_prefill_rejects_reserved_slot_zero():
    checks.check_reserved_slot_zero(Mamba2Cache(3, H, P, N, 2, window=4, pad_slot_id=0))


# ----------------------------------------------------------------------------- cache decode


class _Mamba2Driver(DecodeDriver):
    """``DecodeDriver`` for ``mamba2_decode_cache_`` against ``mamba2_conventional_step``."""

    rings = _RINGS
    out_name = "y"

    def __init__(self, cache, g, *, dt_mode, act_dtype, ckpt_rtol, use_dz):
        super().__init__(cache, g)
        self.dt_mode, self.act_dtype, self.ckpt_rtol, self.use_dz = dt_mode, act_dtype, ckpt_rtol, use_dz
        self.A = -_uniform(g, 1.0, 2.0, H)
        self.dt_bias = _uniform(g, -4.0, -3.0, H)
        self.D = _randn(g, H) if use_dz else None

    def batch(self, b):
        g, act, G = self.g, self.act_dtype, self.cache.ngroups
        x = _randn(g, b, H, P).to(act).to(F64)
        B = _randn(g, b, G, N).to(act).to(F64)
        C = _randn(g, b, G, N).to(act).to(F64)
        z = _randn(g, b, H, P).to(act).to(F64) if self.use_dz else None
        raw = _randn(g, b, H)
        if self.dt_mode == "exact":
            dt = R.softplus(raw + self.dt_bias).float().to(F64)
            kw = dict(dt_bias=None, dt_softplus=False)
        else:
            dt = raw.float()
            kw = dict(dt_bias=self.dt_bias.float(), dt_softplus=True)
        return dict(x=x, dt=dt, B=B, C=C, z=z, kw=kw), _randn(g, b, H, P)

    def decode(self, t, ids, out):
        return R.mamba2_decode_cache_(self.cache, t["x"], t["dt"], self.A, t["B"], t["C"], ids, D=self.D, z=t["z"],
                                      out=out, **t["kw"])

    def step(self, t, r, S_prev):
        row, z = slice(r, r + 1), t["z"]
        return R.mamba2_conventional_step(S_prev, t["x"][row], t["dt"][row], self.A, t["B"][row], t["C"][row],
                                          self.D, None if z is None else z[row], **t["kw"])

    def check_flush(self, s, S_new, what):
        assert_fp32_rounding_of(self.cache.checkpoint[s : s + 1], S_new, extra_rtol=self.ckpt_rtol, what=what)

    def check_record(self, t, r, s, pos, S_prev, S_new, what):
        cache, kw = self.cache, t["kw"]
        assert torch.equal(cache.ring_x[s, pos], t["x"][r].to(cache.dtype))
        assert torch.equal(cache.ring_B[s, pos], t["B"][r].to(cache.dtype))
        assert torch.equal(cache.ring_dt[s, pos], R.mamba2_dt(t["dt"][r], kw["dt_bias"], kw["dt_softplus"]).float())
        return S_new  # the records are exact

    def materialize(self, live):
        return self.cache.materialize(live, self.A)


def _drive(cache, *, seed, steps_after_join, offsets, active_slots, dt_mode, act_dtype, rtol, ckpt_rtol,
           use_dz=True, origins=None):
    """Run decode steps on `cache` and check every step against the conventional recurrence
    (``DecodeDriver``: slots join at different steps, batches hold pad and out-of-range rows).

    Activations hold values representable in act_dtype but are passed as float64 (so the
    stored records are exact and the float64 output is not rounded).
    dt_mode "exact": dt is processed (softplus of U(-4,-3)-shifted values) beforehand and
    rounded to fp32, so records are exact; "softplus": raw dt, dt_bias, dt_softplus=True.
    Returns the number of flushes per slot; checks it is (steps the slot ran) // window.
    """
    driver = _Mamba2Driver(cache, _gen(seed), dt_mode=dt_mode, act_dtype=act_dtype, ckpt_rtol=ckpt_rtol,
                           use_dz=use_dz)
    return driver.run(steps_after_join=steps_after_join, offsets=offsets, active_slots=active_slots,
                      origins=origins, rtol=rtol, mat_rtol=rtol)


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
    checks.check_materialize_fresh_slots(cache, _randn(g, 2, H, P, N), A)
