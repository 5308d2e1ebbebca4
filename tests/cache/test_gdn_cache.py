"""Tests of GDNCache and the cache-level GDN reference step (CPU only)."""

import pytest
import torch

from replayssm_cute import reference as R
from replayssm_cute.cache import GDNCache, Mamba2Cache

from tests.helpers import cache_checks as checks
from tests.helpers.cache_checks import DecodeDriver
from tests.helpers.inputs import F64
from tests.helpers.inputs import gen as _gen
from tests.helpers.inputs import randn as _randn
from tests.helpers.inputs import uniform as _uniform
from tests.helpers.numerics import assert_rel, assert_rounding_of

# Qwen3.5-4B-like, small: 2 key heads, 6 value heads, K = V = 16.
H, HV, K, V = 2, 6, 16, 16
_RINGS = ("ring_u", "ring_k", "ring_g", "ring_v", "ring_beta")


# ----------------------------------------------------------------------------- helpers


def assert_fp32_rounding_of(ckpt, exact, what=""):
    assert_rounding_of(ckpt, exact, 2.0**-24, 1e-37, what)


def _snapshot(cache):
    return checks.snapshot(cache, _RINGS)


def _layer(g, hv=HV):
    return torch.log(_uniform(g, 1.0, 8.0, hv)), _uniform(g, -4.0, -2.0, hv)


