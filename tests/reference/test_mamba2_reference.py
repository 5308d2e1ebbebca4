"""Tests of the float64 reference (replayssm_cute.reference), CPU only.

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

H, P, N = 6, 16, 32  # odd-ish shape: 6 heads, groups 1, 2, 3 or 6


# ----------------------------------------------------------------------------- helpers


def _layer(g, nheads=H):
    """Realistic Mamba-2 parameters: A = -U(1, 2), dt_bias = U(-4, -3), D random."""
    A = -_uniform(g, 1.0, 2.0, nheads)
    dt_bias = _uniform(g, -4.0, -3.0, nheads)
    D = _randn(g, nheads)
    return A, dt_bias, D


def _token(g, b, G, nheads=H):
    return dict(
        x=_randn(g, b, nheads, P),
        dt=_randn(g, b, nheads),
        B=_randn(g, b, G, N),
        C=_randn(g, b, G, N),
        z=_randn(g, b, nheads, P),
    )


# ----------------------------------------------------------------------------- softplus / dt


def test_softplus_values_and_threshold():
    vals = [-50.0, -3.5, -1.0, 0.0, 0.7, 19.5, 20.0, 20.0001, 25.0, 1000.0]
    out = R.softplus(torch.tensor(vals, dtype=F64))
    for v, o in zip(vals, out.tolist()):
        expected = v if v > 20 else math.log1p(math.exp(v))
        assert o == pytest.approx(expected, rel=1e-15, abs=1e-300), v
    # x == 20 is not above the threshold: log1p(exp(20)) = 20 + 2.06e-9 in float64.
    assert out[6].item() != 20.0
    assert out[7].item() == 20.0001
    assert torch.isfinite(out).all()
    assert R.softplus(torch.tensor([1.0], dtype=torch.float32)).dtype == torch.float32


def test_mamba2_dt():
    g = _gen(1)
    dt = _randn(g, 3, H).float()
    bias = _uniform(g, -4, -3, H).float()
    out = R.mamba2_dt(dt, bias, dt_softplus=True)
    assert out.dtype == F64 and out.shape == (3, H)
    pre = dt.double() + bias.double()
    assert torch.equal(out, torch.log1p(torch.exp(pre)))
    assert torch.equal(R.mamba2_dt(dt, bias), pre)
    assert torch.equal(R.mamba2_dt(dt), dt.double())
    assert torch.equal(R.mamba2_dt(dt, None, True), torch.log1p(torch.exp(dt.double())))


# ----------------------------------------------------------------------------- conventional


def _loop_conventional(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):
    """Scalar-loop version of the documented recurrence (independent of the tensor code)."""
    b, nh, p_, n_ = state.shape
    G = B.shape[1]
    S = state.tolist()
    y = [[[0.0] * p_ for _ in range(nh)] for _ in range(b)]
    for r in range(b):
        for hd in range(nh):
            g = hd // (nh // G)
            d = dt[r, hd].item() + (dt_bias[hd].item() if dt_bias is not None else 0.0)
            if dt_softplus:
                d = d if d > 20 else math.log1p(math.exp(d))
            alpha = math.exp(A[hd].item() * d)
            for p in range(p_):
                acc = 0.0
                for n in range(n_):
                    S[r][hd][p][n] = alpha * S[r][hd][p][n] + d * x[r, hd, p].item() * B[r, g, n].item()
                    acc += S[r][hd][p][n] * C[r, g, n].item()
                if D is not None:
                    acc += D[hd].item() * x[r, hd, p].item()
                if z is not None:
                    zz = z[r, hd, p].item()
                    acc *= zz / (1.0 + math.exp(-zz))
                y[r][hd][p] = acc
    return torch.tensor(y, dtype=F64), torch.tensor(S, dtype=F64)


@pytest.mark.parametrize("with_dz", [True, False])
def test_conventional_step_matches_scalar_loops(with_dz):
    g = _gen(2)
    b, nh, p_, n_, G = 2, 4, 3, 5, 2
    A, dt_bias, D = _layer(g, nh)
    state = _randn(g, b, nh, p_, n_)
    x, dt = _randn(g, b, nh, p_), _randn(g, b, nh)
    B, C, z = _randn(g, b, G, n_), _randn(g, b, G, n_), _randn(g, b, nh, p_)
    if not with_dz:
        D = z = None
    y, S = R.mamba2_conventional_step(state, x, dt, A, B, C, D, z, dt_bias, True)
    y_ref, S_ref = _loop_conventional(state, x, dt, A, B, C, D, z, dt_bias, True)
    assert y.dtype == F64 and S.dtype == F64
    assert_rel(S, S_ref, 1e-13, "state")
    assert_rel(y, y_ref, 1e-13, "y")


def test_conventional_step_accepts_low_precision_inputs():
    g = _gen(3)
    A, dt_bias, D = _layer(g)
    t = _token(g, 2, 2)
    state = _randn(g, 2, H, P, N)
    y64, S64 = R.mamba2_conventional_step(state, t["x"], t["dt"], A, t["B"], t["C"], D, t["z"], dt_bias, True)
    xb = t["x"].to(torch.bfloat16)
    y16, S16 = R.mamba2_conventional_step(
        state.float(), xb, t["dt"].float(), A.float(), t["B"].float(), t["C"].float(), D.float(),
        t["z"].float(), dt_bias.float(), True,
    )
    assert y16.dtype == F64 and S16.dtype == F64
    y_ref, _ = R.mamba2_conventional_step(state, xb.double(), t["dt"], A, t["B"], t["C"], D, t["z"], dt_bias, True)
    assert_rel(y16, y_ref, 1e-13, "bf16 x is used exactly")
    assert not torch.allclose(y16, y64, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- replay


def _records(g, b, h, G):
    return (
        _randn(g, b, h, H, P),
        _randn(g, b, h, G, N),
        R.softplus(_uniform(g, -4, -3, b, h, H) + _randn(g, b, h, H)),  # processed dt
    )


@pytest.mark.parametrize("h", [0, 1, 5, 16])
def test_replay_equals_sequential_conventional(h):
    g = _gen(10 + h)
    G = 2
    A, _, _ = _layer(g)
    ckpt = _randn(g, 3, H, P, N)
    rx, rB, rdt = _records(g, 3, h, G)
    S = ckpt.clone()
    for j in range(h):
        _, S = R.mamba2_conventional_step(S, rx[:, j], rdt[:, j], A, rB[:, j], rB[:, j])
    out = R.mamba2_replay(ckpt, rx, rB, rdt, A)
    assert out.dtype == F64
    assert_rel(out, S, 1e-12, f"replay h={h}")
    out.add_(1.0)  # the result must never alias the checkpoint
    assert not torch.equal(out, ckpt)


@pytest.mark.parametrize("G", [1, 2, 3, 6])
@pytest.mark.parametrize("h", [0, 1, 2, 7, 16])
def test_replay_output_equals_state_route(h, G):
    g = _gen(100 * G + h)
    A, _, _ = _layer(g)
    ckpt = _randn(g, 2, H, P, N)
    rx, rB, rdt = _records(g, 2, h, G)
    C = _randn(g, 2, G, N)
    S = R.mamba2_replay(ckpt, rx, rB, rdt, A)
    C_h = C.repeat_interleave(H // G, dim=1)
    y_state = (S * C_h[:, :, None, :]).sum(-1)
    y = R.mamba2_replay_output(ckpt, rx, rB, rdt, A, C)
    assert y.dtype == F64
    assert_rel(y, y_state, 1e-11, f"output-only h={h} G={G}")


def test_replay_output_never_forms_the_state(monkeypatch):
    g = _gen(5)
    A, _, _ = _layer(g)
    ckpt = _randn(g, 2, H, P, N)
    rx, rB, rdt = _records(g, 2, 4, 2)
    C = _randn(g, 2, 2, N)
    expected = R.mamba2_replay_output(ckpt, rx, rB, rdt, A, C)

    def forbidden(*a, **k):
        raise AssertionError("output-only route called mamba2_replay")

    monkeypatch.setattr(R.mamba2, "mamba2_replay", forbidden)
    assert torch.equal(R.mamba2_replay_output(ckpt, rx, rB, rdt, A, C), expected)
    # the output-only replay step does not form S either (non-flush step)
    t = _token(g, 2, 2)
    R.mamba2_replay_step(ckpt, rx, rB, rdt, t["x"], t["dt"], A, t["B"], t["C"], window=16)
    with pytest.raises(AssertionError, match="mamba2_replay"):
        R.mamba2_replay_step(ckpt, rx, rB, rdt, t["x"], t["dt"], A, t["B"], t["C"], window=16, route="state")


# ----------------------------------------------------------------------------- replay step


@pytest.mark.parametrize("route", ["output_only", "state"])
@pytest.mark.parametrize("L,G,with_dz", [(16, 2, True), (3, 1, True), (5, 2, False), (16, 1, False), (5, 3, True)])
def test_replay_step_equals_conventional_over_five_windows(L, G, with_dz, route):
    g = _gen(1000 + 10 * L + G)
    b = 3
    A, dt_bias, D = _layer(g)
    if not with_dz:
        D = None
    S = _randn(g, b, H, P, N)  # conventional state
    ckpt = S.clone()
    rx, rB, rdt = torch.zeros(b, 0, H, P, dtype=F64), torch.zeros(b, 0, G, N, dtype=F64), torch.zeros(b, 0, H, dtype=F64)
    flushes = 0
    for step in range(5 * L + 2):
        t = _token(g, b, G)
        z = t["z"] if with_dz else None
        h = rx.shape[1]
        y, new_ckpt, nx, nB, ndt = R.mamba2_replay_step(
            ckpt, rx, rB, rdt, t["x"], t["dt"], A, t["B"], t["C"], D, z, dt_bias, True, window=L, route=route
        )
        y_conv, S = R.mamba2_conventional_step(S, t["x"], t["dt"], A, t["B"], t["C"], D, z, dt_bias, True)
        assert y.dtype == F64
        assert_rel(y, y_conv, 1e-10, f"y at step {step}")
        if h + 1 == L:
            flushes += 1
            assert nx.shape[1] == nB.shape[1] == ndt.shape[1] == 0
            assert_rel(new_ckpt, S, 1e-10, f"checkpoint after flush at step {step}")
        else:
            assert torch.equal(new_ckpt, ckpt), "a non-flush step changed the checkpoint"
            assert nx.shape == (b, h + 1, H, P) and nB.shape == (b, h + 1, G, N) and ndt.shape == (b, h + 1, H)
            assert torch.equal(nx[:, :h], rx) and torch.equal(nB[:, :h], rB) and torch.equal(ndt[:, :h], rdt)
            assert torch.equal(nx[:, h], t["x"]) and torch.equal(nB[:, h], t["B"])
            assert torch.equal(ndt[:, h], R.mamba2_dt(t["dt"], dt_bias, True))
            assert_rel(R.mamba2_replay(new_ckpt, nx, nB, ndt, A), S, 1e-10, f"replayed state at step {step}")
        ckpt, rx, rB, rdt = new_ckpt, nx, nB, ndt
    assert flushes == 5


def test_replay_step_window_one_is_conventional():
    g = _gen(7)
    A, dt_bias, D = _layer(g)
    S = _randn(g, 2, H, P, N)
    ckpt = S.clone()
    empty = (torch.zeros(2, 0, H, P, dtype=F64), torch.zeros(2, 0, 2, N, dtype=F64), torch.zeros(2, 0, H, dtype=F64))
    for step in range(4):
        t = _token(g, 2, 2)
        y, ckpt, nx, nB, ndt = R.mamba2_replay_step(
            ckpt, *empty, t["x"], t["dt"], A, t["B"], t["C"], D, t["z"], dt_bias, True, window=1
        )
        y_conv, S = R.mamba2_conventional_step(S, t["x"], t["dt"], A, t["B"], t["C"], D, t["z"], dt_bias, True)
        assert nx.shape[1] == 0
        assert_rel(y, y_conv, 1e-12, f"y step {step}")
        assert_rel(ckpt, S, 1e-12, f"state step {step}")


def test_replay_step_argument_errors():
    g = _gen(8)
    A, _, _ = _layer(g)
    ckpt = _randn(g, 1, H, P, N)
    rx, rB, rdt = _records(g, 1, 3, 2)
    t = _token(g, 1, 2)
    args = (t["x"], t["dt"], A, t["B"], t["C"])
    with pytest.raises(ValueError, match="window"):
        R.mamba2_replay_step(ckpt, rx, rB, rdt, *args, window=3)  # h == window
    with pytest.raises(ValueError, match="window"):
        R.mamba2_replay_step(ckpt, rx, rB, rdt, *args, window=0)
    with pytest.raises(ValueError, match="route"):
        R.mamba2_replay_step(ckpt, rx, rB, rdt, *args, window=8, route="fast")
    with pytest.raises(ValueError, match="same number of records"):
        R.mamba2_replay_step(ckpt, rx, rB[:, :2], rdt, *args, window=8)
