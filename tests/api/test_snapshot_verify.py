"""Argument checking of `snapshot_verify`, the snapshot baseline of speculative verification (CPU
caches, so the float64 reference, replayssm_cute.reference, does the math).

`snapshot_verify(cache, ...)` on a conventional cache (window 1) of either layer type: verify's
arguments with `snapshots` ((b, T) + the state's shape, fp32, contiguous) after slot_ids. It never
writes the cache; on the CPU it runs the reference's *_snapshot_verify_cache_: outputs and
snapshots bit-identical to the reference's, batch 0, every bad argument rejected before any write.
"""

import pytest
import torch

import replayssm_cute
from replayssm_cute import GDNCache, Mamba2Cache, snapshot_verify
from replayssm_cute import reference as R

from tests.helpers.api_cases import ACT, G, H, HV, K, KH, N, P, SLOTS, V, assert_cache_bits, assert_same_cache
from tests.helpers.api_cases import bits as _bits
from tests.helpers.api_cases import clone_cache as _clone_cache
from tests.helpers.api_cases import gdn_spec_inputs as _gdn_spec_inputs
from tests.helpers.api_cases import meta as _meta
from tests.helpers.api_cases import snapshot as _snapshot
from tests.helpers.api_cases import spec_inputs as _spec_inputs
from tests.helpers.inputs import gen as _gen

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
    """The reference's cache-level snapshot baseline on `cache` with snapshot_verify's `args`."""
    if kind == "gdn":
        return R.gdn_snapshot_verify_cache_(cache, **args)
    return R.mamba2_snapshot_verify_cache_(cache, **args)


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
