"""Gated DeltaNet kernels on the GPU against float64 references (marked gpu).

Every case runs several full windows with rows at different ring positions (staggered by pad-only
warm-up steps), pad rows (the sentinel and out-of-range ids) and random inputs with realistic
decays, and checks at every step:
- outputs against the plain float64 recurrence (``reference.gdn_conventional_step``);
- the record each non-flush row appends (normalised k, g, u) against that recurrence;
- the checkpoint of every flushing row against the float64 fold of the records the kernel stored
  plus the current token (the cache-level algorithm; tight), and against the recurrence (loose:
  stored keys are rounded to the activation dtype);
- checkpoints bit-identical over non-flush steps and pad rows; cursors; arrival counters back to 0;
- pad outputs and untouched slots bit-identical.
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
BATCH_256 = pytest.mark.xdist_group("gdn_batch_256")

SHAPES = {  # (H key heads, HV value heads, K, V)
    "qwen3.5-4b": (16, 32, 128, 128),
    "qwen3.5-122b": (16, 64, 128, 128),
    "odd": (2, 6, 64, 64),
    "narrow": (1, 3, 48, 32),  # K = 48: lanes partly idle
}


def _params(HV, device, gen):
    A_log = torch.log(1.0 + 15.0 * torch.rand(HV, generator=gen, device=device))
    dt_bias = -4.0 + torch.rand(HV, generator=gen, device=device)
    return A_log.float(), dt_bias.float()


def _inputs(bsz, H, HV, K, V, dtype, device, gen):
    q = torch.randn(bsz, H, K, generator=gen, device=device).to(dtype)
    k = torch.randn(bsz, H, K, generator=gen, device=device).to(dtype)
    v = torch.randn(bsz, HV, V, generator=gen, device=device).to(dtype)
    a = torch.randn(bsz, HV, generator=gen, device=device).to(dtype)
    b = torch.randn(bsz, HV, generator=gen, device=device).to(dtype)
    return q, k, v, a, b


def _stored_records(cache, slots, h):
    """(u, k, g) float64 of records 0..h-1 of each slot, as stored, oldest first."""
    idx = (cache.origin[slots.long()].long()[:, None] + torch.arange(h, device=slots.device)) % cache.capacity
    rows = slots.long()[:, None]
    return cache.ring_u[rows, idx].double(), cache.ring_k[rows, idx].double(), cache.ring_g[rows, idx].double()


def _flush_expected(ckpt, rec_u, rec_k, rec_g, q, k, v, a, b, A_log, dt_bias, scale):
    """Float64 checkpoint after a flush: fold the stored records, then this token (exact)."""
    S_h = reference.gdn_replay(ckpt, rec_u, rec_k, rec_g)
    return reference.gdn_conventional_step(S_h, q, k, v, a, b, A_log, dt_bias, scale)[1]


def _cache_tensors(cache):
    ts = [cache.checkpoint]
    if cache.window > 1:
        ts += [cache.ring_u, cache.ring_k, cache.ring_g, cache.cursor, cache.origin]
    return ts


def _run_case(shape, batch, dtype, window, windows=3, pad_slot_id=-1, seed=0, scale=None, config=None,
              poison_ring=False, aligned=False):
    H, HV, K, V = SHAPES[shape]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    extra = 3  # slots nobody decodes: must stay bit-identical
    first = 1 if pad_slot_id == 0 else 0
    num_slots = first + batch + extra
    cache = rs.GDNCache(num_slots, HV, V, K, H, window=window, dtype=dtype, device=dev,
                        pad_slot_id=pad_slot_id)
    slots = (torch.randperm(batch + extra, generator=gen, device=dev)[:batch] + first).to(torch.int32)
    init = torch.randn(batch, HV, V, K, generator=gen, device=dev) * 0.1
    cache.load_prefill(slots, init)
    if poison_ring:
        # The slots' previous sequence left NaN records behind: positions not yet rewritten must
        # never reach an output or a fold (a zero weight times NaN is still NaN).
        for t in (cache.ring_u, cache.ring_k, cache.ring_g):
            t[slots.long()] = float("nan")
    ref_state = init.double().clone()
    A_log, dt_bias = _params(HV, dev, gen)
    idle = sorted(set(range(first, num_slots)) - set(slots.tolist()))
    idle_before = [t[idle].clone() for t in _cache_tensors(cache)]

    pad_rows = torch.zeros(batch, dtype=torch.bool, device=dev)
    pad_rows[torch.randperm(batch, generator=gen, device=dev)[: max(1, batch // 8)]] = True
    if batch == 1:
        pad_rows[:] = False
    oob_row = batch // 2 if batch > 2 else None
    out_tol = 3e-3 if dtype == torch.float32 else 1.5e-2
    state_tol = 3e-3 if dtype == torch.float32 else 2e-2  # stored keys are rounded to dtype

    # Stagger: row r is live in the first r % window warm-up steps only; aligned rows flush together.
    warm = 0 if aligned else window - 1
    for step in range(warm + windows * window + 1):
        live = ~pad_rows.clone()
        if step < warm:
            live &= (torch.arange(batch, device=dev) % window) > step
        step_slots = torch.where(live, slots, torch.full_like(slots, pad_slot_id))
        if oob_row is not None and step % 3 == 0 and step >= warm:
            step_slots[oob_row] = num_slots + 7  # out of the pool: must act as a pad row
            live[oob_row] = False
        q, k, v, a, b = _inputs(batch, H, HV, K, V, dtype, dev, gen)
        out = torch.full((batch, HV, V), 777.0, dtype=dtype, device=dev)
        h_before = cache.cursor[slots.long()].clone() if window > 1 else torch.zeros_like(slots)
        ck_before = cache.checkpoint[slots.long()].clone()
        flushed = live & (h_before + 1 == window)
        still = live & ~flushed
        if aligned:
            check_aligned_flush(step, window, live, flushed, oob_row)
        fl = flushed.nonzero().flatten()
        if window > 1 and fl.numel():
            rec = _stored_records(cache, slots[fl], window - 1)
        rs.decode(cache, q, k, v, a, b, A_log, dt_bias, step_slots, scale=scale, out=out, config=config)

        o_ref, new_state = reference.gdn_conventional_step(ref_state, q, k, v, a, b, A_log, dt_bias, scale)
        live_idx = live.nonzero().flatten()
        prev_state = ref_state.clone()
        ref_state[live_idx] = new_state[live_idx]
        assert rel_err(out[live_idx], o_ref[live_idx], allow_zero=True) < out_tol, f"step {step} outputs"
        assert torch.all(out[~live] == 777.0), "pad rows' outputs must be untouched"

        ck = cache.checkpoint[slots.long()]
        if fl.numel():
            if window > 1:
                expect = _flush_expected(ck_before[fl], *rec, q[fl], k[fl], v[fl], a[fl], b[fl],
                                         A_log, dt_bias, scale)
                assert rel_err(ck[fl], expect, allow_zero=True) < 2e-5, \
                    f"step {step} checkpoint vs fold of stored records"
                assert rel_err(ck[fl], ref_state[fl], allow_zero=True) < state_tol, \
                    f"step {step} checkpoint vs recurrence"
            else:
                assert rel_err(ck[fl], ref_state[fl], allow_zero=True) < 2e-5, f"step {step} conventional state"
        assert torch.equal(ck[still], ck_before[still]), "non-flush steps must not write the checkpoint"
        assert torch.equal(ck[~live], ck_before[~live]), "pad rows must not write the checkpoint"
        if window > 1:
            h_now = cache.cursor[slots.long()]
            assert torch.equal(h_now[live], torch.where(flushed, 0, h_before + 1)[live].int())
            assert torch.equal(h_now[~live], h_before[~live])
            st = still.nonzero().flatten()
            if st.numel():
                # The record each non-flush row appended, against the recurrence.
                s_st = slots[st].long()
                pos = (cache.origin[s_st].long() + h_before[st].long()) % cache.capacity
                qn, kn = reference.gdn_normalize(q[st], k[st], scale)
                g, beta = reference.gdn_gates(a[st], b[st], A_log, dt_bias)
                k_v = kn.repeat_interleave(HV // H, dim=1)
                Sk = (prev_state[st] * k_v[:, :, None, :]).sum(-1)
                u_ref = beta[..., None] * (v[st].double() - torch.exp(g)[..., None] * Sk)
                assert rel_err(cache.ring_k[s_st, pos], kn, allow_zero=True) < 5e-3, f"step {step} stored k"
                assert rel_err(cache.ring_g[s_st, pos], g, allow_zero=True) < 1e-5, f"step {step} stored g"
                assert rel_err(cache.ring_u[s_st, pos], u_ref, allow_zero=True) < out_tol, f"step {step} stored u"
    assert rel_err(cache.materialize(slots), ref_state, allow_zero=True) < state_tol
    for before, t in zip(idle_before, _cache_tensors(cache)):
        assert torch.equal(t[idle], before), "untouched slots must stay bit-identical"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("window", [1, 16])
@pytest.mark.parametrize("batch", [1, 37, pytest.param(256, marks=BATCH_256)])
def test_decode_bf16(shape, window, batch, decode_kernel):
    _run_case(shape, batch, torch.bfloat16, window, seed=batch + window)


@pytest.mark.parametrize("shape", ["qwen3.5-4b", "odd"])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_decode_fp32_scaled(shape, window, decode_kernel):
    _run_case(shape, 64, torch.float32, window, seed=window, scale=0.05)


@pytest.mark.parametrize("shape", ["qwen3.5-122b", "odd"])
@pytest.mark.parametrize("window", [5, 16])
def test_stale_ring_records_never_reach_outputs_or_folds(shape, window, decode_kernel):
    _run_case(shape, 37, torch.bfloat16, window, seed=window, poison_ring=True)


@pytest.mark.parametrize("rows_per_warp, groups", [(16, 1), (8, 1), (16, 2)])
@pytest.mark.parametrize("window", [1, 16])
def test_pipelined_small_grid(window, rows_per_warp, groups):
    """The pipelined decode on an 8-CTA grid of 3 or 4 stages (every CTA reuses its stages many
    times), whole heads and half heads, 16 or 8 rows per consumer warp (the ring dots split over 4
    or 8 warps, and over 1 or 2 of the narrow head's), one or two consumer groups (each its own
    stages and named barrier), poisoned rings included."""
    from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig

    stages = 3 if groups == 1 else 4
    _run_case("odd", 37, torch.bfloat16, window, seed=window, poison_ring=window > 1,
              config=GDNPipeConfig(stages=stages, ctas=8, rows_per_item=64, rows_per_warp=rows_per_warp,
                                   consumer_groups=groups))
    _run_case("narrow", 9, torch.float32, window, seed=window + 1,
              config=GDNPipeConfig(stages=stages, ctas=8, rows_per_item=16, rows_per_warp=rows_per_warp,
                                   consumer_groups=groups))


@pytest.mark.parametrize("rows_per_warp", [16, 8])
@pytest.mark.parametrize("window", [1, 16])
def test_pipelined_items_of_several_value_heads(window, rows_per_warp):
    """Items of all three value heads of a key head (``heads_per_item`` 3: not a power of two) on
    an 8-CTA grid: one TMA box of 192 (odd) or 96 (narrow) fp32 rows a stage, the key head's ring
    dots once per item and each head's rows, gates and records from its place in the stage, bf16
    and fp32 activations, poisoned rings included; a producer chunk of one item (three heads)."""
    from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig

    _run_case("odd", 37, torch.bfloat16, window, seed=window + 2, poison_ring=window > 1,
              config=GDNPipeConfig(stages=2, ctas=8, rows_per_item=64, rows_per_warp=rows_per_warp, prefetch=1,
                                   heads_per_item=3))
    _run_case("narrow", 9, torch.float32, window, seed=window + 3,
              config=GDNPipeConfig(stages=3, ctas=8, rows_per_item=32, rows_per_warp=rows_per_warp, prefetch=1,
                                   heads_per_item=3))


@pytest.mark.parametrize("row_lanes", [8, 16])
def test_pipelined_row_dots_with_fewer_lanes_a_row(row_lanes):
    """The fp32 checkpoint's row dots of non-flushing items with 8 or 16 lanes to a row
    (``GDNPipeConfig.row_lanes``) on an 8-CTA grid, poisoned rings included."""
    from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig

    _run_case("odd", 37, torch.bfloat16, 16, seed=row_lanes, poison_ring=True,
              config=GDNPipeConfig(stages=3, ctas=8, rows_per_item=64, row_lanes=row_lanes))


@pytest.mark.xdist_group("gpu_memory")
@pytest.mark.parametrize("batch", [3, 511])
def test_tails_with_every_row_flushing_at_once(batch, decode_kernel):
    """Tails of the persistent grid's walk (batch 3: fewer items than CTAs; 511: a last lap partly
    empty) with every row at the same ring position, so each window's last step folds every live
    row at once (the heaviest step, no non-flush item to hide behind)."""
    _run_case("qwen3.5-4b", batch, torch.bfloat16, 16, windows=2, seed=batch, aligned=True)


@pytest.mark.xdist_group("gpu_memory")
def test_decode_batch_512_pad_zero(decode_kernel):
    _run_case("qwen3.5-4b", 512, torch.bfloat16, 16, pad_slot_id=0, windows=3)


@pytest.mark.parametrize("rows,warps", [(8, 2), (32, 4), (64, 4), (128, 8)])
def test_decode_configs(rows, warps):
    from replayssm_cute.kernels.gdn.config import GDNConfig

    _run_case("qwen3.5-122b", 24, torch.bfloat16, 8, windows=3, seed=rows,
              config=GDNConfig(rows_per_cta=rows, num_warps=warps))


@pytest.mark.parametrize("window", [1, 16])
def test_mixed_qkv_strided(window, decode_kernel):
    """vLLM's packed [q | k | v] rows with a row stride wider than the packed width give
    bit-identical outputs and caches to separate contiguous q, k, v."""
    H, HV, K, V = SHAPES["odd"]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(5)
    batch = 37
    caches = [rs.GDNCache(batch + 1, HV, V, K, H, window=window, device=dev) for _ in range(2)]
    slots = torch.randperm(batch, generator=gen, device=dev).to(torch.int32)
    init = torch.randn(batch, HV, V, K, generator=gen, device=dev) * 0.1
    for c in caches:
        c.load_prefill(slots, init)
    A_log, dt_bias = _params(HV, dev, gen)
    width = 2 * H * K + HV * V
    for step in range(2 * window + 3):
        q, k, v, a, b = _inputs(batch, H, HV, K, V, torch.bfloat16, dev, gen)
        wide = torch.randn(batch, width + 40, generator=gen, device=dev).to(torch.bfloat16)
        mixed = wide[:, 8 : 8 + width]  # odd base offset, row stride width + 40
        mixed[:, : H * K] = q.flatten(1)
        mixed[:, H * K : 2 * H * K] = k.flatten(1)
        mixed[:, 2 * H * K :] = v.flatten(1)
        o1 = rs.decode(caches[0], q, k, v, a, b, A_log, dt_bias, slots)
        o2 = rs.decode(caches[1], None, None, None, a, b, A_log, dt_bias, slots, mixed_qkv=mixed)
        assert torch.equal(o1, o2), f"step {step}"
    for t1, t2 in zip(_cache_tensors(caches[0]), _cache_tensors(caches[1])):
        assert torch.equal(t1, t2)


@pytest.mark.parametrize("window", [1, 8])
def test_cuda_graph_capture_replay(window, decode_kernel):
    """Capture several steps in one graph, replay it over several windows with mixed flush rows."""
    H, HV, K, V = SHAPES["odd"]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(11)
    batch, steps_per_graph = 24, 3
    cache = rs.GDNCache(batch + 2, HV, V, K, H, window=window, dtype=torch.bfloat16, device=dev)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    init = torch.randn(batch, HV, V, K, generator=gen, device=dev) * 0.1
    cache.load_prefill(slots, init)
    ref_state = init.double().clone()
    A_log, dt_bias = _params(HV, dev, gen)
    for step in range(window - 1):  # stagger rows before capture
        live = (torch.arange(batch, device=dev) % window) > step
        q, k, v, a, b = _inputs(batch, H, HV, K, V, torch.bfloat16, dev, gen)
        rs.decode(cache, q, k, v, a, b, A_log, dt_bias, torch.where(live, slots, -1))
        _, new_state = reference.gdn_conventional_step(ref_state, q, k, v, a, b, A_log, dt_bias)
        ref_state[live] = new_state[live]
    static_in = [_inputs(batch, H, HV, K, V, torch.bfloat16, dev, gen) for _ in range(steps_per_graph)]
    static_out = [torch.empty(batch, HV, V, dtype=torch.bfloat16, device=dev) for _ in range(steps_per_graph)]
    side = torch.cuda.Stream()  # compile outside capture, warm up on a side stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rs.decode(cache, *static_in[0], A_log, dt_bias, torch.full_like(slots, -1), out=static_out[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(steps_per_graph):
            rs.decode(cache, *static_in[i], A_log, dt_bias, slots, out=static_out[i])
    for replay in range(3 * window // steps_per_graph + 2):
        for i in range(steps_per_graph):
            for dst, src in zip(static_in[i], _inputs(batch, H, HV, K, V, torch.bfloat16, dev, gen)):
                dst.copy_(src)
        graph.replay()
        for i in range(steps_per_graph):
            o_ref, ref_state = reference.gdn_conventional_step(ref_state, *static_in[i], A_log, dt_bias)
            assert rel_err(static_out[i], o_ref, allow_zero=True) < 1.5e-2, f"replay {replay} step {i}"
    assert rel_err(cache.materialize(slots), ref_state, allow_zero=True) < 2e-2
