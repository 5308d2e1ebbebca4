"""Argument checking of `replayssm_cute.decode` (CPU cache, so the reference does the math).

Every bad argument is rejected with an error naming it, before anything is written; the accepted
spellings of the vLLM conventions (stride-0 expansions, batch-strided row views) give exactly the
results of their plain forms. Also: debug-mode slot checks, out-of-pool / pad rows, batch 0.
The same for Gated DeltaNet caches (second half), including vLLM's packed mixed_qkv, and the
GDN CPU path over several windows against the float64 conventional recurrence.
"""

import pytest
import torch

import replayssm_cute
from replayssm_cute import GDNCache, Mamba2Cache, decode
from replayssm_cute import reference as R

from _inputs import gen as _gen64
from _inputs import randn as _randn64
from _inputs import uniform as _uniform64

H, P, N, G, L = 4, 16, 32, 2, 4
SLOTS = 6
ACT = torch.bfloat16
B_ROWS = 3
# cursors per slot: slot 3 flushes (h + 1 == L), the others append a record.
CURSORS = [0, 1, 2, 3, 1, 2]
SLOT_IDS = [3, 1, 5]

CACHE_TENSORS = ("checkpoint", "ring_x", "ring_B", "ring_dt", "cursor", "origin", "arrivals")
GDN_TENSORS = ("checkpoint", "ring_u", "ring_k", "ring_g", "ring_v", "ring_beta", "cursor", "origin",
               "arrivals")


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("REPLAYSSM_CUTE_DEBUG", raising=False)


def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _cache(pad_slot_id=-1, dtype=ACT, seed=0):
    """A CPU cache with random checkpoints and ring records and mixed cursors."""
    c = Mamba2Cache(SLOTS, H, P, N, G, window=L, dtype=dtype, pad_slot_id=pad_slot_id)
    g = _gen(seed)
    c.checkpoint.copy_(torch.randn(c.checkpoint.shape, generator=g))
    c.ring_x.copy_(torch.randn(c.ring_x.shape, generator=g).to(dtype))
    c.ring_B.copy_(torch.randn(c.ring_B.shape, generator=g).to(dtype))
    c.ring_dt.copy_(0.05 + 0.2 * torch.rand(c.ring_dt.shape, generator=g))
    c.cursor.copy_(torch.tensor(CURSORS, dtype=torch.int32))
    c.origin.copy_(torch.randint(0, c.capacity, (SLOTS,), generator=g, dtype=torch.int32))
    return c


def _tensor_names(c):
    return GDN_TENSORS if isinstance(c, GDNCache) else CACHE_TENSORS


def _clone_cache(c):
    if isinstance(c, GDNCache):
        d = GDNCache(c.num_slots, c.num_v_heads, c.head_v_dim, c.head_k_dim, c.num_k_heads,
                     window=c.window, max_draft=c.max_draft, dtype=c.dtype, pad_slot_id=c.pad_slot_id,
                     keep_v_beta=c.keep_v_beta)
    else:
        d = Mamba2Cache(c.num_slots, c.nheads, c.headdim, c.dstate, c.ngroups, window=c.window,
                        max_draft=c.max_draft, dtype=c.dtype, pad_slot_id=c.pad_slot_id)
    for n in _tensor_names(c):
        if getattr(c, n) is not None:
            getattr(d, n).copy_(getattr(c, n))
    return d


def _bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def _snapshot(c):
    return {n: _bits(getattr(c, n)) for n in _tensor_names(c) if getattr(c, n) is not None}


def assert_cache_bits(c, snap):
    now = _snapshot(c)
    assert now.keys() == snap.keys()
    for n in snap:
        assert torch.equal(now[n], snap[n]), f"cache.{n} was written"


def assert_same_cache(c1, c2):
    assert_cache_bits(c1, _snapshot(c2))


def _inputs(b=B_ROWS, slots=SLOT_IDS, dtype=ACT, seed=1):
    g = _gen(seed)
    return dict(
        x=torch.randn(b, H, P, generator=g).to(dtype),
        dt=(torch.randn(b, H, generator=g) - 1.0).to(dtype),
        A=-(0.5 + torch.rand(H, generator=g)),
        B=torch.randn(b, G, N, generator=g).to(dtype),
        C=torch.randn(b, G, N, generator=g).to(dtype),
        slot_ids=torch.tensor(slots, dtype=torch.int32),
        D=torch.randn(H, generator=g),
        z=torch.randn(b, H, P, generator=g).to(dtype),
        dt_bias=0.1 * torch.randn(H, generator=g),
        dt_softplus=True,
    )


def _run(cache, args, out=None):
    return decode(cache, **args, out=out)


# ----------------------------------------------------------------------------- rejections


def _noncontig(t, order):
    """Same shape and values as t, inner dims not packed (a permuted copy)."""
    return t.permute(*order).contiguous().permute(*[order.index(i) for i in range(t.dim())])


