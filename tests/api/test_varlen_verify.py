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


def _dense_and_packed_agree(dense_cache, dense_args, packed_args, out_shape, accepted, T, given_out, own=None):
    """verify + commit in the dense form on `dense_cache` and in the packed form on a copy of it:
    outputs (packed out is the dense out flattened, at the draft positions `own` where rows hold
    fewer than T) and every cache tensor bit-identical."""
    packed_cache = _clone_cache(dense_cache)
    bsz = dense_args["slot_ids"].shape[0]
    own = torch.arange(bsz * T) if own is None else own
    dense_out = torch.full((bsz, T) + out_shape, float("nan"), dtype=ACT)  # skipped rows stay NaN
    packed_out = torch.full((len(own),) + out_shape, float("nan"), dtype=ACT) if given_out else None
    assert verify(dense_cache, **dense_args, out=dense_out) is dense_out
    y = verify(packed_cache, **packed_args, out=packed_out)
    assert y is packed_out if given_out else y.shape == (len(own),) + out_shape
    assert torch.equal(_bits(y), _bits(dense_out.flatten(0, 1)[own]))
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
    # token tensors: b <= total_tokens <= b * num_drafts, all alike, tokens packed back to back
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
    ("v", lambda a: torch.cat([a["v"], a["v"][:1]])),
    ("q", lambda a: a["q"][:-1]),
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
    over = {n: torch.cat([args[n], args[n][:1]]) if n in MAMBA2_TOKENS else args[n] for n in args}
    with pytest.raises(ValueError, match=rf"'x'.*batch {b} to batch \* num_drafts = {NT} packed tokens"):
        verify(_spec_cache(), **over)
    with pytest.raises(ValueError, match=rf"'x'.*batch {b} \* num_drafts {T_} = {NT}"):
        verify(_spec_cache(), **{**args, "x": args["x"][:-1]})  # the others hold b * T: x is the one short
    short = {n: args[n][:-1] if n in MAMBA2_TOKENS else args[n] for n in args}  # uneven rows, but not the out
    with pytest.raises(ValueError, match=rf"'out'.*total_tokens = {NT - 1} as the other token tensors"):
        verify(_spec_cache(), **short, out=torch.zeros(NT, H, P, dtype=ACT))
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


# ------------------------------------------------------------------ rows of fewer drafts than T
# Engines with per-request draft lengths pack rows of 1..T tokens: total_tokens < b * T. verify
# gathers them into (b, T), each row's last token standing in for its missing drafts, runs the
# dense kernel and returns the rows' own outputs packed; commit accepts at most a row's count.


def _uneven(args, names, counts):
    """For dense args (b, T, ...) and row counts (1..T each): (the packed args of rows with those
    counts, the dense args the packed form must equal, each row's missing drafts its last token,
    and which dense draft positions the packed rows are). T (num_drafts) is the dense args'."""
    T = args[names[0]].shape[1]
    stand_in = torch.tensor([r * T + min(t, n - 1) for r, n in enumerate(counts) for t in range(T)])
    own = torch.tensor([r * T + t for r, n in enumerate(counts) for t in range(n)], dtype=torch.long)
    dense, packed = dict(args), dict(args)
    for name in names:
        if args.get(name) is not None:
            flat = args[name].flatten(0, 1)
            dense[name] = flat[stand_in].view(args[name].shape)
            packed[name] = flat[own]
    cu = torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)
    return {**packed, "cu_seqlens": cu, "num_drafts": T}, dense, own


def _uneven_agrees(dense_cache, args, names, counts, accepted, out_shape, given_out):
    """verify + commit of rows with `counts` drafts, packed, against the dense form with stand-in
    drafts (``_dense_and_packed_agree``); the dense outputs at the rows' own positions."""
    packed_args, dense_args, own = _uneven(args, names, counts)
    dense_out = _dense_and_packed_agree(dense_cache, dense_args, packed_args, out_shape, accepted,
                                        args[names[0]].shape[1], given_out, own)
    return dense_out.flatten(0, 1)[own]


@pytest.mark.parametrize("given_out", [True, False])
@pytest.mark.parametrize("counts,accepted", [([3, 1, 2], [3, 1, 1]), ([1, 2, 3], [1, 2, 2]), ([1, 1, 2], [1, 1, 2])])
def test_uneven_rows_equal_the_dense_form_with_stand_in_drafts_mamba2(counts, accepted, given_out):
    """Rows of 1..T tokens (slot 3 and 5 flush, slot 1 appends): each row's outputs and the cache,
    before and after commit, are those of the dense verify whose missing drafts repeat the row's
    last token (causal: a draft's output never sees a later one; commit never accepts them)."""
    args = _spec_inputs(T=max(counts))
    y = _uneven_agrees(_spec_cache(), args, MAMBA2_TOKENS, counts, accepted, (H, P), given_out)
    assert not bool(y.isnan().any())


def test_uneven_rows_equal_the_dense_form_with_stand_in_drafts_gdn():
    args = _gdn_spec_inputs(T=SPEC_DRAFT)
    y = _uneven_agrees(_gdn_cache(max_draft=SPEC_DRAFT), args, GDN_TOKENS, [2, SPEC_DRAFT, 1], [2, 1, 1],
                       (HV, V), True)
    assert not bool(y.isnan().any())


