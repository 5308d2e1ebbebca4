"""Model steps on the CPU: layer caches sharing one SequenceTable against the same layers each owning
its table (the path every other test checks against the float64 recurrence).

A model is a hybrid stack: Mamba-2 and GDN layers, plain and two-precision (a low-precision SR
checkpoint next to an fp8 or nvfp4 read copy). Its twin is the same layers made without ``table=``,
with the same SR seeds, stepped with the same inputs one cache at a time. Both run the float64
reference, so every output, state copy, ring and table entry must agree bit for bit: through
plan_decode / plan_verify + every layer + one commit per step, many windows with flushes, rows
staggered over ring positions, pad and out-of-pool rows, random acceptance, slot reuse
(reset_slots) and forks (fork_slots); materialize_states against the float64 materialize. Then the
protocol's refusals, each before anything is written.
"""

import pytest
import torch

import replayssm_cute as rs
from replayssm_cute import commit, decode, verify
from replayssm_cute.table import SequenceTable

from tests.helpers.inputs import gen

BF16 = torch.bfloat16
SLOTS, WINDOW, MAX_DRAFT = 7, 4, 3
MAMBA2 = (4, 16, 8, 2)  # H, P, N, G
GDN = (2, 4, 16, 8)  # H key heads, HV value heads, K, V
# (layer kind, cache options): plain and two-precision layers of both types
LAYERS = [("mamba2", {}), ("gdn", {}), ("mamba2", dict(checkpoint_format="fp16", read_copy="fp8", sr_seed=11)),
          ("gdn", dict(checkpoint_format="fp8", read_copy="nvfp4", sr_seed=12))]
TABLE = ("committed", "origin", "sr_writes")


def _cache(kind, options, table):
    pool = dict(window=WINDOW, max_draft=MAX_DRAFT, dtype=BF16, table=table, **options)
    if kind == "mamba2":
        H, P, N, G = MAMBA2
        return rs.Mamba2Cache(SLOTS, H, P, N, G, **pool)
    H, HV, K, V = GDN
    return rs.GDNCache(SLOTS, HV, V, K, H, **pool)


class Model:
    """The stack of LAYERS on one shared table (``shared``) or each owning its own."""

    def __init__(self, shared: bool, seed: int = 0):
        self.table = SequenceTable(SLOTS, WINDOW, MAX_DRAFT) if shared else None
        self.caches = [_cache(kind, options, self.table) for kind, options in LAYERS]
        g = gen(100 + seed)
        self.params = [_params(kind, g) for kind, _ in LAYERS]

    def load(self, ids, states):
        if self.table is not None:
            rs.reset_slots(self.table, self.caches, ids, states)
        else:
            for cache, state in zip(self.caches, states):
                cache.load_prefill(ids, state)

    def decode(self, ids, tokens):
        plan = self.table.plan_decode(ids) if self.table is not None else None
        return [decode(c, *_args(kind, t, p, ids), plan=plan)
                for (kind, _), c, t, p in zip(LAYERS, self.caches, tokens, self.params)]

    def verify_commit(self, ids, tokens, accepted):
        T = tokens[0]["x" if LAYERS[0][0] == "mamba2" else "v"].shape[1]
        if self.table is not None:
            plan = self.table.plan_verify(ids, T)
            outs = [verify(c, *_args(kind, t, p, ids), plan=plan)
                    for (kind, _), c, t, p in zip(LAYERS, self.caches, tokens, self.params)]
            self.table.commit(plan, accepted)
            return outs
        outs = []
        for (kind, _), c, t, p in zip(LAYERS, self.caches, tokens, self.params):
            outs.append(verify(c, *_args(kind, t, p, ids)))
            commit(c, ids, accepted)
        return outs


def _params(kind, g):
    if kind == "mamba2":
        H = MAMBA2[0]
        return dict(A=-(1.0 + torch.rand(H, generator=g)), D=torch.randn(H, generator=g),
                    dt_bias=-1.0 + torch.rand(H, generator=g))
    HV = GDN[1]
    return dict(A_log=torch.log(1.0 + 7.0 * torch.rand(HV, generator=g)), dt_bias=torch.rand(HV, generator=g))


def _tokens(kind, lead, g):
    randn = lambda *shape: torch.randn(*lead, *shape, generator=g).to(BF16)  # noqa: E731
    if kind == "mamba2":
        H, P, N, G = MAMBA2
        return dict(x=randn(H, P), dt=randn(H), B=randn(G, N), C=randn(G, N))
    H, HV, K, V = GDN
    return dict(q=randn(H, K), k=randn(H, K), v=randn(HV, V), a=randn(HV), b=randn(HV))


