"""Speculative verify + commit kernels on the GPU against the float64 recurrence (marked gpu).

At least 200 steps per case with random acceptance per row: every draft's output against the
recurrence run from the row's accepted stream, the checkpoint of every flushing row against the
state of its committed records, materialized states after every commit, pad rows and untouched
slots bit-identical, standard decode steps interleaved on the same cache (cursor == window after
a commit included), and the verify + commit step captured in one CUDA graph (both layer types).
verify's packed (varlen) form against the dense form, bit for bit, eager and captured. The
random-acceptance and CUDA-graph cases run on both verify kernels of each layer (``verify_kernel``:
the tile kernel and the pipeline; GDN's ``verify_kernel`` adds the pipeline in units of a key
head's value heads).
"""

import copy

import pytest
import torch

import replayssm_cute as rs
from replayssm_cute import reference

from tests.helpers.numerics import rel_err

pytestmark = pytest.mark.gpu

SHAPES = {"super": (128, 64, 128, 8), "odd": (12, 48, 64, 3)}  # H, P, N, G


def _params(H, device, gen):
    A = -(1.0 + torch.rand(H, generator=gen, device=device))
    dt_bias = -4.0 + torch.rand(H, generator=gen, device=device)
    D = torch.randn(H, generator=gen, device=device)
    return A.float(), dt_bias.float(), D.float()


def _tokens(lead, H, P, N, G, dtype, device, gen):
    x = torch.randn(*lead, H, P, generator=gen, device=device).to(dtype)
    dt = (0.5 * torch.randn(*lead, H, generator=gen, device=device)).to(dtype)
    B = torch.randn(*lead, G, N, generator=gen, device=device).to(dtype)
    C = torch.randn(*lead, G, N, generator=gen, device=device).to(dtype)
    return x, dt, B, C


def _cache_tensors(cache):
    return [cache.checkpoint, cache.ring_x, cache.ring_B, cache.ring_dt, cache.cursor, cache.origin]


