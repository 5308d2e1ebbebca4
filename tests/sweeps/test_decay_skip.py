"""sweeps/decay_skip.py on the CPU: the read rule's bound against the float64 ReplaySSM output
(reference.mamba2_replay_output) on adversarial checkpoints (tight at the threshold) and on read
copies, the flush rule, and a tiny run of the study: its CSV, fractions, errors within the
tolerance, which mixes skip, and the CLI's errors."""

import csv

import pytest
import torch

from replayssm_cute import quant
from replayssm_cute.reference import mamba2_replay_output

from tests.helpers.sweeps import assert_usage_errors, load, run

# its tests share the module's fixtures: one pytest-xdist worker runs them all (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("decay_skip")

F64 = torch.float64
TINY = ["--tokens", "40", "--warmup", "16", "--window", "4", "--batch", "3", "--mamba2-shape", "4,8,128,2",
        "--gdn-shape", "4,16,128,2"]


@pytest.fixture(scope="module")
def ds():
    return load("decay_skip")


def _ring(gen, b, h, H, P, N, G, dt_scale):
    x = torch.randn(b, h, H, P, generator=gen, dtype=F64)
    B = torch.randn(b, h, G, N, generator=gen, dtype=F64)
    dt = dt_scale * torch.rand(b, h, H, generator=gen, dtype=F64)
    return x, B, dt


def _c_norms(C_h):
    return torch.stack([C_h.abs().sum(-1), C_h.pow(2).sum(-1).sqrt()], dim=-1)


