"""The speculative protocol and the argument rules of the public API, on CPU caches.

* verify, then commit, then anything else: while a verify awaits its commit every other op on
  the cache (decode, verify, load_prefill, materialize, read_state) is refused and changes
  nothing, and the commit afterwards gives exactly what a run without the refused call gives;
* commit takes the slot ids of the verify it follows, row for row (CPU path, debug or not);
* materialize takes every form of A that decode takes and skips the pad id as decode does;
* caches off the CPU refuse shapes the GPU kernels cannot run at construction (a CPU cache, the
  reference backend, takes any shape);
* out allocated by a call has zero pad rows; ``config`` must be a launch config or None; inputs
  that require grad are refused while autograd records (the kernels are inference-only).

Bit-identity after a refused call covers every tensor of the cache and its pending verify.
Values are checked against float64 references on random, never-zero inputs.
"""

import copy

import pytest
import torch

from replayssm_cute import GDNCache, Mamba2Cache, commit, decode, snapshot_verify, verify
from replayssm_cute import reference as R

from tests.helpers.inputs import F64, gen, randn, uniform
from tests.helpers.numerics import rel_err

H, P, N, G = 4, 16, 32, 2  # Mamba-2
HV, V, K, KH = 4, 16, 32, 2  # GDN: value heads, V, K, key heads
SLOTS, L, DRAFTS, T = 6, 4, 3, 2
LIVE = [3, 1, 5]
IDS = [3, -1, 1, 5]  # a pad row among the live ones
ACCEPTED = [2, 1, 1, 2]  # the pad row's value is ignored
PROTOCOL = "verify, then commit, then"


def _ids(ids):
    return torch.tensor(ids, dtype=torch.int32)


class Mamba2Layer:
    """A Mamba-2 layer with fp32 activations and its API calls on a cache."""

    kind = "mamba2"
    TOKENS = ("x", "dt", "B", "C", "z")

    def __init__(self, seed=0):
        self.g = g = gen(seed)
        self.A = -uniform(g, 0.5, 1.5, H)
        self.D = randn(g, H)
        self.dt_bias = uniform(g, -1.0, 0.0, H)

    def cache(self, num_slots=SLOTS, dims=(H, P, N, G), **kw):
        kw = {"window": L, "max_draft": DRAFTS, "dtype": torch.float32, **kw}
        return Mamba2Cache(num_slots, *dims, **kw)

    def state(self, n):
        return 0.3 * randn(self.g, n, H, P, N)

    def tokens(self, lead):
        g = self.g
        return dict(x=randn(g, *lead, H, P), dt=randn(g, *lead, H), B=randn(g, *lead, G, N),
                    C=randn(g, *lead, G, N), z=randn(g, *lead, H, P))

    def args(self, ids, lead, tok=None):
        """API keyword arguments, fp32: the float64 tokens `tok`, else fresh ones laid out `lead` + (...)."""
        tok = {n: t.float() for n, t in (tok or self.tokens(lead)).items()}
        return dict(tok, A=self.A.float(), slot_ids=_ids(ids), D=self.D.float(), dt_bias=self.dt_bias.float(),
                    dt_softplus=True)

    def step(self, S, tok, r):
        """float64 (output, state) of row r's token from state S."""
        row = slice(r, r + 1)
        return R.mamba2_conventional_step(S, tok["x"][row], tok["dt"][row], self.A, tok["B"][row], tok["C"][row],
                                          D=self.D, z=tok["z"][row], dt_bias=self.dt_bias, dt_softplus=True)

    def materialize(self, cache, ids):
        return cache.materialize(ids, self.A.float())

    def out_shape(self):
        return (H, P)