b = B_ROWS
BAD = {
    # activation dtype must be the cache's (bf16); no implicit casts
    "x fp16": ("x", lambda a: a["x"].half()),
    "x fp32": ("x", lambda a: a["x"].float()),
    "x fp64": ("x", lambda a: a["x"].double()),
    "x int": ("x", lambda a: torch.zeros(b, H, P, dtype=torch.int32)),
    "x list": ("x", lambda a: a["x"].tolist()),
    "x 2-D": ("x", lambda a: a["x"].reshape(b, H * P)),
    "x P+1": ("x", lambda a: torch.zeros(b, H, P + 1, dtype=ACT)),
    "x H-1": ("x", lambda a: torch.zeros(b, H - 1, P, dtype=ACT)),
    "x inner transposed": ("x", lambda a: _noncontig(a["x"], (0, 2, 1))),
    "x inner stride 2": ("x", lambda a: torch.zeros(b, H, 2 * P, dtype=ACT)[:, :, ::2]),
    "B fp32": ("B", lambda a: a["B"].float()),
    "B G+1": ("B", lambda a: torch.zeros(b, G + 1, N, dtype=ACT)),
    "B N/2": ("B", lambda a: torch.zeros(b, G, N // 2, dtype=ACT)),
    "B batch+1": ("B", lambda a: torch.zeros(b + 1, G, N, dtype=ACT)),
    "B inner transposed": ("B", lambda a: _noncontig(a["B"], (0, 2, 1))),
    "C fp16": ("C", lambda a: a["C"].half()),
    "C G-1": ("C", lambda a: torch.zeros(b, G - 1, N, dtype=ACT)),
    "C batch-1": ("C", lambda a: torch.zeros(b - 1, G, N, dtype=ACT)),
    "C inner transposed": ("C", lambda a: _noncontig(a["C"], (0, 2, 1))),
    "z fp32": ("z", lambda a: a["z"].float()),
    "z P-1": ("z", lambda a: torch.zeros(b, H, P - 1, dtype=ACT)),
    "z batch+1": ("z", lambda a: torch.zeros(b + 1, H, P, dtype=ACT)),
    "z inner transposed": ("z", lambda a: _noncontig(a["z"], (0, 2, 1))),
    "dt H+1": ("dt", lambda a: torch.zeros(b, H + 1, dtype=ACT)),
    "dt batch+1": ("dt", lambda a: torch.zeros(b + 1, H, dtype=ACT)),
    "dt 1-D": ("dt", lambda a: torch.zeros(b, dtype=ACT)),
    "dt fp64": ("dt", lambda a: a["dt"].double()),
    "dt fp16": ("dt", lambda a: a["dt"].half()),
    "dt (b,H,P) materialised": ("dt", lambda a: a["dt"][:, :, None].expand(b, H, P).contiguous()),
    "dt (b,H,P+1) stride 0": ("dt", lambda a: a["dt"][:, :, None].expand(b, H, P + 1)),
    "dt inner transposed": ("dt", lambda a: _noncontig(a["dt"], (1, 0))),
    "dt list": ("dt", lambda a: a["dt"].tolist()),
    "slot_ids int64": ("slot_ids", lambda a: a["slot_ids"].long()),
    "slot_ids int16": ("slot_ids", lambda a: a["slot_ids"].short()),
    "slot_ids b+1": ("slot_ids", lambda a: torch.tensor(SLOT_IDS + [2], dtype=torch.int32)),
    "slot_ids (b,1)": ("slot_ids", lambda a: a["slot_ids"][:, None]),
    "slot_ids list": ("slot_ids", lambda a: list(SLOT_IDS)),
    "slot_ids strided": ("slot_ids", lambda a: torch.tensor([3, 0, 1, 0, 5, 0], dtype=torch.int32)[::2]),
    "A None": ("A", lambda a: None),
    "A fp64": ("A", lambda a: a["A"].double()),
    "A bf16": ("A", lambda a: a["A"].bfloat16()),
    "A H+1": ("A", lambda a: torch.full((H + 1,), -1.0)),
    "A (H,P,N) contiguous": ("A", lambda a: a["A"][:, None, None].expand(H, P, N).contiguous()),
    "A (H,P,N) stride on N": ("A", lambda a: (a["A"][:, None, None] + torch.zeros(H, 1, N)).expand(H, P, N)),
    "A (H,P,N) stride on P": ("A", lambda a: (a["A"][:, None] + torch.zeros(H, P))[:, :, None].expand(H, P, N)),
    "A (H,P) stride 0": ("A", lambda a: a["A"][:, None].expand(H, P)),
    "A (H,N,P) stride 0": ("A", lambda a: a["A"][:, None, None].expand(H, N, P)),
    "D fp16": ("D", lambda a: a["D"].half()),
    "D H-1": ("D", lambda a: a["D"][:-1]),
    "D (H,P) contiguous": ("D", lambda a: a["D"][:, None].expand(H, P).contiguous()),
    "D (H,P+1) stride 0": ("D", lambda a: a["D"][:, None].expand(H, P + 1)),
    "D (H,P,N) stride 0": ("D", lambda a: a["D"][:, None, None].expand(H, P, N)),
    "dt_bias fp64": ("dt_bias", lambda a: a["dt_bias"].double()),
    "dt_bias H+1": ("dt_bias", lambda a: torch.zeros(H + 1)),
    "dt_bias (H,P) contiguous": ("dt_bias", lambda a: a["dt_bias"][:, None].expand(H, P).contiguous()),
    "dt_softplus int": ("dt_softplus", lambda a: 1),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_argument_is_rejected_before_any_write(case):
    name, mutate = BAD[case]
    cache = _cache()
    snap = _snapshot(cache)
    args = _inputs()
    args[name] = mutate(args)
    out = torch.full((b, H, P), 7.0, dtype=ACT)
    with pytest.raises((ValueError, TypeError)) as e:
        _run(cache, args, out=out)
    assert f"'{name}'" in str(e.value), str(e.value)
    assert_cache_bits(cache, snap)
    assert bool((out == 7.0).all())


OUT_BAD = {
    "out fp32": lambda: torch.zeros(b, H, P),
    "out fp16": lambda: torch.zeros(b, H, P, dtype=torch.float16),
    "out P+1": lambda: torch.zeros(b, H, P + 1, dtype=ACT),
    "out batch+1": lambda: torch.zeros(b + 1, H, P, dtype=ACT),
    "out 2-D": lambda: torch.zeros(b, H * P, dtype=ACT),
    "out inner transposed": lambda: torch.zeros(b, P, H, dtype=ACT).transpose(1, 2),
}


@pytest.mark.parametrize("case", list(OUT_BAD), ids=list(OUT_BAD))
def test_bad_out_is_rejected_before_any_write(case):
    cache = _cache()
    snap = _snapshot(cache)
    out = OUT_BAD[case]()
    before = _bits(out)
    with pytest.raises((ValueError, TypeError)) as e:
        _run(cache, _inputs(), out=out)
    assert "'out'" in str(e.value), str(e.value)
    assert_cache_bits(cache, snap)
    assert torch.equal(_bits(out), before)


def test_x_must_match_an_fp32_cache():
    cache = _cache(dtype=torch.float32)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="'x'"):
        _run(cache, _inputs(dtype=ACT))
    assert_cache_bits(cache, snap)
    _run(cache, _inputs(dtype=torch.float32))  # the matching dtype goes through


def test_cache_must_be_a_mamba2_cache():
    cache = _cache()
    for bad in (None, cache.checkpoint, {"checkpoint": cache.checkpoint}):
        with pytest.raises(TypeError, match="'cache'"):
            _run(bad, _inputs())


# ----------------------------------------------------------------------------- accepted spellings


def _same_as_plain(modify, out_factory=None):
    """Run plain arguments and their modified spelling on identical caches; all bits must match."""
    c1, args = _cache(), _inputs()
    c2 = _clone_cache(c1)
    args2 = modify(dict(args))
    o1 = torch.full((b, H, P), 3.0, dtype=ACT)
    o2 = out_factory() if out_factory else torch.full((b, H, P), 3.0, dtype=ACT)
    r1 = _run(c1, args, out=o1)
    r2 = _run(c2, args2, out=o2)
    assert r1 is o1 and r2 is o2
    assert torch.equal(_bits(r1), _bits(r2))
    assert_same_cache(c1, c2)
    # sanity: the step did something (outputs written, the flush slot's checkpoint changed)
    assert not bool((r1 == 3.0).all())
    assert not torch.equal(c1.checkpoint[3], _cache().checkpoint[3])
    return c1, c2


def test_A_stride0_expansion_is_accepted_and_identical():
    _same_as_plain(lambda a: {**a, "A": a["A"][:, None, None].expand(H, P, N)})


def test_dt_stride0_expansion_is_accepted_and_identical():
    _same_as_plain(lambda a: {**a, "dt": a["dt"][:, :, None].expand(b, H, P)})


def test_fp32_dt_is_accepted_with_a_bf16_cache():
    args = _inputs()
    dt32 = args["dt"].float()  # exactly the bf16 values, in fp32
    _same_as_plain(lambda a: {**a, "dt": dt32})
    _same_as_plain(lambda a: {**a, "dt": dt32[:, :, None].expand(b, H, P)})


def test_D_and_dt_bias_stride0_expansions_are_accepted_and_identical():
    _same_as_plain(lambda a: {**a, "D": a["D"][:, None].expand(H, P),
                              "dt_bias": a["dt_bias"][:, None].expand(H, P)})


def test_vllm_style_expansions_together():
    _same_as_plain(lambda a: {**a, "A": a["A"][:, None, None].expand(H, P, N),
                              "dt": a["dt"][:, :, None].expand(b, H, P),
                              "D": a["D"][:, None].expand(H, P),
                              "dt_bias": a["dt_bias"][:, None].expand(H, P)})


def test_batch_strided_views_are_accepted_and_identical():
    """Rows that are slices of a wider projection output (x | B | C | z split along dim 1)."""
    HP, GN = H * P, G * N
    width = HP + 2 * GN + HP + 8

    def strided(a):
        wide = torch.zeros(b, width, dtype=ACT)
        wide[:, :HP] = a["x"].reshape(b, HP)
        wide[:, HP:HP + GN] = a["B"].reshape(b, GN)
        wide[:, HP + GN:HP + 2 * GN] = a["C"].reshape(b, GN)
        wide[:, HP + 2 * GN:2 * HP + 2 * GN] = a["z"].reshape(b, HP)
        dt_wide = torch.zeros(b, H + 5, dtype=ACT)
        dt_wide[:, 2:H + 2] = a["dt"]
        v = dict(a)
        v["x"] = wide[:, :HP].view(b, H, P)
        v["B"] = wide[:, HP:HP + GN].view(b, G, N)
        v["C"] = wide[:, HP + GN:HP + 2 * GN].view(b, G, N)
        v["z"] = wide[:, HP + 2 * GN:2 * HP + 2 * GN].view(b, H, P)
        v["dt"] = dt_wide[:, 2:H + 2]
        for k in ("x", "B", "C", "z", "dt"):
            assert not v[k].is_contiguous() and v[k].stride(0) > v[k][0].numel(), k
            assert torch.equal(v[k], a[k])
        return v

    def out_view():
        o = torch.full((b, 2, H, P), 3.0, dtype=ACT)[:, 1]
        assert not o.is_contiguous()
        return o

    _same_as_plain(strided, out_factory=out_view)


def test_returns_out_allocated_when_not_given():
    y = _run(_cache(), _inputs())
    assert y.shape == (b, H, P) and y.dtype == ACT and y.device.type == "cpu"


# ----------------------------------------------------------------------------- slots


def test_debug_mode_rejects_out_of_pool_slots(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", "1")
    for slots in ([3, SLOTS, 5], [3, -2, 5], [3, 1, 1000]):
        cache = _cache()
        snap = _snapshot(cache)
        out = torch.full((b, H, P), 7.0, dtype=ACT)
        with pytest.raises(IndexError, match="slot"):
            _run(cache, _inputs(slots=slots), out=out)
        assert_cache_bits(cache, snap)
        assert bool((out == 7.0).all())


def test_debug_mode_rejects_duplicate_slots(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", "1")
    cache = _cache()
    snap = _snapshot(cache)
    out = torch.full((b, H, P), 7.0, dtype=ACT)
    with pytest.raises(ValueError, match="same slot"):
        _run(cache, _inputs(slots=[3, 1, 3]), out=out)
    assert_cache_bits(cache, snap)
    assert bool((out == 7.0).all())


def test_debug_mode_allows_repeated_pad_rows(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", "1")
    _run(_cache(), _inputs(slots=[-1, 1, -1]))
    _run(_cache(pad_slot_id=0), _inputs(slots=[0, 2, 0]))


def test_debug_off_when_env_is_zero(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", "0")
    _run(_cache(), _inputs(slots=[3, SLOTS, 5]))  # skipped, not raised


def _check_skipped_rows(cache_kwargs, slots, skipped_rows, expect_slots_touched):
    """Rows in skipped_rows leave out untouched; the others match a batch of just those rows."""
    cache = _cache(**cache_kwargs)
    ref_cache = _clone_cache(cache)
    before = {n: getattr(cache, n).clone() for n in CACHE_TENSORS if getattr(cache, n) is not None}
    args = _inputs(slots=slots)
    out = torch.full((b, H, P), 7.0, dtype=ACT)
    assert _run(cache, args, out=out) is out
    live = [r for r in range(b) if r not in skipped_rows]
    for r in skipped_rows:
        assert bool((out[r] == 7.0).all()), f"row {r} was written"
    # The live rows alone give the same outputs and the same cache.
    sub = {k: (v[live] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b
               and k not in ("A", "D", "dt_bias") else v) for k, v in args.items()}
    ref_out = _run(ref_cache, sub)
    assert torch.equal(_bits(out[live]), _bits(ref_out))
    assert_same_cache(cache, ref_cache)
    # Only the live rows' slots changed.
    for s in range(SLOTS):
        same = all(torch.equal(_bits(getattr(cache, n)[s]), _bits(before[n][s])) for n in before)
        assert same == (s not in expect_slots_touched), f"slot {s}"


def test_out_of_pool_slot_is_skipped_without_debug():
    _check_skipped_rows({}, [3, SLOTS, 5], [1], {3, 5})
    _check_skipped_rows({}, [-7, 1, 2000], [0, 2], {1})


def test_pad_rows_are_skipped():
    _check_skipped_rows({}, [-1, 1, 5], [0], {1, 5})


def test_pad_slot_zero_cache_skips_slot_zero_rows():
    _check_skipped_rows({"pad_slot_id": 0}, [0, 4, 0], [0, 2], {4})
    _check_skipped_rows({"pad_slot_id": 0}, [3, 0, 5], [1], {3, 5})


@pytest.mark.parametrize("debug", ["0", "1"])
def test_batch_zero_returns_empty_out(monkeypatch, debug):
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", debug)
    cache = _cache()
    snap = _snapshot(cache)
    y = _run(cache, _inputs(b=0, slots=[]))
    assert isinstance(y, torch.Tensor) and y.shape == (0, H, P) and y.dtype == ACT
    out = torch.empty(0, H, P, dtype=ACT)
    assert _run(cache, _inputs(b=0, slots=[]), out=out) is out
    assert_cache_bits(cache, snap)


def test_package_exports_decode():
    assert replayssm_cute.decode is decode


def test_per_head_parameters_must_be_packed():
    """A strided (H,) view would be read as packed by the kernels: rejected, naming the argument."""
    cache = Mamba2Cache(8, 4, 16, 32, 2, window=4, dtype=torch.float32)
    x, dt, B, C = torch.randn(1, 4, 16), torch.randn(1, 4), torch.randn(1, 2, 32), torch.randn(1, 2, 32)
    A = (-1 - torch.rand(8))[::2]
    with pytest.raises(ValueError, match="'A'.*packed"):
        decode(cache, x, dt, A, B, C, torch.tensor([1], dtype=torch.int32))


# ============================================================================= Gated DeltaNet

HV, V, K, KH = 4, 16, 32, 2  # value heads, V, K, key heads (2 value heads per key head)
QKV_WIDTH = 2 * KH * K + HV * V  # vLLM's packed [q | k | v] row


def _gdn_cache(pad_slot_id=-1, dtype=ACT, seed=0, keep_v_beta=True, max_draft=0):
    """A CPU GDN cache with random checkpoints and records (v / beta kept, so every ring tensor
    exists and is checked) and the mixed cursors of the Mamba-2 cache above."""
    c = GDNCache(SLOTS, HV, V, K, KH, window=L, max_draft=max_draft, dtype=dtype, pad_slot_id=pad_slot_id,
                 keep_v_beta=keep_v_beta)
    g = _gen(seed)
    c.checkpoint.copy_(torch.randn(c.checkpoint.shape, generator=g))
    c.ring_u.copy_(torch.randn(c.ring_u.shape, generator=g).half())
    keys = torch.randn(c.ring_k.shape, generator=g)
    c.ring_k.copy_((keys / keys.norm(dim=-1, keepdim=True)).to(dtype))
    c.ring_g.copy_(-(0.01 + 0.5 * torch.rand(c.ring_g.shape, generator=g)))
    if keep_v_beta:
        c.ring_v.copy_(torch.randn(c.ring_v.shape, generator=g).to(dtype))
        c.ring_beta.copy_(torch.rand(c.ring_beta.shape, generator=g))
    c.cursor.copy_(torch.tensor(CURSORS, dtype=torch.int32))
    c.origin.copy_(torch.randint(0, c.capacity, (SLOTS,), generator=g, dtype=torch.int32))
    return c


def _gdn_inputs(b=B_ROWS, slots=SLOT_IDS, dtype=ACT, seed=1):
    g = _gen(seed)
    return dict(
        q=torch.randn(b, KH, K, generator=g).to(dtype),
        k=torch.randn(b, KH, K, generator=g).to(dtype),
        v=torch.randn(b, HV, V, generator=g).to(dtype),
        a=torch.randn(b, HV, generator=g).to(dtype),
        b=torch.randn(b, HV, generator=g).to(dtype),
        A_log=torch.log(1.0 + 7.0 * torch.rand(HV, generator=g)),
        dt_bias=-4.0 + 2.0 * torch.rand(HV, generator=g),
        slot_ids=torch.tensor(slots, dtype=torch.int32),
    )


def _packed(args, extra_left=24, extra_right=16):
    """args with q, k, v replaced by mixed_qkv: a column slice [q | k | v] of a wider tensor, so
    its row stride exceeds the packed width (as when vLLM splits a projection output)."""
    bsz = args["v"].shape[0]
    wide = torch.full((bsz, extra_left + QKV_WIDTH + extra_right), 5.0, dtype=args["v"].dtype)
    mixed = wide[:, extra_left:extra_left + QKV_WIDTH]
    mixed[:, :KH * K] = args["q"].reshape(bsz, KH * K)
    mixed[:, KH * K:2 * KH * K] = args["k"].reshape(bsz, KH * K)
    mixed[:, 2 * KH * K:] = args["v"].reshape(bsz, HV * V)
    return {**args, "q": None, "k": None, "v": None, "mixed_qkv": mixed}


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _mixed(args, make):
    """args with q, k, v replaced by the mixed_qkv that make(packed mixed_qkv) returns."""
    packed = _packed(args)
    return {**packed, "mixed_qkv": make(packed["mixed_qkv"])}


GB = B_ROWS
BAD_GDN = {
    # q, k (b, KH, K) and v (b, HV, V): the cache's activation dtype, inner dims packed
    "q fp16": ("q", lambda a: {**a, "q": a["q"].half()}),
    "q fp32": ("q", lambda a: {**a, "q": a["q"].float()}),
    "q int": ("q", lambda a: {**a, "q": torch.zeros(GB, KH, K, dtype=torch.int32)}),
    "q list": ("q", lambda a: {**a, "q": a["q"].tolist()}),
    "q None": ("q", lambda a: {**a, "q": None}),
    "q 2-D": ("q", lambda a: {**a, "q": a["q"].reshape(GB, KH * K)}),
    "q KH+1": ("q", lambda a: {**a, "q": torch.zeros(GB, KH + 1, K, dtype=ACT)}),
    "q K-16": ("q", lambda a: {**a, "q": torch.zeros(GB, KH, K - 16, dtype=ACT)}),
    "q batch+1": ("q", lambda a: {**a, "q": torch.zeros(GB + 1, KH, K, dtype=ACT)}),
    "q inner transposed": ("q", lambda a: {**a, "q": _noncontig(a["q"], (0, 2, 1))}),
    "q inner stride 2": ("q", lambda a: {**a, "q": torch.zeros(GB, KH, 2 * K, dtype=ACT)[:, :, ::2]}),
    "q on meta": ("q", lambda a: {**a, "q": _meta(a["q"])}),
    "k fp32": ("k", lambda a: {**a, "k": a["k"].float()}),
    "k None": ("k", lambda a: {**a, "k": None}),
    "k KH-1": ("k", lambda a: {**a, "k": torch.zeros(GB, KH - 1, K, dtype=ACT)}),
    "k K+16": ("k", lambda a: {**a, "k": torch.zeros(GB, KH, K + 16, dtype=ACT)}),
    "k batch-1": ("k", lambda a: {**a, "k": torch.zeros(GB - 1, KH, K, dtype=ACT)}),
    "k inner transposed": ("k", lambda a: {**a, "k": _noncontig(a["k"], (0, 2, 1))}),
    "k on meta": ("k", lambda a: {**a, "k": _meta(a["k"])}),
    "v fp16": ("v", lambda a: {**a, "v": a["v"].half()}),
    "v fp32": ("v", lambda a: {**a, "v": a["v"].float()}),
    "v None": ("v", lambda a: {**a, "v": None}),
    "v list": ("v", lambda a: {**a, "v": a["v"].tolist()}),
    "v 2-D": ("v", lambda a: {**a, "v": a["v"].reshape(GB, HV * V)}),
    "v HV+1": ("v", lambda a: {**a, "v": torch.zeros(GB, HV + 1, V, dtype=ACT)}),
    "v V-1": ("v", lambda a: {**a, "v": torch.zeros(GB, HV, V - 1, dtype=ACT)}),
    "v inner transposed": ("v", lambda a: {**a, "v": _noncontig(a["v"], (0, 2, 1))}),
    "v on meta": ("v", lambda a: {**a, "v": _meta(a["v"])}),
    # raw gates a, b (b, HV): the activation dtype or fp32, both the same
    "a fp64": ("a", lambda a: {**a, "a": a["a"].double()}),
    "a fp16": ("a", lambda a: {**a, "a": a["a"].half()}),
    "a int": ("a", lambda a: {**a, "a": torch.zeros(GB, HV, dtype=torch.int32)}),
    "a None": ("a", lambda a: {**a, "a": None}),
    "a HV+1": ("a", lambda a: {**a, "a": torch.zeros(GB, HV + 1, dtype=ACT)}),
    "a batch+1": ("a", lambda a: {**a, "a": torch.zeros(GB + 1, HV, dtype=ACT)}),
    "a 1-D": ("a", lambda a: {**a, "a": torch.zeros(GB, dtype=ACT)}),
    "a inner transposed": ("a", lambda a: {**a, "a": _noncontig(a["a"], (1, 0))}),
    "a on meta": ("a", lambda a: {**a, "a": _meta(a["a"])}),
    "b fp32 with bf16 a": ("b", lambda a: {**a, "b": a["b"].float()}),
    "b bf16 with fp32 a": ("b", lambda a: {**a, "a": a["a"].float()}),
    "b None": ("b", lambda a: {**a, "b": None}),
    "b HV-1": ("b", lambda a: {**a, "b": torch.zeros(GB, HV - 1, dtype=ACT)}),
    "b batch-1": ("b", lambda a: {**a, "b": torch.zeros(GB - 1, HV, dtype=ACT)}),
    "b inner transposed": ("b", lambda a: {**a, "b": _noncontig(a["b"], (1, 0))}),
    "b on meta": ("b", lambda a: {**a, "b": _meta(a["b"])}),
    # A_log, dt_bias (HV,): packed, fp32 or the activation dtype
    "A_log fp64": ("A_log", lambda a: {**a, "A_log": a["A_log"].double()}),
    "A_log fp16": ("A_log", lambda a: {**a, "A_log": a["A_log"].half()}),
    "A_log None": ("A_log", lambda a: {**a, "A_log": None}),
    "A_log list": ("A_log", lambda a: {**a, "A_log": a["A_log"].tolist()}),
    "A_log HV+1": ("A_log", lambda a: {**a, "A_log": torch.zeros(HV + 1)}),
    "A_log KH": ("A_log", lambda a: {**a, "A_log": torch.zeros(KH)}),
    "A_log (HV,1)": ("A_log", lambda a: {**a, "A_log": a["A_log"][:, None]}),
    "A_log (HV,V) stride 0": ("A_log", lambda a: {**a, "A_log": a["A_log"][:, None].expand(HV, V)}),
    "A_log strided": ("A_log", lambda a: {**a, "A_log": torch.zeros(2 * HV)[::2]}),
    "A_log on meta": ("A_log", lambda a: {**a, "A_log": _meta(a["A_log"])}),
    "dt_bias fp64": ("dt_bias", lambda a: {**a, "dt_bias": a["dt_bias"].double()}),
    "dt_bias None": ("dt_bias", lambda a: {**a, "dt_bias": None}),
    "dt_bias HV-1": ("dt_bias", lambda a: {**a, "dt_bias": a["dt_bias"][:-1]}),
    "dt_bias (1,HV)": ("dt_bias", lambda a: {**a, "dt_bias": a["dt_bias"][None]}),
    "dt_bias strided": ("dt_bias", lambda a: {**a, "dt_bias": torch.zeros(2 * HV)[::2]}),
    "dt_bias on meta": ("dt_bias", lambda a: {**a, "dt_bias": _meta(a["dt_bias"])}),
    # scale: None or a positive finite number
    "scale 0": ("scale", lambda a: {**a, "scale": 0.0}),
    "scale negative": ("scale", lambda a: {**a, "scale": -0.5}),
    "scale nan": ("scale", lambda a: {**a, "scale": float("nan")}),
    "scale inf": ("scale", lambda a: {**a, "scale": float("inf")}),
    "scale bool": ("scale", lambda a: {**a, "scale": True}),
    "scale str": ("scale", lambda a: {**a, "scale": "0.5"}),
    "scale tensor": ("scale", lambda a: {**a, "scale": torch.tensor(0.5)}),
    # slot_ids (b,) int32, contiguous
    "slot_ids int64": ("slot_ids", lambda a: {**a, "slot_ids": a["slot_ids"].long()}),
    "slot_ids int16": ("slot_ids", lambda a: {**a, "slot_ids": a["slot_ids"].short()}),
    "slot_ids None": ("slot_ids", lambda a: {**a, "slot_ids": None}),
    "slot_ids list": ("slot_ids", lambda a: {**a, "slot_ids": list(SLOT_IDS)}),
    "slot_ids b+1": ("slot_ids", lambda a: {**a, "slot_ids": torch.tensor(SLOT_IDS + [2], dtype=torch.int32)}),
    "slot_ids (b,1)": ("slot_ids", lambda a: {**a, "slot_ids": a["slot_ids"][:, None]}),
    "slot_ids strided": ("slot_ids", lambda a: {
        **a, "slot_ids": torch.tensor([3, 0, 1, 0, 5, 0], dtype=torch.int32)[::2]}),
    "slot_ids on meta": ("slot_ids", lambda a: {**a, "slot_ids": _meta(a["slot_ids"])}),
    # mixed_qkv (b, 2 KH K + HV V): alone, the activation dtype, last dim packed
    "mixed_qkv with q": ("mixed_qkv", lambda a: {**_packed(a), "q": a["q"]}),
    "mixed_qkv with k": ("mixed_qkv", lambda a: {**_packed(a), "k": a["k"]}),
    "mixed_qkv with v": ("mixed_qkv", lambda a: {**_packed(a), "v": a["v"]}),
    "mixed_qkv with q, k, v": ("mixed_qkv", lambda a: {**_packed(a), "q": a["q"], "k": a["k"], "v": a["v"]}),
    "mixed_qkv width+1": ("mixed_qkv", lambda a: {**_packed(a), "mixed_qkv": torch.zeros(GB, QKV_WIDTH + 1, dtype=ACT)}),
    "mixed_qkv width-16": ("mixed_qkv", lambda a: _mixed(a, lambda m: m[:, :-16])),
    "mixed_qkv without v": ("mixed_qkv", lambda a: _mixed(a, lambda m: m[:, :2 * KH * K])),
    "mixed_qkv fp32": ("mixed_qkv", lambda a: _mixed(a, lambda m: m.float())),
    "mixed_qkv fp16": ("mixed_qkv", lambda a: _mixed(a, lambda m: m.half())),
    "mixed_qkv 3-D": ("mixed_qkv", lambda a: _mixed(a, lambda m: m[:, None, :])),
    "mixed_qkv 1-D": ("mixed_qkv", lambda a: _mixed(a, lambda m: m[0])),
    "mixed_qkv list": ("mixed_qkv", lambda a: _mixed(a, lambda m: m.tolist())),
    "mixed_qkv column stride 2": ("mixed_qkv", lambda a: _mixed(
        a, lambda m: torch.zeros(GB, 2 * QKV_WIDTH, dtype=ACT)[:, ::2])),
    "mixed_qkv transposed": ("mixed_qkv", lambda a: _mixed(a, lambda m: m.t().contiguous().t())),
    "mixed_qkv on meta": ("mixed_qkv", lambda a: _mixed(a, _meta)),
    # out (b, HV, V): the activation dtype, inner dims packed
    "out fp32": ("out", lambda a: {**a, "out": torch.full((GB, HV, V), 7.0)}),
    "out fp16": ("out", lambda a: {**a, "out": torch.full((GB, HV, V), 7.0, dtype=torch.float16)}),
    "out HV+1": ("out", lambda a: {**a, "out": torch.full((GB, HV + 1, V), 7.0, dtype=ACT)}),
    "out V+1": ("out", lambda a: {**a, "out": torch.full((GB, HV, V + 1), 7.0, dtype=ACT)}),
    "out batch+1": ("out", lambda a: {**a, "out": torch.full((GB + 1, HV, V), 7.0, dtype=ACT)}),
    "out 2-D": ("out", lambda a: {**a, "out": torch.full((GB, HV * V), 7.0, dtype=ACT)}),
    "out inner transposed": ("out", lambda a: {
        **a, "out": torch.full((GB, V, HV), 7.0, dtype=ACT).transpose(1, 2)}),
    "out on meta": ("out", lambda a: {**a, "out": _meta(torch.empty(GB, HV, V, dtype=ACT))}),
}


def _assert_gdn_rejected(name, args, cache):
    snap = _snapshot(cache)
    out = args.pop("out", None)
    if out is None:
        out = torch.full((args["slot_ids"].shape[0] if isinstance(args.get("slot_ids"), torch.Tensor)
                          else GB, HV, V), 7.0, dtype=ACT)
    before = _bits(out) if out.device.type == "cpu" else None
    with pytest.raises(ValueError) as e:
        decode(cache, **args, out=out)
    assert f"'{name}'" in str(e.value), str(e.value)
    assert_cache_bits(cache, snap)
    if before is not None:
        assert torch.equal(_bits(out), before), "out was written"


@pytest.mark.parametrize("case", list(BAD_GDN), ids=list(BAD_GDN))
def test_gdn_bad_argument_is_rejected_before_any_write(case):
    name, mutate = BAD_GDN[case]
    _assert_gdn_rejected(name, mutate(_gdn_inputs()), _gdn_cache())


@pytest.mark.parametrize("case", ["x fp32", "q fp16", "mixed_qkv fp32"])
def test_gdn_inputs_must_match_an_fp32_cache(case):
    """An fp32 cache takes fp32 activations only (bf16 q, k, v or mixed_qkv are rejected)."""
    cache = _gdn_cache(dtype=torch.float32)
    args = _gdn_inputs(dtype=ACT)
    args["a"], args["b"] = args["a"].float(), args["b"].float()
    name = "q" if case != "mixed_qkv fp32" else "mixed_qkv"
    if name == "mixed_qkv":
        args = _packed(args)
    _assert_gdn_rejected(name, args, cache)
    decode(cache, **_gdn_inputs(dtype=torch.float32))  # the matching dtype goes through


def test_gdn_mixed_qkv_column_stride_rejected_at_batch_one():
    args = _packed(_gdn_inputs(b=1, slots=[3]))
    args["mixed_qkv"] = torch.zeros(1, 2 * QKV_WIDTH, dtype=ACT)[:, ::2]
    _assert_gdn_rejected("mixed_qkv", args, _gdn_cache())


def test_gdn_cache_type_is_checked():
    with pytest.raises(TypeError, match="'cache'"):
        decode(_gdn_cache().checkpoint, **_gdn_inputs())


# ----------------------------------------------------------------------------- GDN, accepted


def _gdn_same(args1, args2, kw=None, out2=None):
    """Run two spellings on identical caches: outputs and every cache tensor bit-identical.
    Returns the cache after the step and its state before."""
    kw = kw or {}
    c1 = _gdn_cache()
    c0, c2 = _clone_cache(c1), _clone_cache(c1)
    o1 = torch.full((GB, HV, V), 3.0, dtype=ACT)
    o2 = out2 if out2 is not None else torch.full((GB, HV, V), 3.0, dtype=ACT)
    assert decode(c1, **args1, out=o1, **kw) is o1
    assert decode(c2, **args2, out=o2, **kw) is o2
    assert torch.equal(_bits(o1), _bits(o2))
    assert_same_cache(c1, c2)
    # the step did something: outputs written, slot 3 flushed (its checkpoint changed), slots 1
    # and 5 appended a record (their cursors moved)
    assert not bool((o1 == 3.0).any())
    assert not torch.equal(c1.checkpoint[3], c0.checkpoint[3])
    assert c1.cursor.tolist() == [0, 2, 2, 0, 1, 3]
    return c1


def test_gdn_mixed_qkv_is_identical_to_separate_q_k_v():
    args = _gdn_inputs()
    packed = _packed(args)
    m = packed["mixed_qkv"]
    assert m.stride(0) > QKV_WIDTH and m.stride(1) == 1 and m.storage_offset() > 0
    for name in ("q", "k", "v"):
        assert args[name].is_contiguous()
    _gdn_same(args, packed)


def test_gdn_mixed_qkv_positional_with_none_q_k_v():
    args = _gdn_inputs()
    packed = _packed(args)
    c1, c2 = _gdn_cache(), _gdn_cache()
    y1 = decode(c1, args["q"], args["k"], args["v"], args["a"], args["b"], args["A_log"],
                args["dt_bias"], args["slot_ids"])
    y2 = decode(c2, None, None, None, args["a"], args["b"], args["A_log"], args["dt_bias"],
                args["slot_ids"], mixed_qkv=packed["mixed_qkv"])
    assert torch.equal(_bits(y1), _bits(y2))
    assert_same_cache(c1, c2)


def test_gdn_batch_strided_views_are_accepted_and_identical():
    """q, k, v, a, b and out as row slices of wider tensors (any batch stride)."""
    args = _gdn_inputs()

    def wide_view(t, pad=3):
        w = torch.full((t.shape[0], t[0].numel() + 2 * pad), 9.0, dtype=t.dtype)
        w[:, pad:pad + t[0].numel()] = t.reshape(t.shape[0], -1)
        v = w[:, pad:pad + t[0].numel()].view(t.shape)
        assert not v.is_contiguous() and torch.equal(v, t)
        return v

    strided = {**args, **{n: wide_view(args[n]) for n in ("q", "k", "v", "a", "b")}}
    out = torch.full((GB, 2, HV, V), 3.0, dtype=ACT)[:, 1]
    _gdn_same(args, strided, out2=out)


@pytest.mark.parametrize("gates,params,scale", [
    (ACT, torch.float32, None),
    (torch.float32, ACT, 0.3),
    (torch.float32, torch.float32, 2),
])
def test_gdn_decode_equals_the_cache_reference(gates, params, scale):
    """The CPU path of decode is reference.gdn_decode_cache_, bit for bit, for every accepted
    gate / parameter dtype and scale."""
    args = _gdn_inputs()
    for n in ("a", "b"):
        args[n] = args[n].to(gates)
    for n in ("A_log", "dt_bias"):
        args[n] = args[n].to(params)
    c1 = _gdn_cache()
    c2 = _clone_cache(c1)
    o1 = torch.full((GB, HV, V), 3.0, dtype=ACT)
    o2 = o1.clone()
    assert decode(c1, **args, scale=scale, out=o1) is o1
    R.gdn_decode_cache_(c2, args["q"], args["k"], args["v"], args["a"], args["b"], args["A_log"],
                        args["dt_bias"], args["slot_ids"], scale=scale, out=o2)
    assert torch.equal(_bits(o1), _bits(o2))
    assert_same_cache(c1, c2)
    assert not bool((o1 == 3.0).any())


def test_gdn_returns_out_allocated_when_not_given():
    y = decode(_gdn_cache(), **_gdn_inputs())
    assert y.shape == (GB, HV, V) and y.dtype == ACT and y.device.type == "cpu"
    y = decode(_gdn_cache(), **_packed(_gdn_inputs()))
    assert y.shape == (GB, HV, V) and y.dtype == ACT


@pytest.mark.parametrize("debug", ["0", "1"])
def test_gdn_batch_zero_returns_empty_out(monkeypatch, debug):
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", debug)
    cache = _gdn_cache()
    snap = _snapshot(cache)
    for args in (_gdn_inputs(b=0, slots=[]), _packed(_gdn_inputs(b=0, slots=[]))):
        y = decode(cache, **args)
        assert y.shape == (0, HV, V) and y.dtype == ACT
    assert_cache_bits(cache, snap)


def test_gdn_debug_mode_rejects_bad_slots(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", "1")
    for slots, exc in (([3, SLOTS, 5], IndexError), ([3, 1, 3], ValueError)):
        cache = _gdn_cache()
        snap = _snapshot(cache)
        with pytest.raises(exc, match="slot"):
            decode(cache, **_gdn_inputs(slots=slots))
        assert_cache_bits(cache, snap)


# ----------------------------------------------------------------------------- GDN, many windows


def _snapshot_tensors(c):
    return {n: getattr(c, n) for n in _tensor_names(c) if getattr(c, n) is not None}


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("window,pad,seed", [(4, -1, 0), (16, 0, 1), (1, -1, 2)])
def test_gdn_decode_over_windows_matches_the_conventional_recurrence(window, pad, seed):
    """decode (CPU path) on a float32 cache, token by token, against reference.gdn_conventional_step
    in float64: >= 5 windows, rows staggered over ring positions (row r joins at step r mod L),
    every batch padded with pad-sentinel and out-of-pool rows in shuffled order, packed
    mixed_qkv on odd steps. Outputs every step, materialized states every step.

    The cache stores each record's u in fp16 (unit roundoff 2^-11 = 4.9e-4; observed relative
    errors about 3e-4), which the float64 recurrence does not: the tolerance with a ring is 1e-3,
    far below what a wrong decay or a lost record gives (1e-2 and up). Window 1 rounds only the
    fp32 state and outputs (errors about 1e-7)."""
    tol = 1e-6 if window == 1 else 1e-3
    g = _gen64(seed)
    slots = [5, 2, 7, 1, 4] if pad == -1 else [5, 2, 7, 1, 3]
    nslots = 8
    cache = GDNCache(nslots, HV, V, K, KH, window=window, dtype=torch.float32, pad_slot_id=pad)
    S0 = _randn64(g, len(slots), HV, V, K) * 0.3
    cache.load_prefill(slots, S0.float())
    ref = {s: S0[i:i + 1] for i, s in enumerate(slots)}
    A_log, dt_bias = torch.log(_uniform64(g, 1.0, 8.0, HV)), _uniform64(g, -4.0, -2.0, HV)
    skip = [pad, nslots, nslots + 5, -3] if pad == -1 else [pad, -1, nslots, 2 * nslots]
    steps = (len(slots) - 1) % max(window, 1) + 5 * window + 3
    flushes = 0
    for step in range(steps):
        live = [s for r, s in enumerate(slots) if step >= r % window]
        ids = live + skip[:1 + step % len(skip)]
        perm = torch.randperm(len(ids), generator=g).tolist()
        ids = [ids[i] for i in perm]
        bsz = len(ids)
        tok = dict(q=_randn64(g, bsz, KH, K), k=_randn64(g, bsz, KH, K), v=_randn64(g, bsz, HV, V),
                   a=_randn64(g, bsz, HV), b=_randn64(g, bsz, HV))
        args = {n: t.float() for n, t in tok.items()}
        args.update(A_log=A_log.float(), dt_bias=dt_bias.float(),
                    slot_ids=torch.tensor(ids, dtype=torch.int32))
        if step % 2:
            args = _packed(args)
        out = torch.full((bsz, HV, V), 7.0)
        h_before = {s: int(cache.cursor[s]) for s in live}
        idle = [s for s in range(nslots) if s not in live]
        idle_before = {n: t[idle].clone() for n, t in _snapshot_tensors(cache).items()}
        assert decode(cache, **args, out=out) is out
        for r, s in enumerate(ids):
            row = slice(r, r + 1)
            if s not in live:
                assert bool((out[r] == 7.0).all()), f"step {step}: skipped row {r} (slot {s}) was written"
                continue
            o_ref, ref[s] = R.gdn_conventional_step(
                ref[s], tok["q"][row], tok["k"][row], tok["v"][row], tok["a"][row], tok["b"][row],
                A_log, dt_bias)
            e = _rel(out[row], o_ref)
            assert e < tol, f"step {step} slot {s}: output off by {e:.2e}"
            if h_before[s] + 1 == window:
                flushes += 1
                assert int(cache.cursor[s]) == 0
        mat = cache.materialize(live)
        for i, s in enumerate(live):
            e = _rel(mat[i:i + 1], ref[s])
            assert e < tol, f"step {step} slot {s}: materialized state off by {e:.2e}"
        for n, t in _snapshot_tensors(cache).items():
            assert torch.equal(t[idle], idle_before[n]), f"step {step}: {n} of a slot not in the batch was written"
    assert not cache.arrivals.any()
    assert flushes >= 5 * len(slots)


# ============================================================================= speculative verify / commit
#
# `verify(cache, ...)` takes decode's Mamba-2 arguments with a draft axis, tokens (b, T, ...), on
# a cache with draft room (max_draft >= T, T <= window); `commit(cache, slot_ids, num_accepted)`
# applies the last verify. On the CPU both run the float64 reference (reference_spec).

from replayssm_cute import commit, verify  # noqa: E402
from replayssm_cute import reference_spec as RS  # noqa: E402

SPEC_DRAFT = 3  # the spec cache's max_draft
SPEC_T = 2
# slot 3 holds window records (left by a commit): any T flushes; slot 5: h + T = 5 > L flushes;
# slot 1: h + T = 3 <= L appends.
SPEC_CURSORS = [0, 1, 2, L, 1, 3]


def _spec_cache(pad_slot_id=-1, dtype=ACT, seed=0, window=L, max_draft=SPEC_DRAFT):
    c = Mamba2Cache(SLOTS, H, P, N, G, window=window, max_draft=max_draft, dtype=dtype,
                    pad_slot_id=pad_slot_id)
    g = _gen(seed)
    c.checkpoint.copy_(torch.randn(c.checkpoint.shape, generator=g))
    c.ring_x.copy_(torch.randn(c.ring_x.shape, generator=g).to(dtype))
    c.ring_B.copy_(torch.randn(c.ring_B.shape, generator=g).to(dtype))
    c.ring_dt.copy_(0.05 + 0.2 * torch.rand(c.ring_dt.shape, generator=g))
    c.cursor.copy_(torch.tensor([min(h, window) for h in SPEC_CURSORS], dtype=torch.int32))
    c.origin.copy_(torch.randint(0, c.capacity, (SLOTS,), generator=g, dtype=torch.int32))
    return c


def _spec_inputs(T=SPEC_T, b=B_ROWS, slots=SLOT_IDS, dtype=ACT, seed=1):
    g = _gen(seed)
    return dict(
        x=torch.randn(b, T, H, P, generator=g).to(dtype),
        dt=(torch.randn(b, T, H, generator=g) - 1.0).to(dtype),
        A=-(0.5 + torch.rand(H, generator=g)),
        B=torch.randn(b, T, G, N, generator=g).to(dtype),
        C=torch.randn(b, T, G, N, generator=g).to(dtype),
        slot_ids=torch.tensor(slots, dtype=torch.int32),
        D=torch.randn(H, generator=g),
        z=torch.randn(b, T, H, P, generator=g).to(dtype),
        dt_bias=0.1 * torch.randn(H, generator=g),
        dt_softplus=True,
    )


def _pending(cache):
    return getattr(cache, "pending_drafts", None)


def _meta_like(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


T_ = SPEC_T
BAD_VERIFY = {
    # x (b, T, H, P): the cache's activation dtype, inner dims packed, on the cache's device
    "x fp16": ("x", lambda a: a["x"].half()),
    "x fp32": ("x", lambda a: a["x"].float()),
    "x int": ("x", lambda a: torch.zeros(b, T_, H, P, dtype=torch.int32)),
    "x list": ("x", lambda a: a["x"].tolist()),
    "x None": ("x", lambda a: None),
    "x decode layout (b, H, P)": ("x", lambda a: a["x"][:, 0]),
    "x 5-D": ("x", lambda a: a["x"][:, :, None]),
    "x P+1": ("x", lambda a: torch.zeros(b, T_, H, P + 1, dtype=ACT)),
    "x H-1": ("x", lambda a: torch.zeros(b, T_, H - 1, P, dtype=ACT)),
    "x inner transposed": ("x", lambda a: _noncontig(a["x"], (0, 1, 3, 2))),
    "x draft axis last": ("x", lambda a: _noncontig(a["x"], (0, 2, 3, 1))),
    "x on meta": ("x", lambda a: _meta_like(a["x"])),
    # dt (b, T, H) raw, or its stride-0 expansion (b, T, H, P)
    "dt decode layout (b, H)": ("dt", lambda a: a["dt"][:, 0]),
    "dt T+1": ("dt", lambda a: torch.zeros(b, T_ + 1, H, dtype=ACT)),
    "dt T-1": ("dt", lambda a: a["dt"][:, :1]),
    "dt H+1": ("dt", lambda a: torch.zeros(b, T_, H + 1, dtype=ACT)),
    "dt batch+1": ("dt", lambda a: torch.zeros(b + 1, T_, H, dtype=ACT)),
    "dt fp16": ("dt", lambda a: a["dt"].half()),
    "dt fp64": ("dt", lambda a: a["dt"].double()),
    "dt list": ("dt", lambda a: a["dt"].tolist()),
    "dt (b,T,H,P) materialised": ("dt", lambda a: a["dt"][..., None].expand(b, T_, H, P).contiguous()),
    "dt (b,T,H,P+1) stride 0": ("dt", lambda a: a["dt"][..., None].expand(b, T_, H, P + 1)),
    "dt inner transposed": ("dt", lambda a: _noncontig(a["dt"], (0, 2, 1))),
    "dt on meta": ("dt", lambda a: _meta_like(a["dt"])),
    # A, D, dt_bias (H,) fp32 (or decode's stride-0 expansions)
    "A None": ("A", lambda a: None),
    "A fp64": ("A", lambda a: a["A"].double()),
    "A H+1": ("A", lambda a: torch.full((H + 1,), -1.0)),
    "A (H,P,N) contiguous": ("A", lambda a: a["A"][:, None, None].expand(H, P, N).contiguous()),
    "A on meta": ("A", lambda a: _meta_like(a["A"])),
    "D fp16": ("D", lambda a: a["D"].half()),
    "D H-1": ("D", lambda a: a["D"][:-1]),
    "D on meta": ("D", lambda a: _meta_like(a["D"])),
    "dt_bias fp64": ("dt_bias", lambda a: a["dt_bias"].double()),
    "dt_bias H+1": ("dt_bias", lambda a: torch.zeros(H + 1)),
    "dt_bias on meta": ("dt_bias", lambda a: _meta_like(a["dt_bias"])),
    # B, C (b, T, G, N)
    "B fp32": ("B", lambda a: a["B"].float()),
    "B decode layout (b, G, N)": ("B", lambda a: a["B"][:, 0]),
    "B T-1": ("B", lambda a: a["B"][:, :1]),
    "B G+1": ("B", lambda a: torch.zeros(b, T_, G + 1, N, dtype=ACT)),
    "B batch+1": ("B", lambda a: torch.zeros(b + 1, T_, G, N, dtype=ACT)),
    "B inner transposed": ("B", lambda a: _noncontig(a["B"], (0, 1, 3, 2))),
    "B on meta": ("B", lambda a: _meta_like(a["B"])),
    "C fp16": ("C", lambda a: a["C"].half()),
    "C T+1": ("C", lambda a: torch.zeros(b, T_ + 1, G, N, dtype=ACT)),
    "C N/2": ("C", lambda a: torch.zeros(b, T_, G, N // 2, dtype=ACT)),
    "C batch-1": ("C", lambda a: a["C"][:-1]),
    "C on meta": ("C", lambda a: _meta_like(a["C"])),
    # z (b, T, H, P), optional
    "z fp32": ("z", lambda a: a["z"].float()),
    "z decode layout (b, H, P)": ("z", lambda a: a["z"][:, 0]),
    "z T+1": ("z", lambda a: torch.zeros(b, T_ + 1, H, P, dtype=ACT)),
    "z P-1": ("z", lambda a: torch.zeros(b, T_, H, P - 1, dtype=ACT)),
    "z inner transposed": ("z", lambda a: _noncontig(a["z"], (0, 1, 3, 2))),
    "z on meta": ("z", lambda a: _meta_like(a["z"])),
    # slot_ids (b,) int32, contiguous
    "slot_ids int64": ("slot_ids", lambda a: a["slot_ids"].long()),
    "slot_ids b+1": ("slot_ids", lambda a: torch.tensor(SLOT_IDS + [2], dtype=torch.int32)),
    "slot_ids (b,T)": ("slot_ids", lambda a: a["slot_ids"][:, None].expand(b, T_).contiguous()),
    "slot_ids list": ("slot_ids", lambda a: list(SLOT_IDS)),
    "slot_ids strided": ("slot_ids", lambda a: torch.tensor([3, 0, 1, 0, 5, 0], dtype=torch.int32)[::2]),
    "slot_ids on meta": ("slot_ids", lambda a: _meta_like(a["slot_ids"])),
    "dt_softplus int": ("dt_softplus", lambda a: 1),
}


def _assert_verify_rejected(name, args, cache, out=None):
    """verify raises ValueError naming `name`; no cache tensor, no out element, no pending
    commit changes."""
    snap = _snapshot(cache)
    pending = _pending(cache)
    if out is None:
        out = torch.full((b, T_, H, P), 7.0, dtype=ACT)
    before = _bits(out) if out.device.type == "cpu" else None
    with pytest.raises(ValueError) as e:
        verify(cache, **args, out=out)
    assert f"'{name}'" in str(e.value), str(e.value)
    assert_cache_bits(cache, snap)
    assert _pending(cache) == pending
    if before is not None:
        assert torch.equal(_bits(out), before), "out was written"
    return str(e.value)


@pytest.mark.parametrize("case", list(BAD_VERIFY), ids=list(BAD_VERIFY))
def test_verify_bad_argument_is_rejected_before_any_write(case):
    name, mutate = BAD_VERIFY[case]
    args = _spec_inputs()
    args[name] = mutate(args)
    cache = _spec_cache()
    _assert_verify_rejected(name, args, cache)
    with pytest.raises(ValueError, match="'cache'"):  # nothing to commit
        commit(cache, args["slot_ids"] if name != "slot_ids" else torch.tensor(SLOT_IDS, dtype=torch.int32),
               torch.ones(b, dtype=torch.int32))


BAD_VERIFY_OUT = {
    "out fp32": lambda: torch.full((b, T_, H, P), 7.0),
    "out decode layout (b, H, P)": lambda: torch.full((b, H, P), 7.0, dtype=ACT),
    "out T+1": lambda: torch.full((b, T_ + 1, H, P), 7.0, dtype=ACT),
    "out batch+1": lambda: torch.full((b + 1, T_, H, P), 7.0, dtype=ACT),
    "out inner transposed": lambda: torch.full((b, T_, P, H), 7.0, dtype=ACT).transpose(2, 3),
    "out on meta": lambda: torch.empty((b, T_, H, P), dtype=ACT, device="meta"),
}


@pytest.mark.parametrize("case", list(BAD_VERIFY_OUT), ids=list(BAD_VERIFY_OUT))
def test_verify_bad_out_is_rejected_before_any_write(case):
    _assert_verify_rejected("out", _spec_inputs(), _spec_cache(), out=BAD_VERIFY_OUT[case]())


@pytest.mark.parametrize("window,max_draft,T", [
    (L, 2, 3),  # T > max_draft
    (L, 8, L + 1),  # T > window
    (L, SPEC_DRAFT, 0),  # no drafts
    (2, 16, 3),  # T > window, max_draft 16
])
def test_verify_draft_count_out_of_range(window, max_draft, T):
    cache = _spec_cache(window=window, max_draft=max_draft)
    out = torch.full((b, T, H, P), 7.0, dtype=ACT)
    msg = _assert_verify_rejected("x", _spec_inputs(T=T), cache, out=out)
    assert f"max_draft {max_draft}" in msg and f"window {window}" in msg, msg


@pytest.mark.parametrize("window", [1, L])
def test_verify_needs_a_cache_with_draft_room(window):
    """max_draft 0 (and every conventional cache, window 1): verify is refused, naming the cache."""
    cache = _cache() if window == L else Mamba2Cache(SLOTS, H, P, N, G, window=1, dtype=ACT)
    assert cache.max_draft == 0
    msg = _assert_verify_rejected("cache", _spec_inputs(T=1), cache,
                                  out=torch.full((b, 1, H, P), 7.0, dtype=ACT))
    assert "max_draft" in msg


def test_verify_needs_a_cache():
    with pytest.raises(TypeError, match="'cache'"):
        verify(_spec_cache().checkpoint, **_spec_inputs())


def test_commit_needs_a_preceding_verify():
    cache = _spec_cache()
    snap = _snapshot(cache)
    slots = torch.tensor(SLOT_IDS, dtype=torch.int32)
    ones = torch.ones(b, dtype=torch.int32)
    with pytest.raises(ValueError, match="'cache'.*verify"):
        commit(cache, slots, ones)
    assert_cache_bits(cache, snap)
    # one commit per verify: the second is refused and changes nothing
    args = _spec_inputs()
    verify(cache, **args)
    commit(cache, slots, ones)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="'cache'.*verify"):
        commit(cache, slots, ones)
    assert_cache_bits(cache, snap)
    with pytest.raises(TypeError, match="'cache'"):
        commit(cache.checkpoint, slots, ones)


BAD_COMMIT = {
    "num_accepted int64": ("num_accepted", lambda a, s: (s, a.long())),
    "num_accepted int16": ("num_accepted", lambda a, s: (s, a.short())),
    "num_accepted fp32": ("num_accepted", lambda a, s: (s, a.float())),
    "num_accepted bool": ("num_accepted", lambda a, s: (s, a.bool())),
    "num_accepted b+1": ("num_accepted", lambda a, s: (s, torch.ones(b + 1, dtype=torch.int32))),
    "num_accepted b-1": ("num_accepted", lambda a, s: (s, a[:-1])),
    "num_accepted (b,1)": ("num_accepted", lambda a, s: (s, a[:, None])),
    "num_accepted scalar": ("num_accepted", lambda a, s: (s, a[0])),
    "num_accepted list": ("num_accepted", lambda a, s: (s, a.tolist())),
    "num_accepted int": ("num_accepted", lambda a, s: (s, 1)),
    "num_accepted None": ("num_accepted", lambda a, s: (s, None)),
    "num_accepted strided": ("num_accepted", lambda a, s: (s, a.repeat_interleave(2)[::2])),
    "num_accepted on meta": ("num_accepted", lambda a, s: (s, _meta_like(a))),
    "slot_ids int64": ("slot_ids", lambda a, s: (s.long(), a)),
    "slot_ids list": ("slot_ids", lambda a, s: (s.tolist(), a)),
    "slot_ids (b,1)": ("slot_ids", lambda a, s: (s[:, None], a)),
    "slot_ids strided": ("slot_ids", lambda a, s: (s.repeat_interleave(2)[::2], a)),
    "slot_ids on meta": ("slot_ids", lambda a, s: (_meta_like(s), a)),
}


@pytest.mark.parametrize("case", list(BAD_COMMIT), ids=list(BAD_COMMIT))
def test_commit_bad_argument_is_rejected_before_any_write(case):
    """A rejected commit writes nothing and keeps the verify pending: the right commit still
    applies afterwards."""
    name, mutate = BAD_COMMIT[case]
    cache = _spec_cache()
    args = _spec_inputs()
    verify(cache, **args)
    ref = _clone_cache(cache)
    snap = _snapshot(cache)
    accepted = torch.tensor([2, 1, 2], dtype=torch.int32)
    bad_slots, bad_acc = mutate(accepted, args["slot_ids"])
    with pytest.raises(ValueError) as e:
        commit(cache, bad_slots, bad_acc)
    assert f"'{name}'" in str(e.value), str(e.value)
    assert_cache_bits(cache, snap)
    assert _pending(cache) == SPEC_T
    commit(cache, args["slot_ids"], accepted)
    RS.commit_cache_(ref, args["slot_ids"], accepted, num_drafts=SPEC_T)
    assert_same_cache(cache, ref)


@pytest.mark.parametrize("values", [[0, 1, 1], [1, SPEC_T + 1, 1], [1, 1, -1], [SPEC_DRAFT + 5, 1, 1]])
def test_debug_commit_checks_num_accepted_range(monkeypatch, values):
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", "1")
    cache = _spec_cache()
    args = _spec_inputs()
    verify(cache, **args)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="num_accepted"):
        commit(cache, args["slot_ids"], torch.tensor(values, dtype=torch.int32))
    assert_cache_bits(cache, snap)
    assert _pending(cache) == SPEC_T
    commit(cache, args["slot_ids"], torch.tensor([1, SPEC_T, 1], dtype=torch.int32))


def test_debug_commit_ignores_pad_rows_accepted_values(monkeypatch):
    """Pad and out-of-pool rows are skipped by verify and commit: their num_accepted is ignored."""
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", "1")
    cache = _spec_cache()
    args = _spec_inputs(slots=[-1, 1, 5])
    verify(cache, **args)
    before = cache.cursor.clone()
    commit(cache, args["slot_ids"], torch.tensor([0, 2, 1], dtype=torch.int32))
    assert int(cache.cursor[1]) == int(before[1]) + 2 and int(cache.cursor[5]) == int(before[5]) + 1


def test_commit_out_of_range_without_debug_is_still_refused_on_the_cpu():
    """Without REPLAYSSM_CUTE_DEBUG the CPU path still refuses num_accepted outside 1..T (the
    reference checks it) and writes nothing; the GPU kernel does not check."""
    cache = _spec_cache()
    args = _spec_inputs()
    verify(cache, **args)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match="num_accepted"):
        commit(cache, args["slot_ids"], torch.tensor([1, SPEC_T + 1, 1], dtype=torch.int32))
    assert_cache_bits(cache, snap)


def test_debug_verify_and_commit_check_slot_ids(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", "1")
    for slots, exc in (([3, SLOTS, 5], IndexError), ([3, 1, 3], ValueError)):
        cache = _spec_cache()
        snap = _snapshot(cache)
        with pytest.raises(exc, match="slot"):
            verify(cache, **_spec_inputs(slots=slots))
        assert_cache_bits(cache, snap)
        assert _pending(cache) is None


# ----------------------------------------------------------------------------- verify / commit, accepted


def _verify_commit_both_ways(cache_kw, api_args, ref_args, accepted, T=SPEC_T):
    """verify + commit through the API and reference_spec's cache functions called directly on
    identical caches: outputs and every cache tensor bit-identical. Returns (api cache, out)."""
    c1 = _spec_cache(**cache_kw)
    c2 = _clone_cache(c1)
    c0 = _clone_cache(c1)
    nrows = ref_args["slot_ids"].shape[0]
    o1 = torch.full((nrows, T, H, P), float("nan"), dtype=c1.dtype)  # skipped rows stay NaN
    o2 = o1.clone()
    assert verify(c1, **api_args, out=o1) is o1
    RS.mamba2_verify_cache_(c2, **ref_args, out=o2)
    assert torch.equal(_bits(o1), _bits(o2))
    assert_same_cache(c1, c2)
    acc = torch.tensor(accepted, dtype=torch.int32)
    assert commit(c1, api_args["slot_ids"], acc) is None
    RS.commit_cache_(c2, ref_args["slot_ids"], acc, num_drafts=T)
    assert_same_cache(c1, c2)
    return c0, c1, o1


def test_verify_commit_equal_the_spec_reference():
    """Slot 3 (h = window) and slot 5 (h + T > window) flush, slot 1 appends; D, z, dt_bias."""
    args = _spec_inputs()
    c0, c1, out = _verify_commit_both_ways({}, args, args, [2, 1, 1])
    assert not bool(out.isnan().any())
    for s in (3, 5):  # flushed: new checkpoint, origin moved past the folded records
        assert not torch.equal(c1.checkpoint[s], c0.checkpoint[s])
        assert int(c1.origin[s]) == (int(c0.origin[s]) + int(c0.cursor[s])) % c1.capacity
    assert torch.equal(c1.checkpoint[1], c0.checkpoint[1])
    assert c1.cursor.tolist() == [0, 1 + 1, 2, 2, 1, 1]


@pytest.mark.parametrize("T", [1, SPEC_DRAFT])
def test_verify_commit_vllm_spellings_equal_the_spec_reference(T):
    """Stride-0 expansions of dt, A, D, dt_bias, fp32 dt and a batch-strided x view (the draft and
    inner axes packed) give exactly the
    reference's results on the plain tensors; pad and out-of-pool rows are skipped (out untouched)."""
    slots = [-1, 5, SLOTS + 2, 1]
    plain = _spec_inputs(T=T, b=4, slots=slots)
    api = dict(plain)
    api["dt"] = plain["dt"].float()[..., None].expand(4, T, H, P)
    api["A"] = plain["A"][:, None, None].expand(H, P, N)
    api["D"] = plain["D"][:, None].expand(H, P)
    api["dt_bias"] = plain["dt_bias"][:, None].expand(H, P)
    wide = torch.zeros(4, T * H * P + 8, dtype=ACT)  # rows of a wider buffer: any batch stride
    wide[:, 8:] = plain["x"].reshape(4, T * H * P)
    api["x"] = wide[:, 8:].view(4, T, H, P)
    assert not api["x"].is_contiguous() and torch.equal(api["x"], plain["x"])
    _, _, out = _verify_commit_both_ways({}, api, plain, [1, T, 1, 1], T=T)
    assert bool(out[0].isnan().all()) and bool(out[2].isnan().all())
    assert not bool(out[1].isnan().any()) and not bool(out[3].isnan().any())


def test_verify_allocates_out_and_takes_batch_zero():
    cache = _spec_cache()
    y = verify(cache, **_spec_inputs())
    assert y.shape == (b, SPEC_T, H, P) and y.dtype == ACT
    commit(cache, torch.tensor(SLOT_IDS, dtype=torch.int32), torch.ones(b, dtype=torch.int32))
    snap = _snapshot(cache)
    y = verify(cache, **_spec_inputs(b=0, slots=[]))
    assert y.shape == (0, SPEC_T, H, P)
    commit(cache, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert_cache_bits(cache, snap)


def test_package_exports_verify_and_commit():
    assert replayssm_cute.verify is verify and replayssm_cute.commit is commit


@pytest.mark.parametrize("pad,seed", [(-1, 0), (0, 1)])
def test_verify_commit_decode_run_matches_the_recurrence(pad, seed):
    """~40 API steps on a float32 CPU cache (window 4, max_draft 3): verify of T = 1..3 drafts with
    random acceptance, then commit, with standard decode steps interleaved; every batch has pad
    and out-of-pool rows in shuffled order. Against the float64 recurrence on each slot's accepted
    stream (reference_spec.mamba2_snapshot_verify / reference.mamba2_conventional_step): every
    draft's output and every decode output, the materialized state after every step; at most L
    committed records; slots outside the batch bit-identical. The run includes decodes and
    verifies right after a commit that left cursor == window."""
    window, max_draft, nslots, tol = 4, 3, 7, 1e-5
    g = _gen64(seed)
    slots = [5, 2, 6, 3] if pad == -1 else [5, 2, 6, 1]
    skip = [pad, nslots, nslots + 9] if pad == -1 else [pad, -1, nslots]
    cache = Mamba2Cache(nslots, H, P, N, G, window=window, max_draft=max_draft, dtype=torch.float32,
                        pad_slot_id=pad)
    S0 = _randn64(g, len(slots), H, P, N) * 0.3
    cache.load_prefill(slots, S0.float())
    ref = {s: S0[i:i + 1] for i, s in enumerate(slots)}
    A = -_uniform64(g, 0.5, 1.5, H)
    D, dt_bias = _randn64(g, H), _uniform64(g, -1.0, 0.0, H)
    idle = [s for s in range(nslots) if s not in slots]
    idle_before = {n: getattr(cache, n)[idle].clone() for n in CACHE_TENSORS}
    seen = {"decode_at_full": 0, "verify_at_full": 0, "flush": 0, "verify": 0, "decode": 0}

    def tokens(lead):
        t = dict(x=_randn64(g, *lead, H, P), dt=_randn64(g, *lead, H), B=_randn64(g, *lead, G, N),
                 C=_randn64(g, *lead, G, N), z=_randn64(g, *lead, H, P))
        return t, {k: v.float() for k, v in t.items()}

    for step in range(40):
        ids = slots + skip[:1 + step % len(skip)]
        ids = [ids[i] for i in torch.randperm(len(ids), generator=g).tolist()]
        rows = {s: r for r, s in enumerate(ids) if s in slots}
        sid = torch.tensor(ids, dtype=torch.int32)
        h_before = {s: int(cache.cursor[s]) for s in slots}
        full = [s for s in slots if h_before[s] == window]
        do_decode = step % 5 == 4 or (bool(full) and step % 2 == 0)
        if do_decode:
            tok, args = tokens((len(ids),))
            out = torch.full((len(ids), H, P), 7.0)
            assert decode(cache, **args, A=A.float(), slot_ids=sid, D=D.float(), dt_bias=dt_bias.float(),
                          dt_softplus=True, out=out) is out
            seen["decode"] += 1
            seen["decode_at_full"] += len(full)
            for s, r in rows.items():
                row = slice(r, r + 1)
                y, ref[s] = R.mamba2_conventional_step(
                    ref[s], tok["x"][row], tok["dt"][row], A, tok["B"][row], tok["C"][row], D=D,
                    z=tok["z"][row], dt_bias=dt_bias, dt_softplus=True)
                e = _rel(out[row], y)
                assert e < tol, f"step {step} slot {s}: decode output off by {e:.2e}"
                expect_h = 0 if h_before[s] + 1 >= window else h_before[s] + 1
                assert int(cache.cursor[s]) == expect_h, f"step {step} slot {s}: decode cursor"
        else:
            T = 1 + int(torch.randint(0, max_draft, (1,), generator=g))
            tok, args = tokens((len(ids), T))
            out = torch.full((len(ids), T, H, P), 7.0)
            assert verify(cache, **args, A=A.float(), slot_ids=sid, D=D.float(), dt_bias=dt_bias.float(),
                          dt_softplus=True, out=out) is out
            seen["verify"] += 1
            seen["verify_at_full"] += len(full)
            # mostly all-accepted, so that cursors reach the window
            acc = [T if torch.rand(1, generator=g).item() < 0.5 else
                   1 + int(torch.randint(0, T, (1,), generator=g)) for _ in ids]
            snaps = {}
            for s, r in rows.items():
                row = slice(r, r + 1)
                y, snaps[s] = RS.mamba2_snapshot_verify(
                    ref[s], tok["x"][row], tok["dt"][row], A, tok["B"][row], tok["C"][row], D=D,
                    z=tok["z"][row], dt_bias=dt_bias, dt_softplus=True)
                e = _rel(out[row], y)
                assert e < tol, f"step {step} slot {s}: verify outputs off by {e:.2e}"
            assert commit(cache, sid, torch.tensor(acc, dtype=torch.int32)) is None
            for s, r in rows.items():
                ref[s] = snaps[s][:, acc[r] - 1]
                flushed = RS.spec_flush(h_before[s], T, window)
                seen["flush"] += flushed
                expect_h = (0 if flushed else h_before[s]) + acc[r]
                assert int(cache.cursor[s]) == expect_h, f"step {step} slot {s}: cursor after commit"
        for r, s in enumerate(ids):
            if s not in rows:
                assert bool((out[r] == 7.0).all()), f"step {step}: skipped row {r} (slot {s}) was written"
        assert all(0 <= int(cache.cursor[s]) <= window for s in slots), "at most L committed records"
        mat = cache.materialize(slots, A.float())
        for i, s in enumerate(slots):
            e = _rel(mat[i:i + 1], ref[s])
            assert e < tol, f"step {step} slot {s}: materialized state off by {e:.2e}"
        for n, before in idle_before.items():
            assert torch.equal(getattr(cache, n)[idle], before), f"step {step}: {n} of an idle slot was written"
    assert seen["decode_at_full"] >= 2 and seen["verify_at_full"] >= 2, seen
    assert seen["flush"] >= 10 and seen["decode"] >= 8 and seen["verify"] >= 20, seen


# ----------------------------------------------------------------------------- snapshot baseline
#
# `snapshot_verify(cache, ...)` on a conventional cache (window 1) of either layer type: verify's
# arguments with `snapshots` ((b, T) + the state's shape, fp32, contiguous) after slot_ids. It
# never writes the cache; on the CPU it runs reference_spec's *_snapshot_verify_cache_.

from replayssm_cute import snapshot_verify  # noqa: E402

SNAP_T = 3
SNAP_SLOTS = [-1, 5, SLOTS + 2, 1, 3]  # a pad row and an out-of-pool row among live ones


def _snap_cache(kind, window=1):
    """A CPU cache of `kind` with random states; conventional unless `window` > 1."""
    drafts = 0 if window == 1 else 1
    if kind == "gdn":
        c = GDNCache(SLOTS, HV, V, K, KH, window=window, max_draft=drafts, dtype=ACT)
    else:
        c = Mamba2Cache(SLOTS, H, P, N, G, window=window, max_draft=drafts, dtype=ACT)
    c.checkpoint.copy_(torch.randn(c.checkpoint.shape, generator=_gen(0)))
    return c


def _snap_args(kind, T=SNAP_T, slots=SNAP_SLOTS):
    """snapshot_verify's keyword arguments for `kind`: tokens (b, T, ...), out and snapshots NaN."""
    bsz = len(slots)
    if kind == "gdn":
        args, out = _gdn_spec_inputs(T=T, slots=slots), (HV, V)
    else:
        args, out = _spec_inputs(T=T, b=bsz, slots=slots), (H, P)
    state = (HV, V, K) if kind == "gdn" else (H, P, N)
    return {**args, "out": torch.full((bsz, T) + out, float("nan"), dtype=ACT),
            "snapshots": torch.full((bsz, T) + state, float("nan"))}


def _snap_reference_(kind, cache, args):
    """reference_spec's cache-level snapshot baseline on `cache` with snapshot_verify's `args`."""
    if kind == "gdn":
        return RS.gdn_snapshot_verify_cache_(cache, **args)
    return RS.mamba2_snapshot_verify_cache_(cache, **args)


@pytest.mark.parametrize("kind,scale", [("mamba2", None), ("gdn", None), ("gdn", 0.3)])
def test_snapshot_verify_equals_the_spec_reference(kind, scale):
    """Outputs and snapshots bit-identical to the reference's; the cache is not written; pad and
    out-of-pool rows leave out and snapshots untouched."""
    c1 = _snap_cache(kind)
    c2 = _clone_cache(c1)
    args = _snap_args(kind)
    if scale is not None:
        args["scale"] = scale
    ref = {**args, "out": args["out"].clone(), "snapshots": args["snapshots"].clone()}
    assert snapshot_verify(c1, **args) is args["out"]
    _snap_reference_(kind, c2, ref)
    for n in ("out", "snapshots"):
        assert torch.equal(_bits(args[n]), _bits(ref[n])), n
        assert bool(args[n][[0, 2]].isnan().all()), f"{n} of a skipped row was written"
        assert not bool(args[n][[1, 3, 4]].isnan().any())
    assert_same_cache(c1, _snap_cache(kind))


@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_snapshot_verify_allocates_out_and_takes_batch_zero(kind):
    cache = _snap_cache(kind)
    args = _snap_args(kind)
    del args["out"]
    y = snapshot_verify(cache, **args)
    assert y.shape == args["snapshots"].shape[:4] and y.dtype == ACT
    args = _snap_args(kind, slots=[])
    assert snapshot_verify(cache, **args) is args["out"]
    assert_same_cache(cache, _snap_cache(kind))


def _snap_drafts(kind, T):
    """Arguments with T drafts in every token tensor and in snapshots."""
    return lambda a: _snap_args(kind, T=T)


BAD_SNAPSHOT = {
    # (layer, argument named in the error, mutation of _snap_args, cache window)
    "gdn cache with a ring": ("gdn", "cache", lambda a: a, 4),
    "gdn T=17": ("gdn", "v", _snap_drafts("gdn", 17), 1),
    "gdn T=0": ("gdn", "v", _snap_drafts("gdn", 0), 1),
    "gdn q fp32": ("gdn", "q", lambda a: {**a, "q": a["q"].float()}, 1),
    "gdn v decode layout": ("gdn", "v", lambda a: {**a, "v": a["v"][:, 0]}, 1),
    "gdn a T-1": ("gdn", "a", lambda a: {**a, "a": a["a"][:, 1:]}, 1),
    "gdn A_log HV+1": ("gdn", "A_log", lambda a: {**a, "A_log": torch.zeros(HV + 1)}, 1),
    "gdn scale negative": ("gdn", "scale", lambda a: {**a, "scale": -1.0}, 1),
    "gdn slot_ids int64": ("gdn", "slot_ids", lambda a: {**a, "slot_ids": a["slot_ids"].long()}, 1),
    "gdn out T+1": ("gdn", "out", lambda a: {**a, "out": torch.full((5, SNAP_T + 1, HV, V), 7.0, dtype=ACT)}, 1),
    "gdn snapshots None": ("gdn", "snapshots", lambda a: {**a, "snapshots": None}, 1),
    "gdn snapshots list": ("gdn", "snapshots", lambda a: {**a, "snapshots": a["snapshots"].tolist()}, 1),
    "gdn snapshots fp64": ("gdn", "snapshots", lambda a: {**a, "snapshots": a["snapshots"].double()}, 1),
    "gdn snapshots bf16": ("gdn", "snapshots", lambda a: {**a, "snapshots": a["snapshots"].to(ACT)}, 1),
    "gdn snapshots T+1": ("gdn", "snapshots", lambda a: {**a, "snapshots": torch.zeros(5, SNAP_T + 1, HV, V, K)}, 1),
    "gdn snapshots (V, K) swapped": ("gdn", "snapshots", lambda a: {
        **a, "snapshots": torch.zeros(5, SNAP_T, HV, K, V)}, 1),
    "gdn snapshots transposed": ("gdn", "snapshots", lambda a: {
        **a, "snapshots": torch.zeros(5, SNAP_T, HV, K, V).transpose(3, 4)}, 1),
    "gdn snapshots on meta": ("gdn", "snapshots", lambda a: {**a, "snapshots": _meta(a["snapshots"])}, 1),
    "mamba2 cache with a ring": ("mamba2", "cache", lambda a: a, 4),
    "mamba2 T=17": ("mamba2", "x", _snap_drafts("mamba2", 17), 1),
    "mamba2 x fp32": ("mamba2", "x", lambda a: {**a, "x": a["x"].float()}, 1),
    "mamba2 snapshots fp16": ("mamba2", "snapshots", lambda a: {**a, "snapshots": a["snapshots"].half()}, 1),
    "mamba2 snapshots (N, P) swapped": ("mamba2", "snapshots", lambda a: {
        **a, "snapshots": torch.zeros(5, SNAP_T, H, N, P)}, 1),
}


@pytest.mark.parametrize("case", list(BAD_SNAPSHOT), ids=list(BAD_SNAPSHOT))
def test_snapshot_verify_bad_argument_is_rejected_before_any_write(case):
    kind, name, mutate, window = BAD_SNAPSHOT[case]
    cache = _snap_cache(kind, window)
    snap = _snapshot(cache)
    args = mutate(_snap_args(kind))
    buffers = {n: _bits(t) for n in ("out", "snapshots") if isinstance(t := args.get(n), torch.Tensor)
               and t.device.type == "cpu"}
    with pytest.raises(ValueError) as e:
        snapshot_verify(cache, **args)
    assert str(e.value).startswith("snapshot_verify: ") and f"'{name}'" in str(e.value), str(e.value)
    assert_cache_bits(cache, snap)
    for n, before in buffers.items():
        assert torch.equal(_bits(args[n]), before), f"{n} was written"


def test_snapshot_verify_needs_a_cache():
    with pytest.raises(TypeError, match="snapshot_verify: argument 'cache'"):
        snapshot_verify(_snap_cache("gdn").checkpoint, **_snap_args("gdn"))
    assert replayssm_cute.snapshot_verify is snapshot_verify


# ----------------------------------------------------------------------------- packed (varlen) verify
#
# `verify(..., cu_seqlens=, num_drafts=T)` takes the engines' packed layout, tokens (b * T, ...)
# with row i at cu_seqlens[i]:cu_seqlens[i + 1] = i * T:(i + 1) * T, and returns out packed. It is
# the dense form on zero-copy (b, T, ...) views, so it must give the dense form's results exactly.


def _packed_tokens(args, names, T):
    """args with the token tensors `names` packed (b * T, ...) and the varlen keywords added."""
    bsz = args["slot_ids"].shape[0]
    packed = {n: args[n].flatten(0, 1) for n in names if args.get(n) is not None}
    return {**args, **packed, "cu_seqlens": torch.arange(bsz + 1, dtype=torch.int32) * T, "num_drafts": T}


MAMBA2_TOKENS = ("x", "dt", "B", "C", "z")
GDN_TOKENS = ("q", "k", "v", "a", "b")


def _gdn_spec_inputs(T=SPEC_T, slots=SLOT_IDS, seed=1):
    """GDN verify arguments, tokens laid out (b, T, ...)."""
    bsz = len(slots)
    args = _gdn_inputs(b=bsz * T, slots=slots * T, seed=seed)
    return {**args, **{n: args[n].unflatten(0, (bsz, T)) for n in GDN_TOKENS},
            "slot_ids": torch.tensor(slots, dtype=torch.int32)}


def _dense_and_packed_agree(dense_cache, dense_args, packed_args, out_shape, accepted, T, given_out):
    """verify + commit in the dense form on `dense_cache` and in the packed form on a copy of it:
    outputs (packed out is the dense out flattened) and every cache tensor bit-identical."""
    packed_cache = _clone_cache(dense_cache)
    bsz = dense_args["slot_ids"].shape[0]
    dense_out = torch.full((bsz, T) + out_shape, float("nan"), dtype=ACT)  # skipped rows stay NaN
    packed_out = torch.full((bsz * T,) + out_shape, float("nan"), dtype=ACT) if given_out else None
    assert verify(dense_cache, **dense_args, out=dense_out) is dense_out
    y = verify(packed_cache, **packed_args, out=packed_out)
    assert y is packed_out if given_out else y.shape == (bsz * T,) + out_shape
    assert torch.equal(_bits(y), _bits(dense_out.flatten(0, 1)))
    assert_same_cache(packed_cache, dense_cache)
    acc = torch.tensor(accepted, dtype=torch.int32)
    commit(dense_cache, dense_args["slot_ids"], acc)
    commit(packed_cache, packed_args["slot_ids"], acc)
    assert_same_cache(packed_cache, dense_cache)
    return dense_out


@pytest.mark.parametrize("T,given_out", [(SPEC_T, True), (SPEC_T, False), (1, True), (SPEC_DRAFT, True)])
def test_varlen_verify_equals_dense_mamba2(T, given_out):
    """Packed x, dt, B, C and z (slot 3 and 5 flush, slot 1 appends) give the dense form's outputs
    and cache, before and after commit."""
    args = _spec_inputs(T=T)
    out = _dense_and_packed_agree(_spec_cache(), args, _packed_tokens(args, MAMBA2_TOKENS, T), (H, P),
                                  [T, 1, 1], T, given_out)
    assert not bool(out.isnan().any())


def test_varlen_verify_equals_dense_mamba2_vllm_spellings():
    """Packed fp32 dt as a stride-0 (b * T, H, P) expansion, no z; pad and out-of-pool rows skipped."""
    slots = [-1, 5, SLOTS + 2, 1]
    args = _spec_inputs(T=SPEC_T, b=4, slots=slots)
    args["z"] = None
    packed = _packed_tokens(args, MAMBA2_TOKENS, SPEC_T)
    packed["dt"] = packed["dt"].float()[..., None].expand(4 * SPEC_T, H, P)
    args["dt"] = args["dt"].float()
    out = _dense_and_packed_agree(_spec_cache(), args, packed, (H, P), [1, SPEC_T, 1, 1], SPEC_T, True)
    assert bool(out[0].isnan().all()) and bool(out[2].isnan().all()) and not bool(out[1].isnan().any())


@pytest.mark.parametrize("T,given_out", [(SPEC_T, True), (SPEC_T, False), (SPEC_DRAFT, True)])
def test_varlen_verify_equals_dense_gdn(T, given_out):
    """Packed q, k, v, a, b on a GDN cache (slot 3 flushes, slots 1 and 5 append at T = 2)."""
    args = _gdn_spec_inputs(T=T)
    out = _dense_and_packed_agree(_gdn_cache(max_draft=SPEC_DRAFT), args, _packed_tokens(args, GDN_TOKENS, T),
                                  (HV, V), [1, T, 1], T, given_out)
    assert not bool(out.isnan().any())


def _wider_rows(t):
    """Same values as t (n, ...), each token a column slice of a wider row: a gap between tokens."""
    wide = torch.zeros(t.shape[0], t[0].numel() + 8, dtype=t.dtype)
    wide[:, :t[0].numel()] = t.reshape(t.shape[0], -1)
    return wide[:, :t[0].numel()].view(t.shape)


NT = b * T_  # total tokens of the packed spec inputs
BAD_VARLEN = {
    # cu_seqlens (b + 1,) int32 on the cache's device
    "cu_seqlens int64": ("cu_seqlens", lambda a: a["cu_seqlens"].long()),
    "cu_seqlens fp32": ("cu_seqlens", lambda a: a["cu_seqlens"].float()),
    "cu_seqlens (b,)": ("cu_seqlens", lambda a: a["cu_seqlens"][1:]),
    "cu_seqlens (b+2,)": ("cu_seqlens", lambda a: torch.arange(b + 2, dtype=torch.int32) * T_),
    "cu_seqlens (b+1,1)": ("cu_seqlens", lambda a: a["cu_seqlens"][:, None]),
    "cu_seqlens list": ("cu_seqlens", lambda a: a["cu_seqlens"].tolist()),
    "cu_seqlens on meta": ("cu_seqlens", lambda a: _meta_like(a["cu_seqlens"])),
    "cu_seqlens missing": ("cu_seqlens", lambda a: None),
    # num_drafts: the Python int T, 1..min(max_draft, window)
    "num_drafts missing": ("num_drafts", lambda a: None),
    "num_drafts float": ("num_drafts", lambda a: float(T_)),
    "num_drafts bool": ("num_drafts", lambda a: True),
    "num_drafts tensor": ("num_drafts", lambda a: torch.tensor(T_)),
    "num_drafts 0": ("num_drafts", lambda a: 0),
    "num_drafts > max_draft": ("num_drafts", lambda a: SPEC_DRAFT + 1),
    # token tensors: total_tokens == b * num_drafts, tokens packed back to back
    "x a row short": ("x", lambda a: a["x"][:NT - 1]),
    "x a token over": ("x", lambda a: torch.zeros(NT + 1, H, P, dtype=ACT)),
    "x dense layout (b, T, H, P)": ("x", lambda a: a["x"].unflatten(0, (b, T_))),
    "x 1-D": ("x", lambda a: a["x"].flatten()),
    "x list": ("x", lambda a: a["x"].tolist()),
    "x column slice of a wider row": ("x", lambda a: _wider_rows(a["x"])),
    "x inner transposed": ("x", lambda a: _noncontig(a["x"], (0, 2, 1))),
    "x P+1": ("x", lambda a: torch.zeros(NT, H, P + 1, dtype=ACT)),
    "dt a row short": ("dt", lambda a: a["dt"][:NT - T_]),
    "dt column slice of a wider row": ("dt", lambda a: _wider_rows(a["dt"])),
    "B a row short": ("B", lambda a: a["B"][:NT - 1]),
    "C a token over": ("C", lambda a: torch.zeros(NT + 1, G, N, dtype=ACT)),
    "z dense layout (b, T, H, P)": ("z", lambda a: a["z"].unflatten(0, (b, T_))),
    "slot_ids list": ("slot_ids", lambda a: list(SLOT_IDS)),
    "slot_ids int64": ("slot_ids", lambda a: a["slot_ids"].long()),
}


@pytest.mark.parametrize("case", list(BAD_VARLEN), ids=list(BAD_VARLEN))
def test_varlen_verify_bad_argument_is_rejected_before_any_write(case):
    name, mutate = BAD_VARLEN[case]
    args = _packed_tokens(_spec_inputs(), MAMBA2_TOKENS, T_)
    args[name] = mutate(args)
    _assert_verify_rejected(name, args, _spec_cache(), out=torch.full((NT, H, P), 7.0, dtype=ACT))


@pytest.mark.parametrize("case,out", [
    ("dense layout (b, T, H, P)", lambda: torch.full((b, T_, H, P), 7.0, dtype=ACT)),
    ("a row short", lambda: torch.full((NT - T_, H, P), 7.0, dtype=ACT)),
    ("column slice of a wider row", lambda: _wider_rows(torch.full((NT, H, P), 7.0, dtype=ACT))),
    ("fp32", lambda: torch.full((NT, H, P), 7.0)),
])
def test_varlen_verify_bad_out_is_rejected_before_any_write(case, out):
    args = _packed_tokens(_spec_inputs(), MAMBA2_TOKENS, T_)
    _assert_verify_rejected("out", args, _spec_cache(), out=out())


@pytest.mark.parametrize("name,mutate", [
    ("v", lambda a: a["v"][:-1]),
    ("q", lambda a: _wider_rows(a["q"])),
    ("b", lambda a: a["b"].unflatten(0, (b, T_))),
    ("cu_seqlens", lambda a: a["cu_seqlens"].long()),
    ("num_drafts", lambda a: None),
])
def test_varlen_gdn_verify_bad_argument_is_rejected_before_any_write(name, mutate):
    cache = _gdn_cache(max_draft=SPEC_DRAFT)
    args = _packed_tokens(_gdn_spec_inputs(), GDN_TOKENS, T_)
    args[name] = mutate(args)
    snap = _snapshot(cache)
    out = torch.full((NT, HV, V), 7.0, dtype=ACT)
    with pytest.raises(ValueError, match=f"verify: argument '{name}'"):
        verify(cache, **args, out=out)
    assert_cache_bits(cache, snap)
    assert _pending(cache) is None and bool((out == 7.0).all())


def test_varlen_errors_say_what_was_expected():
    args = _packed_tokens(_spec_inputs(), MAMBA2_TOKENS, T_)
    with pytest.raises(ValueError, match=rf"'x'.*batch {b} \* num_drafts {T_} = {NT}"):
        verify(_spec_cache(), **{**args, "x": args["x"][:-1]})
    with pytest.raises(ValueError, match=r"'x'.*packed back to back.*contiguous"):
        verify(_spec_cache(), **{**args, "x": _wider_rows(args["x"])})
    with pytest.raises(ValueError, match=rf"'cu_seqlens'.*shape \({b + 1},\)"):
        verify(_spec_cache(), **{**args, "cu_seqlens": args["cu_seqlens"][1:]})
    with pytest.raises(ValueError, match=r"'num_drafts'.*Python int"):
        verify(_spec_cache(), **{**args, "num_drafts": None})


# cu_seqlens whose shapes pass but whose rows do not hold exactly T tokens each.
WRONG_CU_SEQLENS = {
    "a short row": ([0, T_, T_ + 1, NT], "row 1 with 1 tokens"),
    "a long row": ([0, T_ + 1, 2 * T_, NT], f"row 0 with {T_ + 1} tokens"),
    "nonzero start": ([1, T_ + 1, 2 * T_ + 1, NT + 1], "cu_seqlens[0] = 1"),
    "all zero": ([0, 0, 0, 0], "row 0 with 0 tokens"),
}


@pytest.mark.parametrize("case", list(WRONG_CU_SEQLENS), ids=list(WRONG_CU_SEQLENS))
def test_debug_varlen_verify_checks_cu_seqlens(monkeypatch, case):
    """REPLAYSSM_CUTE_DEBUG=1 reads cu_seqlens back (synchronises) and rejects rows without
    exactly num_drafts tokens; without it cu_seqlens is never read, so the same call (the
    CUDA-graph capturable path) goes through as the dense form."""
    bounds, got = WRONG_CU_SEQLENS[case]
    args = _packed_tokens(_spec_inputs(), MAMBA2_TOKENS, T_)
    args["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", "1")
    msg = _assert_verify_rejected("cu_seqlens", args, _spec_cache(), out=torch.full((NT, H, P), 7.0, dtype=ACT))
    assert got in msg and f"exactly num_drafts = {T_} tokens" in msg, msg
    monkeypatch.delenv("REPLAYSSM_CUTE_DEBUG")
    verify(_spec_cache(), **args)


def test_debug_varlen_verify_accepts_arange_cu_seqlens(monkeypatch):
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", "1")
    args = _spec_inputs()
    _dense_and_packed_agree(_spec_cache(), args, _packed_tokens(args, MAMBA2_TOKENS, T_), (H, P),
                            [1, 1, 1], T_, True)


def test_varlen_verify_takes_batch_zero():
    cache = _spec_cache()
    snap = _snapshot(cache)
    args = _packed_tokens(_spec_inputs(b=0, slots=[]), MAMBA2_TOKENS, T_)
    assert tuple(args["cu_seqlens"].shape) == (1,)
    y = verify(cache, **args)
    assert y.shape == (0, H, P)
    commit(cache, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert_cache_bits(cache, snap)