def _args(kind, t, p, ids):
    if kind == "mamba2":
        return (t["x"], t["dt"], p["A"], t["B"], t["C"], ids, p["D"], None, p["dt_bias"], True)
    return (t["q"], t["k"], t["v"], t["a"], t["b"], p["A_log"], p["dt_bias"], ids)


def _states(g, n):
    shapes = [(MAMBA2[0], MAMBA2[1], MAMBA2[2]) if kind == "mamba2" else (GDN[1], GDN[3], GDN[2])
              for kind, _ in LAYERS]
    return [torch.randn(n, *s, generator=g) for s in shapes]


def _slot_tensors(cache):
    """The cache's per-slot tensors (state copies, scales, rings)."""
    return {n: t for n, t in vars(cache).items() if isinstance(t, torch.Tensor) and n != "sr_seed"}


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same(shared: Model, alone: Model, what: str):
    for i, (a, b) in enumerate(zip(shared.caches, alone.caches)):
        for name, t in _slot_tensors(a).items():
            assert torch.equal(_bits(t), _bits(getattr(b, name))), f"{what}: layer {i} {name}"
        assert torch.equal(a.cursor, b.cursor) and torch.equal(a.origin, b.origin), f"{what}: layer {i} positions"
        if b.sr_counter is not None:  # an SR layer's own counter is the shared table's
            assert torch.equal(a.sr_counter, b.sr_counter), f"{what}: layer {i} SR writes"


def _assert_outs(outs_a, outs_b, what):
    for i, (a, b) in enumerate(zip(outs_a, outs_b)):
        assert torch.equal(a, b), f"{what}: layer {i} outputs"


def _ids(rows):
    return torch.tensor(rows, dtype=torch.int32)


def test_shared_table_steps_as_layers_owning_their_tables():
    """Standard and speculative steps, many windows, staggered rows, pad rows, random
    acceptance, slot reuse and a fork: the shared-table model and its twin agree bit for bit."""
    g = gen(1)
    shared, alone = Model(True), Model(False)
    for m in (shared, alone):
        m.load(_ids([1, 2, 3, 4, 5]), _states(gen(2), 5))
    _assert_same(shared, alone, "after the prefill hand-over")
    stats = dict(flushes=0, folds=0, partial=0)
    for step in range(40):
        # rows enter at different steps and in a different order each step; -1 and 99 are pad
        live = [s for s in (1, 2, 3, 4, 5) if step >= s - 1]
        rows = [live[i] for i in torch.randperm(len(live), generator=g).tolist()] + [-1, 99][: 1 + step % 2]
        ids = _ids(rows)
        h = {s: int(shared.table.committed[s]) for s in live}
        if step % 3 == 2:
            T = 1 + step % MAX_DRAFT
            tokens = [_tokens(kind, (len(rows), T), g) for kind, _ in LAYERS]
            accepted = torch.randint(1, T + 1, (len(rows),), generator=g, dtype=torch.int32)
            outs = [m.verify_commit(ids, tokens, accepted) for m in (shared, alone)]
            stats["folds"] += sum(h[s] + T > WINDOW for s in live)
            stats["partial"] += int((accepted[: len(live)] < T).sum())
        else:
            tokens = [_tokens(kind, (len(rows),), g) for kind, _ in LAYERS]
            outs = [m.decode(ids, tokens) for m in (shared, alone)]
            stats["flushes"] += sum(h[s] + 1 >= WINDOW for s in live)
        _assert_outs(*outs, f"step {step}")
        _assert_same(shared, alone, f"step {step}")
        if step == 17:  # slot 3's sequence ends; a new one takes its slot
            states = _states(gen(3), 1)
            for m in (shared, alone):
                m.load(_ids([3]), states)
            _assert_same(shared, alone, "after slot reuse")
    assert stats["flushes"] >= 10 and stats["folds"] >= 5 and stats["partial"] >= 5, stats