class GDNLayer:
    """A Gated DeltaNet layer with fp32 activations and its API calls on a cache."""

    kind = "gdn"
    TOKENS = ("q", "k", "v", "a", "b")

    def __init__(self, seed=0):
        self.g = g = gen(seed)
        self.A_log = torch.log(uniform(g, 1.0, 8.0, HV))
        self.dt_bias = uniform(g, -4.0, -2.0, HV)

    def cache(self, num_slots=SLOTS, dims=(HV, V, K, KH), **kw):
        kw = {"window": L, "max_draft": DRAFTS, "dtype": torch.float32, **kw}
        return GDNCache(num_slots, *dims, **kw)

    def state(self, n):
        return 0.3 * randn(self.g, n, HV, V, K)

    def tokens(self, lead):
        g = self.g
        return dict(q=randn(g, *lead, KH, K), k=randn(g, *lead, KH, K), v=randn(g, *lead, HV, V),
                    a=randn(g, *lead, HV), b=randn(g, *lead, HV))

    def args(self, ids, lead, tok=None):
        tok = {n: t.float() for n, t in (tok or self.tokens(lead)).items()}
        return dict(tok, A_log=self.A_log.float(), dt_bias=self.dt_bias.float(), slot_ids=_ids(ids))

    def step(self, S, tok, r):
        row = slice(r, r + 1)
        return R.gdn_conventional_step(S, tok["q"][row], tok["k"][row], tok["v"][row], tok["a"][row],
                                       tok["b"][row], self.A_log, self.dt_bias)

    def materialize(self, cache, ids):
        return cache.materialize(ids)

    def out_shape(self):
        return (HV, V)


LAYERS = {"mamba2": Mamba2Layer, "gdn": GDNLayer}


def _bits(cache):
    """Every tensor of the cache (bit patterns) and its pending verify."""
    named = {n: t for n, t in vars(cache).items() if isinstance(t, torch.Tensor)}
    named.update(committed=cache.table.committed, origin=cache.table.origin, sr_writes=cache.table.sr_writes)
    tensors = {n: t.detach().clone().contiguous().view(-1).view(torch.uint8) for n, t in named.items()}
    return tensors, getattr(cache, "pending_drafts", None)


def assert_bits(cache, bits):
    tensors, pending = _bits(cache)
    assert tensors.keys() == bits[0].keys()
    for n, t in tensors.items():
        assert torch.equal(t, bits[0][n]), f"cache.{n} was written"
    assert pending == bits[1], "the pending verify changed"


def _with_records(layer, **kw):
    """A cache whose live slots hold ring records at different cursors (1, 2, 3 after prefill
    and up to three decode steps), with the float64 state of each live slot."""
    cache = layer.cache(**kw)
    S0 = layer.state(len(LIVE))
    cache.load_prefill(LIVE, S0.float())
    ref = {s: S0[i : i + 1].float().to(F64) for i, s in enumerate(LIVE)}
    for step in range(3):
        ids = LIVE[step:] + [cache.pad_slot_id]
        tok = layer.tokens((len(ids),))
        decode(cache, **layer.args(ids, None, tok))
        for r, s in enumerate(ids[:-1]):
            ref[s] = layer.step(ref[s], tok, r)[1]
    assert sorted(int(cache.cursor[s]) for s in LIVE) == [1, 2, 3]
    return cache, ref


# ============================================================================= issue item 2: materialize


def test_materialize_takes_every_A_form_that_decode_takes():
    """A (H,) fp32, its stride-0 expansion (H, P, N) (vLLM's form, which decode takes) and (H,)
    fp64 give the same state, the float64 recurrence's, on slots holding ring records."""
    layer = Mamba2Layer(1)
    cache, ref = _with_records(layer)
    A32 = layer.A.float()
    forms = {"(H,)": A32, "stride-0 (H, P, N)": A32[:, None, None].expand(H, P, N), "(H,) fp64": layer.A}
    mats = {name: cache.materialize(LIVE, A) for name, A in forms.items()}
    expected = torch.cat([ref[s] for s in LIVE])
    for name, mat in mats.items():
        assert mat.dtype == F64
        assert rel_err(mat, expected) < 1e-6, name
    assert torch.equal(mats["(H,)"], mats["stride-0 (H, P, N)"])


BAD_A = {
    "H+1": lambda A: torch.full((H + 1,), -1.0),
    "(H, P, N) materialised": lambda A: A[:, None, None].expand(H, P, N).contiguous(),
    "(H, P) stride 0": lambda A: A[:, None].expand(H, P),
    "(H, N, P) stride 0": lambda A: A[:, None, None].expand(H, N, P),
    "int": lambda A: torch.ones(H, dtype=torch.int32),
    "bf16": lambda A: A.bfloat16(),
    "list": lambda A: A.tolist(),
    "None": lambda A: None,
    "on meta": lambda A: torch.empty(H, device="meta"),
}


