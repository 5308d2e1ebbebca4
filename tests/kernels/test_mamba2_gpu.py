"""Mamba-2 kernels on the GPU against the float64 plain recurrence (marked gpu).

Every case runs several full windows with rows at different ring positions (staggered by
pad-only warm-up steps), pad rows (the sentinel and out-of-range ids), random inputs with
realistic decays, and checks: outputs of every step, the checkpoint after every flush, the
checkpoint bit-identical over non-flush steps, untouched slots and pad outputs bit-identical.
"""

import pytest
import torch

import replayssm_cute as rs
from replayssm_cute import reference

from tests.helpers.cache_checks import check_aligned_flush
from tests.helpers.numerics import rel_err

pytestmark = pytest.mark.gpu
# The batch-256 cases hold about 10 GB each (float64 reference states): one worker runs them in
# turn (pytest -n with --dist loadgroup), so eight workers fit the GPU.
BATCH_256 = pytest.mark.xdist_group("mamba2_batch_256")

SHAPES = {
    "nano4b": (96, 80, 128, 8),
    "super": (128, 64, 128, 8),
    "odd": (12, 48, 64, 3),
    "tiny": (4, 16, 32, 1),
}


def _params(H, P, N, device, gen):
    A = -(1.0 + torch.rand(H, generator=gen, device=device))
    dt_bias = -4.0 + torch.rand(H, generator=gen, device=device)
    D = torch.randn(H, generator=gen, device=device)
    return A.float(), dt_bias.float(), D.float()


def _inputs(b, H, P, N, G, dtype, device, gen, with_z):
    x = torch.randn(b, H, P, generator=gen, device=device).to(dtype)
    dt = (torch.randn(b, H, generator=gen, device=device) * 0.5).to(dtype)
    B = torch.randn(b, G, N, generator=gen, device=device).to(dtype)
    C = torch.randn(b, G, N, generator=gen, device=device).to(dtype)
    z = torch.randn(b, H, P, generator=gen, device=device).to(dtype) if with_z else None
    return x, dt, B, C, z