def _capture(step, slot_ids):
    """A CUDA graph of ``step(slot_ids)``, compiled first outside capture by one eager run on pad
    rows only (a side stream)."""
    pad = torch.full_like(slot_ids, -1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile outside capture, on pad rows only
        step(pad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(slot_ids)
    return graph


@pytest.mark.parametrize("shape,window,T,batch,poison", [
    ("odd", 8, 4, 24, False), ("odd", 8, 8, 24, False), ("super", 16, 8, 64, False), ("super", 16, 2, 37, False),
    ("odd", 5, 1, 9, False), ("odd", 8, 4, 24, True),
])
def test_verify_commit_random_acceptance(shape, window, T, batch, poison, verify_kernel):
    H, P, N, G = SHAPES[shape]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(window * 100 + T)
    host = torch.Generator().manual_seed(T)
    extra = 3
    cache = rs.Mamba2Cache(batch + extra, H, P, N, G, window=window, max_draft=T, dtype=torch.bfloat16,
                           device=dev)
    slots = torch.randperm(batch + extra, generator=gen, device=dev)[:batch].to(torch.int32)
    init = torch.randn(batch, H, P, N, generator=gen, device=dev) * 0.1
    cache.load_prefill(slots, init)
    if poison:  # NaN records of the slots' previous sequence: positions not yet rewritten are never read
        for t in (cache.ring_x, cache.ring_B, cache.ring_dt):
            t[slots.long()] = float("nan")
    ref_state = init.double().clone()
    A, dt_bias, D = _params(H, dev, gen)
    idle = sorted(set(range(batch + extra)) - set(slots.tolist()))
    idle_before = [t[idle].clone() for t in _cache_tensors(cache)]
    flushes = 0
    for step in range(200):
        live = torch.rand(batch, generator=gen, device=dev) > 0.1
        if batch > 2 and step % 7 == 0:
            live[batch // 2] = False  # an out-of-pool id below
        step_slots = torch.where(live, slots, torch.full_like(slots, -1))
        if batch > 2 and step % 7 == 0:
            step_slots[batch // 2] = batch + extra + 5
        h_before = cache.cursor[slots.long()].clone()
        ck_before = cache.checkpoint[slots.long()].clone()
        if step % 10 == 9:
            # A standard decode step on the same cache (T = 1 of the same stream).
            x, dt, B, C = _tokens((batch,), H, P, N, G, torch.bfloat16, dev, gen)
            out = rs.decode(cache, x, dt, A, B, C, step_slots, D=D, dt_bias=dt_bias, dt_softplus=True)
            y_ref, new_state = reference.mamba2_conventional_step(
                ref_state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)
            assert rel_err(out[live], y_ref[live], allow_zero=True) < 1e-2, f"step {step} decode outputs"
            ref_state[live] = new_state[live]
            continue
        x, dt, B, C = _tokens((batch, T), H, P, N, G, torch.bfloat16, dev, gen)
        out = torch.full((batch, T, H, P), 777.0, dtype=torch.bfloat16, device=dev)
        rs.verify(cache, x, dt, A, B, C, step_slots, D=D, dt_bias=dt_bias, dt_softplus=True, out=out)
        y_ref, snaps = reference.mamba2_snapshot_verify(ref_state, x, dt, A, B, C, D=D, dt_bias=dt_bias,
                                                             dt_softplus=True)
        assert rel_err(out[live], y_ref[live], allow_zero=True) < 1e-2, f"step {step} draft outputs"
        assert torch.all(out[~live] == 777.0), "pad rows' outputs must be untouched"
        flushed = live & (h_before + T > window)
        ck = cache.checkpoint[slots.long()]
        if flushed.any():
            flushes += 1
            assert rel_err(ck[flushed], ref_state[flushed], allow_zero=True) < 2e-5, \
                f"step {step} checkpoint after flush"
        assert torch.equal(ck[~flushed], ck_before[~flushed]), "only flushing rows write the checkpoint"
        accepted = torch.randint(1, T + 1, (batch,), generator=host, dtype=torch.int32).to(dev)
        rs.commit(cache, step_slots, accepted)
        acc = accepted.long()
        for r in live.nonzero().flatten().tolist():
            ref_state[r] = snaps[r, acc[r] - 1]
        h_now = cache.cursor[slots.long()]
        expect_h = torch.where(flushed, accepted, h_before + accepted)
        assert torch.equal(h_now[live], expect_h[live]), f"step {step} cursors"
        assert torch.equal(h_now[~live], h_before[~live])
        assert int(h_now.max()) <= window, "at most L committed records"
        assert rel_err(cache.materialize(slots, A), ref_state, allow_zero=True) < 2e-5, \
            f"step {step} materialized state"
    assert flushes > 10
    for before, t in zip(idle_before, _cache_tensors(cache)):
        assert torch.equal(t[idle], before), "untouched slots must stay bit-identical"


def test_verify_commit_cuda_graph(verify_kernel):
    """One graph holds verify + commit; replays with fresh drafts and acceptance per row."""
    H, P, N, G = SHAPES["odd"]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    host = torch.Generator().manual_seed(3)
    batch, window, T = 16, 8, 4
    cache = rs.Mamba2Cache(batch + 1, H, P, N, G, window=window, max_draft=T, device=dev)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    init = torch.randn(batch, H, P, N, generator=gen, device=dev) * 0.1
    cache.load_prefill(slots, init)
    ref_state = init.double().clone()
    A, dt_bias, D = _params(H, dev, gen)
    static = _tokens((batch, T), H, P, N, G, torch.bfloat16, dev, gen)
    out = torch.empty(batch, T, H, P, dtype=torch.bfloat16, device=dev)
    accepted = torch.ones(batch, dtype=torch.int32, device=dev)

    def step(slot_ids):
        rs.verify(cache, *static[:2], A, *static[2:], slot_ids, D=D, dt_bias=dt_bias, dt_softplus=True, out=out)
        rs.commit(cache, slot_ids, accepted)

    graph = _capture(step, slots)
    for replay in range(60):
        for dst, src in zip(static, _tokens((batch, T), H, P, N, G, torch.bfloat16, dev, gen)):
            dst.copy_(src)
        accepted.copy_(torch.randint(1, T + 1, (batch,), generator=host, dtype=torch.int32))
        graph.replay()
        x, dt, B, C = static
        y_ref, snaps = reference.mamba2_snapshot_verify(ref_state, x, dt, A, B, C, D=D, dt_bias=dt_bias,
                                                             dt_softplus=True)
        assert rel_err(out, y_ref, allow_zero=True) < 1e-2, f"replay {replay}"
        ref_state = snaps[torch.arange(batch), accepted.long() - 1]
    assert rel_err(cache.materialize(slots, A), ref_state, allow_zero=True) < 2e-5


GDN_SHAPES = {"qwen3.5-122b": (16, 64, 128, 128), "odd": (2, 6, 64, 64)}  # H, HV, K, V


def _gdn_tokens(lead, H, HV, K, V, dtype, device, gen):
    q = torch.randn(*lead, H, K, generator=gen, device=device).to(dtype)
    k = torch.randn(*lead, H, K, generator=gen, device=device).to(dtype)
    v = torch.randn(*lead, HV, V, generator=gen, device=device).to(dtype)
    a = torch.randn(*lead, HV, generator=gen, device=device).to(dtype)
    b = torch.randn(*lead, HV, generator=gen, device=device).to(dtype)
    return q, k, v, a, b


def _gdn_cache_tensors(cache):
    return [cache.checkpoint, cache.ring_u, cache.ring_k, cache.ring_g, cache.cursor, cache.origin]


def _gdn_params(HV, device, gen):
    A_log = torch.log(1.0 + 15.0 * torch.rand(HV, generator=gen, device=device))
    dt_bias = -4.0 + torch.rand(HV, generator=gen, device=device)
    return A_log, dt_bias


def _gdn_fold_of_stored(cache, slot_ids, h, ckpt):
    """Float64 fold of each slot's h committed records as stored in its ring, from `ckpt`: what a
    flush must write (the tight checkpoint check)."""
    window, dev = cache.window, cache.checkpoint.device
    idx = (cache.origin[slot_ids.long()].long()[:, None] + torch.arange(window, device=dev)) % cache.capacity
    rows = slot_ids.long()[:, None]
    stored = [cache.ring_u[rows, idx].double(), cache.ring_k[rows, idx].double(), cache.ring_g[rows, idx].double()]
    mask = torch.arange(window, device=dev)[None, :] < h.long()[:, None]  # committed records only
    stored = [torch.where(mask.view(mask.shape + (1,) * (t.dim() - 2)), t, 0.0) for t in stored]  # stale may be NaN
    return reference.gdn_replay(ckpt, *stored)


@pytest.mark.parametrize("shape,window,T,batch,poison", [
    ("odd", 8, 4, 24, False), ("odd", 8, 8, 24, False), ("qwen3.5-122b", 16, 4, 32, False), ("odd", 5, 1, 9, False),
    ("odd", 8, 4, 24, True),
])
def test_gdn_verify_commit_random_acceptance(shape, window, T, batch, poison, verify_kernel):
    """GDN verify (drafts' corrections by the triangular solve) + commit over 200 steps against the
    float64 recurrence on the accepted stream; checkpoints after flushes against the fold of
    the stored records; standard decode steps interleaved."""
    H, HV, K, V = GDN_SHAPES[shape]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(window * 10 + T)
    host = torch.Generator().manual_seed(T + 1)
    extra = 3
    cache = rs.GDNCache(batch + extra, HV, V, K, H, window=window, max_draft=T, dtype=torch.bfloat16,
                        device=dev)
    slots = torch.randperm(batch + extra, generator=gen, device=dev)[:batch].to(torch.int32)
    init = torch.randn(batch, HV, V, K, generator=gen, device=dev) * 0.1
    cache.load_prefill(slots, init)
    if poison:  # NaN records of the slots' previous sequence: positions not yet rewritten are never read
        for t in (cache.ring_u, cache.ring_k, cache.ring_g):
            t[slots.long()] = float("nan")
    ref_state = init.double().clone()
    A_log, dt_bias = _gdn_params(HV, dev, gen)
    idle = sorted(set(range(batch + extra)) - set(slots.tolist()))
    idle_before = [t[idle].clone() for t in _gdn_cache_tensors(cache)]
    flushes = 0
    for step in range(200):
        live = torch.rand(batch, generator=gen, device=dev) > 0.1
        step_slots = torch.where(live, slots, torch.full_like(slots, -1))
        h_before = cache.cursor[slots.long()].clone()
        ck_before = cache.checkpoint[slots.long()].clone()
        if step % 10 == 9:
            q, k, v, a, b = _gdn_tokens((batch,), H, HV, K, V, torch.bfloat16, dev, gen)
            out = rs.decode(cache, q, k, v, a, b, A_log, dt_bias, step_slots)
            o_ref, new_state = reference.gdn_conventional_step(ref_state, q, k, v, a, b, A_log, dt_bias)
            assert rel_err(out[live], o_ref[live], allow_zero=True) < 2e-2, f"step {step} decode outputs"
            ref_state[live] = new_state[live]
            continue
        q, k, v, a, b = _gdn_tokens((batch, T), H, HV, K, V, torch.bfloat16, dev, gen)
        out = torch.full((batch, T, HV, V), 777.0, dtype=torch.bfloat16, device=dev)
        flushed = live & (h_before + T > window)
        fl = flushed.nonzero().flatten()
        if fl.numel():
            expect = _gdn_fold_of_stored(cache, slots[fl], h_before[fl], ck_before[fl])
        rs.verify(cache, q, k, v, a, b, A_log, dt_bias, step_slots, out=out)
        o_ref, snaps = reference.gdn_snapshot_verify(ref_state, q, k, v, a, b, A_log, dt_bias)
        assert rel_err(out[live], o_ref[live], allow_zero=True) < 2e-2, f"step {step} draft outputs"
        assert torch.all(out[~live] == 777.0), "pad rows' outputs must be untouched"
        ck = cache.checkpoint[slots.long()]
        if fl.numel():
            flushes += 1
            assert rel_err(ck[fl], expect, allow_zero=True) < 2e-5, f"step {step} checkpoint vs fold of stored records"
            assert rel_err(ck[fl], ref_state[fl], allow_zero=True) < 2e-2, f"step {step} checkpoint vs recurrence"
        assert torch.equal(ck[~flushed], ck_before[~flushed]), "only flushing rows write the checkpoint"
        accepted = torch.randint(1, T + 1, (batch,), generator=host, dtype=torch.int32).to(dev)
        rs.commit(cache, step_slots, accepted)
        for r in live.nonzero().flatten().tolist():
            ref_state[r] = snaps[r, accepted[r].long() - 1]
        h_now = cache.cursor[slots.long()]
        expect_h = torch.where(flushed, accepted, h_before + accepted)
        assert torch.equal(h_now[live], expect_h[live]), f"step {step} cursors"
        assert torch.equal(h_now[~live], h_before[~live])
        assert int(h_now.max()) <= window
        assert rel_err(cache.materialize(slots), ref_state, allow_zero=True) < 2e-2, f"step {step} materialized state"
    assert flushes > 10
    for before, t in zip(idle_before, _gdn_cache_tensors(cache)):
        assert torch.equal(t[idle], before), "untouched slots must stay bit-identical"


def test_gdn_verify_commit_cuda_graph(verify_kernel):
    """One graph holds GDN verify + commit; replays with fresh drafts and acceptance per row, across
    flushes: outputs against the float64 recurrence on the accepted stream, checkpoints of flushing
    rows against the fold of their stored records and the recurrence, cursors after the commit."""
    H, HV, K, V = GDN_SHAPES["odd"]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    host = torch.Generator().manual_seed(3)
    batch, window, T = 16, 8, 4
    cache = rs.GDNCache(batch + 1, HV, V, K, H, window=window, max_draft=T, device=dev)
    slots = torch.arange(batch, dtype=torch.int32, device=dev)
    init = torch.randn(batch, HV, V, K, generator=gen, device=dev) * 0.1
    cache.load_prefill(slots, init)
    ref_state = init.double().clone()
    A_log, dt_bias = _gdn_params(HV, dev, gen)
    static = _gdn_tokens((batch, T), H, HV, K, V, torch.bfloat16, dev, gen)
    out = torch.empty(batch, T, HV, V, dtype=torch.bfloat16, device=dev)
    accepted = torch.ones(batch, dtype=torch.int32, device=dev)

    def step(slot_ids):
        rs.verify(cache, *static, A_log, dt_bias, slot_ids, out=out)
        rs.commit(cache, slot_ids, accepted)

    graph = _capture(step, slots)
    flushes = 0
    for replay in range(60):
        for dst, src in zip(static, _gdn_tokens((batch, T), H, HV, K, V, torch.bfloat16, dev, gen)):
            dst.copy_(src)
        accepted.copy_(torch.randint(1, T + 1, (batch,), generator=host, dtype=torch.int32))
        h_before = cache.cursor[slots.long()].clone()
        ck_before = cache.checkpoint[slots.long()].clone()
        flushed = h_before + T > window
        if flushed.any():
            expect = _gdn_fold_of_stored(cache, slots[flushed], h_before[flushed], ck_before[flushed])
        graph.replay()
        o_ref, snaps = reference.gdn_snapshot_verify(ref_state, *static, A_log, dt_bias)
        assert rel_err(out, o_ref, allow_zero=True) < 2e-2, f"replay {replay} draft outputs"
        ck = cache.checkpoint[slots.long()]
        if flushed.any():
            flushes += 1
            assert rel_err(ck[flushed], expect, allow_zero=True) < 2e-5, \
                f"replay {replay} checkpoint vs fold of stored records"
            assert rel_err(ck[flushed], ref_state[flushed], allow_zero=True) < 2e-2, \
                f"replay {replay} checkpoint vs recurrence"
        assert torch.equal(ck[~flushed], ck_before[~flushed]), "only flushing rows write the checkpoint"
        expect_h = torch.where(flushed, accepted, h_before + accepted)
        assert torch.equal(cache.cursor[slots.long()], expect_h), f"replay {replay} cursors"
        ref_state = snaps[torch.arange(batch), accepted.long() - 1]
    assert flushes > 10
    assert rel_err(cache.materialize(slots), ref_state, allow_zero=True) < 2e-2


@pytest.mark.parametrize("uneven", [False, True], ids=["T-each", "1-to-T"])
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_varlen_verify_matches_dense_bit_for_bit(kind, captured, uneven):
    """verify's packed form (tokens (total, ...), cu_seqlens, num_drafts) + commit, run eagerly or
    replayed from one CUDA graph, against the dense form run eagerly on an identical copy of the
    cache, over 40 steps with pad rows and random acceptance (flushes included): outputs,
    checkpoint, ring, cursor and origin bit-identical after every step. Rows hold T tokens each,
    or (uneven) 1..T, their counts reshuffled every step (the total fixed, as a graph needs),
    against the dense form whose missing drafts repeat the row's last token, accepting at most
    a row's count."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(7)
    host = torch.Generator().manual_seed(7)
    batch, window, T = 24, 8, 4
    if kind == "mamba2":
        H, P, N, G = SHAPES["odd"]
        cache = rs.Mamba2Cache(batch + 2, H, P, N, G, window=window, max_draft=T, device=dev)
        state_shape, out_shape, cache_tensors = (H, P, N), (H, P), _cache_tensors
        A, dt_bias, D = _params(H, dev, gen)

        def make_tokens():
            z = torch.randn(batch, T, H, P, generator=gen, device=dev).to(torch.bfloat16)
            return _tokens((batch, T), H, P, N, G, torch.bfloat16, dev, gen) + (z,)

        def run_verify(c, tokens, slot_ids, out, **packed):
            x, dt, B, C, z = tokens
            return rs.verify(c, x, dt, A, B, C, slot_ids, D=D, z=z, dt_bias=dt_bias, dt_softplus=True, out=out,
                             **packed)
    else:
        H, HV, K, V = GDN_SHAPES["odd"]
        cache = rs.GDNCache(batch + 2, HV, V, K, H, window=window, max_draft=T, device=dev)
        state_shape, out_shape, cache_tensors = (HV, V, K), (HV, V), _gdn_cache_tensors
        A_log, dt_bias = _gdn_params(HV, dev, gen)

        def make_tokens():
            return _gdn_tokens((batch, T), H, HV, K, V, torch.bfloat16, dev, gen)

        def run_verify(c, tokens, slot_ids, out, **packed):
            return rs.verify(c, *tokens, A_log, dt_bias, slot_ids, out=out, **packed)

    slots = torch.randperm(batch + 2, generator=gen, device=dev)[:batch].to(torch.int32)
    cache.load_prefill(slots, torch.randn(batch, *state_shape, generator=gen, device=dev) * 0.1)
    twin = copy.deepcopy(cache)
    # Static buffers: the dense form reads them as (b, T, ...), the packed form as (b * T, ...).
    tokens = make_tokens()
    base_counts = torch.tensor([i % T + 1 if uneven else T for i in range(batch)])
    total = int(base_counts.sum())
    packed_tokens = [t.flatten(0, 1)[:total].clone() for t in tokens]
    packed = dict(cu_seqlens=torch.arange(batch + 1, dtype=torch.int32, device=dev) * T, num_drafts=T)
    dense_out = torch.empty(batch, T, *out_shape, dtype=torch.bfloat16, device=dev)
    packed_out = torch.empty(total, *out_shape, dtype=torch.bfloat16, device=dev)
    step_slots = slots.clone()
    accepted = torch.ones(batch, dtype=torch.int32, device=dev)

    def packed_step(slot_ids=step_slots):
        assert run_verify(twin, packed_tokens, slot_ids, packed_out, **packed) is packed_out
        rs.commit(twin, slot_ids, accepted)

    if captured:
        graph = _capture(packed_step, step_slots)
    flushes = 0
    for step in range(40):
        counts = base_counts[torch.randperm(batch, generator=host)]
        stand_in = torch.tensor([r * T + min(t, n - 1) for r, n in enumerate(counts.tolist()) for t in range(T)],
                                device=dev)
        own = torch.tensor([r * T + t for r, n in enumerate(counts.tolist()) for t in range(n)], device=dev)
        for dst, src, flat in zip(tokens, make_tokens(), packed_tokens):
            dst.copy_(src.flatten(0, 1)[stand_in].view(src.shape))
            flat.copy_(dst.flatten(0, 1)[own])
        packed["cu_seqlens"].copy_(torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
        live = torch.rand(batch, generator=gen, device=dev) > 0.1
        step_slots.copy_(torch.where(live, slots, torch.full_like(slots, -1)))
        accepted.copy_(torch.cat([torch.randint(1, n + 1, (1,), generator=host, dtype=torch.int32)
                                  for n in counts.tolist()]))
        dense_out.fill_(777.0)
        packed_out.fill_(777.0)
        flushes += int((live & (cache.cursor[slots.long()] + T > window)).any())
        run_verify(cache, tokens, step_slots, dense_out)
        rs.commit(cache, step_slots, accepted)
        graph.replay() if captured else packed_step()
        assert torch.equal(packed_out, dense_out.flatten(0, 1)[own]), f"step {step} outputs"
        pairs = zip(cache_tensors(cache), cache_tensors(twin))
        differ = [i for i, (dense, varlen) in enumerate(pairs) if not torch.equal(dense, varlen)]
        assert not differ, f"step {step}: tensors {differ} of {cache_tensors.__name__} differ"
    assert flushes > 10


@pytest.mark.parametrize("shape,T,batch", [("super", 8, 64), ("odd", 4, 37), ("super", 2, 1)])
def test_snapshot_baseline(shape, T, batch):
    """The conventional speculative baseline kernel against the float64 recurrence: outputs and
    every snapshot; the cache and pad rows untouched."""
    H, P, N, G = SHAPES[shape]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(T)
    cache = rs.Mamba2Cache(batch + 2, H, P, N, G, window=1, device=dev)
    slots = torch.randperm(batch + 2, generator=gen, device=dev)[:batch].to(torch.int32)
    cache.checkpoint.normal_(generator=gen).mul_(0.1)
    before = cache.checkpoint.clone()
    A, dt_bias, D = _params(H, dev, gen)
    live = torch.ones(batch, dtype=torch.bool, device=dev)
    if batch > 1:
        live[batch // 3] = False
    step_slots = torch.where(live, slots, torch.full_like(slots, -1))
    x, dt, B, C = _tokens((batch, T), H, P, N, G, torch.bfloat16, dev, gen)
    snaps = torch.full((batch, T, H, P, N), 5.0, device=dev)
    out = torch.full((batch, T, H, P), 777.0, dtype=torch.bfloat16, device=dev)
    rs.snapshot_verify(cache, x, dt, A, B, C, step_slots, snaps, D=D, dt_bias=dt_bias, dt_softplus=True, out=out)
    y_ref, s_ref = reference.mamba2_snapshot_verify(cache.checkpoint[slots.long()], x, dt, A, B, C, D=D,
                                                         dt_bias=dt_bias, dt_softplus=True)
    assert rel_err(out[live], y_ref[live], allow_zero=True) < 1e-2
    assert rel_err(snaps[live], s_ref[live], allow_zero=True) < 2e-5
    assert torch.all(out[~live] == 777.0) and torch.all(snaps[~live] == 5.0)
    assert torch.equal(cache.checkpoint, before)


# K = V = 48: a state row fills only 24 of a warp's lanes.
GDN_SNAPSHOT_SHAPES = {**GDN_SHAPES, "k48": (2, 4, 48, 48)}  # H, HV, K, V


@pytest.mark.parametrize("shape,T,batch,config", [
    ("qwen3.5-122b", 8, 64, None), ("qwen3.5-122b", 16, 3, None), ("qwen3.5-122b", 4, 20, (64, 8)),
    ("odd", 5, 37, None), ("odd", 2, 1, None), ("k48", 3, 19, None),
])
def test_gdn_snapshot_baseline(shape, T, batch, config):
    """The GDN conventional speculative baseline kernel against the float64 recurrence: outputs and
    every snapshot; pad and out-of-pool rows leave out and snapshots untouched, the cache (every
    slot) bit-identical."""
    H, HV, K, V = GDN_SNAPSHOT_SHAPES[shape]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(T + 10)
    cache = rs.GDNCache(batch + 2, HV, V, K, H, window=1, dtype=torch.bfloat16, device=dev)
    slots = torch.randperm(batch + 2, generator=gen, device=dev)[:batch].to(torch.int32)
    cache.checkpoint.normal_(generator=gen).mul_(0.1)
    before = cache.checkpoint.clone()
    A_log = torch.log(1.0 + 15.0 * torch.rand(HV, generator=gen, device=dev))
    dt_bias = -4.0 + torch.rand(HV, generator=gen, device=dev)
    live = torch.ones(batch, dtype=torch.bool, device=dev)
    step_slots = slots.clone()
    if batch > 1:
        live[batch // 3] = False
        step_slots[batch // 3] = -1
    if batch > 2:
        live[batch // 2] = False
        step_slots[batch // 2] = batch + 9  # out of the pool
    q, k, v, a, b = _gdn_tokens((batch, T), H, HV, K, V, torch.bfloat16, dev, gen)
    snaps = torch.full((batch, T, HV, V, K), 5.0, device=dev)
    out = torch.full((batch, T, HV, V), 777.0, dtype=torch.bfloat16, device=dev)
    if config is not None:
        from replayssm_cute.kernels.gdn.config import GDNConfig

        config = GDNConfig(*config)
    assert rs.snapshot_verify(cache, q, k, v, a, b, A_log, dt_bias, step_slots, snaps, out=out, config=config) is out
    o_ref, s_ref = reference.gdn_snapshot_verify(before[slots.long()], q, k, v, a, b, A_log, dt_bias)
    assert rel_err(out[live], o_ref[live], allow_zero=True) < 2e-2
    assert rel_err(snaps[live], s_ref[live], allow_zero=True) < 2e-5
    assert torch.all(out[~live] == 777.0) and torch.all(snaps[~live] == 5.0)
    assert torch.equal(cache.checkpoint, before)