@pytest.mark.parametrize("case", list(BAD_A))
def test_materialize_refuses_an_A_decode_refuses(case):
    layer = Mamba2Layer(2)
    cache, _ = _with_records(layer)
    with pytest.raises(ValueError, match="'A'"):
        cache.materialize(LIVE, BAD_A[case](layer.A.float()))


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("pad", [-1, 0])
def test_materialize_skips_the_pad_id_as_decode_does(kind, pad):
    """Rows naming the pad sentinel come back zero (no state is read for them); the other rows
    are the states of their slots. Ids outside the pool are still refused."""
    layer = LAYERS[kind](3)
    cache, ref = _with_records(layer, pad_slot_id=pad)
    ids = [5, pad, 1, pad, 3]
    mat = layer.materialize(cache, torch.tensor(ids))
    assert not mat[1].any() and not mat[3].any()
    assert torch.equal(mat[[0, 2, 4]], layer.materialize(cache, [5, 1, 3]))
    assert rel_err(mat[[0, 2, 4]], torch.cat([ref[s] for s in (5, 1, 3)])) < 2e-3
    for bad in ([SLOTS], [-2] if pad == -1 else [-1]):
        with pytest.raises(ValueError, match="slot_ids"):
            layer.materialize(cache, bad)


# ============================================================================= issue item 3: verify pending


def _pending_op(layer, op, cache):
    """Run the op named `op` on `cache`: one that reads or writes slot state."""
    if op == "decode":
        decode(cache, **layer.args(IDS, (len(IDS),)))
    elif op == "verify":
        verify(cache, **layer.args(IDS, (len(IDS), T)))
    elif op == "verify packed":
        args = layer.args(IDS, (len(IDS), T))
        packed = {n: args[n].flatten(0, 1) for n in layer.TOKENS}
        verify(cache, **{**args, **packed}, cu_seqlens=torch.arange(len(IDS) + 1, dtype=torch.int32) * T,
               num_drafts=T)
    elif op == "load_prefill":
        cache.load_prefill([2], layer.state(1).float())
    elif op == "materialize":
        layer.materialize(cache, LIVE)
    elif op == "read_state":
        cache.read_state(LIVE)
    else:
        raise AssertionError(op)


OPS = ["decode", "verify", "verify packed", "load_prefill", "materialize", "read_state"]


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("op", OPS)
def test_every_op_is_refused_while_a_verify_is_pending(kind, op):
    """Between verify and commit, `op` raises naming the protocol and writes nothing; the commit
    then gives exactly the cache of a run without it, and after the commit `op` runs again.
    (decode there would overwrite a draft with its record: the state ends 60-80% off.)"""
    layer = LAYERS[kind](4)
    cache, _ = _with_records(layer)
    twin = copy.deepcopy(cache)
    args = layer.args(IDS, (len(IDS), T))
    verify(cache, **args)
    verify(twin, **args)
    assert cache.pending_drafts == T
    bits = _bits(cache)
    with pytest.raises(ValueError, match=PROTOCOL) as e:
        _pending_op(layer, op, cache)
    assert "commit(" in str(e.value), str(e.value)
    assert_bits(cache, bits)
    commit(cache, _ids(IDS), _ids(ACCEPTED))
    commit(twin, _ids(IDS), _ids(ACCEPTED))
    assert_bits(cache, _bits(twin))
    assert cache.pending_drafts is None
    _pending_op(layer, op, cache)  # refused no longer
    if op.startswith("verify"):
        commit(cache, _ids(IDS), _ids(ACCEPTED))


def test_snapshot_verify_never_meets_a_pending_verify():
    """snapshot_verify runs on conventional caches (window 1) only, which have no draft room:
    verify refuses them, so no verify can be pending where snapshot_verify runs."""
    layer = Mamba2Layer(5)
    conv = layer.cache(window=1, max_draft=0)
    with pytest.raises(ValueError, match="max_draft"):
        verify(conv, **layer.args(IDS, (len(IDS), 1)))
    assert conv.pending_drafts is None


