"""Tests of the float64 Gated DeltaNet reference (replayssm_cute.reference, gdn_*), CPU only.

The ReplaySSM functions are checked against the plain conventional recurrence, which is
itself checked against scalar Python loops written straight from the formulas.
"""

import math

import pytest
import torch

from replayssm_cute import reference as R

from tests.helpers.inputs import F64
from tests.helpers.inputs import gen as _gen
from tests.helpers.inputs import randn as _randn
from tests.helpers.inputs import uniform as _uniform
from tests.helpers.numerics import assert_rel

# Qwen3.5-4B-like, small: 2 key heads, 6 value heads (3 per key head), K = V = 16.
H, HV, K, V = 2, 6, 16, 16


# ----------------------------------------------------------------------------- helpers


def _layer(g, hv=HV):
    """Realistic GDN parameters: A_log = log U(1, 8), dt_bias = U(-4, -2)."""
    return torch.log(_uniform(g, 1.0, 8.0, hv)), _uniform(g, -4.0, -2.0, hv)


def _token(g, b, h=H, hv=HV, k=K, v=V):
    return dict(q=_randn(g, b, h, k), k=_randn(g, b, h, k), v=_randn(g, b, hv, v),
                a=_randn(g, b, hv), b=_randn(g, b, hv))


def _records(g, b, n, h=H, hv=HV):
    """n records: u random, k unit-norm keys, g = log decays in about [-1.2, -0.01]."""
    kk = _randn(g, b, n, h, K)
    kk = kk / kk.norm(dim=-1, keepdim=True)
    return _randn(g, b, n, hv, V), kk, -_uniform(g, 0.01, 1.2, b, n, hv)


def _empty(b, h=H, hv=HV):
    return (torch.zeros(b, 0, hv, V, dtype=F64), torch.zeros(b, 0, h, K, dtype=F64),
            torch.zeros(b, 0, hv, dtype=F64))


def _fold_loop(S, u, k, g):
    """S = exp(g) S + u k^T, one value head at a time (head hv reads key head hv // ratio)."""
    S = S.clone()
    nh, nkh = S.shape[1], k.shape[1]
    for hv in range(nh):
        kh = hv // (nh // nkh)
        S[:, hv] = torch.exp(g[:, hv])[:, None, None] * S[:, hv] + u[:, hv, :, None] * k[:, kh, None, :]
    return S


# ----------------------------------------------------------------------------- gates / normalize


def test_gdn_gates_matches_formula():
    # a + dt_bias = -33, -4, 0, 15.5, 20 (not above the softplus threshold), 23 (above it)
    a = torch.tensor([[-30.0, -1.5, 0.0, 14.0, 19.0, 25.0]], dtype=F64)
    b = torch.tensor([[-40.0, -2.0, 0.0, 0.5, 3.0, 40.0]], dtype=F64)
    A_log = torch.tensor([0.0, 0.5, 1.0, -1.0, 2.0, 0.25], dtype=F64)
    dt_bias = torch.tensor([-3.0, -2.5, 0.0, 1.5, 1.0, -2.0], dtype=F64)
    g, beta = R.gdn_gates(a, b, A_log, dt_bias)
    assert g[0, 4].item() != -20.0 * math.exp(2.0) and g[0, 5].item() == -23.0 * math.exp(0.25)
    assert g.dtype == F64 and beta.dtype == F64 and g.shape == beta.shape == (1, 6)
    for i in range(6):
        x = a[0, i].item() + dt_bias[i].item()
        sp = x if x > 20 else math.log1p(math.exp(x))
        assert g[0, i].item() == pytest.approx(-math.exp(A_log[i].item()) * sp, rel=1e-14, abs=1e-300)
        assert beta[0, i].item() == pytest.approx(1.0 / (1.0 + math.exp(-b[0, i].item())), rel=1e-14)
    assert bool((g < 0).all()) and bool((beta > 0).all()) and bool((beta <= 1).all())
    # low-precision inputs are used exactly
    g32, beta32 = R.gdn_gates(a.float(), b.bfloat16(), A_log.float(), dt_bias.float())
    assert g32.dtype == F64 and torch.equal(g32, g)
    assert torch.equal(beta32, torch.sigmoid(b.bfloat16().double()))