def test_uneven_rows_own_outputs_match_verifying_each_row_alone():
    """A row's outputs do not depend on the other rows' counts or on its stand-in drafts: the same
    as a dense verify of that row alone with T = its count (on a row that does not flush, where
    the fold decision, which depends on T, is the same)."""
    args = _spec_inputs(T=SPEC_DRAFT, b=1, slots=[1])  # slot 1: h = 1, h + 3 <= L appends
    packed, _, _ = _uneven(args, MAMBA2_TOKENS, [2])
    alone = {n: (v[:, :2] if n in MAMBA2_TOKENS and v is not None else v) for n, v in args.items()}
    c1, c2 = _spec_cache(), _spec_cache()
    y = verify(c1, **packed)
    assert torch.equal(_bits(y), _bits(verify(c2, **alone).flatten(0, 1)))


def test_uneven_rows_with_pad_slots_keep_the_callers_out_rows():
    """A skipped row (pad sentinel) keeps its tokens' rows of the caller's packed out."""
    args = _spec_inputs(T=SPEC_DRAFT, b=3, slots=[3, -1, 5])
    packed, _, _ = _uneven(args, MAMBA2_TOKENS, [2, 3, 1])
    out = torch.full((6, H, P), 7.0, dtype=ACT)
    verify(_spec_cache(), **packed, out=out)
    assert bool((out[2:5] == 7.0).all()) and not bool((out[:2] == 7.0).any()) and not bool((out[5] == 7.0).any())


def test_commit_refuses_accepting_more_than_a_rows_drafts():
    """On the CPU (and in debug mode on the GPU) commit refuses num_accepted past a row's count,
    naming the row; nothing moves, and a valid commit then goes through."""
    cache = _spec_cache()
    packed, _, _ = _uneven(_spec_inputs(T=SPEC_DRAFT), MAMBA2_TOKENS, [3, 1, 2])
    verify(cache, **packed)
    snap = _snapshot(cache)
    with pytest.raises(ValueError, match=r"'num_accepted'.*draft count.*row 1: 2 of 1"):
        commit(cache, packed["slot_ids"], torch.tensor([3, 2, 2], dtype=torch.int32))
    assert_cache_bits(cache, snap)
    commit(cache, packed["slot_ids"], torch.tensor([3, 1, 2], dtype=torch.int32))
    assert _pending(cache) is None


def test_uneven_rows_over_many_steps_of_random_acceptance():
    """30 verify + commit steps with random counts (1..T per row) and random acceptance within
    them: the packed form keeps the cache bit-identical to the dense form with stand-in drafts."""
    g = torch.Generator().manual_seed(5)
    dense_cache = _spec_cache()
    packed_cache = _clone_cache(dense_cache)
    for step in range(30):
        counts = torch.randint(1, SPEC_DRAFT + 1, (B_ROWS,), generator=g).tolist()
        acc = [int(torch.randint(1, n + 1, (1,), generator=g)) for n in counts]
        packed, dense, own = _uneven(_spec_inputs(T=max(counts), seed=100 + step), MAMBA2_TOKENS, counts)
        y_dense = verify(dense_cache, **dense).flatten(0, 1)[own]
        assert torch.equal(_bits(verify(packed_cache, **packed)), _bits(y_dense)), step
        for c, a in ((dense_cache, dense), (packed_cache, packed)):
            commit(c, a["slot_ids"], torch.tensor(acc, dtype=torch.int32))
        assert_same_cache(packed_cache, dense_cache)


UNEVEN_CU_SEQLENS = {  # 5 packed tokens over 3 rows, T = 3
    "an empty row": ([0, 0, 3, 5], "row 0 with 0 tokens"),
    "a row over T": ([0, 4, 4, 5], "row 0 with 4 tokens"),
    "short of the tokens": ([0, 1, 2, 4], "cu_seqlens[-1] = 4"),
}


@pytest.mark.parametrize("case", list(UNEVEN_CU_SEQLENS), ids=list(UNEVEN_CU_SEQLENS))
def test_debug_uneven_verify_checks_cu_seqlens(monkeypatch, case):
    bounds, got = UNEVEN_CU_SEQLENS[case]
    packed, _, _ = _uneven(_spec_inputs(T=SPEC_DRAFT), MAMBA2_TOKENS, [2, 2, 1])
    packed["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", "1")
    msg = _assert_verify_rejected("cu_seqlens", packed, _spec_cache(), out=torch.full((5, H, P), 7.0, dtype=ACT))
    assert got in msg and "rows of 1..num_drafts = 3 tokens" in msg, msg


def test_plan_verify_checks_draft_counts():
    cache = _spec_cache()
    ids = torch.tensor(SLOT_IDS, dtype=torch.int32)
    for bad in (torch.ones(B_ROWS, dtype=torch.int64), torch.ones(B_ROWS + 1, dtype=torch.int32), [1, 1, 1]):
        with pytest.raises(ValueError, match="argument 'draft_counts'"):
            cache.table.plan_verify(ids, SPEC_T, draft_counts=bad)
        assert cache.table.pending is None
    # bad slot ids are named as such, not as a draft_counts mismatch
    with pytest.raises(ValueError, match="argument 'slot_ids'"):
        cache.table.plan_verify(ids.tolist(), SPEC_T, draft_counts=torch.ones(B_ROWS, dtype=torch.int32))
    assert cache.table.pending is None