# ============================================================================= issue item 4: commit's slot ids


WRONG_COMMIT_IDS = {
    "a slot never verified": [3, -1, 1, 4],
    "rows permuted": [5, -1, 1, 3],
    "a live row as pad": [3, -1, -1, 5],
    "a row fewer": [3, -1, 1],
    "a row more": [3, -1, 1, 5, 2],
}


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("case", list(WRONG_COMMIT_IDS))
@pytest.mark.parametrize("debug", ["0", "1"])
def test_commit_refuses_slot_ids_other_than_the_verified_ones(monkeypatch, kind, case, debug):
    """A commit naming other slots than its verify (or the same in another row order) is refused
    on the CPU path, debug or not, writes nothing and keeps the verify pending; the right commit
    then applies exactly."""
    monkeypatch.setenv("REPLAYSSM_CUTE_DEBUG", debug)
    layer = LAYERS[kind](6)
    cache, _ = _with_records(layer)
    twin = copy.deepcopy(cache)
    args = layer.args(IDS, (len(IDS), T))
    verify(cache, **args)
    verify(twin, **args)
    bits = _bits(cache)
    wrong = WRONG_COMMIT_IDS[case]
    accepted = (ACCEPTED + [1])[: len(wrong)]
    with pytest.raises(ValueError, match="'slot_ids'") as e:
        commit(cache, _ids(wrong), _ids(accepted))
    assert "verify" in str(e.value), str(e.value)
    assert_bits(cache, bits)
    commit(cache, _ids(IDS), _ids(ACCEPTED))
    commit(twin, _ids(IDS), _ids(ACCEPTED))
    assert_bits(cache, _bits(twin))


def test_commit_after_verify_follows_the_float64_recurrence():
    """The commit of the verified ids moves exactly those slots: after it, every live slot's
    state is the float64 recurrence over its accepted drafts and the untouched slot is as it was."""
    layer = Mamba2Layer(7)
    cache, ref = _with_records(layer)
    before = copy.deepcopy(cache)
    tok = layer.tokens((len(IDS), T))
    verify(cache, **layer.args(IDS, None, tok))
    commit(cache, _ids(IDS), _ids(ACCEPTED))
    for r, s in enumerate(IDS):
        if s == -1:
            continue
        S = ref[s]
        for t in range(ACCEPTED[r]):
            S = layer.step(S, {n: v[:, t] for n, v in tok.items()}, r)[1]
        assert rel_err(layer.materialize(cache, [s]), S) < 1e-6, f"slot {s}"
    for s in (0, 2, 4):
        assert torch.equal(cache.checkpoint[s], before.checkpoint[s]) and int(cache.cursor[s]) == 0


# ============================================================================= shapes at construction


MAMBA2_GPU_REFUSED = {
    "dstate 17": (dict(dims=(H, P, 17, G)), "dstate"),
    "dstate 288": (dict(dims=(H, P, 288, G)), "dstate"),
    "dstate 16": (dict(dims=(H, P, 16, G)), "dstate"),
    "headdim 24": (dict(dims=(H, 24, N, G)), "headdim"),
    "window 33": (dict(window=33, max_draft=0), "window"),
    "ring 33": (dict(window=20, max_draft=13), "window"),
}
GDN_GPU_REFUSED = {
    "head_v_dim 24": (dict(dims=(HV, 24, K, KH)), "head_v_dim"),
    "head_k_dim 272": (dict(dims=(HV, V, 272, KH)), "head_k_dim"),
    "head_k_dim 8": (dict(dims=(HV, V, 8, KH)), "head_k_dim"),
    "window 33": (dict(window=33, max_draft=0), "window"),
    "ring 33": (dict(window=17, max_draft=16), "window"),
}


@pytest.mark.parametrize("kind,case", [("mamba2", c) for c in MAMBA2_GPU_REFUSED]
                         + [("gdn", c) for c in GDN_GPU_REFUSED])