def test_gdn_normalize_matches_formula():
    g = _gen(1)
    q, k = _randn(g, 2, H, 5).float(), _randn(g, 2, H, 5).bfloat16()
    k[1, 1] = 0  # an all-zero key stays finite (the 1e-6 keeps the norm away from zero)
    q_before, k_before = q.clone(), k.clone()
    qn, kn = R.gdn_normalize(q, k)
    assert qn.dtype == F64 and kn.dtype == F64 and qn.shape == q.shape and kn.shape == k.shape
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "inputs were modified"
    for r in range(2):
        for h in range(H):
            qq, kk = q[r, h].double().tolist(), k[r, h].double().tolist()
            nq = math.sqrt(sum(x * x for x in qq) + 1e-6)
            nk = math.sqrt(sum(x * x for x in kk) + 1e-6)
            for i in range(5):
                assert qn[r, h, i].item() == pytest.approx(qq[i] / nq * 5 ** -0.5, rel=1e-14, abs=1e-300)
                assert kn[r, h, i].item() == pytest.approx(kk[i] / nk, rel=1e-14, abs=1e-300)
    assert not kn[1, 1].any() and torch.isfinite(kn).all()
    assert_rel(kn[0].norm(dim=-1), torch.ones(H, dtype=F64), 1e-5, "unit norm")
    qs, ks = R.gdn_normalize(q, k, scale=0.3)
    assert torch.equal(ks, kn)
    assert_rel(qs, qn / 5 ** -0.5 * 0.3, 1e-15, "explicit scale")


# ----------------------------------------------------------------------------- conventional


def _loop_conventional(state, q, k, v, a, b, A_log, dt_bias, scale):
    """Scalar-loop version of the documented recurrence (independent of the tensor code)."""
    nb, nh, vd, kd = state.shape
    nkh = q.shape[1]
    S = state.tolist()
    o = [[[0.0] * vd for _ in range(nh)] for _ in range(nb)]
    for r in range(nb):
        for hv in range(nh):
            kh = hv // (nh // nkh)
            qq, kk = q[r, kh].tolist(), k[r, kh].tolist()
            nq = math.sqrt(sum(x * x for x in qq) + 1e-6)
            nk = math.sqrt(sum(x * x for x in kk) + 1e-6)
            qq = [x / nq * scale for x in qq]
            kk = [x / nk for x in kk]
            x = a[r, hv].item() + dt_bias[hv].item()
            gg = -math.exp(A_log[hv].item()) * (x if x > 20 else math.log1p(math.exp(x)))
            alpha = math.exp(gg)
            beta = 1.0 / (1.0 + math.exp(-b[r, hv].item()))
            for p in range(vd):
                sk = sum(S[r][hv][p][n] * kk[n] for n in range(kd))
                u = beta * (v[r, hv, p].item() - alpha * sk)
                for n in range(kd):
                    S[r][hv][p][n] = alpha * S[r][hv][p][n] + u * kk[n]
                o[r][hv][p] = sum(S[r][hv][p][n] * qq[n] for n in range(kd))
    return torch.tensor(o, dtype=F64), torch.tensor(S, dtype=F64)


@pytest.mark.parametrize("nkh,nh,scale", [(2, 4, None), (3, 3, None), (1, 3, 0.7)])
def test_conventional_step_matches_scalar_loops(nkh, nh, scale):
    g = _gen(2 + nh)
    nb, kd, vd = 2, 5, 3
    A_log, dt_bias = _layer(g, nh)
    state = _randn(g, nb, nh, vd, kd)
    t = _token(g, nb, nkh, nh, kd, vd)
    o, S = R.gdn_conventional_step(state, t["q"], t["k"], t["v"], t["a"], t["b"], A_log, dt_bias, scale)
    o_ref, S_ref = _loop_conventional(state, t["q"], t["k"], t["v"], t["a"], t["b"], A_log, dt_bias,
                                      kd ** -0.5 if scale is None else scale)
    assert o.dtype == F64 and S.dtype == F64
    assert_rel(S, S_ref, 1e-13, "state")
    assert_rel(o, o_ref, 1e-13, "o")