def test_skip_rule_bounds_the_output_tightly(ds):
    """A checkpoint of +-M aligned with sign(C) makes the dropped term exactly gamma M |C|_1 (the
    smaller of the two bounds there): at tau equal to it the rule skips and the error is tau; a
    hair below it reads; a drift bound counts against the budget."""
    gen = torch.Generator().manual_seed(1)
    b, h, H, P, N, G = 2, 3, 4, 5, 128, 2
    A = -torch.tensor([8.0, 1.0, 16.0, 4.0], dtype=F64)
    x, B, dt = _ring(gen, b, h, H, P, N, G, 0.3)
    C = torch.randn(b, G, N, generator=gen, dtype=F64)
    M = torch.tensor([[3.0, 0.5, 7.0, 1.0], [2.0, 9.0, 0.25, 4.0]], dtype=F64)
    C_h = C.repeat_interleave(H // G, 1)
    ckpt = M[..., None, None] * torch.sign(C_h)[:, :, None, :].expand(b, H, P, N)
    gamma = torch.exp(A * dt.sum(1))
    exact = mamba2_replay_output(ckpt, x, B, dt, A, C)
    skipped = mamba2_replay_output(torch.zeros_like(ckpt), x, B, dt, A, C)
    err = (skipped - exact).abs().amax(-1)
    bound = gamma * ds.term_bound(ds.matrix_norms(ckpt), _c_norms(C_h))
    torch.testing.assert_close(err, bound, rtol=1e-12, atol=0)
    torch.testing.assert_close(bound, gamma * M * C_h.abs().sum(-1), rtol=1e-12, atol=0)
    no_copy = {f: torch.full((b, H, 2), float("inf"), dtype=F64) for f in ds.COARSE}
    zero = torch.zeros(b, H, 2, dtype=F64)
    norms, cn = ds.matrix_norms(ckpt), _c_norms(C_h)
    assert (ds.read_choice(gamma, norms, zero, no_copy, cn, bound) == 0).all()
    assert (ds.read_choice(gamma, norms, zero, no_copy, cn, bound * (1 - 1e-9)) == len(ds.COARSE) + 1).all()
    assert (ds.read_choice(gamma, norms, 1e-3 * norms, no_copy, cn, bound) == len(ds.COARSE) + 1).all()


def test_row_norm_bound_is_tight_for_aligned_rows(ds):
    """A checkpoint whose rows are multiples of C makes Cauchy-Schwarz tight, and that bound is
    the smaller one there (much below max|S| |C|_1)."""
    gen = torch.Generator().manual_seed(3)
    b, h, H, P, N, G = 1, 2, 2, 6, 128, 1
    A = -torch.tensor([3.0, 9.0], dtype=F64)
    x, B, dt = _ring(gen, b, h, H, P, N, G, 0.3)
    C = torch.randn(b, G, N, generator=gen, dtype=F64)
    ckpt = torch.linspace(-2, 5, P, dtype=F64)[None, None, :, None] * C[:, :, None, :].expand(b, H, P, N)
    gamma = torch.exp(A * dt.sum(1))
    err = (mamba2_replay_output(torch.zeros_like(ckpt), x, B, dt, A, C)
           - mamba2_replay_output(ckpt, x, B, dt, A, C)).abs().amax(-1)
    C_h = C.expand(b, H, N)
    bound = gamma * ds.term_bound(ds.matrix_norms(ckpt), _c_norms(C_h))
    torch.testing.assert_close(err, bound, rtol=1e-12, atol=0)
    assert (bound < 0.5 * gamma * ckpt.abs().amax(dim=(-2, -1)) * C_h.abs().sum(-1)).all()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_coarse_rule_bounds_the_output(ds, fmt):
    """Reading a copy Q instead of the checkpoint moves the output by at most the bound of
    S - Q(S), and the rule picks the copy exactly where that is within tau."""
    gen = torch.Generator().manual_seed(2)
    b, h, H, P, N, G = 3, 5, 4, 16, 128, 1
    A = -torch.tensor([2.0, 6.0, 12.0, 16.0], dtype=F64)
    x, B, dt = _ring(gen, b, h, H, P, N, G, 0.2)
    C = torch.randn(b, G, N, generator=gen, dtype=F64)
    ckpt32 = (torch.randn(b, H, P, N, generator=gen) * torch.logspace(-3, 3, N)).to(torch.float32)
    q = ds._format(fmt, N).encode_rtn(ckpt32).dequantized.to(F64)
    E = ds.matrix_norms(ckpt32.to(F64) - q)
    assert (E > 0).all()
    exact = mamba2_replay_output(ckpt32.to(F64), x, B, dt, A, C)
    coarse = mamba2_replay_output(q, x, B, dt, A, C)
    gamma = torch.exp(A * dt.sum(1))
    cn = _c_norms(C.repeat_interleave(H, 1))
    copy_bound = gamma * ds.term_bound(E, cn)
    assert ((coarse - exact).abs().amax(-1) <= copy_bound * (1 + 1e-12)).all()
    norms = ds.matrix_norms(ckpt32.to(F64))
    errors = {f: torch.full_like(norms, float("inf")) for f in ds.COARSE}
    errors[fmt] = E
    zero = torch.zeros_like(norms)
    tau = copy_bound.median()
    choice = ds.read_choice(gamma, norms, zero, errors, cn, tau)
    want = torch.where(copy_bound <= tau, ds.COARSE.index(fmt) + 1, len(ds.COARSE) + 1)
    want = torch.where(gamma * ds.term_bound(norms, cn) <= tau, 0, want)
    assert torch.equal(choice, want) and (choice == ds.COARSE.index(fmt) + 1).any()


def test_flush_rule(ds):
    M = torch.tensor([1.0, 1.0, 4.0, 0.0], dtype=F64)
    norms = torch.stack([M, 10 * M], -1)
    gamma = torch.tensor([2.0 ** -24, 2.0 ** -23, 2.0 ** -26, 0.5], dtype=F64)
    assert ds.flush_skips(gamma, norms, torch.zeros_like(norms)).tolist() == [True, False, True, True]
    assert ds.flush_skips(gamma, norms, norms).tolist() == [False, False, True, True]


def test_tiny_study(tmp_path):
    out = tmp_path / "ds.csv"
    proc = run("decay_skip", TINY + ["--mixes", "fast,slow", "--tol-rel", "2e-3", "--out", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(open(out)))
    assert [(r["layer"], r["mix"], int(r["k"])) for r in rows] == [
        (layer, m, k) for layer in ("mamba2", "gdn") for m in ("fast", "slow") for k in range(1, 5)]
    fracs = ["frac_skip", "frac_nvfp4", "frac_fp8", "frac_fp32"]
    for r in rows:
        assert abs(sum(float(r[f]) for f in fracs) - 1) < 1e-12
        assert 0 <= float(r["max_err_over_tol"]) <= 1, r
    for layer in ("mamba2", "gdn"):
        fast = [r for r in rows if r["mix"] == "fast" and r["layer"] == layer]
        assert sum(float(r["frac_skip"]) for r in fast) > 0 and max(float(r["max_err_over_tol"]) for r in fast) > 0
        # skipping grows with the decay since the checkpoint: never less at a later position
        nonflush = [float(r["frac_skip"]) for r in fast if r["flush"] == "False"]
        assert nonflush[-1] >= nonflush[0], layer
    assert all(float(r["frac_fp32"]) == 1 for r in rows if r["mix"] == "slow")
    assert "window_bytes_rel" in proc.stdout


def test_usage_errors():
    assert_usage_errors("decay_skip", [
        (["--mixes", "medium"], "--mixes: unknown mix 'medium'"),
        (["--tol-rel", "x"], "--tol-rel: comma-separated numbers expected"),
        (["--tol-rel", "0"], "--tol-rel: tolerances must be > 0"),
        (["--window", "1"], "--window: must be >= 2"),
        (["--layers", "rwkv"], "--layers: unknown layer 'rwkv'"),
        (["--mamba2-shape", "4,8,96,2"], "--mamba2-shape: the state's innermost dim a multiple of 128"),
        (["--gdn-shape", "4,16,128"], "--gdn-shape: four dims >= 1 expected"),
        (["--gdn-shape", "3,16,128,2"], "--gdn-shape: heads a multiple of the groups"),
        (["--mamba2-model", "qwen3.5-122b"], "--mamba2-model: a mamba2 model expected"),
        (["--out", "README.md/x.csv"], "--out: cannot create README.md/x.csv"),
    ])