def test_a_cache_off_the_cpu_refuses_shapes_the_kernels_cannot_run(kind, case):
    """On any device but the CPU (here "meta", which allocates nothing) the constructor refuses
    a shape the GPU kernels refuse, naming the argument and the supported range; the CPU
    cache, the float64 reference backend, takes it."""
    layer = LAYERS[kind](8)
    kw, name = (MAMBA2_GPU_REFUSED if kind == "mamba2" else GDN_GPU_REFUSED)[case]
    with pytest.raises(ValueError, match=name) as e:
        layer.cache(device="meta", **kw)
    assert "CPU" in str(e.value), str(e.value)  # says where any shape is taken
    layer.cache(device="cpu", **kw)


def test_from_state_off_the_cpu_refuses_shapes_the_kernels_cannot_run():
    with pytest.raises(ValueError, match="dstate"):
        Mamba2Cache.from_state(torch.empty(2, H, P, 17, device="meta"), G)
    with pytest.raises(ValueError, match="head_k_dim"):
        GDNCache.from_state(torch.empty(2, HV, V, 24, device="meta"), KH)
    Mamba2Cache.from_state(torch.zeros(2, H, P, 17), G)
    GDNCache.from_state(torch.zeros(2, HV, V, 24), KH)


def test_the_edges_of_the_kernel_range_are_taken_off_the_cpu():
    Mamba2Layer().cache(device="meta", dims=(H, 16, 32, G), window=16, max_draft=16)
    Mamba2Layer().cache(device="meta", dims=(H, 80, 256, G), window=32, max_draft=0)
    GDNLayer().cache(device="meta", dims=(HV, 256, 16, KH), window=16, max_draft=16)
    GDNLayer().cache(device="meta", dims=(HV, 16, 256, KH), window=32, max_draft=0)


def test_construction_limits_agree_with_the_kernels_checks():
    """The host-side limits are those of the kernels' own shape checks (check_tiles), so the
    two cannot drift apart: for a grid of dims and rings, a meta cache is taken exactly when a
    16-row launch config's check_tiles takes the shape."""
    pytest.importorskip("cutlass")
    from replayssm_cute.kernels.gdn.config import GDNConfig, GDNShape
    from replayssm_cute.kernels.mamba2.config import Mamba2Config, Mamba2Shape
    from replayssm_cute.runtime.launch import cute_dtype

    bf16, fp32 = cute_dtype(torch.bfloat16), cute_dtype(torch.float32)

    def taken(make):
        try:
            make()
        except ValueError:
            return False
        return True

    for P_, N_, window, drafts in [(16, 32, 4, 3), (24, 32, 4, 0), (16, 48, 4, 0), (32, 256, 16, 16),
                                   (32, 288, 8, 0), (16, 64, 20, 13), (48, 128, 33, 0), (16, 16, 2, 1)]:
        shape = Mamba2Shape(H, P_, N_, G, window, window + drafts, bf16, bf16, True, False, True, True, -1)
        kernel_takes = Mamba2Config(16, 1).check_tiles(shape) is None
        assert taken(lambda: Mamba2Layer().cache(device="meta", dims=(H, P_, N_, G), window=window,
                                                 max_draft=drafts)) == kernel_takes, (P_, N_, window, drafts)
    for V_, K_, window, drafts in [(16, 32, 4, 3), (24, 32, 4, 0), (16, 8, 4, 0), (256, 256, 16, 16),
                                   (272, 16, 8, 0), (16, 64, 20, 13), (32, 32, 33, 0)]:
        shape = GDNShape(HV, V_, K_, KH, window, window + drafts, bf16, bf16, fp32, fp32, 0.0, False, -1)
        kernel_takes = GDNConfig(16, 1).check_tiles(shape) is None
        assert taken(lambda: GDNLayer().cache(device="meta", dims=(HV, V_, K_, KH), window=window,
                                              max_draft=drafts)) == kernel_takes, (V_, K_, window, drafts)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_a_cpu_cache_of_any_shape_decodes_as_the_float64_recurrence(kind):
    """The CPU path (the reference) on a shape no kernel runs: odd dims, a ring of 36."""
    layer = LAYERS[kind](9)
    dims = (H, 12, 17, G) if kind == "mamba2" else (HV, 12, 20, KH)
    cache = layer.cache(dims=dims, window=33, max_draft=3)
    state_dims = cache.checkpoint.shape[1:]
    S0 = 0.3 * randn(layer.g, 2, *state_dims)
    cache.load_prefill([1, 4], S0.float())
    ref = {s: S0[i : i + 1].float().to(F64) for i, s in enumerate((1, 4))}
    for _ in range(3):
        g = layer.g
        if kind == "mamba2":
            P_, N_ = dims[1], dims[2]
            tok = dict(x=randn(g, 2, H, P_), dt=randn(g, 2, H), B=randn(g, 2, G, N_), C=randn(g, 2, G, N_),
                       z=randn(g, 2, H, P_))
            out = decode(cache, **{n: t.float() for n, t in tok.items()}, A=layer.A.float(), slot_ids=_ids([1, 4]),
                         D=layer.D.float(), dt_bias=layer.dt_bias.float(), dt_softplus=True)
        else:
            V_, K_ = dims[1], dims[2]
            tok = dict(q=randn(g, 2, KH, K_), k=randn(g, 2, KH, K_), v=randn(g, 2, HV, V_), a=randn(g, 2, HV),
                       b=randn(g, 2, HV))
            out = decode(cache, **{n: t.float() for n, t in tok.items()}, A_log=layer.A_log.float(),
                         dt_bias=layer.dt_bias.float(), slot_ids=_ids([1, 4]))
        for r, s in enumerate((1, 4)):
            y, ref[s] = layer.step(ref[s], tok, r)
            assert rel_err(out[r : r + 1], y) < 2e-3
    assert rel_err(layer.materialize(cache, [1, 4]), torch.cat([ref[1], ref[4]])) < 2e-3


