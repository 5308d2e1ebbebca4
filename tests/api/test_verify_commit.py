"""Argument checking of speculative `verify` and `commit` on Mamba-2 caches (CPU cache, so the
float64 reference, replayssm_cute.reference, does the math).

`verify(cache, ...)` takes decode's Mamba-2 arguments with a draft axis, tokens (b, T, ...), on a
cache with draft room (max_draft >= T, T <= window); `commit(cache, slot_ids, num_accepted)` applies
the last verify. Every bad argument of either is rejected with an error naming it, before anything is
written (a rejected commit keeps the verify pending); the debug-mode checks of num_accepted and slot
ids; vLLM's spellings give exactly the reference's results; a long run of verify + commit with
decodes interleaved against the float64 recurrence.
"""

import pytest
import torch

import replayssm_cute
from replayssm_cute import Mamba2Cache, commit, decode, verify
from replayssm_cute import reference as R

from tests.helpers.api_cases import (ACT, B_ROWS, CACHE_TENSORS, G, H, L, N, P, SLOT_IDS, SLOTS,
                                     SPEC_DRAFT, SPEC_T, assert_cache_bits, assert_same_cache)
from tests.helpers.api_cases import assert_verify_rejected as _assert_verify_rejected
from tests.helpers.api_cases import bits as _bits
from tests.helpers.api_cases import clone_cache as _clone_cache
from tests.helpers.api_cases import mamba2_cache as _cache
from tests.helpers.api_cases import meta as _meta_like
from tests.helpers.api_cases import noncontig as _noncontig
from tests.helpers.api_cases import pending as _pending
from tests.helpers.api_cases import snapshot as _snapshot
from tests.helpers.api_cases import spec_cache as _spec_cache
from tests.helpers.api_cases import spec_inputs as _spec_inputs
from tests.helpers.inputs import gen as _gen64
from tests.helpers.inputs import randn as _randn64
from tests.helpers.inputs import uniform as _uniform64
from tests.helpers.numerics import rel_err

b = B_ROWS
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
    R.commit_cache_(ref, args["slot_ids"], accepted, num_drafts=SPEC_T)
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
    for s, a in ((1, 2), (5, 1)):  # a folding row (h + T > window) keeps only its accepted drafts
        h = int(before[s])
        assert int(cache.cursor[s]) == (a if h + SPEC_T > cache.window else h + a)


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
    """verify + commit through the API and the reference's cache functions called directly on
    identical caches: outputs and every cache tensor bit-identical. Returns (api cache, out)."""
    c1 = _spec_cache(**cache_kw)
    c2 = _clone_cache(c1)
    c0 = _clone_cache(c1)
    nrows = ref_args["slot_ids"].shape[0]
    o1 = torch.full((nrows, T, H, P), float("nan"), dtype=c1.dtype)  # skipped rows stay NaN
    o2 = o1.clone()
    assert verify(c1, **api_args, out=o1) is o1
    R.mamba2_verify_cache_(c2, **ref_args, out=o2)
    assert torch.equal(_bits(o1), _bits(o2))
    assert_same_cache(c1, c2)
    acc = torch.tensor(accepted, dtype=torch.int32)
    assert commit(c1, api_args["slot_ids"], acc) is None
    R.commit_cache_(c2, ref_args["slot_ids"], acc, num_drafts=T)
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
    stream (reference.mamba2_snapshot_verify / reference.mamba2_conventional_step): every
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
                e = rel_err(out[row], y)
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
                y, snaps[s] = R.mamba2_snapshot_verify(
                    ref[s], tok["x"][row], tok["dt"][row], A, tok["B"][row], tok["C"][row], D=D,
                    z=tok["z"][row], dt_bias=dt_bias, dt_softplus=True)
                e = rel_err(out[row], y)
                assert e < tol, f"step {step} slot {s}: verify outputs off by {e:.2e}"
            assert commit(cache, sid, torch.tensor(acc, dtype=torch.int32)) is None
            for s, r in rows.items():
                ref[s] = snaps[s][:, acc[r] - 1]
                flushed = R.spec_flush(h_before[s], T, window)
                seen["flush"] += flushed
                expect_h = (0 if flushed else h_before[s]) + acc[r]
                assert int(cache.cursor[s]) == expect_h, f"step {step} slot {s}: cursor after commit"
        for r, s in enumerate(ids):
            if s not in rows:
                assert bool((out[r] == 7.0).all()), f"step {step}: skipped row {r} (slot {s}) was written"
        assert all(0 <= int(cache.cursor[s]) <= window for s in slots), "at most L committed records"
        mat = cache.materialize(slots, A.float())
        for i, s in enumerate(slots):
            e = rel_err(mat[i:i + 1], ref[s])
            assert e < tol, f"step {step} slot {s}: materialized state off by {e:.2e}"
        for n, before in idle_before.items():
            assert torch.equal(getattr(cache, n)[idle], before), f"step {step}: {n} of an idle slot was written"
    assert seen["decode_at_full"] >= 2 and seen["verify_at_full"] >= 2, seen
    assert seen["flush"] >= 10 and seen["decode"] >= 8 and seen["verify"] >= 20, seen