def _run_case(shape, batch, dtype, window, with_z=False, windows=3, pad_slot_id=-1, seed=0, poison_ring=False,
              config=None, aligned=False):
    H, P, N, G = SHAPES[shape]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    extra = 3  # slots nobody decodes: must stay bit-identical
    first = 1 if pad_slot_id == 0 else 0
    num_slots = first + batch + extra
    cache = rs.Mamba2Cache(num_slots, H, P, N, G, window=window, dtype=dtype, device=dev,
                           pad_slot_id=pad_slot_id)
    slots = (torch.randperm(batch + extra, generator=gen, device=dev)[:batch] + first).to(torch.int32)
    init = torch.randn(batch, H, P, N, generator=gen, device=dev) * 0.1
    cache.load_prefill(slots, init)
    if poison_ring:
        # The slots' previous sequence left NaN records behind: positions not yet rewritten must
        # never reach an output or a fold (a zero weight times NaN is still NaN).
        for t in (cache.ring_x, cache.ring_B, cache.ring_dt):
            t[slots.long()] = float("nan")
    ref_state = init.double().clone()
    A, dt_bias, D = _params(H, P, N, dev, gen)
    idle = sorted(set(range(first, num_slots)) - set(slots.tolist()))
    idle_before = [t[idle].clone() for t in _cache_tensors(cache)]

    pad_rows = torch.zeros(batch, dtype=torch.bool, device=dev)
    pad_rows[torch.randperm(batch, generator=gen, device=dev)[: max(1, batch // 8)] ] = True
    if batch == 1:
        pad_rows[:] = False
    oob_row = batch // 2 if batch > 2 else None
    tol = 2e-5 if dtype == torch.float32 else 1e-2

    # Stagger: row r is live in the first r % window warm-up steps only; aligned rows flush together.
    warm = 0 if aligned else window - 1
    total = warm + windows * window + 1
    for step in range(total):
        live = ~pad_rows.clone()
        if step < warm:
            live &= (torch.arange(batch, device=dev) % window) > step
        step_slots = torch.where(live, slots, torch.full_like(slots, pad_slot_id))
        if oob_row is not None and step % 3 == 0 and step >= warm:
            step_slots[oob_row] = num_slots + 7  # out of the pool: must act as a pad row
            live[oob_row] = False
        x, dt, B, C, z = _inputs(batch, H, P, N, G, dtype, dev, gen, with_z)
        out = torch.full((batch, H, P), 777.0, dtype=dtype, device=dev)
        h_before = cache.cursor[slots.long()].clone() if window > 1 else torch.zeros_like(slots)
        ck_before = cache.checkpoint[slots.long()].clone()
        rs.decode(cache, x, dt, A, B, C, step_slots, D=D, z=z, dt_bias=dt_bias, dt_softplus=True,
                  out=out, config=config)
        y_ref, new_state = reference.mamba2_conventional_step(
            ref_state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)
        live_idx = live.nonzero().flatten()
        ref_state[live_idx] = new_state[live_idx]
        assert rel_err(out[live_idx], y_ref[live_idx], allow_zero=True) < tol, f"step {step} outputs"
        assert torch.all(out[~live] == 777.0), "pad rows' outputs must be untouched"
        flushed = live & (h_before + 1 == window)
        still = live & ~flushed
        if aligned:
            check_aligned_flush(step, window, live, flushed, oob_row)
        ck = cache.checkpoint[slots.long()]
        if flushed.any():
            assert rel_err(ck[flushed], ref_state[flushed], allow_zero=True) < 2e-5, \
                f"step {step} checkpoint after flush"
        assert torch.equal(ck[still], ck_before[still]), "non-flush steps must not write the checkpoint"
        assert torch.equal(ck[~live], ck_before[~live]), "pad rows must not write the checkpoint"
        if window > 1:
            h_now = cache.cursor[slots.long()]
            assert torch.equal(h_now[live], torch.where(flushed, 0, h_before + 1)[live].int())
            assert torch.equal(h_now[~live], h_before[~live])
    state = cache.materialize(slots, A)
    assert rel_err(state, ref_state, allow_zero=True) < 2e-5
    for before, t in zip(idle_before, _cache_tensors(cache)):
        assert torch.equal(t[idle], before), "untouched slots must stay bit-identical"


def _cache_tensors(cache):
    ts = [cache.checkpoint]
    if cache.window > 1:
        ts += [cache.ring_x, cache.ring_B, cache.ring_dt, cache.cursor, cache.origin]
    return ts


@pytest.mark.parametrize("shape", ["nano4b", "super", "odd", "tiny"])
@pytest.mark.parametrize("window", [1, 16])
@pytest.mark.parametrize("batch", [1, 37, pytest.param(256, marks=BATCH_256)])
def test_decode_bf16(shape, window, batch, decode_kernel):
    _run_case(shape, batch, torch.bfloat16, window, seed=batch + window)


@pytest.mark.parametrize("shape", ["super", "odd"])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_decode_fp32_with_z(shape, window, decode_kernel):
    _run_case(shape, 64, torch.float32, window, with_z=True, seed=window)


@pytest.mark.parametrize("shape", ["super", "odd"])
@pytest.mark.parametrize("window", [5, 16])
def test_stale_ring_records_never_reach_outputs_or_folds(shape, window, decode_kernel):
    _run_case(shape, 37, torch.bfloat16, window, seed=window, poison_ring=True)


@pytest.mark.parametrize("mma_fold, groups", [(True, 1), (False, 1), (False, 2)])
@pytest.mark.parametrize("window", [1, 16])
def test_pipelined_small_grid(mma_fold, groups, window):
    """The pipelined decode on an 8-CTA grid of 3 stages, or 2 a consumer group (every CTA reuses its stages many times),
    folding on tensor cores and on CUDA cores, with two consumer groups of 32-row warps taking
    turns at the items, poisoned rings included."""
    from replayssm_cute.kernels.mamba2.pipelined import Mamba2PipeConfig

    config = Mamba2PipeConfig(stages=3 if groups == 1 else 4, ctas=8, mma_fold=mma_fold, consumer_groups=groups,
                              rows_per_warp=16 if groups == 1 else 32)
    _run_case("odd", 37, torch.bfloat16, window, seed=window, poison_ring=window > 1, config=config)
    _run_case("super", 9, torch.float32, window, with_z=True, seed=window + 1, config=config)


@pytest.mark.parametrize("heads, groups, rows, mma_fold", [(2, 1, 16, True), (4, 2, 32, False)])
@pytest.mark.parametrize("window", [1, 16])
def test_pipelined_items_of_several_heads(heads, groups, rows, mma_fold, window):
    """The pipelined decode with items of 2 or 4 heads of a group (one TMA box of their tiles, the
    group's B . C computed once for them) on an 8-CTA grid of 2 stages: heads at every place in an
    item, poisoned rings, the fold on tensor and on CUDA cores, one and two consumer groups."""
    from replayssm_cute.kernels.mamba2.pipelined import Mamba2PipeConfig

    config = Mamba2PipeConfig(stages=2, ctas=8, mma_fold=mma_fold, consumer_groups=groups, rows_per_warp=rows,
                              heads_per_item=heads)
    _run_case("odd", 37, torch.bfloat16, window, seed=window + heads, poison_ring=window > 1, config=config)
    two = Mamba2PipeConfig(stages=2, ctas=8, mma_fold=mma_fold, consumer_groups=groups, rows_per_warp=rows,
                           heads_per_item=2)  # four 64-row fp32 tiles a stage would not fit twice
    _run_case("super", 9, torch.float32, window, with_z=True, seed=window + 1, config=two)


@pytest.mark.xdist_group("gpu_memory")
@pytest.mark.parametrize("batch", [3, 511])
def test_tails_with_every_row_flushing_at_once(batch, decode_kernel):
    """Tails of the persistent grid's walk (batch 3: fewer items than CTAs; 511: a last lap partly
    empty) with every row at the same ring position, so each window's last step folds every live
    row at once (the heaviest step, no non-flush item to hide behind)."""
    _run_case("nano4b", batch, torch.bfloat16, 16, windows=2, seed=batch, aligned=True)


@pytest.mark.xdist_group("gpu_memory")
def test_decode_batch_512_pad_zero(decode_kernel):
    _run_case("super", 512, torch.bfloat16, 16, pad_slot_id=0, windows=3)


@pytest.mark.parametrize("window", [1, 8])
def test_cuda_graph_capture_replay(window, decode_kernel):
    """Capture several steps in one graph, replay it over several windows with mixed flush rows."""
    H, P, N, G = SHAPES["odd"]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    batch, steps_per_graph = 24, 3
    cache = rs.Mamba2Cache(batch + 2, H, P, N, G, window=window, dtype=torch.bfloat16, device=dev)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    init = torch.randn(batch, H, P, N, generator=gen, device=dev) * 0.1
    cache.load_prefill(slots, init)
    ref_state = init.double().clone()
    A, dt_bias, D = _params(H, P, N, dev, gen)
    # Stagger rows before capture.
    for step in range(window - 1):
        live = (torch.arange(batch, device=dev) % window) > step
        x, dt, B, C, _ = _inputs(batch, H, P, N, G, torch.bfloat16, dev, gen, False)
        rs.decode(cache, x, dt, A, B, C, torch.where(live, slots, -1), D=D, dt_bias=dt_bias,
                  dt_softplus=True)
        _, new_state = reference.mamba2_conventional_step(ref_state, x, dt, A, B, C, D=D,
                                                          dt_bias=dt_bias, dt_softplus=True)
        ref_state[live] = new_state[live]
    static_in = [_inputs(batch, H, P, N, G, torch.bfloat16, dev, gen, False)[:4] for _ in range(steps_per_graph)]
    static_out = [torch.empty(batch, H, P, dtype=torch.bfloat16, device=dev) for _ in range(steps_per_graph)]
    # Compile outside capture, then warm up on a side stream as torch requires.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x, dt, B, C = static_in[0]
        rs.decode(cache, x, dt, A, B, C, torch.full_like(slots, -1), D=D, dt_bias=dt_bias,
                  dt_softplus=True, out=static_out[0])
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(steps_per_graph):
            x, dt, B, C = static_in[i]
            rs.decode(cache, x, dt, A, B, C, slots, D=D, dt_bias=dt_bias, dt_softplus=True,
                      out=static_out[i])
    for replay in range(3 * window // steps_per_graph + 2):
        for i in range(steps_per_graph):
            fresh = _inputs(batch, H, P, N, G, torch.bfloat16, dev, gen, False)[:4]
            for dst, src in zip(static_in[i], fresh):
                dst.copy_(src)
        graph.replay()
        for i in range(steps_per_graph):
            x, dt, B, C = static_in[i]
            y_ref, ref_state = reference.mamba2_conventional_step(ref_state, x, dt, A, B, C, D=D,
                                                                  dt_bias=dt_bias, dt_softplus=True)
            assert rel_err(static_out[i], y_ref, allow_zero=True) < 1e-2, f"replay {replay} step {i}"
    assert rel_err(cache.materialize(slots, A), ref_state, allow_zero=True) < 2e-5