# ============================================================================= out, config, autograd


@pytest.fixture
def poisoned_empty(monkeypatch):
    """torch.empty returns NaN (ints: 77) instead of whatever memory held: code that reads
    memory it never wrote shows up deterministically."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else 77)

    monkeypatch.setattr(torch, "empty", poisoned)


def _call(layer, op, cache, ids, **kw):
    """The API call `op` ("decode", "verify", "snapshot_verify") on rows `ids`."""
    if op == "decode":
        return decode(cache, **layer.args(ids, (len(ids),)), **kw)
    args = layer.args(ids, (len(ids), T))
    if op == "verify":
        return verify(cache, **args, **kw)
    state = tuple(cache.checkpoint.shape[1:])
    return snapshot_verify(cache, **args, snapshots=torch.zeros((len(ids), T) + state), **kw)


def _op_cache(layer, op):
    if op == "snapshot_verify":
        cache = layer.cache(window=1, max_draft=0)
        cache.load_prefill(LIVE, layer.state(len(LIVE)).float())
        return cache
    return _with_records(layer)[0]


CALLS = [(kind, op) for kind in LAYERS for op in ("decode", "verify", "snapshot_verify")]


@pytest.mark.parametrize("kind,op", CALLS)
def test_out_allocated_by_the_call_has_zero_pad_rows(poisoned_empty, kind, op):
    layer = LAYERS[kind](10)
    cache = _op_cache(layer, op)
    ids = [-1, 3, SLOTS + 4, 1]  # a pad row and an out-of-pool row: both skipped
    out = _call(layer, op, cache, ids)
    assert not out[0].any() and not out[2].any()
    assert bool(out[1].isfinite().all()) and bool(out[1].abs().sum() > 0)
    assert bool(out[3].isfinite().all()) and bool(out[3].abs().sum() > 0)


@pytest.mark.parametrize("kind,op", CALLS)
@pytest.mark.parametrize("config", ["fast", (16, 4), {"rows_per_cta": 16}, 16, "other layer's config"])
def test_config_must_be_a_launch_config(kind, op, config):
    """On the CPU path too, ``config`` is None or the layer's launch config class; anything else
    is refused naming it, before anything is written. The right class is taken (and unused)."""
    pytest.importorskip("cutlass")
    from replayssm_cute.kernels.gdn.config import GDNConfig
    from replayssm_cute.kernels.mamba2.config import Mamba2Config

    layer = LAYERS[kind](11)
    cache = _op_cache(layer, op)
    twin = copy.deepcopy(cache)
    configs = {"mamba2": Mamba2Config(16, 1), "gdn": GDNConfig(16, 1)}
    own, other = configs[kind], configs["gdn" if kind == "mamba2" else "mamba2"]
    if config == "other layer's config":
        config = other
    bits = _bits(cache)
    state = copy.deepcopy(layer.g.get_state())
    with pytest.raises(ValueError, match="'config'") as e:
        _call(layer, op, cache, IDS, config=config)
    assert type(own).__name__ in str(e.value), str(e.value)
    assert_bits(cache, bits)
    layer.g.set_state(state)
    out = _call(layer, op, cache, IDS, config=own)
    layer.g.set_state(state)
    assert torch.equal(out, _call(layer, op, twin, IDS))
    assert_bits(cache, _bits(twin))


GRAD_INPUTS = {"mamba2": ["x", "dt", "B", "C", "z", "A", "D", "dt_bias", "out"],
               "gdn": ["q", "k", "v", "a", "b", "A_log", "dt_bias", "mixed_qkv", "out"]}


def _grad_args(layer, op, name):
    """Arguments of `op` on IDS with `name` requiring grad (a leaf, as a Parameter is)."""
    lead = (len(IDS),) if op == "decode" else (len(IDS), T)
    args = layer.args(IDS, lead)
    if name == "out":
        args["out"] = torch.zeros(lead + layer.out_shape())
    if name == "mixed_qkv":
        args["mixed_qkv"] = torch.cat([args.pop(n).flatten(1) for n in ("q", "k", "v")], dim=1)
        args.update(q=None, k=None, v=None)
    args[name] = args[name].detach().requires_grad_(True)
    return args


@pytest.mark.parametrize("kind,op,name", [(kind, op, name) for kind in LAYERS for op in ("decode", "verify")
                                          for name in GRAD_INPUTS[kind]
                                          if not (op == "verify" and name == "mixed_qkv")])  # decode's layout
def test_inputs_that_require_grad_are_refused_while_autograd_records(kind, op, name):
    """The kernels are inference-only: with grad mode on, an input that requires grad is refused
    naming it (else the CPU path would pull the cache into the autograd graph); under
    torch.no_grad() the same call runs and no cache tensor gets a grad_fn."""
    layer = LAYERS[kind](12)
    cache = _with_records(layer)[0]
    args = _grad_args(layer, op, name)
    fn = decode if op == "decode" else verify
    bits = _bits(cache)
    with pytest.raises(ValueError, match=f"'{name}'") as e:
        fn(cache, **args)
    assert "no_grad" in str(e.value), str(e.value)
    assert_bits(cache, bits)
    with torch.no_grad():
        out = fn(cache, **args)
    assert out.grad_fn is None
    for n, t in vars(cache).items():
        if isinstance(t, torch.Tensor):
            assert t.grad_fn is None and not t.requires_grad, n


@pytest.mark.parametrize("kind,op", CALLS)
def test_pipelined_config_is_a_decode_config_only(kind, op):
    """The pipelined decode's config is taken by decode (on the CPU path, unused) and refused,
    naming 'config', by every other op, before anything is written."""
    pytest.importorskip("cutlass")
    from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig
    from replayssm_cute.kernels.mamba2.pipelined import Mamba2PipeConfig

    layer = LAYERS[kind](11)
    cache = _op_cache(layer, op)
    twin = copy.deepcopy(cache)
    config = Mamba2PipeConfig() if kind == "mamba2" else GDNPipeConfig()
    state = copy.deepcopy(layer.g.get_state())
    if op != "decode":
        bits = _bits(cache)
        with pytest.raises(ValueError, match="'config'"):
            _call(layer, op, cache, IDS, config=config)
        assert_bits(cache, bits)
        return
    out = _call(layer, op, cache, IDS, config=config)
    layer.g.set_state(state)
    assert torch.equal(out, _call(layer, op, twin, IDS))
    assert_bits(cache, _bits(twin))
