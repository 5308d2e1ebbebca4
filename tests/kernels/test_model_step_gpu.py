"""Whole model steps on the GPU: layer caches sharing one SequenceTable (marked gpu).

A model here is a stack of layer caches made with one ``table=``: 3 Mamba-2 layers, 2 GDN layers,
or a hybrid of both (the table only holds positions, so layer types may share it). The same
model is built on the CPU (caches sharing a CPU table: the float64 reference backend) from the
same random checkpoints and rings, and every step runs there with the same inputs. Rows start at
different ring positions (load_prefill is refused on a shared table, so eager warm-up steps
decode different subsets of the rows), one row is the pad sentinel throughout and others are
padded at random. Checked at every step: every layer's outputs of the live rows against the CPU
model's, pad rows' outputs untouched, the table (committed, origin, sr_writes) equal to the CPU
table, every layer's ``materialize``d state and checkpoint against the CPU model's; at the end,
slots never named bit-identical.

- standard decode: plan_decode + every layer's decode captured in one CUDA graph, replayed over
  more than two windows (flushes included); an old-path twin (every cache owning its table and
  planning itself) run eagerly on the same inputs must match the shared path bit for bit;
- speculative: plan_verify + every layer's verify + table.commit with random accepted counts,
  eager or captured in one graph, standard decode steps interleaved;
- protocol refusals on the GPU path raise ValueError before anything is written.
"""

import pytest
import torch

import replayssm_cute as rs
from replayssm_cute.kernels.limits import PDL_ENV
from replayssm_cute.table import SequenceTable

from tests.helpers.numerics import rel_err

pytestmark = pytest.mark.gpu

DEV = "cuda"
BF16 = torch.bfloat16
MAMBA2 = (12, 48, 64, 3)  # H, P, N, G: headdim a multiple of 16, dstate of 32
GDN = (2, 6, 64, 64)  # H key heads, HV value heads, K, V: multiples of 16
STACKS = {"mamba2": ("mamba2",) * 3, "gdn": ("gdn",) * 2,
          "hybrid": ("mamba2", "gdn", "mamba2", "gdn", "mamba2")}
# (outputs, states) against the CPU model: test_mamba2_gpu / test_gdn_gpu / test_spec_gpu's bounds
TOL = {"mamba2": (1e-2, 2e-5), "gdn": (1.5e-2, 2e-2)}
RINGS = {"mamba2": ("ring_x", "ring_B", "ring_dt"), "gdn": ("ring_u", "ring_k", "ring_g")}
TABLE = ("committed", "origin", "sr_writes")
PAD_ROW = 2  # this row is the pad sentinel at every step


def _cache(kind, table, shared=True):
    """A layer cache of `kind` with `table`'s pool arguments, on that table (or owning its own)."""
    pool = dict(window=table.window, max_draft=table.max_draft, dtype=BF16, device=table.device,
                pad_slot_id=table.pad_slot_id, table=table if shared else None)
    if kind == "mamba2":
        H, P, N, G = MAMBA2
        return rs.Mamba2Cache(table.num_slots, H, P, N, G, **pool)
    H, HV, K, V = GDN
    return rs.GDNCache(table.num_slots, HV, V, K, H, **pool)


def _params(kind, gen):
    """A layer's weights (keyword arguments of decode / verify), realistic decays, on the GPU."""
    rand = lambda n: torch.rand(n, generator=gen, device=DEV)  # noqa: E731
    if kind == "mamba2":
        H = MAMBA2[0]
        return dict(A=-(1.0 + rand(H)), dt_bias=-4.0 + rand(H), D=torch.randn(H, generator=gen, device=DEV),
                    dt_softplus=True)
    HV = GDN[1]
    return dict(A_log=torch.log(1.0 + 15.0 * rand(HV)), dt_bias=-4.0 + rand(HV))


def _tokens(kind, lead, gen):
    """Random bf16 token tensors of a step, leading dims `lead` ((b,) or (b, T)), by keyword."""
    randn = lambda *shape, s=1.0: (s * torch.randn(*lead, *shape, generator=gen, device=DEV)).to(BF16)  # noqa: E731
    if kind == "mamba2":
        H, P, N, G = MAMBA2
        return dict(x=randn(H, P), dt=randn(H, s=0.5), B=randn(G, N), C=randn(G, N))
    H, HV, K, V = GDN
    return dict(q=randn(H, K), k=randn(H, K), v=randn(HV, V), a=randn(HV, s=0.5), b=randn(HV))