def test_fork_copies_every_layer_and_both_copies_continue_alike():
    """fork_slots: the forked slot decodes exactly as its source from then on, in every layer;
    pad rows and rows naming no slot skip; materialize_states is the float64 materialize in fp32."""
    g = gen(4)
    m = Model(True)
    m.load(_ids([1, 2]), _states(gen(5), 2))
    for step in range(WINDOW + 2):  # slot 1 and 2 at different ring positions, past a flush
        rows = [1, 2] if step % 2 else [1]
        m.decode(_ids(rows), [_tokens(kind, (len(rows),), g) for kind, _ in LAYERS])
    before = [{n: t.clone() for n, t in _slot_tensors(c).items()} for c in m.caches]
    table_before = [getattr(m.table, n).clone() for n in TABLE]
    rs.fork_slots(m.table, m.caches, _ids([1, -1, 2]), _ids([4, 5, -1]))  # rows 2 and 3 skip
    for c, snap in zip(m.caches, before):
        for name, t in _slot_tensors(c).items():
            assert torch.equal(_bits(t[4]), _bits(snap[name][1])), name
            keep = [s for s in range(SLOTS) if s != 4]
            assert torch.equal(_bits(t[keep]), _bits(snap[name][keep])), f"fork wrote {name} outside slot 4"
    for n, t in zip(TABLE, table_before):
        got = getattr(m.table, n)
        assert int(got[4]) == int(t[1]) and torch.equal(got[[0, 1, 2, 3, 5, 6]], t[[0, 1, 2, 3, 5, 6]]), n
    flushed = False  # SR bits are keyed by slot: an SR checkpoint's fork rounds its own way from its first flush
    for step in range(2 * WINDOW + 1):
        token = [_tokens(kind, (1,), g) for kind, _ in LAYERS]
        twice = [{k: torch.cat([v, v]) for k, v in t.items()} for t in token]
        flushed |= int(m.table.committed[1]) + 1 >= WINDOW
        outs = m.decode(_ids([1, 4]), twice)
        for i, o in enumerate(outs):
            if flushed and LAYERS[i][1].get("checkpoint_format", "fp32") != "fp32":
                torch.testing.assert_close(o[0], o[1], rtol=0.1, atol=1e-2 * float(o[0].abs().max()))
            else:
                assert torch.equal(o[0], o[1]), f"step {step} layer {i}: the fork diverged"
    assert flushed
    for (kind, options), c in zip(LAYERS, m.caches):
        sr = options.get("checkpoint_format", "fp32") != "fp32"
        assert torch.equal(_bits(c.checkpoint[1]), _bits(c.checkpoint[4])) != sr, "SR bits are the slot's own"
    for (kind, _), c, p in zip(LAYERS, m.caches, m.params):
        A = p["A"] if kind == "mamba2" else None
        got = rs.materialize_states(c, _ids([4, -1, 1, 2]), A)
        want = c.materialize([4, 1, 2], A) if kind == "mamba2" else c.materialize([4, 1, 2])
        assert got.dtype == torch.float32 and torch.equal(got[1], torch.zeros_like(got[1]))
        assert torch.equal(got[[0, 2, 3]], want.to(torch.float32)), kind


def test_stale_ring_records_never_reach_outputs_or_states():
    """Slots reused after a sequence that left NaN records in every ring position: the records
    not yet rewritten weigh nothing anywhere (outputs, flush folds, verify, materialised states),
    so every step matches a model whose rings were clean, bit for bit. The kernels' twin checks
    are the poisoned cases of tests/kernels/test_mamba2_gpu.py and test_spec_gpu.py."""
    clean, poisoned = Model(shared=True), Model(shared=True)
    g = gen(7)
    ids = torch.tensor([0, 2, 5], dtype=torch.int32)
    states = _states(g, len(ids))
    for m in (clean, poisoned):
        m.load(ids, states)
    for cache in poisoned.caches:
        for name, t in _slot_tensors(cache).items():
            if name.startswith("ring_"):
                t[ids.long()] = float("nan")
    for step in range(3 * WINDOW):
        if step % 3 == 2:
            T = 1 + step % MAX_DRAFT
            tokens = [_tokens(kind, (len(ids), T), g) for kind, _ in LAYERS]
            accepted = torch.randint(1, T + 1, (len(ids),), generator=g, dtype=torch.int32)
            outs = [m.verify_commit(ids, tokens, accepted) for m in (clean, poisoned)]
        else:
            tokens = [_tokens(kind, (len(ids),), g) for kind, _ in LAYERS]
            outs = [m.decode(ids, tokens) for m in (clean, poisoned)]
        _assert_outs(*outs, f"step {step}")
        for (kind, _), a, b, p in zip(LAYERS, clean.caches, poisoned.caches, clean.params):
            A = p["A"] if kind == "mamba2" else None
            assert torch.equal(rs.materialize_states(a, ids, A), rs.materialize_states(b, ids, A)), \
                f"step {step}: {kind} materialized state"


def test_reset_and_fork_without_live_rows_write_nothing():
    m = Model(True)
    m.load(_ids([1, 2]), _states(gen(6), 2))
    snap = [{n: t.clone() for n, t in _slot_tensors(c).items()} for c in m.caches]
    table = [getattr(m.table, n).clone() for n in TABLE]
    rs.reset_slots(m.table, m.caches, _ids([-1, 7]), _states(gen(7), 2))
    rs.fork_slots(m.table, m.caches, _ids([-1, 1]), _ids([2, 99]))
    for c, s in zip(m.caches, snap):
        for n, t in _slot_tensors(c).items():
            assert torch.equal(_bits(t), _bits(s[n])), n
    for n, t in zip(TABLE, table):
        assert torch.equal(getattr(m.table, n), t), n