# ----------------------------------------------------------------------------- replay


@pytest.mark.parametrize("nkh,nh", [(H, HV), (2, 2)])
@pytest.mark.parametrize("h", [0, 1, 5, 16])
def test_replay_equals_sequential_folds(h, nkh, nh):
    g = _gen(10 + h + nh)
    ckpt = _randn(g, 3, nh, V, K)
    ru, rk, rg = _records(g, 3, h, nkh, nh)
    S = ckpt.clone()
    for j in range(h):
        S = _fold_loop(S, ru[:, j], rk[:, j], rg[:, j])
    out = R.gdn_replay(ckpt, ru, rk, rg)
    assert out.dtype == F64
    assert_rel(out, S, 1e-12, f"replay h={h}")
    out.add_(1.0)  # the result must never alias the checkpoint
    assert not torch.equal(out, ckpt)


@pytest.mark.parametrize("nkh,nh", [(H, HV), (2, 2), (1, 3)])
@pytest.mark.parametrize("h", [0, 1, 2, 7, 16])
def test_replay_output_equals_state_route(h, nkh, nh):
    g = _gen(100 * nh + h)
    ckpt = _randn(g, 2, nh, V, K)
    ru, rk, rg = _records(g, 2, h, nkh, nh)
    x = _randn(g, 2, nkh, K)
    S = R.gdn_replay(ckpt, ru, rk, rg)
    x_v = x.repeat_interleave(nh // nkh, dim=1)
    y = R.gdn_replay_output(ckpt, ru, rk, rg, x)
    assert y.dtype == F64
    assert_rel(y, (S * x_v[:, :, None, :]).sum(-1), 1e-11, f"output-only h={h}")


def test_replay_output_never_forms_the_state(monkeypatch):
    g = _gen(5)
    A_log, dt_bias = _layer(g)
    ckpt = _randn(g, 2, HV, V, K)
    ru, rk, rg = _records(g, 2, 4)
    x = _randn(g, 2, H, K)
    expected = R.gdn_replay_output(ckpt, ru, rk, rg, x)
    t = _token(g, 2)
    args = (t["q"], t["k"], t["v"], t["a"], t["b"], A_log, dt_bias)
    step_expected = R.gdn_replay_step(ckpt, ru, rk, rg, *args, window=16)

    def forbidden(*a, **k):
        raise AssertionError("output-only route called gdn_replay")

    monkeypatch.setattr(R.gdn, "gdn_replay", forbidden)
    assert torch.equal(R.gdn_replay_output(ckpt, ru, rk, rg, x), expected)
    step = R.gdn_replay_step(ckpt, ru, rk, rg, *args, window=16)  # non-flush: S never formed
    assert all(torch.equal(a_, b_) for a_, b_ in zip(step, step_expected))
    with pytest.raises(AssertionError, match="gdn_replay"):  # a flush folds the ring
        R.gdn_replay_step(ckpt, ru, rk, rg, *args, window=5)


# ----------------------------------------------------------------------------- replay step


@pytest.mark.parametrize(
    "L,nkh,nh,scale",
    [(16, H, HV, None), (3, H, HV, None), (5, 2, 2, 0.5), (16, 2, 2, None), (7, 1, 3, None)],
)
def test_replay_step_equals_conventional_over_five_windows(L, nkh, nh, scale):
    g = _gen(1000 + 10 * L + nh)
    b = 3
    A_log, dt_bias = _layer(g, nh)
    S = _randn(g, b, nh, V, K)  # conventional state
    ckpt = S.clone()
    ru, rk, rg = _empty(b, nkh, nh)
    flushes = 0
    for step in range(5 * L + 2):
        t = _token(g, b, nkh, nh)
        h = ru.shape[1]
        o, new_ckpt, nu, nk, ng = R.gdn_replay_step(
            ckpt, ru, rk, rg, t["q"], t["k"], t["v"], t["a"], t["b"], A_log, dt_bias, scale, window=L
        )
        # the correction from the conventional state before the token
        qn, kn = R.gdn_normalize(t["q"], t["k"], scale)
        gg, beta = R.gdn_gates(t["a"], t["b"], A_log, dt_bias)
        Sk = (S * kn.repeat_interleave(nh // nkh, dim=1)[:, :, None, :]).sum(-1)
        u_expect = beta[..., None] * (t["v"] - torch.exp(gg)[..., None] * Sk)
        o_conv, S = R.gdn_conventional_step(S, t["q"], t["k"], t["v"], t["a"], t["b"], A_log, dt_bias, scale)
        assert o.dtype == F64
        assert_rel(o, o_conv, 1e-10, f"o at step {step}")
        if h + 1 == L:
            flushes += 1
            assert nu.shape[1] == nk.shape[1] == ng.shape[1] == 0
            assert_rel(new_ckpt, S, 1e-10, f"checkpoint after flush at step {step}")
        else:
            assert torch.equal(new_ckpt, ckpt), "a non-flush step changed the checkpoint"
            assert nu.shape == (b, h + 1, nh, V) and nk.shape == (b, h + 1, nkh, K) and ng.shape == (b, h + 1, nh)
            assert torch.equal(nu[:, :h], ru) and torch.equal(nk[:, :h], rk) and torch.equal(ng[:, :h], rg)
            assert_rel(nu[:, h], u_expect, 1e-10, f"u at step {step}")
            assert torch.equal(nk[:, h], kn) and torch.equal(ng[:, h], gg)
            assert_rel(R.gdn_replay(new_ckpt, nu, nk, ng), S, 1e-10, f"replayed state at step {step}")
        ckpt, ru, rk, rg = new_ckpt, nu, nk, ng
    assert flushes == 5


def test_replay_step_window_one_is_conventional():
    g = _gen(7)
    A_log, dt_bias = _layer(g)
    S = _randn(g, 2, HV, V, K)
    ckpt = S.clone()
    for step in range(4):
        t = _token(g, 2)
        args = (t["q"], t["k"], t["v"], t["a"], t["b"], A_log, dt_bias)
        o, ckpt, nu, nk, ng = R.gdn_replay_step(ckpt, *_empty(2), *args, window=1)
        o_conv, S = R.gdn_conventional_step(S, *args)
        assert nu.shape[1] == nk.shape[1] == ng.shape[1] == 0
        assert_rel(o, o_conv, 1e-12, f"o step {step}")
        assert_rel(ckpt, S, 1e-12, f"state step {step}")


def test_replay_step_argument_errors():
    g = _gen(8)
    A_log, dt_bias = _layer(g)
    ckpt = _randn(g, 1, HV, V, K)
    ru, rk, rg = _records(g, 1, 3)
    t = _token(g, 1)
    args = (t["q"], t["k"], t["v"], t["a"], t["b"], A_log, dt_bias)
    with pytest.raises(ValueError, match="window"):
        R.gdn_replay_step(ckpt, ru, rk, rg, *args, window=3)  # h == window
    with pytest.raises(ValueError, match="window"):
        R.gdn_replay_step(ckpt, ru, rk, rg, *args, window=0)
    with pytest.raises(ValueError, match="same number of records"):
        R.gdn_replay_step(ckpt, ru, rk[:, :2], rg, *args, window=8)
    with pytest.raises(ValueError, match="multiple of num_k_heads"):
        R.gdn_conventional_step(ckpt, _randn(g, 1, 4, K), _randn(g, 1, 4, K), *args[2:])
