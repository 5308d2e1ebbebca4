"""Argument checking of `replayssm_cute.decode` on Gated DeltaNet caches (CPU cache, so the reference
does the math), including vLLM's packed mixed_qkv.

Every bad argument is rejected with an error naming it, before anything is written; mixed_qkv and
batch-strided views give exactly the results of separate q, k, v; the CPU path is the cache-level
reference bit for bit. Also: debug-mode slot checks, batch 0, and decode over several windows
against the float64 conventional recurrence.
"""

import pytest
import torch

from replayssm_cute import GDNCache, decode
from replayssm_cute import reference as R

from tests.helpers.api_cases import (ACT, B_ROWS, HV, K, KH, SLOT_IDS, SLOTS, V, assert_cache_bits,
                                     assert_same_cache)
from tests.helpers.api_cases import bits as _bits
from tests.helpers.api_cases import clone_cache as _clone_cache
from tests.helpers.api_cases import gdn_cache as _gdn_cache
from tests.helpers.api_cases import gdn_inputs as _gdn_inputs
from tests.helpers.api_cases import meta as _meta
from tests.helpers.api_cases import noncontig as _noncontig
from tests.helpers.api_cases import snapshot as _snapshot
from tests.helpers.api_cases import tensor_names as _tensor_names
from tests.helpers.inputs import gen as _gen64
from tests.helpers.inputs import randn as _randn64
from tests.helpers.inputs import uniform as _uniform64
from tests.helpers.numerics import rel_err

QKV_WIDTH = 2 * KH * K + HV * V  # vLLM's packed [q | k | v] row


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
            e = rel_err(out[row], o_ref)
            assert e < tol, f"step {step} slot {s}: output off by {e:.2e}"
            if h_before[s] + 1 == window:
                flushes += 1
                assert int(cache.cursor[s]) == 0
        mat = cache.materialize(live)
        for i, s in enumerate(live):
            e = rel_err(mat[i:i + 1], ref[s])
            assert e < tol, f"step {step} slot {s}: materialized state off by {e:.2e}"
        for n, t in _snapshot_tensors(cache).items():
            assert torch.equal(t[idle], idle_before[n]), f"step {step}: {n} of a slot not in the batch was written"
    assert flushes >= 5 * len(slots)