def _snapshot(m):
    return ([{n: t.clone() for n, t in _slot_tensors(c).items()} for c in m.caches],
            [getattr(m.table, n).clone() for n in TABLE])


def _assert_unchanged(m, snap, what):
    caches, table = snap
    for c, s in zip(m.caches, caches):
        for n, t in _slot_tensors(c).items():
            assert torch.equal(_bits(t), _bits(s[n])), f"{what} wrote {n}"
    for n, t in zip(TABLE, table):
        assert torch.equal(getattr(m.table, n), t), f"{what} moved the table's {n}"


def test_protocol_misuse_is_refused_before_anything_is_written():
    g = gen(8)
    m = Model(True)
    m.load(_ids([1, 2]), _states(gen(9), 2))
    ids = _ids([1, 2])
    kind, cache, params = LAYERS[0][0], m.caches[0], m.params[0]
    tok = _tokens(kind, (2,), g)
    other = SequenceTable(SLOTS, WINDOW, MAX_DRAFT)

    def refused(what, fn, match, exc=ValueError):
        snap = _snapshot(m)
        with pytest.raises(exc, match=match):
            fn()
        _assert_unchanged(m, snap, what)

    refused("a plan-less decode on a shared cache", lambda: decode(cache, *_args(kind, tok, params, ids)), "'plan'")
    plan = m.table.plan_decode(ids)
    refused("another table's plan", lambda: decode(cache, *_args(kind, tok, params, ids),
                                                   plan=other.plan_decode(ids)), "another table")
    refused("other slot ids than the plan's", lambda: decode(cache, *_args(kind, tok, params, ids.clone()),
                                                             plan=plan), "'slot_ids'")
    m.table.plan_decode(ids)  # the table moved on: `plan` is stale
    refused("a stale plan", lambda: decode(cache, *_args(kind, tok, params, ids), plan=plan), "stale")
    refused("load_prefill on a shared cache", lambda: cache.load_prefill([1], _states(g, 1)[0]), "shares")
    vplan = m.table.plan_verify(ids, 2)
    vtok = _tokens(kind, (2, 2), g)
    refused("a decode while a verify awaits its commit",
            lambda: decode(cache, *_args(kind, tok, params, ids), plan=vplan), "awaits its commit")
    refused("a decode plan during a pending verify", lambda: m.table.plan_decode(ids), "awaits its commit",
            RuntimeError)
    refused("a verify of another T than planned", lambda: verify(cache, *_args(kind, _tokens(kind, (2, 3), g),
                                                                              params, ids), plan=vplan), "'plan'")
    refused("a reset during a pending verify", lambda: rs.reset_slots(m.table, m.caches, ids, _states(g, 2)),
            "awaits its commit", RuntimeError)
    verify(cache, *_args(kind, vtok, params, ids), plan=vplan)
    refused("a commit of another plan", lambda: m.table.commit(plan, torch.ones(2, dtype=torch.int32)), "pending")
    refused("a commit with accepted counts out of range",
            lambda: m.table.commit(vplan, torch.tensor([1, 3], dtype=torch.int32)), "num_accepted")
    m.table.commit(vplan, torch.tensor([1, 2], dtype=torch.int32))
    refused("a second commit", lambda: m.table.commit(vplan, torch.ones(2, dtype=torch.int32)), "no verify")
    with pytest.raises(ValueError, match="table"):
        rs.Mamba2Cache(SLOTS + 1, *MAMBA2, window=WINDOW, max_draft=MAX_DRAFT, table=m.table)
    with pytest.raises(ValueError, match="share"):
        rs.reset_slots(m.table, [_cache("mamba2", {}, None)], ids, _states(g, 2)[:1])


def test_table_arguments_are_checked():
    for args, kwargs, match in [((0, 4), {}, "num_slots"), ((4, 0), {}, "window"), ((4, 1, 2), {}, "max_draft"),
                                ((4, 4, 17), {}, "max_draft"), ((4, 4), dict(pad_slot_id=3), "pad_slot_id")]:
        with pytest.raises(ValueError, match=match):
            SequenceTable(*args, **kwargs)
    t = SequenceTable(4, 4, 2)
    with pytest.raises(ValueError, match="num_drafts"):
        t.plan_verify(_ids([1]), 3)
    with pytest.raises(ValueError, match="slot_ids"):
        t.plan_decode(torch.tensor([1], dtype=torch.int64))
    with pytest.raises(ValueError, match="distinct"):
        t.plan_decode(_ids([1, 1]))
    assert t.committed.tolist() == [0, 0, 0, 0]