def _fold(S, u, k, g):
    """The plain recurrence update S = exp(g) S + u k^T for one slot (1, HV, V, K), value head
    hv reading key head hv // (HV // H); u (HV, V), k (H, K), g (HV,) as float64."""
    S = S.clone()
    nh, nkh = S.shape[1], k.shape[0]
    for hv in range(nh):
        S[0, hv] = torch.exp(g[hv]) * S[0, hv] + u[hv, :, None] * k[hv // (nh // nkh), None, :]
    return S


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize("keep", [False, True])
def test_layout_and_defaults(keep):
    c = GDNCache(5, HV, V, K, H, window=8, max_draft=3, dtype=torch.float16, keep_v_beta=keep)
    assert (c.num_slots, c.num_v_heads, c.head_v_dim, c.head_k_dim, c.num_k_heads) == (5, HV, V, K, H)
    assert (c.window, c.max_draft, c.capacity, c.pad_slot_id, c.keep_v_beta) == (8, 3, 11, -1, keep)
    assert c.dtype == torch.float16 and c.device == torch.device("cpu")
    assert not c.is_conventional and c.read_copy is None
    expect = {
        "checkpoint": ((5, HV, V, K), torch.float32),
        "ring_u": ((5, 11, HV, V), torch.float16),
        "ring_k": ((5, 11, H, K), torch.float16),
        "ring_g": ((5, 11, HV), torch.float32),
    }
    if keep:
        expect["ring_v"] = ((5, 11, HV, V), torch.float16)
        expect["ring_beta"] = ((5, 11, HV), torch.float32)
    else:
        assert c.ring_v is None and c.ring_beta is None
    checks.check_layout(c, expect)
    assert c.checkpoint.stride() == (HV * V * K, V * K, K, 1)


def test_defaults_and_conventional():
    c = GDNCache(3, 4, 32, 16, 4)
    assert c.window == 16 and c.max_draft == 0 and c.capacity == 16 and c.dtype == torch.bfloat16
    assert c.ring_k.dtype == torch.bfloat16 and c.ring_u.dtype == torch.float16 and not c.keep_v_beta
    conv = GDNCache(3, 4, 32, 16, 2, window=1)
    assert conv.is_conventional and conv.capacity == 1
    assert all(getattr(conv, n) is None for n in _RINGS)
    assert conv.checkpoint.shape == (3, 4, 32, 16)


def test_repr():
    r = repr(GDNCache(4, HV, 32, K, H, window=5, max_draft=1, pad_slot_id=0, keep_v_beta=True))
    for part in ["GDNCache(", "num_slots=4", "num_v_heads=6", "head_v_dim=32", "head_k_dim=16",
                 "num_k_heads=2", "window=5", "max_draft=1", "capacity=6", "torch.bfloat16",
                 "pad_slot_id=0", "keep_v_beta=True"]:
        assert part in r


def test_shares_the_pool_base_with_mamba2():
    base = [k for k in GDNCache.__mro__ if k in Mamba2Cache.__mro__ and k is not object]
    assert base, "GDNCache and Mamba2Cache share no base class"
    for name in ("load_prefill", "memory_per_slot", "_slot_ids", "__repr__"):
        assert getattr(GDNCache, name) is getattr(Mamba2Cache, name), name


BASE = dict(num_slots=4, num_v_heads=HV, head_v_dim=V, head_k_dim=K, num_k_heads=H)


@pytest.mark.parametrize(
    "changes,exc,match",
    [
        (dict(num_slots=0), ValueError, "num_slots"),
        (dict(num_slots=2.0), TypeError, "num_slots"),
        (dict(num_v_heads=0), ValueError, "num_v_heads"),
        (dict(num_v_heads=True), TypeError, "num_v_heads"),
        (dict(head_v_dim=0), ValueError, "head_v_dim"),
        # the GPU kernels' range, off the CPU ("meta" allocates nothing; a CPU cache takes any shape)
        (dict(head_v_dim=24, device="meta"), ValueError, "head_v_dim must be a multiple of 16"),
        (dict(head_v_dim=272, device="meta"), ValueError, "head_v_dim"),
        (dict(head_k_dim=8, device="meta"), ValueError, "head_k_dim must be a multiple of 16"),
        (dict(head_k_dim=512, device="meta"), ValueError, "head_k_dim"),
        (dict(window=30, max_draft=3, device="meta"), ValueError, "window \\+ max_draft"),
        (dict(head_k_dim="16"), TypeError, "head_k_dim"),
        (dict(num_k_heads=0), ValueError, "num_k_heads"),
        (dict(num_k_heads=4), ValueError, "multiple of num_k_heads"),
        *checks.WINDOW_CASES,
        (dict(window=1, keep_v_beta=True), ValueError, "keep_v_beta"),
        (dict(keep_v_beta=1), TypeError, "keep_v_beta"),
        *checks.DTYPE_PAD_DEVICE_CASES,
    ],
)
def test_constructor_validation(changes, exc, match):
    positional = ["num_slots", "num_v_heads", "head_v_dim", "head_k_dim", "num_k_heads"]
    checks.check_constructor_rejects(GDNCache, BASE, positional, changes, exc, match)


def test_constructor_accepts_edge_values():
    GDNCache(1, 1, 16, 256, 1, window=1)
    GDNCache(2, 6, 256, 16, 6, window=2, max_draft=16, dtype=torch.float32, pad_slot_id=0, keep_v_beta=True)


@pytest.mark.parametrize(
    "shape,window,max_draft,dtype,keep",
    [((32, 128, 128, 16), 16, 0, torch.bfloat16, False), ((64, 128, 128, 16), 13, 4, torch.float16, True),
     ((HV, V, K, H), 5, 16, torch.float32, True), ((HV, 32, K, HV), 1, 0, torch.bfloat16, False)],
)
def test_memory_per_slot(shape, window, max_draft, dtype, keep):
    nh, vd, kd, nkh = shape
    c = GDNCache(3, nh, vd, kd, nkh, window=window, max_draft=max_draft, dtype=dtype, keep_v_beta=keep)
    m = c.memory_per_slot()
    cap = window + max_draft
    act = checks.ACT_BYTES[dtype]
    ring = window > 1
    assert list(m) == ["checkpoint", *_RINGS, "cursor", "origin", "sr_counter", "total"]
    assert m["checkpoint"] == 4 * nh * vd * kd
    assert m["ring_u"] == (cap * nh * vd * 2 if ring else 0)
    assert m["ring_k"] == (cap * nkh * kd * act if ring else 0)
    assert m["ring_g"] == (cap * nh * 4 if ring else 0)
    assert m["ring_v"] == (cap * nh * vd * act if keep else 0)
    assert m["ring_beta"] == (cap * nh * 4 if keep else 0)
    checks.check_memory_totals(c, m, _RINGS)


def test_memory_qwen35_4b_numbers():
    m = GDNCache(1, 32, 128, 128, 16, window=16).memory_per_slot()
    assert m["checkpoint"] == 2_097_152
    assert m["ring_u"] == 131_072 and m["ring_k"] == 65_536 and m["ring_g"] == 2_048
    assert m["ring_v"] == 0 and m["ring_beta"] == 0
    assert m["total"] == 2_097_152 + 131_072 + 65_536 + 2_048 + 12
    m2 = GDNCache(1, 32, 128, 128, 16, window=16, keep_v_beta=True).memory_per_slot()
    assert m2["ring_v"] == 131_072 and m2["ring_beta"] == 2_048
    assert m2["total"] == m["total"] + 131_072 + 2_048


# ----------------------------------------------------------------------------- from_state


def test_from_state_shares_storage():
    g = _gen(1)
    state = _randn(g, 4, HV, V, K).float()
    c = GDNCache.from_state(state, H)
    assert c.checkpoint is state
    assert c.is_conventional and c.ring_u is None and not c.keep_v_beta
    assert (c.num_slots, c.num_v_heads, c.head_v_dim, c.head_k_dim, c.num_k_heads) == (4, HV, V, K, H)
    assert c.cursor.shape == (4,) and c.cursor.dtype == torch.int32
    before = state.clone()
    A_log, dt_bias = _layer(g)
    o = R.gdn_decode_cache_(c, _randn(g, 1, H, K), _randn(g, 1, H, K), _randn(g, 1, HV, V),
                            _randn(g, 1, HV), _randn(g, 1, HV), A_log, dt_bias, [2])
    assert not torch.equal(state[2], before[2]), "decoding did not update the engine's tensor"
    assert torch.equal(state[[0, 1, 3]], before[[0, 1, 3]])
    assert o.shape == (1, HV, V)
    state[0].fill_(3.0)
    assert bool((c.checkpoint[0] == 3.0).all())

    c2 = GDNCache.from_state(state, 6, window=4, max_draft=2, dtype=torch.float16, pad_slot_id=0,
                             keep_v_beta=True)
    assert c2.checkpoint.data_ptr() == state.data_ptr()
    assert c2.ring_k.shape == (4, 6, 6, K) and c2.ring_k.dtype == torch.float16
    assert c2.ring_v.shape == (4, 6, HV, V) and c2.ring_beta.shape == (4, 6, HV)
    assert c2.pad_slot_id == 0 and c2.capacity == 6


@pytest.mark.parametrize(
    "make,exc,match",
    [
        (lambda: torch.zeros(2, HV, V, K, dtype=torch.float16), ValueError, "float32"),
        (lambda: torch.zeros(2, HV, K, V + 16).transpose(2, 3), ValueError, "K innermost"),
        (lambda: torch.zeros(HV, V, K), ValueError, r"\(slots, num_v_heads, head_v_dim, head_k_dim\)"),
        (lambda: torch.zeros(2, HV, V, 24, device="meta"), ValueError, "head_k_dim"),
        (lambda: [[0.0]], TypeError, "state"),
    ],
)
def test_from_state_validation(make, exc, match):
    with pytest.raises(exc, match=match):
        GDNCache.from_state(make(), H)
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        GDNCache.from_state(torch.zeros(2, HV, V, K), 4)


# ----------------------------------------------------------------------------- load_prefill


def test_load_prefill_sets_checkpoint_and_clears_cursor():
    g = _gen(2)
    c = GDNCache(5, HV, V, K, H, window=4, max_draft=2, keep_v_beta=True)
    c.ring_u.normal_(generator=g)  # rings hold data, which load_prefill must not disturb
    c.ring_v.normal_(generator=g)
    state = checks.check_load_prefill(c, g, _RINGS)
    assert torch.equal(c.materialize([1]), state[1:2].float().to(F64))


@pytest.mark.parametrize("ids,state,exc,match", checks.load_prefill_cases((HV, V, K), (HV, K, V + 16)))
def test_load_prefill_validation(ids, state, exc, match):
    checks.check_load_prefill_rejects(GDNCache(5, HV, V, K, H, window=4), _RINGS, ids, state, exc, match)


def test_load_prefill_rejects_reserved_slot_zero():
    checks.check_reserved_slot_zero(GDNCache(3, HV, V, K, H, window=4, pad_slot_id=0))


# ----------------------------------------------------------------------------- cache decode


# unit roundoff and subnormal spacing of each ring dtype of k
_UNIT_TINY = {torch.float32: (2.0**-24, 1e-37), torch.bfloat16: (2.0**-8, 1e-37), torch.float16: (2.0**-11, 2.0**-24)}


class _GDNDriver(DecodeDriver):
    """``DecodeDriver`` for ``gdn_decode_cache_`` against ``gdn_conventional_step``.

    The recurrence each step is checked against starts from the state the cache holds: the
    stored checkpoint after a flush, and after a non-flush step the fold of the record as
    stored (u rounded to fp16, k to the ring dtype, g to fp32), each stored value first
    checked to be the rounding of the exact one.
    """

    rings = _RINGS
    out_name = "o"

    def __init__(self, cache, g, *, act_dtype, scale):
        super().__init__(cache, g)
        self.act_dtype, self.scale = act_dtype, scale
        self.A_log, self.dt_bias = _layer(g, cache.num_v_heads)

    def batch(self, b):
        g, act = self.g, self.act_dtype
        nh, nkh = self.cache.num_v_heads, self.cache.num_k_heads
        q = _randn(g, b, nkh, K).to(act).to(F64)
        k = _randn(g, b, nkh, K).to(act).to(F64)
        v = _randn(g, b, nh, V).to(act).to(F64)
        a = _randn(g, b, nh).to(act).to(F64)
        bg = _randn(g, b, nh).to(act).to(F64)
        return (q, k, v, a, bg), _randn(g, b, nh, V)

    def decode(self, t, ids, out):
        q, k, v, a, bg = t
        return R.gdn_decode_cache_(self.cache, q, k, v, a, bg, self.A_log, self.dt_bias, ids, scale=self.scale,
                                   out=out)

    def step(self, t, r, S_prev):
        q, k, v, a, bg = (x[r : r + 1] for x in t)
        return R.gdn_conventional_step(S_prev, q, k, v, a, bg, self.A_log, self.dt_bias, self.scale)

    def check_flush(self, s, S_new, what):
        assert_fp32_rounding_of(self.cache.checkpoint[s : s + 1], S_new, what)

    def check_record(self, t, r, s, pos, S_prev, S_new, what):
        cache = self.cache
        nh, nkh = cache.num_v_heads, cache.num_k_heads
        q, k, v, a, bg = (x[r : r + 1] for x in t)
        # the exact record, from the recurrence's state before the token
        _, kn = R.gdn_normalize(q, k, self.scale)
        gg, beta = R.gdn_gates(a, bg, self.A_log, self.dt_bias)
        Sk = (S_prev * kn.repeat_interleave(nh // nkh, dim=1)[:, :, None, :]).sum(-1)
        u = (beta[..., None] * (v - torch.exp(gg)[..., None] * Sk))[0]
        unit_k, tiny_k = _UNIT_TINY[cache.dtype]
        assert_rounding_of(cache.ring_u[s, pos], u, 2.0**-11, 2.0**-24, f"u {what}")
        assert_rounding_of(cache.ring_k[s, pos], kn[0], unit_k, tiny_k, f"k {what}")
        assert torch.equal(cache.ring_g[s, pos], gg[0].float())
        if cache.keep_v_beta:
            assert torch.equal(cache.ring_v[s, pos], v[0].to(cache.dtype))
            assert torch.equal(cache.ring_beta[s, pos], beta[0].float())
        return _fold(S_prev, cache.ring_u[s, pos].to(F64), cache.ring_k[s, pos].to(F64), cache.ring_g[s, pos].to(F64))

    def materialize(self, live):
        return self.cache.materialize(live)


def _drive(cache, *, seed, steps_after_join, offsets, active_slots, act_dtype, origins=None, scale=None):
    """Run decode steps on `cache` and check every step against the plain recurrence
    (``_GDNDriver``: slots join at different steps, batches hold pad and out-of-range rows).

    Activations hold values representable in act_dtype but are passed as float64 (so `out`
    is float64 and nothing but the stored records is rounded). Returns the flushes per slot;
    checks it is (steps the slot ran) // window.
    """
    driver = _GDNDriver(cache, _gen(seed), act_dtype=act_dtype, scale=scale)
    return driver.run(steps_after_join=steps_after_join, offsets=offsets, active_slots=active_slots,
                      origins=origins, rtol=1e-10, mat_rtol=1e-12)


@pytest.mark.parametrize(
    "window,nkh,nh,max_draft,pad,origins,act_dtype,keep,scale",
    [
        (16, H, HV, 0, -1, None, torch.float32, False, None),
        (3, H, HV, 2, 0, [4, 3, 0, 2, 1], torch.bfloat16, True, None),
        (5, 2, 2, 3, -1, [7, 6, 5, 1, 0], torch.float16, False, 0.4),
        (16, 2, 2, 4, 0, [19, 3, 17, 0, 10], torch.bfloat16, True, None),
        (7, 1, 3, 1, -1, [1, 2, 7, 0, 5], torch.float32, False, None),
        (1, H, HV, 0, -1, None, torch.bfloat16, False, None),
        (1, 2, 2, 0, 0, None, torch.float32, False, None),
    ],
)
def test_cache_decode_against_recurrence(window, nkh, nh, max_draft, pad, origins, act_dtype, keep, scale):
    cache = GDNCache(8, nh, V, K, nkh, window=window, max_draft=max_draft, dtype=act_dtype, pad_slot_id=pad,
                     keep_v_beta=keep)
    active = [0, 2, 3, 5, 6] if pad == -1 else [1, 2, 3, 5, 6]
    offsets = [0, 1, 2, 4, 7]
    flushes = _drive(cache, seed=window * 100 + nh * 10 + max_draft, steps_after_join=5 * window + 2,
                     offsets=offsets, active_slots=active, act_dtype=act_dtype, origins=origins, scale=scale)
    assert min(flushes.values()) == (5 if window > 1 else 5 * window + 2)


def test_cache_decode_rounds_only_stored_records():
    """fp32 inputs into a bf16 ring: the current token's record is exact, earlier records are
    read back as stored (u fp16, k bf16), and that rounding is visible but small."""
    g = _gen(11)
    L = 4
    cache = GDNCache(2, HV, V, K, H, window=L, dtype=torch.bfloat16)
    A_log, dt_bias = _layer(g)
    S0 = _randn(g, 1, HV, V, K)
    cache.load_prefill([1], S0)
    S_stored = S0.float().to(F64)  # the recurrence through the stored (rounded) records
    S_exact = S_stored.clone()  # the recurrence with nothing rounded
    for i in range(L):
        t = [_randn(g, 1, H, K), _randn(g, 1, H, K), _randn(g, 1, HV, V), _randn(g, 1, HV), _randn(g, 1, HV)]
        o = R.gdn_decode_cache_(cache, *[x.float() for x in t], A_log.float(), dt_bias.float(), [1])
        assert o.dtype == torch.float32
        o_expect, S_full = R.gdn_conventional_step(S_stored, *t, A_log.float(), dt_bias.float())
        o_exact, S_exact = R.gdn_conventional_step(S_exact, *t, A_log.float(), dt_bias.float())
        assert_rel(o, o_expect, 1e-6, f"token {i}")  # out is fp32: 1e-6 covers its rounding
        if i > 0:  # earlier records were rounded: using them exactly would be a visible difference
            diff = (o_expect - o_exact).abs().max() / o_exact.abs().max()
            assert 1e-5 < diff < 1e-2, f"token {i}: rounding effect {diff:.2e}"
        if i + 1 < L:
            S_stored = _fold(S_stored, cache.ring_u[1, i].to(F64), cache.ring_k[1, i].to(F64),
                             cache.ring_g[1, i].to(F64))
        else:  # flush: the last token is folded exactly
            assert_fp32_rounding_of(cache.checkpoint[1:2], S_full, "flush")
    assert int(cache.cursor[1]) == 0


def test_cache_decode_out_allocation_and_pad_rows():
    g = _gen(12)
    cache = GDNCache(3, HV, V, K, H, window=4, pad_slot_id=0)
    A_log, dt_bias = _layer(g)
    v = _randn(g, 3, HV, V).bfloat16()
    args = (_randn(g, 3, H, K).bfloat16(), _randn(g, 3, H, K).bfloat16(), v, _randn(g, 3, HV).bfloat16(),
            _randn(g, 3, HV).bfloat16(), A_log.float(), dt_bias.float())
    cache.load_prefill([1, 2], _randn(g, 2, HV, V, K))
    o = R.gdn_decode_cache_(cache, *args, torch.tensor([2, 0, 1], dtype=torch.int32))
    assert o.dtype == torch.bfloat16 and o.shape == v.shape
    assert not o[1].any() and o[0].abs().sum() > 0 and o[2].abs().sum() > 0
    assert cache.cursor.tolist() == [0, 1, 1]
    assert not cache.ring_u[0].any() and not cache.checkpoint[0].any()


def test_cache_decode_argument_errors():
    g = _gen(13)
    cache = GDNCache(4, HV, V, K, H, window=4)
    A_log, dt_bias = _layer(g)
    q, k, v = _randn(g, 2, H, K), _randn(g, 2, H, K), _randn(g, 2, HV, V)
    a, b = _randn(g, 2, HV), _randn(g, 2, HV)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="more than once"):
        R.gdn_decode_cache_(cache, q, k, v, a, b, A_log, dt_bias, [1, 1])
    with pytest.raises(ValueError, match="slot_ids"):
        R.gdn_decode_cache_(cache, q, k, v, a, b, A_log, dt_bias, [1])
    with pytest.raises(ValueError, match="k must have shape"):
        R.gdn_decode_cache_(cache, q, k[:, :1], v, a, b, A_log, dt_bias, [1, 2])
    with pytest.raises(ValueError, match="q must have shape"):
        R.gdn_decode_cache_(cache, _randn(g, 2, HV, K), k, v, a, b, A_log, dt_bias, [1, 2])
    with pytest.raises(ValueError, match="a must have shape"):
        R.gdn_decode_cache_(cache, q, k, v, a[:, :2], b, A_log, dt_bias, [1, 2])
    with pytest.raises(ValueError, match="A_log must have shape"):
        R.gdn_decode_cache_(cache, q, k, v, a, b, A_log[:2], dt_bias, [1, 2])
    with pytest.raises(ValueError, match="dt_bias"):
        R.gdn_decode_cache_(cache, q, k, v, a, b, A_log, None, [1, 2])
    with pytest.raises(ValueError, match="out must have shape"):
        R.gdn_decode_cache_(cache, q, k, v, a, b, A_log, dt_bias, [1, 2], out=torch.zeros(3, HV, V))
    for n, t in snap.items():
        assert torch.equal(getattr(cache, n), t), n
    R.gdn_decode_cache_(cache, q, k, v, a, b, A_log, dt_bias, [-1, -1])  # several pad rows are fine
    for n, t in snap.items():
        assert torch.equal(getattr(cache, n), t), n
    cache.cursor[2] = 4  # corrupt: h must stay below window
    with pytest.raises(RuntimeError, match="cursor"):
        R.gdn_decode_cache_(cache, q, k, v, a, b, A_log, dt_bias, [2, -1])


def test_materialize_validation_and_fresh_slots():
    g = _gen(14)
    cache = GDNCache(3, HV, V, K, H, window=4, pad_slot_id=0)
    checks.check_materialize_fresh_slots(cache, _randn(g, 2, HV, V, K))
