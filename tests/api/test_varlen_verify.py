"""Packed (varlen) `verify` against the dense form, and its argument checking (CPU caches).

`verify(..., cu_seqlens=, num_drafts=T)` takes the engines' packed layout, tokens (b * T, ...) with
row i at cu_seqlens[i]:cu_seqlens[i + 1] = i * T:(i + 1) * T, and returns out packed. It is the dense
form on zero-copy (b, T, ...) views, so it must give the dense form's results exactly, for both
layer types; every bad argument is rejected before any write, and the debug mode reads cu_seqlens
back to check it.
"""

import pytest
import torch

from replayssm_cute import commit, verify

from tests.helpers.api_cases import (ACT, B_ROWS, G, GDN_TOKENS, H, HV, N, P, SLOT_IDS, SLOTS, SPEC_DRAFT,
                                     SPEC_T, V, assert_cache_bits, assert_same_cache)
from tests.helpers.api_cases import assert_verify_rejected as _assert_verify_rejected
from tests.helpers.api_cases import bits as _bits
from tests.helpers.api_cases import clone_cache as _clone_cache
from tests.helpers.api_cases import gdn_cache as _gdn_cache
from tests.helpers.api_cases import gdn_spec_inputs as _gdn_spec_inputs
from tests.helpers.api_cases import meta as _meta_like
from tests.helpers.api_cases import noncontig as _noncontig
from tests.helpers.api_cases import pending as _pending
from tests.helpers.api_cases import snapshot as _snapshot
from tests.helpers.api_cases import spec_cache as _spec_cache
from tests.helpers.api_cases import spec_inputs as _spec_inputs

b = B_ROWS
T_ = SPEC_T


def _packed_tokens(args, names, T):
    """args with the token tensors `names` packed (b * T, ...) and the varlen keywords added."""
    bsz = args["slot_ids"].shape[0]
    packed = {n: args[n].flatten(0, 1) for n in names if args.get(n) is not None}
    return {**args, **packed, "cu_seqlens": torch.arange(bsz + 1, dtype=torch.int32) * T, "num_drafts": T}


MAMBA2_TOKENS = ("x", "dt", "B", "C", "z")


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