def _out(kind, lead, device=DEV):
    shape = MAMBA2[:2] if kind == "mamba2" else (GDN[1], GDN[3])
    return torch.full((*lead, *shape), 777.0, dtype=BF16, device=device)


def _cpu(d):
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in d.items()}


def _copy_into(static, fresh):
    for buffers, values in zip(static, fresh):
        for name, t in buffers.items():
            t.copy_(values[name])


def _capture(step, ids):
    """A CUDA graph of ``step(ids)``; ``step`` runs first on pad rows only, on a side stream
    (compiles the kernels, warms the allocator, touches no slot and no table entry)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(torch.full_like(ids, -1))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(ids)
    return graph


class Model:
    """The layers `kinds` on the GPU sharing one table (the path under test), on the CPU sharing a
    CPU table (the reference) and, with `solo`, on the GPU each owning its table (the old path),
    all from the same random checkpoints and rings (every slot's, so that a stray write shows)."""

    def __init__(self, kinds, num_slots, window, max_draft, seed, solo=False):
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.kinds = kinds
        self.table = SequenceTable(num_slots, window, max_draft, device=DEV)
        self.cpu_table = SequenceTable(num_slots, window, max_draft)
        self.gpu = [_cache(k, self.table) for k in kinds]
        self.cpu = [_cache(k, self.cpu_table) for k in kinds]
        self.solo = [_cache(k, self.table, shared=False) for k in kinds] if solo else None
        for i, kind in enumerate(kinds):
            for name in ("checkpoint",) + RINGS[kind]:
                value = 0.1 * torch.randn(getattr(self.gpu[i], name).shape, generator=gen, device=DEV)
                for stack in (self.gpu, self.cpu) + ((self.solo,) if solo else ()):
                    t = getattr(stack[i], name)
                    t.copy_(value.to(t.dtype))
        everyone = torch.arange(num_slots, dtype=torch.int32)
        self.table.reset(everyone.to(DEV))  # the hand-over after a prefill: no records, origin 0
        self.cpu_table.reset(everyone)
        self.params = [_params(k, gen) for k in kinds]
        self.cpu_params = [_cpu(p) for p in self.params]

    def tokens(self, lead, gen):
        return [_tokens(k, lead, gen) for k in self.kinds]

    def outs(self, lead, device=DEV):
        return [_out(k, lead, device) for k in self.kinds]

    def decode(self, ids, tokens, outs):
        """A standard model step on the shared GPU table: one plan, then every layer."""
        plan = self.table.plan_decode(ids)
        for cache, p, tok, out in zip(self.gpu, self.params, tokens, outs):
            rs.decode(cache, slot_ids=ids, plan=plan, out=out, **p, **tok)

    def verify(self, ids, tokens, outs, accepted):
        """A speculative model step: one plan_verify, every layer's verify, one commit."""
        plan = self.table.plan_verify(ids, outs[0].shape[1])
        for cache, p, tok, out in zip(self.gpu, self.params, tokens, outs):
            rs.verify(cache, slot_ids=ids, plan=plan, out=out, **p, **tok)
        self.table.commit(plan, accepted)

    def solo_decode(self, ids, tokens, outs):
        """The old path: every cache plans its own step."""
        for cache, p, tok, out in zip(self.solo, self.params, tokens, outs):
            rs.decode(cache, slot_ids=ids, out=out, **p, **tok)

    def reference(self, ids, tokens, accepted=None):
        """The same step on the CPU model (verify + commit with `accepted`); its outputs."""
        ids = ids.cpu()
        lead = tuple(next(iter(tokens[0].values())).shape[:1 if accepted is None else 2])
        outs = self.outs(lead, "cpu")
        if accepted is None:
            plan, op = self.cpu_table.plan_decode(ids), rs.decode
        else:
            plan, op = self.cpu_table.plan_verify(ids, lead[1]), rs.verify
        for cache, p, tok, out in zip(self.cpu, self.cpu_params, tokens, outs):
            op(cache, slot_ids=ids, plan=plan, out=out, **p, **_cpu(tok))
        if accepted is not None:
            self.cpu_table.commit(plan, accepted.cpu())
        return outs

    def check(self, what, ids, outs, ref_outs, slots):
        """Outputs of the live rows against the CPU model's and pad rows untouched; the table;
        every layer's materialized state and checkpoint of `slots` (a list of slot ids)."""
        live = (ids >= 0).cpu()
        for name in TABLE:
            assert torch.equal(getattr(self.table, name).cpu(), getattr(self.cpu_table, name)), f"{what}: {name}"
        idx = torch.tensor(slots)
        for i, (kind, gpu, cpu) in enumerate(zip(self.kinds, self.gpu, self.cpu)):
            out_tol, state_tol = TOL[kind]
            out = outs[i].cpu()
            assert rel_err(out[live], ref_outs[i][live], allow_zero=True) < out_tol, f"{what}: layer {i} outputs"
            assert torch.all(out[~live] == 777.0), f"{what}: layer {i} pad rows' outputs must be untouched"
            args = (self.params[i]["A"],) if kind == "mamba2" else ()
            cpu_args = (self.cpu_params[i]["A"],) if kind == "mamba2" else ()
            assert rel_err(gpu.materialize(slots, *args).cpu(), cpu.materialize(slots, *cpu_args)) < state_tol, \
                f"{what}: layer {i} materialized states"
            assert rel_err(gpu.checkpoint.cpu()[idx], cpu.checkpoint[idx]) < state_tol, f"{what}: layer {i} checkpoints"

    def idle_tensors(self, idle):
        """Clones of every GPU tensor's entries of the slots `idle` (caches and table)."""
        idx = torch.tensor(idle, device=DEV)
        ts = [getattr(self.table, n)[idx].clone() for n in TABLE]
        for kind, cache in zip(self.kinds, self.gpu):
            ts += [getattr(cache, n)[idx].clone() for n in ("checkpoint",) + RINGS[kind]]
        return ts


def _setup(stack, window, max_draft, seed, solo=False, batch=12, extra=3):
    """(model, slots (b,) int32 on the GPU, the list of slots a step may name, the idle slots,
    their tensors now)."""
    model = Model(STACKS[stack], batch + extra, window, max_draft, seed, solo)
    gen = torch.Generator(device=DEV).manual_seed(seed + 1)
    slots = torch.randperm(batch + extra, generator=gen, device=DEV)[:batch].to(torch.int32)
    named = [s for r, s in enumerate(slots.tolist()) if r != PAD_ROW]
    idle = sorted(set(range(batch + extra)) - set(named))
    return model, slots, named, idle, model.idle_tensors(idle)


def _stagger(model, slots, named, gen, solo_outs=None):
    """Eager warm-up steps: row r is live in the first r % window of them only, so rows enter the
    captured steps at different ring positions."""
    batch, window = slots.shape[0], model.table.window
    for step in range(window - 1):
        live = (torch.arange(batch, device=DEV) % window) > step
        live[PAD_ROW] = False
        ids = torch.where(live, slots, -1)
        tokens, outs = model.tokens((batch,), gen), model.outs((batch,))
        model.decode(ids, tokens, outs)
        if solo_outs is not None:
            model.solo_decode(ids, tokens, solo_outs)
            assert all(torch.equal(a[live], b[live]) for a, b in zip(outs, solo_outs)), f"warm-up {step}: old path"
        model.check(f"warm-up {step}", ids, outs, model.reference(ids, tokens), named)


def _step_ids(slots, gen):
    """This step's slot ids: ~15% of the rows padded at random, PAD_ROW always."""
    live = torch.rand(slots.shape[0], generator=gen, device=DEV) > 0.15
    live[PAD_ROW] = False
    return torch.where(live, slots, -1)


@pytest.mark.parametrize("stack,window", [("mamba2", 8), ("gdn", 8), ("hybrid", 5), ("hybrid", 16)])
def test_model_decode_step_in_one_graph(stack, window):
    model, slots, named, idle, idle_before = _setup(stack, window, 0, seed=window, solo=True)
    batch = slots.shape[0]
    gen = torch.Generator(device=DEV).manual_seed(7)
    solo_outs = model.outs((batch,))
    _stagger(model, slots, named, gen, solo_outs)

    tokens, outs = model.tokens((batch,), gen), model.outs((batch,))
    step_ids = slots.clone()
    graph = _capture(lambda ids: model.decode(ids, tokens, outs), step_ids)
    flushes = 0
    for step in range(2 * window + 3):
        _copy_into(tokens, model.tokens((batch,), gen))
        step_ids.copy_(_step_ids(slots, gen))
        for out in outs + solo_outs:
            out.fill_(777.0)
        h_before = model.cpu_table.committed[step_ids.cpu().clamp_min(0).long()]
        flushes += int(((step_ids.cpu() >= 0) & (h_before + 1 >= window)).sum())
        graph.replay()
        model.solo_decode(step_ids, tokens, solo_outs)
        assert all(torch.equal(a, b) for a, b in zip(outs, solo_outs)), f"step {step}: old path outputs"
        model.check(f"step {step}", step_ids, outs, model.reference(step_ids, tokens), named)
    assert flushes >= len(named)
    for i, (kind, shared, solo) in enumerate(zip(model.kinds, model.gpu, model.solo)):
        for name in ("checkpoint",) + RINGS[kind]:
            assert torch.equal(getattr(shared, name), getattr(solo, name)), f"layer {i} {name}: old path differs"
        for name in TABLE:
            assert torch.equal(getattr(solo.table, name), getattr(model.table, name)), f"layer {i} table {name}"
    for before, now in zip(idle_before, model.idle_tensors(idle)):
        assert torch.equal(before, now), "untouched slots must stay bit-identical"


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("stack,window,T", [("hybrid", 8, 4), ("mamba2", 16, 8), ("gdn", 8, 8), ("hybrid", 5, 1)])
def test_model_verify_commit(stack, window, T, captured):
    """plan_verify + every layer's verify + commit with random accepted counts per row, a
    standard decode step every fifth step (h == window after a commit included)."""
    model, slots, named, idle, idle_before = _setup(stack, window, T, seed=10 * window + T)
    batch = slots.shape[0]
    gen = torch.Generator(device=DEV).manual_seed(T)
    host = torch.Generator().manual_seed(T)
    _stagger(model, slots, named, gen)

    ver_tokens, ver_outs = model.tokens((batch, T), gen), model.outs((batch, T))
    dec_tokens, dec_outs = model.tokens((batch,), gen), model.outs((batch,))
    step_ids = slots.clone()
    accepted = torch.ones(batch, dtype=torch.int32, device=DEV)
    verify = lambda ids: model.verify(ids, ver_tokens, ver_outs, accepted)  # noqa: E731
    decode = lambda ids: model.decode(ids, dec_tokens, dec_outs)  # noqa: E731
    if captured:
        verify_graph, decode_graph = _capture(verify, step_ids), _capture(decode, step_ids)
        verify, decode = (lambda ids: verify_graph.replay()), (lambda ids: decode_graph.replay())
    flushes = 0
    for step in range(60):
        step_ids.copy_(_step_ids(slots, gen))
        live = (step_ids >= 0).cpu()
        h_before = model.cpu_table.committed[step_ids.cpu().clamp_min(0).long()]
        if step % 5 == 4:
            _copy_into(dec_tokens, model.tokens((batch,), gen))
            for out in dec_outs:
                out.fill_(777.0)
            decode(step_ids)
            model.check(f"step {step} (decode)", step_ids, dec_outs, model.reference(step_ids, dec_tokens), named)
            continue
        _copy_into(ver_tokens, model.tokens((batch, T), gen))
        accepted.copy_(torch.randint(1, T + 1, (batch,), generator=host, dtype=torch.int32))
        for out in ver_outs:
            out.fill_(777.0)
        flushes += int((live & (h_before + T > window)).sum())
        verify(step_ids)
        ref_outs = model.reference(step_ids, ver_tokens, accepted)
        model.check(f"step {step} (verify)", step_ids, ver_outs, ref_outs, named)
    assert flushes > 10
    for before, now in zip(idle_before, model.idle_tensors(idle)):
        assert torch.equal(before, now), "untouched slots must stay bit-identical"


REFUSALS = ["decode without plan", "verify without plan", "stale decode plan", "committed verify plan",
            "plan of another table", "another slot_ids tensor", "decode plan to verify",
            "decode while a verify is pending", "commit of another table's plan"]


@pytest.mark.parametrize("case", REFUSALS)
@pytest.mark.parametrize("kind", ["mamba2", "gdn"])
def test_protocol_refusals_write_nothing(kind, case):
    """Each misuse of the model-step protocol on a cache sharing its table raises ValueError
    before anything is written: the caches' tensors, the table and the outputs unchanged."""
    T = 4
    gen = torch.Generator(device=DEV).manual_seed(5)
    table = SequenceTable(8, 8, T, device=DEV)
    other = SequenceTable(8, 8, T, device=DEV)
    cache = _cache(kind, table)
    _cache(kind, table)  # a second layer on the table
    for name in ("checkpoint",) + RINGS[kind]:
        t = getattr(cache, name)
        t.copy_(0.1 * torch.randn(t.shape, generator=gen, device=DEV))
    params = _params(kind, gen)
    ids = torch.tensor([3, -1, 0, 5], dtype=torch.int32, device=DEV)
    dec_tok, ver_tok = _tokens(kind, (4,), gen), _tokens(kind, (4, T), gen)
    dec_out, ver_out = _out(kind, (4,)), _out(kind, (4, T))
    accepted = torch.full((4,), 2, dtype=torch.int32, device=DEV)
    decode = lambda plan, slot_ids=ids: rs.decode(cache, slot_ids=slot_ids, plan=plan, out=dec_out,  # noqa: E731
                                                  **params, **dec_tok)
    verify = lambda plan: rs.verify(cache, slot_ids=ids, plan=plan, out=ver_out, **params, **ver_tok)  # noqa: E731
    match = "argument 'plan'"
    if case == "decode without plan":
        call = lambda: decode(None)  # noqa: E731
    elif case == "verify without plan":
        call = lambda: verify(None)  # noqa: E731
    elif case == "stale decode plan":
        old = table.plan_decode(ids)
        table.plan_decode(ids)
        call = lambda: decode(old)  # noqa: E731
    elif case == "committed verify plan":
        done = table.plan_verify(ids, T)
        table.commit(done, accepted)
        call = lambda: verify(done)  # noqa: E731
    elif case == "plan of another table":
        foreign = other.plan_decode(ids)
        call = lambda: decode(foreign)  # noqa: E731
    elif case == "another slot_ids tensor":
        plan = table.plan_decode(ids)
        call, match = (lambda: decode(plan, slot_ids=ids.clone())), "argument 'slot_ids'"
    elif case == "decode plan to verify":
        plan = table.plan_decode(ids)
        call = lambda: verify(plan)  # noqa: E731
    elif case == "decode while a verify is pending":
        pending = table.plan_verify(ids, T)
        call, match = (lambda: decode(pending)), "awaits its commit"
    else:
        foreign = other.plan_verify(ids, T)
        call, match = (lambda: table.commit(foreign, accepted)), "another table"
    tensors = lambda: [t.clone() for t in [getattr(cache, n) for n in ("checkpoint",) + RINGS[kind]]  # noqa: E731
                       + [getattr(table, n) for n in TABLE] + [dec_out, ver_out]]
    before = tensors()
    with pytest.raises(ValueError, match=match):
        call()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(before, tensors())):
        assert torch.equal(a, b), f"{case}: tensor {i} written by a refused call"


