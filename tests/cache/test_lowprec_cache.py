"""Low-precision caches (docs/design.md section 5): two-checkpoint options, prefill load, SR
bits, memory per slot and the float64 reference decode on them (CPU only). Formats:
``replayssm_cute.quant``; layouts and the SR bits: ``replayssm_cute.cache``'s module docstring."""

import math

import pytest
import torch

from replayssm_cute import api, quant
from replayssm_cute import reference as R
from replayssm_cute.cache import GDNCache, Mamba2Cache, checkpoint_sr_bits

from tests.helpers.inputs import F64
from tests.helpers.inputs import gen as _gen
from tests.helpers.inputs import randn as _randn
from tests.helpers.inputs import uniform as _uniform
from tests.helpers.numerics import fmix32 as _fmix32

# small shapes with K = 128, so fp8 has its real 128-element row blocks
MH, MP, MN, MG = 4, 8, 128, 2  # Mamba-2 H, P, N, G
GHV, GV, GK, GH = 2, 16, 128, 1  # GDN HV, V, K, H
L = 4
M32 = (1 << 32) - 1


# ----------------------------------------------------------------------------- independent helpers


def _py_bits(seed: int, slot: int, counter: int, e: int) -> int:
    """The documented SR bits of one element in plain Python ints (cache module docstring)."""
    sr = lambda s, off: _fmix32((off & M32) ^ _fmix32((s & M32) ^ 0x9E3779B9))  # noqa: E731
    return sr(sr(sr(seed, slot), counter), e)


def _bits(cache, slot, counter):
    """SR bits of write `counter` of `slot`, from quant.sr_bits chained as documented."""
    seed = int(cache.sr_seed[0])
    k1 = quant.sr_bits(seed, torch.tensor(slot))
    k2 = quant.sr_bits(k1, torch.tensor(counter))
    shape = _state_shape(cache)
    return quant.sr_bits(k2, torch.arange(math.prod(shape))).view(shape)


def _state_shape(cache):
    return tuple(cache._state_shape)


def _fmt(name, K):
    return None if name == "fp32" else (quant.FP8E4M3(block_k=128 if K % 128 == 0 else K) if name == "fp8"
                                         else quant.FORMATS[name])


