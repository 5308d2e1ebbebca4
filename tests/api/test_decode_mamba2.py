"""Argument checking of `replayssm_cute.decode` on Mamba-2 caches (CPU cache, so the reference does
the math).

Every bad argument is rejected with an error naming it, before anything is written; the accepted
spellings of the vLLM conventions (stride-0 expansions, batch-strided row views) give exactly the
results of their plain forms. Also: debug-mode slot checks, out-of-pool / pad rows, batch 0.
"""

import pytest
import torch

import replayssm_cute
from replayssm_cute import Mamba2Cache, decode

from tests.helpers.api_cases import (ACT, B_ROWS, CACHE_TENSORS, G, H, N, P, SLOT_IDS, SLOTS,
                                     assert_cache_bits, assert_same_cache)
from tests.helpers.api_cases import bits as _bits
from tests.helpers.api_cases import clone_cache as _clone_cache
from tests.helpers.api_cases import mamba2_cache as _cache
from tests.helpers.api_cases import noncontig as _noncontig
from tests.helpers.api_cases import snapshot as _snapshot
from tests.helpers.inputs import gen as _gen


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