def _graph(fn):
    """A CUDA graph of ``fn()`` (run eagerly once before, by the caller, to compile)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@pytest.mark.parametrize("stack", ["hybrid"])
def test_lifecycle_inside_one_graph(stack):
    """reset_slots, a model decode step, fork_slots and materialize_states captured in one CUDA graph
    and replayed: every layer's outputs, states and the table against the same calls on the CPU
    model, forked slots bit-identical to their sources, untouched slots bit-identical."""
    window = 5
    model, slots, named, idle, idle_before = _setup(stack, window, 0, seed=21)
    batch = slots.shape[0]
    gen = torch.Generator(device=DEV).manual_seed(22)
    reset_ids = slots.clone()
    reset_ids[PAD_ROW] = -1
    states = [0.1 * torch.randn((batch,) + c.checkpoint.shape[1:], generator=gen, device=DEV) for c in model.gpu]
    src, dst = slots[:2].clone(), slots[2:4].clone()
    dst[0] = -1  # a skipped fork row
    tokens, outs = model.tokens((batch,), gen), model.outs((batch,))
    A = [p.get("A") for p in model.params]
    mats = [None] * len(model.gpu)

    def gpu_step():
        rs.reset_slots(model.table, model.gpu, reset_ids, states)
        model.decode(reset_ids, tokens, outs)
        rs.fork_slots(model.table, model.gpu, src, dst)
        for i, cache in enumerate(model.gpu):
            mats[i] = rs.materialize_states(cache, reset_ids, A[i])

    def cpu_step():
        ids = reset_ids.cpu()
        rs.reset_slots(model.cpu_table, model.cpu, ids, [s.cpu() for s in states])
        ref_outs = model.reference(ids, tokens)
        rs.fork_slots(model.cpu_table, model.cpu, src.cpu(), dst.cpu())
        return ref_outs

    gpu_step()  # eager once (compiles the kernels), then the same in a graph
    cpu_step()
    graph = _graph(gpu_step)
    for replay in range(3):
        _copy_into(tokens, model.tokens((batch,), gen))
        graph.replay()
        ref_outs = cpu_step()
        model.check(f"replay {replay}", reset_ids, outs, ref_outs, named)
        for i, (kind, gpu, cpu) in enumerate(zip(model.kinds, model.gpu, model.cpu)):
            want = rs.materialize_states(cpu, reset_ids.cpu(), model.cpu_params[i].get("A"))
            assert rel_err(mats[i].cpu(), want, allow_zero=True) < TOL[kind][1], f"replay {replay}: layer {i} states"
            for name in ("checkpoint",) + RINGS[kind]:
                t = getattr(gpu, name)
                assert torch.equal(t[int(dst[1])], t[int(src[1])]), f"replay {replay}: layer {i} {name} not forked"
    for before, now in zip(idle_before, model.idle_tensors(idle)):
        assert torch.equal(before, now), "untouched slots must stay bit-identical"


def test_plain_and_programmatic_launches_agree_bit_for_bit(monkeypatch):
    """The same hybrid model steps (standard decode and verify + commit with random accepted
    counts, each captured in one CUDA graph, pad rows at random), with every kernel launched
    programmatically (the default: a kernel starts while the one before it finishes) and plainly
    (REPLAYSSM_CUTE_PDL=0): every output, cache tensor and table entry bit-identical."""
    window, T = 5, 3
    runs = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(PDL_ENV, mode)
        model, slots, named, idle, idle_before = _setup("hybrid", window, T, seed=31)
        batch = slots.shape[0]
        gen = torch.Generator(device=DEV).manual_seed(32)
        host = torch.Generator().manual_seed(33)
        ver_tokens, ver_outs = model.tokens((batch, T), gen), model.outs((batch, T))
        dec_tokens, dec_outs = model.tokens((batch,), gen), model.outs((batch,))
        step_ids = slots.clone()
        accepted = torch.ones(batch, dtype=torch.int32, device=DEV)
        verify = _capture(lambda ids: model.verify(ids, ver_tokens, ver_outs, accepted), step_ids)
        decode = _capture(lambda ids: model.decode(ids, dec_tokens, dec_outs), step_ids)
        log = []
        for step in range(4 * window):
            step_ids.copy_(_step_ids(slots, gen))
            if step % 3 == 2:
                tokens, outs, graph, acc = dec_tokens, dec_outs, decode, None
                _copy_into(tokens, model.tokens((batch,), gen))
            else:
                tokens, outs, graph, acc = ver_tokens, ver_outs, verify, accepted
                _copy_into(tokens, model.tokens((batch, T), gen))
                accepted.copy_(torch.randint(1, T + 1, (batch,), generator=host, dtype=torch.int32))
            for out in outs:
                out.fill_(777.0)
            graph.replay()
            log += [o.clone() for o in outs]
            if mode == "1":  # the programmatic run against the CPU model too
                model.check(f"step {step}", step_ids, outs, model.reference(step_ids, tokens, acc), named)
        state = [getattr(model.table, n) for n in TABLE]
        for kind, cache in zip(model.kinds, model.gpu):
            state += [getattr(cache, n) for n in ("checkpoint",) + RINGS[kind]]
        runs[mode] = (log, state)
        if mode == "1":
            for before, now in zip(idle_before, model.idle_tensors(idle)):
                assert torch.equal(before, now), "untouched slots must stay bit-identical"
    (log_pdl, state_pdl), (log_plain, state_plain) = runs["1"], runs["0"]
    assert all(torch.equal(a, b) for a, b in zip(log_pdl, log_plain)), "outputs differ"
    assert all(torch.equal(a, b) for a, b in zip(state_pdl, state_plain)), "caches or table differ"