def _raw(t):
    """Bit pattern of a tensor, comparable with torch.equal whatever its dtype (NaN included)."""
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(
        {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _copy_parts(cache, copy, s):
    """Stored bytes of one copy of slot s: data then scales."""
    parts = [getattr(cache, copy)]
    parts += [t for t in (getattr(cache, copy + "_scale"), getattr(cache, copy + "_state_scale")) if t is not None]
    return [_raw(p[s]) for p in parts]


def _enc_parts(enc):
    return [_raw(enc.data)] + [_raw(t) for t in enc.scales]


def _assert_copy_is(cache, copy, s, expected32, mode, counter=None):
    """Slot s's copy holds expected32 (fp32 state) cast by RTN or by SR with the documented bits."""
    fmt_name = cache.checkpoint_format if copy == "checkpoint" else cache.read_copy_format
    fmt = _fmt(fmt_name, expected32.shape[-1])
    got = _copy_parts(cache, copy, s)
    if fmt is None:
        assert len(got) == 1 and torch.equal(got[0], _raw(expected32)), f"{copy} of slot {s} != the fp32 state"
        return
    enc = fmt.encode_rtn(expected32) if mode == "rtn" else fmt.encode_sr(expected32, _bits(cache, s, counter))
    want = _enc_parts(enc)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{copy} part {i} of slot {s} is not quant's {mode} encoding"


def _tensors(cache) -> dict:
    """Every tensor of the cache, with its table's positions under the cache's names."""
    named = {n: t for n, t in vars(cache).items() if isinstance(t, torch.Tensor)}
    named.update((n, getattr(cache, n)) for n in ("cursor", "origin", "sr_counter") if getattr(cache, n) is not None)
    return named


def _snap(cache):
    return {n: t.clone() for n, t in _tensors(cache).items()}


def _heads_scale(g, n):
    """Per-head magnitudes over three decades, so per-row and per-state scales matter."""
    return torch.pow(10.0, _uniform(g, -2.0, 1.0, n)).to(F64)


# ----------------------------------------------------------------------------- layers


class _Mamba2:
    """A Mamba-2 layer with realistic decays: A = -exp(A_log), dt = softplus(dt_raw + dt_bias)
    around 1e-3..1e-1; head 0 is slow (alpha = exp(A dt) > 0.999)."""

    kind = "mamba2"
    rings = ("ring_x", "ring_B", "ring_dt")

    def __init__(self, g):
        self.g = g
        self.A = -torch.exp(_uniform(g, -4.0, 1.0, MH))
        self.A[0] = -0.02
        target_dt = torch.pow(10.0, _uniform(g, -3.0, -1.0, MH))
        self.dt_bias = torch.log(torch.expm1(target_dt)).float().to(F64)
        self.D = _randn(g, MH)

    def cache(self, n=8, **kw):
        return Mamba2Cache(n, MH, MP, MN, MG, window=kw.pop("window", L), dtype=kw.pop("dtype", torch.float32), **kw)

    def prefill(self, n):
        return _randn(self.g, n, MH, MP, MN) * _heads_scale(self.g, MH)[None, :, None, None]

    def inputs(self, b):
        g = self.g
        return (_randn(g, b, MH, MP), 0.3 * _randn(g, b, MH), _randn(g, b, MG, MN), _randn(g, b, MG, MN))

    def decode(self, cache, t, ids, fn=None):
        x, dt, B, C = t
        fn = fn or R.mamba2_decode_cache_
        return fn(cache, x, dt, self.A, B, C, ids, D=self.D, dt_bias=self.dt_bias, dt_softplus=True)

    def row(self, t, r):
        return tuple(u[r : r + 1] for u in t)

    def flush_state(self, cache, s, h, S_prev, t, r, mode=None):
        """(None, the state a flush of slot s (h records before the token) must rebuild), float64."""
        x, dt, B, _ = self.row(t, r)
        o, cap = int(cache.origin[s]), cache.capacity
        idx = [(o + i) % cap for i in range(h)]
        X = torch.cat([cache.ring_x[s, idx].to(F64)[None], x[:, None]], 1) if h else x[:, None]
        Bk = torch.cat([cache.ring_B[s, idx].to(F64)[None], B[:, None]], 1) if h else B[:, None]
        dtp = R.mamba2_dt(dt, self.dt_bias, True)
        DT = torch.cat([cache.ring_dt[s, idx].to(F64)[None], dtp[:, None]], 1) if h else dtp[:, None]
        return None, R.mamba2_replay(S_prev, X, Bk, DT, self.A)

    def materialize(self, cache, ids):
        return cache.materialize(ids, self.A)

    def verify(self, cache, t, ids):
        x, dt, B, C = t
        return R.mamba2_verify_cache_(cache, x, dt, self.A, B, C, ids, D=self.D, dt_bias=self.dt_bias,
                                       dt_softplus=True)

    def draft_inputs(self, b, T):
        x, dt, B, C = self.inputs(b * T)
        return tuple(u.reshape((b, T) + u.shape[1:]) for u in (x, dt, B, C))


class _GDN:
    """A GDN layer with realistic decays: g = -exp(A_log) softplus(a + dt_bias); value head 0
    is slow (A_log = -6: alpha > 0.99)."""

    kind = "gdn"
    rings = ("ring_u", "ring_k", "ring_g", "ring_v", "ring_beta")

    def __init__(self, g):
        self.g = g
        self.A_log = _uniform(g, -2.0, 1.0, GHV)
        self.A_log[0] = -6.0
        self.dt_bias = _uniform(g, -4.0, -1.0, GHV)

    def cache(self, n=8, **kw):
        return GDNCache(n, GHV, GV, GK, GH, window=kw.pop("window", L), dtype=kw.pop("dtype", torch.float32), **kw)

    def prefill(self, n):
        return 0.3 * _randn(self.g, n, GHV, GV, GK) * _heads_scale(self.g, GHV)[None, :, None, None]

    def inputs(self, b):
        g = self.g
        return (_randn(g, b, GH, GK), _randn(g, b, GH, GK), _randn(g, b, GHV, GV), _randn(g, b, GHV),
                _randn(g, b, GHV))

    def decode(self, cache, t, ids, fn=None):
        q, k, v, a, bg = t
        fn = fn or R.gdn_decode_cache_
        return fn(cache, q, k, v, a, bg, self.A_log, self.dt_bias, ids)

    def row(self, t, r):
        return tuple(u[r : r + 1] for u in t)

    def flush_state(self, cache, s, h, S_prev, t, r, mode=None):
        """(output, state) of a flush of slot s (h records before the token), float64: the
        re-derivation of Algorithm 6 (mode "rederive") or the fold of the cached corrections,
        then the token's step. Computed here by a plain loop and checked against the reference
        functions, whose values are returned (so fp32 roundings compare exactly)."""
        mode = mode or cache.flush_corrections
        o, cap = int(cache.origin[s]), cache.capacity
        S = S_prev.clone()
        rep = GHV // GH
        idx = [(o + i) % cap for i in range(h)]
        for p in idx:
            kk = cache.ring_k[s, p].to(F64).repeat_interleave(rep, 0)  # (HV, K)
            alpha = torch.exp(cache.ring_g[s, p].to(F64))
            if mode == "rederive":
                Sk = torch.einsum("hvk,hk->hv", S[0], kk)
                u = cache.ring_beta[s, p].to(F64)[:, None] * (cache.ring_v[s, p].to(F64) - alpha[:, None] * Sk)
            else:
                u = cache.ring_u[s, p].to(F64)
            S = alpha[None, :, None, None] * S + u[None, :, :, None] * kk[None, :, None, :]
        q, k, v, a, bg = self.row(t, r)
        y_ind, S_ind = R.gdn_conventional_step(S, q, k, v, a, bg, self.A_log, self.dt_bias)
        rec = lambda n: getattr(cache, n)[s, idx].to(F64)[None]  # noqa: E731
        if mode == "rederive":
            S_h = R.gdn_replay_rederive(S_prev, rec("ring_k"), rec("ring_g"), rec("ring_v"), rec("ring_beta"))[0]
        else:
            S_h = R.gdn_replay(S_prev, rec("ring_u"), rec("ring_k"), rec("ring_g"))
        y, S_new = R.gdn_conventional_step(S_h, q, k, v, a, bg, self.A_log, self.dt_bias)
        assert torch.allclose(S_new, S_ind, rtol=1e-12, atol=1e-12 * S_ind.abs().max().item())
        assert torch.allclose(y, y_ind, rtol=1e-12, atol=1e-12 * y_ind.abs().max().item())
        return y, S_new

    def materialize(self, cache, ids):
        return cache.materialize(ids)

    def verify(self, cache, t, ids):
        q, k, v, a, bg = t
        return R.gdn_verify_cache_(cache, q, k, v, a, bg, self.A_log, self.dt_bias, ids)

    def draft_inputs(self, b, T):
        t = self.inputs(b * T)
        return tuple(u.reshape((b, T) + u.shape[1:]) for u in t)


LAYERS = {"mamba2": _Mamba2, "gdn": _GDN}


def _schedule(cache, step, active, offsets, g):
    """Batch slot ids of `step`: the slots that joined by then (so rows sit at different ring
    positions), plus pad and out-of-pool rows, shuffled."""
    live = [s for s, off in zip(active, offsets) if step >= off]
    ids = live + [cache.pad_slot_id, cache.num_slots, -7][: 1 + step % 3]
    perm = torch.randperm(len(ids), generator=g).tolist()
    return [ids[i] for i in perm], live


def _run(layer, caches, *, steps, active=(1, 2, 4, 6), offsets=(0, 1, 2, 5), seed=0, on_step=None, before_step=None,
         S0=None):
    """Load the same prefill states into every cache, then decode the same inputs on all of them
    in lockstep. on_step(step, ids, live, inputs, outs, befores) checks each step. Returns the
    per-step outputs of each cache."""
    g = _gen(seed)
    S0 = layer.prefill(len(active)) if S0 is None else S0
    for c in caches:
        c.load_prefill(list(active), S0)
    history = [[] for _ in caches]
    for step in range(steps):
        ids, live = _schedule(caches[0], step, active, offsets, g)
        t = layer.inputs(len(ids))
        if before_step is not None:
            before_step(step, ids, live, t)
        befores = [_snap(c) for c in caches]
        outs = [layer.decode(c, t, torch.tensor(ids)) for c in caches]
        for hst, o in zip(history, outs):
            hst.append((ids, o))
        if on_step is not None:
            on_step(step, ids, live, t, outs, befores)
    return history


# ----------------------------------------------------------------------------- construction


def test_defaults_are_the_plain_fp32_cache():
    for c in (_Mamba2(_gen(0)).cache(), _GDN(_gen(0)).cache()):
        assert c.is_plain and not c.shared and c.checkpoint_format == "fp32" and c.read_copy_format is None
        assert c.checkpoint.dtype == torch.float32 and c.read_copy is None
        assert c.sr_seed is None and c.sr_counter is None
        assert c.checkpoint_scale is None and c.checkpoint_state_scale is None and c.read_copy_scale is None
    gdn = _GDN(_gen(0)).cache()
    assert gdn.keep_v_beta is False and gdn.flush_corrections == "fold"


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_layouts(kind):
    layer = LAYERS[kind](_gen(1))
    S = _state_shape(layer.cache(2))
    rows, K = S[:-1], S[-1]
    c = layer.cache(3, checkpoint_format="fp16", read_copy="nvfp4", sr_seed=5)
    assert c.checkpoint.shape == (3,) + S and c.checkpoint.dtype == torch.float16
    assert c.read_copy.shape == (3,) + rows + (K // 2,) and c.read_copy.dtype == torch.uint8
    assert c.read_copy_scale.shape == (3,) + rows + (K // 16,) and c.read_copy_scale.dtype == torch.float8_e4m3fn
    assert c.read_copy_state_scale.shape == (3, S[0]) and c.read_copy_state_scale.dtype == torch.float32
    assert c.sr_seed.shape == (1,) and c.sr_seed.dtype == torch.int64 and int(c.sr_seed) == 5
    assert c.sr_counter.shape == (3,) and c.sr_counter.dtype == torch.int32
    assert not c.is_plain and not c.shared
    c = layer.cache(3, checkpoint_format="fp8", read_copy="fp8")
    assert c.checkpoint.dtype == torch.float8_e4m3fn and c.checkpoint.shape == (3,) + S
    assert c.checkpoint_scale.shape == (3,) + rows + (1,) and c.checkpoint_scale.dtype == torch.float32
    assert c.read_copy.dtype == torch.float8_e4m3fn and c.read_copy_scale.shape == (3,) + rows + (1,)
    c = layer.cache(3, checkpoint_format="nvfp4", shared=True)
    assert c.shared and c.read_copy is None and c.checkpoint.shape == (3,) + rows + (K // 2,)
    for t in (c.checkpoint, c.checkpoint_scale, c.checkpoint_state_scale, c.sr_counter):
        assert t.is_contiguous() and not t.any()
    assert layer.cache(3, checkpoint_format="fp16").shared  # no read copy: the shared configuration
    c = layer.cache(3, window=1, checkpoint_format="fp8")
    assert c.is_conventional and c.shared
    if kind == "gdn":
        c = layer.cache(3, read_copy="fp8")
        assert c.keep_v_beta and c.flush_corrections == "rederive" and c.ring_v is not None
        c = layer.cache(3, read_copy="fp8", flush_corrections="fold")
        assert c.keep_v_beta and c.flush_corrections == "fold"
        c = layer.cache(3, keep_v_beta=True, flush_corrections="rederive")
        assert not c.is_plain and c.checkpoint.dtype == torch.float32
        assert not layer.cache(3, checkpoint_format="fp16").keep_v_beta  # shared: the u fold


def test_fp8_block_for_other_K():
    c = Mamba2Cache(2, 2, 16, 64, 1, checkpoint_format="fp8", read_copy="fp8")
    assert c.checkpoint_scale.shape == (2, 2, 16, 1) and c.read_copy_scale.shape == (2, 2, 16, 1)
    c = Mamba2Cache(2, 2, 16, 256, 1, read_copy="fp8")
    assert c.read_copy_scale.shape == (2, 2, 16, 2)


def test_default_seed_from_torch_generator():
    torch.manual_seed(123)
    a = Mamba2Cache(2, MH, MP, MN, MG, checkpoint_format="fp16")
    torch.manual_seed(123)
    b = Mamba2Cache(2, MH, MP, MN, MG, checkpoint_format="fp16")
    assert int(a.sr_seed) == int(b.sr_seed) and 0 <= int(a.sr_seed) <= M32


_M_BASE = dict(num_slots=4, nheads=MH, headdim=MP, dstate=MN, ngroups=MG)
_G_BASE = dict(num_slots=4, num_v_heads=GHV, head_v_dim=GV, head_k_dim=GK, num_k_heads=GH)
_COMMON_CASES = [
    (dict(checkpoint_format="bf16"), ValueError, "checkpoint_format"),
    (dict(checkpoint_format=None), ValueError, "checkpoint_format"),
    (dict(read_copy="fp32"), ValueError, "read_copy"),
    (dict(read_copy="int8"), ValueError, "read_copy"),
    (dict(shared=1), TypeError, "shared"),
    (dict(shared=True), ValueError, "shared=True needs a low-precision checkpoint_format"),
    (dict(shared=True, checkpoint_format="fp16", read_copy="fp8"), ValueError, "read_copy must be None when shared"),
    (dict(window=1, read_copy="fp8"), ValueError, "read_copy must be None when window == 1"),
    (dict(checkpoint_format="nvfp4", read_copy="fp8"), ValueError, "checkpoint_format='nvfp4'"),
    (dict(checkpoint_format="fp16", sr_seed=-1), ValueError, "sr_seed"),
    (dict(checkpoint_format="fp16", sr_seed=1 << 32), ValueError, "sr_seed"),
    (dict(checkpoint_format="fp16", sr_seed=True), ValueError, "sr_seed"),
    (dict(sr_seed=3), ValueError, "sr_seed needs a low-precision checkpoint_format"),
]


@pytest.mark.parametrize("changes,exc,match", _COMMON_CASES + [
    (dict(dstate=40, read_copy="nvfp4"), ValueError, r"read_copy='nvfp4' needs dstate"),
    (dict(dstate=40, checkpoint_format="nvfp4", shared=True), ValueError, r"checkpoint_format='nvfp4' needs dstate"),
])
def test_mamba2_option_validation(changes, exc, match):
    with pytest.raises(exc, match=match):
        Mamba2Cache(**dict(_M_BASE, **changes))


@pytest.mark.parametrize("changes,exc,match", _COMMON_CASES + [
    (dict(read_copy="fp8", keep_v_beta=False), ValueError, "keep_v_beta must be True"),
    (dict(keep_v_beta="yes"), TypeError, "keep_v_beta"),
    (dict(flush_corrections="replay"), ValueError, "flush_corrections"),
    (dict(flush_corrections="rederive"), ValueError, "flush_corrections='rederive' needs keep_v_beta"),
    (dict(window=1, keep_v_beta=True), ValueError, "keep_v_beta"),
])
def test_gdn_option_validation(changes, exc, match):
    with pytest.raises(exc, match=match):
        GDNCache(**dict(_G_BASE, **changes))


# ----------------------------------------------------------------------------- memory per slot


def test_memory_per_slot_parts_and_allocation():
    for kind, kw in [("mamba2", dict(checkpoint_format="fp16", read_copy="nvfp4", max_draft=2)),
                     ("mamba2", dict(checkpoint_format="fp8", shared=True)),
                     ("mamba2", dict(read_copy="fp8")),
                     ("gdn", dict(checkpoint_format="fp8", read_copy="fp16")),
                     ("gdn", dict(checkpoint_format="nvfp4", window=1))]:
        layer = LAYERS[kind](_gen(0))
        c = layer.cache(3, **kw)
        m = c.memory_per_slot()
        assert m["total"] == sum(v for k, v in m.items() if k != "total")
        allocated = sum(t.numel() * t.element_size() for n, t in _tensors(c).items() if n != "sr_seed")
        allocated += 0 if c.sr_counter is not None else c.table.sr_writes.nbytes  # the own table's, unused
        assert allocated == c.num_slots * m["total"], (kind, kw)
        S = _state_shape(c)
        V, K = S[-2], S[-1]
        ck = quant.bytes_per_state(_fmt(c.checkpoint_format, K) or "fp32", V, K) * S[0]
        assert sum(v for k, v in m.items() if k.startswith("checkpoint")) == ck
        rc = 0 if c.read_copy is None else quant.bytes_per_state(_fmt(c.read_copy_format, K), V, K) * S[0]
        assert sum(v for k, v in m.items() if k.startswith("read_copy")) == rc
        assert m["sr_counter"] == 4  # the cache's own table's counter, whatever the format


def test_memory_model_numbers():
    # Nemotron-3-Super Mamba-2 layer (128 x 64 x 128, 8 groups), window 16
    base = Mamba2Cache(1, 128, 64, 128, 8, window=16).memory_per_slot()
    m = Mamba2Cache(1, 128, 64, 128, 8, window=16, checkpoint_format="fp16", read_copy="nvfp4").memory_per_slot()
    assert m["checkpoint"] == 2_097_152
    assert m["read_copy"] == 524_288 and m["read_copy_scale"] == 65_536 and m["read_copy_state_scale"] == 512
    assert m["total"] == base["total"] - 4_194_304 + 2_097_152 + 524_288 + 65_536 + 512
    m = Mamba2Cache(1, 128, 64, 128, 8, window=16, checkpoint_format="fp8", shared=True).memory_per_slot()
    assert m["checkpoint"] == 1_048_576 and m["checkpoint_scale"] == 32_768 and "read_copy" not in m
    # Qwen3.5-122B GDN layer (64 x 128 x 128, 16 key heads): a read copy adds the v / beta records
    m = GDNCache(1, 64, 128, 128, 16, window=16, read_copy="fp8").memory_per_slot()
    assert m["checkpoint"] == 4_194_304 and m["read_copy"] == 1_048_576 and m["read_copy_scale"] == 32_768
    assert m["ring_v"] == 16 * 64 * 128 * 2 and m["ring_beta"] == 16 * 64 * 4


# ----------------------------------------------------------------------------- prefill load and SR bits


def test_sr_bits_formula():
    c = Mamba2Cache(4, 2, 16, 32, 1, checkpoint_format="fp16", sr_seed=0xDEADBEEF)
    bits = checkpoint_sr_bits(c.sr_seed, 3, 7, (2, 16, 32))
    assert bits.dtype == torch.int32 and bits.shape == (2, 16, 32)
    flat = bits.flatten()
    for e in (0, 1, 31, 32, 511, 1023):
        assert int(flat[e]) & M32 == _py_bits(0xDEADBEEF, 3, 7, e)
    assert torch.equal(checkpoint_sr_bits(0xDEADBEEF, 3, 7, (2, 16, 32)), bits)
    assert not torch.equal(checkpoint_sr_bits(0xDEADBEEF, 3, 8, (2, 16, 32)), bits)
    assert not torch.equal(checkpoint_sr_bits(0xDEADBEEF, 2, 7, (2, 16, 32)), bits)
    # counters wrap mod 2^32
    assert torch.equal(checkpoint_sr_bits(5, 1, (1 << 32) + 9, (4, 16)), checkpoint_sr_bits(5, 1, 9, (4, 16)))


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
@pytest.mark.parametrize("ckpt,read", [("fp32", "fp8"), ("fp16", "nvfp4"), ("fp8", "fp16"), ("fp16", None),
                                       ("nvfp4", None)])
def test_load_prefill_writes_every_copy(kind, ckpt, read):
    layer = LAYERS[kind](_gen(2))
    seed = {"sr_seed": 77} if ckpt != "fp32" else {}
    c = layer.cache(5, checkpoint_format=ckpt, read_copy=read, pad_slot_id=0, **seed)
    S = layer.prefill(2)
    before = _snap(c)
    c.load_prefill([3, 1], S)
    S32 = S.float()
    for i, s in enumerate([3, 1]):
        _assert_copy_is(c, "checkpoint", s, S32[i], "sr", counter=0)
        if read is not None:
            _assert_copy_is(c, "read_copy", s, S32[i], "rtn")
    for n, t in before.items():  # other slots untouched
        if n != "sr_seed":
            for s in (0, 2, 4):
                assert torch.equal(_raw(getattr(c, n)[s]), _raw(t[s])), n
    if ckpt != "fp32":
        assert c.sr_counter.tolist() == [0, 1, 0, 1, 0]
        c.load_prefill([3], S[1:])  # a second SR write draws fresh bits
        assert c.sr_counter.tolist() == [0, 1, 0, 2, 0]
        _assert_copy_is(c, "checkpoint", 3, S32[1], "sr", counter=1)
        same = all(torch.equal(a, b) for a, b in zip(_copy_parts(c, "checkpoint", 3), _copy_parts(c, "checkpoint", 1)))
        assert not same or ckpt == "nvfp4"  # nvfp4 may round both alike; fp16 / fp8 practically never
        # sanity: the decoded SR checkpoint is within about one format step of the state
        dec = c.read_state([1])[0].to(F64)
        assert (dec - S32[1].to(F64)).abs().max() <= S32[1].abs().max() * (0.5 if ckpt == "nvfp4" else 0.13)
    else:
        assert torch.equal(c.read_state([1, 3]), torch.stack([S32[1], S32[0]]))


# ----------------------------------------------------------------------------- decode: fp32 equivalence


@pytest.mark.parametrize("kind,kw", [("mamba2", {}), ("gdn", {}), ("gdn", dict(keep_v_beta=True)),
                                     ("mamba2", dict(window=1)), ("gdn", dict(window=1, pad_slot_id=0))])
def test_fp32_config_through_lowprec_reference_is_bit_identical(kind, kw):
    """The low-precision reference on an fp32 checkpoint without read copy is the plain reference
    bit for bit: outputs, checkpoints, rings and cursors."""
    layer = LAYERS[kind](_gen(3))
    plain, other = layer.cache(**kw), layer.cache(**kw)
    fn = R.mamba2_decode_lowprec_cache_ if kind == "mamba2" else R.gdn_decode_lowprec_cache_
    active = (1, 2, 4, 6)
    g = _gen(30)
    S0 = layer.prefill(len(active))
    plain.load_prefill(list(active), S0)
    other.load_prefill(list(active), S0)
    window = plain.window
    for step in range(3 * window + 6):
        ids, _ = _schedule(plain, step, active, (0, 1, 2, 5), g)
        t = layer.inputs(len(ids))
        y0 = layer.decode(plain, t, torch.tensor(ids))
        y1 = layer.decode(other, t, torch.tensor(ids), fn=fn)
        assert torch.equal(y0, y1), f"step {step}"
        for n, v in _snap(plain).items():
            assert torch.equal(v, getattr(other, n)), f"{n} step {step}"


def test_gdn_rederive_on_fp32_tracks_the_exact_recurrence():
    """fp32 checkpoint, keep_v_beta: re-derived flush corrections keep the checkpoint at the fp32
    rounding of the exact recurrence (k and gates as stored); folding the fp16 cached
    corrections does not."""
    layer = _GDN(_gen(4))
    red = layer.cache(keep_v_beta=True, flush_corrections="rederive")
    fold = layer.cache(keep_v_beta=True)
    errs = {"rederive": [], "fold": []}

    def on_step(step, ids, live, t, outs, befores):
        for r, s in enumerate(ids):
            if s not in live or int(befores[0]["cursor"][s]) + 1 != L:
                continue
            for name, c, b in (("rederive", red, befores[0]), ("fold", fold, befores[1])):
                # exact: from the same stored records (a flush writes no ring and keeps the
                # origin), corrections re-derived in float64 along the way
                _, exact = layer.flush_state(c, s, L - 1, b["checkpoint"][s : s + 1].to(F64), t, r, mode="rederive")
                errs[name].append(((c.checkpoint[s].to(F64) - exact[0]).abs().max() / exact.abs().max()).item())

    _run(layer, [red, fold], steps=3 * L + 5, on_step=on_step)
    assert max(errs["rederive"]) < 1e-6, errs["rederive"]
    assert max(errs["fold"]) > 1e-5, "fold should carry the fp16 rounding of the cached corrections"


# ----------------------------------------------------------------------------- decode: copies at flushes


CONFIGS = [
    dict(checkpoint_format="fp32", read_copy="fp8"),
    dict(checkpoint_format="fp16", read_copy="nvfp4"),
    dict(checkpoint_format="fp8", read_copy="fp16"),
    dict(checkpoint_format="fp16", shared=True),
    dict(checkpoint_format="nvfp4", shared=True),
]


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c['checkpoint_format']}-{c.get('read_copy', 'shared')}")
def test_decode_reads_and_writes_the_right_copies(kind, cfg):
    """Each step: a non-flush step's output is the output of the state read from the read copy
    (the checkpoint when shared) and writes no copy; a flush rebuilds from the recurrence
    checkpoint, writes SR (documented bits) into a low-precision checkpoint and RTN into the read
    copy, both from the same fp32 state, and advances sr_counter by one; materialize follows."""
    layer = LAYERS[kind](_gen(5))
    c = layer.cache(8, sr_seed=1234 if cfg["checkpoint_format"] != "fp32" else None, **cfg)
    probe = layer.cache(1)  # a plain fp32 cache to evaluate a step on a given state
    flushes = {}

    def on_step(step, ids, live, t, outs, befores):
        (b,) = befores
        (y,) = outs
        for r, s in enumerate(ids):
            if s not in live:
                continue
            h = int(b["cursor"][s])
            flush = h + 1 == L
            # the state the step must read, decoded from the copies as they were before the step
            copy = "checkpoint" if flush or c.read_copy is None else "read_copy"
            fmt = c.checkpoint_format if copy == "checkpoint" else c.read_copy_format
            parts = [b[copy][s : s + 1]] + [b[copy + sfx][s : s + 1] for sfx in ("_scale", "_state_scale")
                                            if b.get(copy + sfx) is not None]
            S_read = parts[0].to(F64) if fmt == "fp32" else _fmt(fmt, parts[0].shape[-1] * (2 if fmt == "nvfp4" else 1)
                                                                 ).decode(parts[0], tuple(parts[1:])).to(F64)
            # evaluate the plain reference on that state, with the slot's records, in a probe cache
            probe.checkpoint.copy_(S_read.float())  # exact: decoded values are fp32
            for n in layer.rings:
                if getattr(probe, n) is not None:
                    getattr(probe, n)[0] = b[n][s]
            probe.cursor[0], probe.origin[0] = h, int(b["origin"][s])
            rederive_flush = kind == "gdn" and flush and c.flush_corrections == "rederive"
            if not rederive_flush:
                expect_y = layer.decode(probe, layer.row(t, r), torch.tensor([0]))
                assert torch.equal(y[r : r + 1], expect_y), f"output step {step} slot {s}"
            if not flush:
                for copy_ in ("checkpoint", "read_copy"):
                    if getattr(c, copy_) is not None:
                        assert torch.equal(_raw(getattr(c, copy_)[s]), _raw(b[copy_][s])), "non-flush wrote a copy"
                if c.sr_counter is not None:
                    assert int(c.sr_counter[s]) == int(b["sr_counter"][s])
                continue
            flushes[s] = flushes.get(s, 0) + 1
            y_new, S_new = layer.flush_state(c, s, h, S_read, t, r)
            if rederive_flush:
                assert torch.equal(y[r : r + 1], y_new), f"flush output step {step} slot {s}"
            else:
                # the plain reference on the decoded checkpoint stores the same fp32 state
                assert torch.equal(probe.checkpoint[0], S_new[0].float())
            S32 = S_new[0].float()
            _assert_copy_is(c, "checkpoint", s, S32, "sr",
                            counter=None if c.sr_counter is None else int(b["sr_counter"][s]))
            if c.read_copy is not None:
                _assert_copy_is(c, "read_copy", s, S32, "rtn")
            if c.sr_counter is not None:
                assert int(c.sr_counter[s]) == int(b["sr_counter"][s]) + 1
            assert int(c.cursor[s]) == 0 and int(c.origin[s]) == int(b["origin"][s])
            assert torch.equal(layer.materialize(c, [s]), c.read_state([s]).to(F64))
        if live:
            mat = layer.materialize(c, live)
            assert mat.dtype == F64 and mat.shape == (len(live),) + _state_shape(c)

    _run(layer, [c], steps=3 * L + 6, on_step=on_step)
    assert min(flushes.values()) >= 2


# ----------------------------------------------------------------------------- the read copy never feeds the recurrence


def _perturb_read_copy(c, s):
    """Change what slot s's read copy decodes to (a scale, or the fp16 values), leaving the
    checkpoint alone."""
    if c.read_copy_format == "fp16":
        c.read_copy[s] = (c.read_copy[s].float() * 1.25).half()
    elif c.read_copy_format == "fp8":
        c.read_copy_scale[s] *= 1.25
    else:
        c.read_copy_state_scale[s] *= 2.0


@pytest.mark.parametrize("kind,cfg", [
    ("mamba2", dict(checkpoint_format="fp16", read_copy="nvfp4")),
    ("mamba2", dict(checkpoint_format="fp32", read_copy="fp8")),
    ("gdn", dict(checkpoint_format="fp16", read_copy="fp8")),
    ("gdn", dict(checkpoint_format="fp32", read_copy="nvfp4")),
    ("gdn", dict(checkpoint_format="fp8", read_copy="fp16")),
])
def test_read_copy_never_feeds_the_recurrence(kind, cfg):
    """Two caches, same seed and inputs; one's read copies are perturbed right after the prefill
    load and again mid-window. Non-flush outputs differ until the slot's next flush; flush
    outputs, every checkpoint byte and sr_counter stay identical; after a flush the read
    copies agree again. GDN's cached corrections differ, yet re-deriving keeps them out of the
    checkpoint."""
    layer = LAYERS[kind](_gen(6))
    ref, per = layer.cache(8, sr_seed=99 if cfg["checkpoint_format"] != "fp32" else None, **cfg), None
    per = layer.cache(8, sr_seed=99 if cfg["checkpoint_format"] != "fp32" else None, **cfg)
    active = (1, 2, 4, 6)
    dirty = set(active)
    seen_diff = {"out": 0, "u": 0}
    S0 = layer.prefill(len(active))

    def before_step(step, ids, live, t):
        if step == 0:
            for s in active:
                _perturb_read_copy(per, s)
        if step == L + 1:  # mid-window for slots at other ring positions
            for s in live:
                if int(per.cursor[s]) not in (0, L - 1):
                    _perturb_read_copy(per, s)
                    dirty.add(s)

    def on_step(step, ids, live, t, outs, befores):
        y_ref, y_per = outs
        for r, s in enumerate(ids):
            if s not in live:
                continue
            flush = int(befores[0]["cursor"][s]) + 1 == L
            assert torch.equal(_raw(ref.checkpoint[s]), _raw(per.checkpoint[s])), f"checkpoint step {step} slot {s}"
            for sfx in ("_scale", "_state_scale"):
                if getattr(ref, "checkpoint" + sfx) is not None:
                    a, b = getattr(ref, "checkpoint" + sfx)[s], getattr(per, "checkpoint" + sfx)[s]
                    assert torch.equal(_raw(a), _raw(b))
            if ref.sr_counter is not None:
                assert torch.equal(ref.sr_counter, per.sr_counter)
            if flush:
                assert torch.equal(y_ref[r], y_per[r]), f"flush output step {step} slot {s}"
                assert all(torch.equal(a, b) for a, b in zip(_copy_parts(ref, "read_copy", s),
                                                             _copy_parts(per, "read_copy", s)))
                dirty.discard(s)
            elif s in dirty:
                assert not torch.equal(y_ref[r], y_per[r]), f"non-flush output ignored the read copy (step {step})"
                seen_diff["out"] += 1
            else:
                assert torch.equal(y_ref[r], y_per[r])
        if kind == "gdn":
            seen_diff["u"] += int(not torch.equal(ref.ring_u, per.ring_u))

    _run(layer, [ref, per], steps=3 * L + 6, before_step=before_step, on_step=on_step, S0=S0)
    assert seen_diff["out"] >= 6
    if kind == "gdn":
        assert seen_diff["u"] > 0, "the perturbation never reached a cached correction: the check is vacuous"
    # materialize reads the checkpoint and the raw records (GDN: re-derived corrections) only
    assert torch.equal(layer.materialize(ref, list(active)), layer.materialize(per, list(active)))


def test_gdn_fold_variant_lets_the_read_copy_into_the_checkpoint():
    """The comparison point: folding the cached corrections (flush_corrections="fold") carries
    a perturbed read copy into the checkpoint at the next flush."""
    layer = _GDN(_gen(7))
    ref = layer.cache(8, read_copy="fp8", flush_corrections="fold")
    per = layer.cache(8, read_copy="fp8", flush_corrections="fold")

    def before_step(step, ids, live, t):
        if step == 0:
            for s in (1, 2, 4, 6):
                _perturb_read_copy(per, s)

    _run(layer, [ref, per], steps=2 * L + 5, before_step=before_step)
    assert not torch.equal(ref.checkpoint, per.checkpoint)


# ----------------------------------------------------------------------------- seeds, shared, conventional


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_fixed_seed_reproduces_and_seeds_differ(kind):
    layer = LAYERS[kind](_gen(8))
    cfg = dict(checkpoint_format="fp8", read_copy="nvfp4")
    a, b, c = layer.cache(8, sr_seed=11, **cfg), layer.cache(8, sr_seed=11, **cfg), layer.cache(8, sr_seed=12, **cfg)
    hist = _run(layer, [a, b, c], steps=2 * L + 6)
    for n, v in _snap(a).items():
        assert torch.equal(_raw(v), _raw(getattr(b, n))), n
    assert all(torch.equal(y1, y2) for (_, y1), (_, y2) in zip(hist[0], hist[1]))
    assert not torch.equal(_raw(a.checkpoint), _raw(c.checkpoint))
    assert torch.equal(a.sr_counter, c.sr_counter)


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_shared_is_one_low_precision_copy(kind):
    """shared=True and a low-precision checkpoint without read copy are the same configuration:
    one SR copy, read by every step."""
    layer = LAYERS[kind](_gen(9))
    a = layer.cache(8, checkpoint_format="fp8", shared=True, sr_seed=3)
    b = layer.cache(8, checkpoint_format="fp8", sr_seed=3)
    assert a.shared and b.shared and a.read_copy is None
    assert not any(k.startswith("read_copy") for k in a.memory_per_slot())
    hist = _run(layer, [a, b], steps=2 * L + 3)
    assert all(torch.equal(y1, y2) for (_, y1), (_, y2) in zip(hist[0], hist[1]))
    assert torch.equal(_raw(a.checkpoint), _raw(b.checkpoint))


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
@pytest.mark.parametrize("fmt", ["fp16", "fp8", "nvfp4"])
def test_conventional_low_precision_state(kind, fmt):
    """window 1: every step decodes the stored state, takes the conventional step in float64 and
    stores its fp32 rounding with SR (write w of the slot = its counter); the output comes from
    the unrounded new state."""
    layer = LAYERS[kind](_gen(10))
    c = layer.cache(8, window=1, checkpoint_format=fmt, sr_seed=2024)
    writes = {}

    def on_step(step, ids, live, t, outs, befores):
        (b,) = befores
        for r, s in enumerate(ids):
            if s not in live:
                continue
            parts = [b["checkpoint"][s : s + 1]] + [
                b[n][s : s + 1] for n in ("checkpoint_scale", "checkpoint_state_scale") if b.get(n) is not None]
            S_prev = _fmt(fmt, _state_shape(c)[-1]).decode(parts[0], tuple(parts[1:])).to(F64)
            if kind == "mamba2":
                x, dt, B, C = layer.row(t, r)
                y, S_new = R.mamba2_conventional_step(S_prev, x, dt, layer.A, B, C, layer.D, None, layer.dt_bias, True)
            else:
                q, k, v, a, bg = layer.row(t, r)
                y, S_new = R.gdn_conventional_step(S_prev, q, k, v, a, bg, layer.A_log, layer.dt_bias)
            assert torch.allclose(outs[0][r : r + 1], y, rtol=1e-12, atol=1e-12 * y.abs().max().item())
            _assert_copy_is(c, "checkpoint", s, S_new[0].float(), "sr", counter=int(b["sr_counter"][s]))
            writes[s] = int(c.sr_counter[s])

    _run(layer, [c], steps=8, on_step=on_step)
    assert writes and all(w >= 4 for w in writes.values())


# ----------------------------------------------------------------------------- speculative verify


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_verify_on_two_precision_cache(kind):
    """Verify + commit cycles on a two-precision cache (Algorithms 3 and 6): equal to the plain
    reference bit for bit on fp32 without read copy; with a read copy, non-flush verify steps
    read it (a perturbation changes their outputs), flush steps read the checkpoint, write every
    copy from one fp32 state, and the checkpoints never see the read copy."""
    layer = LAYERS[kind](_gen(11))
    T, window = 3, 6
    active = [1, 3, 4]
    S0 = layer.prefill(len(active))
    # fp32 through the low-precision reference equals the plain reference
    plain, same = layer.cache(6, window=window, max_draft=T), layer.cache(6, window=window, max_draft=T)
    fn = R.mamba2_verify_lowprec_cache_ if kind == "mamba2" else R.gdn_verify_lowprec_cache_
    cfg = dict(window=window, max_draft=T, checkpoint_format="fp16", read_copy="fp8", sr_seed=5)
    ref, per = layer.cache(6, **cfg), layer.cache(6, **cfg)
    for c in (plain, same, ref, per):
        c.load_prefill(active, S0)
    for s in active:
        _perturb_read_copy(per, s)
    dirty, flushes, diffs = set(active), 0, 0
    for step in range(8):
        ids = active + [-1]
        t = layer.draft_inputs(len(ids), T)
        acc = torch.tensor([1 + (step + i) % T for i in range(len(ids))])
        ti = torch.tensor(ids)
        y0 = layer.verify(plain, t, ti)
        if kind == "mamba2":
            x, dt, B, C = t
            y1 = fn(same, x, dt, layer.A, B, C, ti, layer.D, None, layer.dt_bias, True)
        else:
            q, k, v, a, bg = t
            y1 = fn(same, q, k, v, a, bg, layer.A_log, layer.dt_bias, ti)
        assert torch.equal(y0, y1)
        hs = {s: int(ref.cursor[s]) for s in active}
        cnt = ref.sr_counter.clone()
        y_ref, y_per = layer.verify(ref, t, ti), layer.verify(per, t, ti)
        for r, s in enumerate(ids[:-1]):
            flush = hs[s] + T > window
            if flush:
                flushes += 1
                assert torch.equal(y_ref[r], y_per[r]), "a flush step read the read copy"
                # the table (SR counter, h, origin) moves at the commit
                assert int(ref.sr_counter[s]) == int(cnt[s]) and int(ref.cursor[s]) == hs[s]
                assert torch.equal(_raw(ref.read_copy[s]), _raw(per.read_copy[s]))
                dirty.discard(s)
            elif s in dirty:
                diffs += int(not torch.equal(y_ref[r], y_per[r]))
            assert torch.equal(_raw(ref.checkpoint[s]), _raw(per.checkpoint[s]))
        for c in (plain, same, ref, per):
            R.commit_cache_(c, ti, acc, num_drafts=T)
        for n, v in _snap(plain).items():
            assert torch.equal(v, getattr(same, n)), n
    assert flushes >= 3 and diffs >= 2


def test_verify_flush_writes_quant_casts_of_one_fp32_state():
    """A flushing verify step stores SR(fp32 rebuild) in the checkpoint and RTN(same) in the read copy."""
    layer = _Mamba2(_gen(13))
    T, window = 2, 4
    c = layer.cache(4, window=window, max_draft=T, checkpoint_format="fp8", read_copy="nvfp4", sr_seed=8)
    c.load_prefill([1, 2], layer.prefill(2))
    for step in range(6):
        ids = torch.tensor([1, 2])
        t = layer.draft_inputs(2, T)
        before = _snap(c)
        layer.verify(c, t, ids)
        for s in (1, 2):
            h = int(before["cursor"][s])
            if h + T <= window:
                continue
            parts = [before["checkpoint"][s : s + 1], before["checkpoint_scale"][s : s + 1]]
            S_prev = _fmt("fp8", MN).decode(parts[0], (parts[1],)).to(F64)
            o, cap = int(before["origin"][s]), c.capacity
            idx = [(o + i) % cap for i in range(h)]
            S_new = R.mamba2_replay(S_prev, before["ring_x"][s, idx][None], before["ring_B"][s, idx][None],
                                    before["ring_dt"][s, idx][None], layer.A)[0].float()
            _assert_copy_is(c, "checkpoint", s, S_new, "sr", counter=int(before["sr_counter"][s]))
            _assert_copy_is(c, "read_copy", s, S_new, "rtn")
            assert int(c.origin[s]) == o and int(c.cursor[s]) == h  # the commit moves them
        acc = [T, 1 + step % T]
        R.commit_cache_(c, ids, torch.tensor(acc), num_drafts=T)
        for s, a in zip(ids, acc):
            h = int(before["cursor"][s])
            folded = h + T > window
            assert int(c.cursor[s]) == (a if folded else h + a)
            assert int(c.origin[s]) == (int(before["origin"][s]) + (h if folded else 0)) % c.capacity
            assert int(c.sr_counter[s]) == int(before["sr_counter"][s]) + folded


# ----------------------------------------------------------------------------- API on the CPU


def test_api_decode_on_cpu_and_gpu_guard():
    layer = _Mamba2(_gen(14))
    c = Mamba2Cache(4, MH, MP, MN, MG, window=L, checkpoint_format="fp16", read_copy="fp8", sr_seed=1)
    c.load_prefill([0, 2], layer.prefill(2))
    x, dt, B, C = layer.inputs(2)
    y = api.decode(c, x.bfloat16(), dt.float(), layer.A.float(), B.bfloat16(), C.bfloat16(),
                   torch.tensor([2, 0], dtype=torch.int32), D=layer.D.float(), dt_bias=layer.dt_bias.float(),
                   dt_softplus=True)
    assert y.shape == (2, MH, MP) and y.dtype == torch.bfloat16 and bool(torch.isfinite(y.float()).all())
    assert c.cursor.tolist() == [1, 0, 1, 0]
    with pytest.raises(NotImplementedError, match="CPU reference only"):
        api._check_device(c, torch.device("cuda"))
    with pytest.raises(NotImplementedError, match="low-precision"):
        R.mamba2_snapshot_verify_cache_(Mamba2Cache(2, MH, MP, MN, MG, window=1, checkpoint_format="fp16"),
                                         x[:, None], dt[:, None], layer.A, B[:, None], C[:, None], [0, 1],
                                         torch.zeros(2, 1, MH, MP, MN))
