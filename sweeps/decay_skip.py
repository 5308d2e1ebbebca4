"""Decay-aware checkpoint reads (paper Appendix F), a float64 study of Mamba-2 and Gated DeltaNet
on the CPU: how many of a ReplaySSM step's checkpoint reads a proven bound lets a kernel skip or
serve from a coarse read copy, by position in the window, what that saves in bytes, and the
output error it costs over a long generation against the float64 recurrence. No kernel skips
reads yet; this measures what one could (docs/design.md section 11 has the bounds and proofs).

    python sweeps/decay_skip.py                                  # both layers, 3 decay mixes, 2048 tokens
    python sweeps/decay_skip.py --layers gdn --mixes fast --tokens 8192 --tol-rel 2e-3,2e-4

The CSV goes to sweeps/results/decay_skip_cpu_<date>.csv unless --out names another file.

The Mamba-2 bound (per row r, head h, at a non-flush step with k records since the checkpoint, this
token's included). The checkpoint enters the output only as ``gamma_k (S_ckpt C)`` with
``gamma_k = exp(A_h * sum of the k dts)``, and for any matrix X,
``max_p |(X C)_p| <= min(max|X| |C|_1, max_p |X[p, :]|_2 |C|_2)`` (``term_bound``). The flush
that writes the checkpoint can store its two norms per (slot, head), and those of
``S_ckpt - Q(S_ckpt)`` for a read copy Q. Given an absolute output tolerance tau a step takes,
per (row, head): skip the read if ``gamma_k (bound(S_ckpt) + bound(drift)) <= tau``; else the
smallest read copy (nvfp4, fp8) with ``gamma_k (bound(S - Q) + bound(drift)) <= tau``; else the
exact checkpoint. The drift bounds how far the stored checkpoint is from the exact one through
flushes that skipped their read: a flush drops ``gamma_L S_ckpt`` only where
``gamma_L (max|S| + max|drift|) <= 2^-24 max|S|`` (below fp32 resolution of the old checkpoint),
and then drift <- gamma_L (drift + norms(S_ckpt)), else drift <- gamma_L drift (both norms).
Gated DeltaNet: the rule of ``GDNStudy``, with Frobenius norms and the shift a step's correction
carries into later steps (docs/design.md section 11).

Decay mixes (per head: A_h, and a dt level dt0_h; per token dt = softplus(softplus^-1(dt0_h)
+ N(0, 0.5^2)), the raw dt's spread around its bias):

* ``init``: Mamba-2's initialisation, A in -U(1, 16), dt0 log-uniform in [0.001, 0.1]
  (mamba_ssm's A_init_range and dt_min / dt_max defaults);
* ``fast``: A in -U(1, 16), dt0 log-uniform in [0.01, 1] (synthetic: heads that forget within
  a few tokens);
* ``slow``: A in -U(1, 4), dt0 log-uniform in [1e-4, 0.01] (synthetic: long-memory heads).

Inputs: Mamba-2 x, B, C standard normal, D = 1, no gate; GDN q, k, v standard normal (q, k
L2-normalised, q scaled by K^-0.5), beta = sigmoid(N(0, 1)), the decay -exp(A_log) softplus(a +
dt_bias) with exp(A_log) = -A and dt_bias of the mix (the raw gate a = N(0, 0.5^2)). Rows are
staggered over ring positions (row r starts with r % L records); a warm-up of --warmup tokens of
the exact recurrence sets the state's scale. tau = tol_rel * rms(y) with rms(y) measured over the warm-up (an engine calibrates
it once per layer): 2^-9 ~ 2e-3 is half a bf16 ulp at the typical output.

Per mix, tolerance and window position k (k = L is the flush) the CSV holds the fractions of
(row, head) reads skipped / from nvfp4 / from fp8 / exact, the checkpoint bytes read relative to
the exact step, and the largest output error over tau (<= 1 by the bound); the summary adds the
window-mean ideal bytes (checkpoint, flush write, ring records, activations at the shape of
--mamba2-model / --gdn-model) relative to the exact ReplaySSM step.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_files import check_out, default_out  # noqa: E402

from replayssm_cute import quant  # noqa: E402
from replayssm_cute.models import get_model  # noqa: E402
from replayssm_cute.reference import (  # noqa: E402
    gdn_conventional_step, gdn_gates, gdn_normalize, gdn_replay_step, mamba2_conventional_step,
)
from replayssm_cute.perf import ideal_bytes, quant_format, state_bytes  # noqa: E402

F64 = torch.float64
MIXES = {  # name: (A range (low, high) of -A, dt0 log-uniform range)
    "init": ((1.0, 16.0), (1e-3, 1e-1)),
    "fast": ((1.0, 16.0), (1e-2, 1.0)),
    "slow": ((1.0, 4.0), (1e-4, 1e-2)),
}
COARSE = ("nvfp4", "fp8")  # read copies tried after a skip, smallest first
FLUSH_REL = 2.0 ** -24  # a flush drops the checkpoint term below fp32 resolution of the old checkpoint
DT_SPREAD = 0.5
PROG = "decay_skip"


def matrix_norms(X: torch.Tensor) -> torch.Tensor:
    """(..., 2): max |X| and the largest row 2-norm max_p |X[p, :]|_2 of each (..., P, N) matrix."""
    return torch.stack([X.abs().amax(dim=(-2, -1)), X.pow(2).sum(-1).sqrt().amax(-1)], dim=-1)


def term_bound(norms: torch.Tensor, c_norms: torch.Tensor) -> torch.Tensor:
    """A bound on max_p |(X C)_p| from X's matrix_norms and C's (|C|_1, |C|_2): the smaller of
    max|X| |C|_1 (triangle inequality) and max_p |X[p, :]|_2 |C|_2 (Cauchy-Schwarz)."""
    return torch.minimum(norms[..., 0] * c_norms[..., 0], norms[..., 1] * c_norms[..., 1])


def read_choice(gamma, ckpt_norms, drift_norms, copy_norms, c_norms, tau):
    """Per (row, head) of a non-flush step: 0 skips the checkpoint read, i + 1 reads the coarse
    copy COARSE[i], len(COARSE) + 1 the exact checkpoint; the cheapest whose bound
    gamma * (term_bound(what is dropped) + term_bound(drift)) is within tau (docs/design.md
    section 11). copy_norms[fmt] are the norms of S - Q(S)."""
    drift = term_bound(drift_norms, c_norms)
    choice = torch.full(gamma.shape, len(COARSE) + 1, dtype=torch.long)
    for i, fmt in reversed(list(enumerate(COARSE))):
        choice = torch.where(gamma * (term_bound(copy_norms[fmt], c_norms) + drift) <= tau, i + 1, choice)
    return torch.where(gamma * (term_bound(ckpt_norms, c_norms) + drift) <= tau, 0, choice)


def flush_skips(gamma, ckpt_norms, drift_norms):
    """Per (row, head) of a flush: True where dropping gamma_L S_ckpt stays below fp32 resolution
    of the old checkpoint elementwise, gamma_L (max|S| + max|drift|) <= 2^-24 max|S|."""
    M, Dr = ckpt_norms[..., 0], drift_norms[..., 0]
    return gamma * (M + Dr) <= FLUSH_REL * M


def softplus_inv(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def decay_mix(name: str, heads: int, gen: torch.Generator):
    """(A (H,), dt bias (H,)) of a decay mix."""
    (a_lo, a_hi), (d_lo, d_hi) = MIXES[name]
    A = -(a_lo + (a_hi - a_lo) * torch.rand(heads, generator=gen, dtype=F64))
    dt0 = torch.exp(math.log(d_lo) + (math.log(d_hi) - math.log(d_lo)) * torch.rand(heads, generator=gen, dtype=F64))
    return A, softplus_inv(dt0)


class Mamba2Study:
    """One decay mix at one Mamba-2 shape: the exact recurrence and, per tolerance, the reads a
    bounded step takes and its outputs."""

    def __init__(self, args, mix: str, gen: torch.Generator):
        b, (H, P, N, G) = args.batch, args.mamba2_shape
        self.dims = (b, H, P, N, G)
        self.A, self.dt_bias = decay_mix(mix, H, gen)
        self.gen = gen

    def inputs(self):
        b, H, P, N, G = self.dims
        x = torch.randn(b, H, P, generator=self.gen, dtype=F64)
        B = torch.randn(b, G, N, generator=self.gen, dtype=F64)
        C = torch.randn(b, G, N, generator=self.gen, dtype=F64)
        dt = torch.nn.functional.softplus(self.dt_bias + DT_SPREAD * torch.randn(b, H, generator=self.gen, dtype=F64))
        return x, B, C, dt

    def run(self, tols_rel, window: int, tokens: int, warmup: int):
        """Rows of (tol_rel, k, fractions, bytes, error) accumulated over `tokens` steps."""
        b, H, P, N, G = self.dims
        hpg = H // G
        S = torch.zeros(b, H, P, N, dtype=F64)
        D = torch.ones(H, dtype=F64)
        ys = []
        for _ in range(warmup):
            x, B, C, dt = self.inputs()
            y, S = mamba2_conventional_step(S, x, dt, self.A, B, C, D)
            ys.append(y)
        y_rms = torch.stack(ys).pow(2).mean().sqrt().item()
        phase = torch.arange(b) % window  # row r has r % L records at the start
        ckpt = S.clone()  # exact checkpoint of each row (all rows start from the warm-up state)
        log_gamma = torch.zeros(b, H, dtype=F64)  # sum of A dt since the checkpoint
        # per tolerance: the bounded cache's checkpoint offset from the exact one (stored = ckpt - delta),
        # its drift bound Dr, and the read-copy errors of its stored checkpoint
        tols = list(tols_rel)
        state = {t: {"delta": torch.zeros_like(S), "drift": torch.zeros(b, H, 2, dtype=F64)} for t in tols}
        for st in state.values():
            self._refresh(st, ckpt, torch.ones(b, dtype=torch.bool))
        counts = {(t, k): torch.zeros(len(COARSE) + 2, dtype=F64) for t in tols for k in range(1, window + 1)}
        worst = {(t, k): 0.0 for t in tols for k in range(1, window + 1)}
        for step in range(tokens):
            x, B, C, dt = self.inputs()
            C_h = C.repeat_interleave(hpg, 1)
            y_exact, S = mamba2_conventional_step(S, x, dt, self.A, B, C, D)
            log_gamma = log_gamma + self.A * dt
            gamma = torch.exp(log_gamma)
            k = (phase + step) % window + 1  # records since the checkpoint, this token's included
            flush = k == window
            c_norms = torch.stack([C_h.abs().sum(-1), C_h.pow(2).sum(-1).sqrt()], dim=-1)  # (b, H, 2)
            for t in tols:
                tau = t * y_rms
                st = state[t]
                stored = ckpt - st["delta"]
                norms, drift = st["norms"], st["drift"]
                choice = read_choice(gamma, norms, drift, st["E"], c_norms, tau)
                flush_skip = flush_skips(gamma, norms, drift)
                # what the step uses for the checkpoint: the stored one, its copy, or nothing
                used = stored
                for i, fmt in enumerate(COARSE):
                    sel = (choice == i + 1) & ~flush[:, None]
                    used = torch.where(sel[..., None, None], st["Q"][fmt], used)
                skip = torch.where(flush[:, None], flush_skip, choice == 0)
                used = torch.where(skip[..., None, None], torch.zeros_like(used), used)
                # the step's output: the exact one less the checkpoint term's difference
                y = y_exact - gamma[..., None] * torch.einsum("bhpn,bhn->bhp", ckpt - used, C_h)
                err = (y - y_exact).abs().amax(-1) / tau  # (b, H)
                for kk in k.unique().tolist():
                    rows = k == kk
                    ch = torch.where(skip[rows], 0, torch.where(flush[rows][:, None], len(COARSE) + 1, choice[rows]))
                    counts[t, kk] += torch.bincount(ch.flatten(), minlength=len(COARSE) + 2).to(F64)
                    worst[t, kk] = max(worst[t, kk], err[rows].max().item())
                if flush.any():  # the bounded cache's new checkpoint: gamma_L * used + records
                    new_delta = gamma[..., None, None] * (ckpt - used)
                    st["delta"] = torch.where(flush[:, None, None, None], new_delta, st["delta"])
                    new_drift = gamma[..., None] * (drift + norms * skip[..., None])
                    st["drift"] = torch.where(flush[:, None, None], new_drift, drift)
            if flush.any():
                ckpt = torch.where(flush[:, None, None, None], S, ckpt)
                log_gamma = torch.where(flush[:, None], torch.zeros_like(log_gamma), log_gamma)
                for t in tols:
                    self._refresh(state[t], ckpt, flush)
        return counts, worst, y_rms

    @staticmethod
    def _refresh(st, ckpt, rows):
        """What a flush writes next to the checkpoint of `rows` (a bool mask): its matrix_norms,
        and each read copy Q with the norms of S - Q(S) (fp32 checkpoint, RTN copies)."""
        b, H = ckpt.shape[:2]
        idx = rows.nonzero()[:, 0]
        stored32 = (ckpt[idx] - st["delta"][idx]).to(torch.float32)
        st.setdefault("norms", torch.zeros(b, H, 2, dtype=F64))
        st.setdefault("E", {})
        st.setdefault("Q", {})
        st["norms"][idx] = matrix_norms(stored32.to(F64))
        for fmt in COARSE:
            q = _format(fmt, ckpt.shape[-1]).encode_rtn(stored32).dequantized.to(F64)
            st["E"].setdefault(fmt, torch.zeros(b, H, 2, dtype=F64))
            st["Q"].setdefault(fmt, torch.zeros_like(ckpt))
            st["E"][fmt][idx] = matrix_norms(stored32.to(F64) - q)
            st["Q"][fmt][idx] = q


class GDNStudy:
    """One decay mix at one Gated DeltaNet shape (docs/design.md section 11): per row, the exact
    recurrence and, per tolerance, a cache whose steps may drop or coarsen the checkpoint term.
    Each ring record carries e = beta alpha gamma_h |Delta|_F, the shift its correction leaves
    (0 after an exact read); a step's bound is (alpha gamma_h |Delta|_F + dev) |q|_2 with dev =
    alpha (gamma_h drift + sum_j e_j gamma_{j+1:h}). A flush folds the cached corrections, so its
    new checkpoint's drift is that step's bound over |q|_2; it skips its read where alpha gamma_h
    |S_ckpt|_F <= 2^-24 max|S_ckpt|."""

    def __init__(self, args, mix: str, gen: torch.Generator):
        b, (HV, V, K, H) = args.batch, args.gdn_shape
        self.dims = (b, HV, V, K, H)
        A, self.dt_bias = decay_mix(mix, HV, gen)
        self.A_log = torch.log(-A)  # g = -exp(A_log) softplus(a + dt_bias): the same decay as A dt
        self.gen = gen

    def inputs(self):
        b, HV, V, K, H = self.dims
        q = torch.randn(b, H, K, generator=self.gen, dtype=F64)
        k = torch.randn(b, H, K, generator=self.gen, dtype=F64)
        v = torch.randn(b, HV, V, generator=self.gen, dtype=F64)
        a = DT_SPREAD * torch.randn(b, HV, generator=self.gen, dtype=F64)
        beta_raw = torch.randn(b, HV, generator=self.gen, dtype=F64)
        return q, k, v, a, beta_raw

    def run(self, tols_rel, window: int, tokens: int, warmup: int):
        b, HV, V, K, H = self.dims
        S = torch.zeros(b, HV, V, K, dtype=F64)
        ys, history = [], []  # the last window's (state before, token) of the warm-up
        for _ in range(warmup):
            tok = self.inputs()
            history = (history + [(S, tok)])[-window:]
            o, S = gdn_conventional_step(S, *tok, self.A_log, self.dt_bias)
            ys.append(o)
        y_rms = torch.stack(ys).pow(2).mean().sqrt().item()
        tols = list(tols_rel)
        # per (tolerance, row): the bounded cache; row r starts with r % L records, its checkpoint
        # written r % L warm-up tokens before the end (rows staggered over ring positions)
        caches = {}
        for r in range(b):
            m = min(r % window, len(history))
            start = history[len(history) - m][0] if m else S
            ring = _empty_ring(HV, V, K, H)
            ckpt = start[r:r + 1].to(torch.float32).to(F64)
            for _, tok in history[len(history) - m:]:
                _, _, *ring = gdn_replay_step(ckpt, *ring, *(x[r:r + 1] for x in tok), self.A_log, self.dt_bias,
                                              window=window)
            for t in tols:
                caches[t, r] = {"ckpt": ckpt.clone(), "ring": [x.clone() for x in ring],
                                "e": torch.zeros(1, m, HV, dtype=F64), "drift": torch.zeros(1, HV, dtype=F64)}
                _gdn_refresh(caches[t, r])
        counts = {(t, k): torch.zeros(len(COARSE) + 2, dtype=F64) for t in tols for k in range(1, window + 1)}
        worst = {(t, k): 0.0 for t in tols for k in range(1, window + 1)}
        for step in range(tokens):
            tok = self.inputs()
            o_exact, S = gdn_conventional_step(S, *tok, self.A_log, self.dt_bias)
            g, beta = gdn_gates(tok[3], tok[4], self.A_log, self.dt_bias)
            alpha = torch.exp(g)
            qn, _ = gdn_normalize(tok[0], tok[1])
            q2 = qn.pow(2).sum(-1).sqrt().repeat_interleave(HV // H, 1)  # (b, HV)
            for t in tols:
                tau = t * y_rms
                for r in range(b):
                    c = caches[t, r]
                    h = c["ring"][2].shape[1]
                    flush = h + 1 == window
                    rg = c["ring"][2]  # (1, h, HV)
                    gamma_h = torch.exp(rg.sum(1))
                    later = torch.exp(torch.flip(torch.cumsum(torch.flip(rg, [1]), 1), [1]) - rg)  # gamma_{j+1:h}
                    dev = alpha[r:r + 1] * (gamma_h * c["drift"] + (c["e"] * later).sum(1))
                    scale = alpha[r:r + 1] * gamma_h
                    if flush:
                        skip = scale * c["frob"] <= FLUSH_REL * c["maxabs"]
                        choice = torch.where(skip, 0, len(COARSE) + 1)
                    else:
                        choice = torch.full_like(gamma_h, len(COARSE) + 1, dtype=torch.long)
                        for i, fmt in reversed(list(enumerate(COARSE))):
                            ok = (scale * c["E"][fmt] + dev) * q2[r:r + 1] <= tau
                            choice = torch.where(ok, i + 1, choice)
                        choice = torch.where((scale * c["frob"] + dev) * q2[r:r + 1] <= tau, 0, choice)
                    used = c["ckpt"].clone()
                    delta_frob = torch.zeros_like(gamma_h)
                    for i, fmt in enumerate(COARSE):
                        sel = choice == i + 1
                        used = torch.where(sel[..., None, None], c["Q"][fmt], used)
                        delta_frob = torch.where(sel, c["E"][fmt], delta_frob)
                    sel = choice == 0
                    used = torch.where(sel[..., None, None], torch.zeros_like(used), used)
                    delta_frob = torch.where(sel, c["frob"], delta_frob)
                    o, new_ckpt, *ring = gdn_replay_step(used, *c["ring"], *(x[r:r + 1] for x in tok), self.A_log,
                                                         self.dt_bias, window=window)
                    err = (o - o_exact[r:r + 1]).abs().amax(-1) / tau
                    kk = h + 1
                    counts[t, kk] += torch.bincount(choice.flatten(), minlength=len(COARSE) + 2).to(F64)
                    worst[t, kk] = max(worst[t, kk], err.max().item())
                    e_new = beta[r:r + 1] * scale * delta_frob
                    if flush:
                        # the fold used `used` for the checkpoint and the cached corrections: its
                        # distance to the exact state is within this step's bound over |q|_2
                        c["drift"] = scale * delta_frob + dev
                        c["ckpt"], c["ring"], c["e"] = new_ckpt, ring, torch.zeros(1, 0, HV, dtype=F64)
                        _gdn_refresh(c)
                    else:
                        c["ring"], c["e"] = ring, torch.cat([c["e"], e_new[:, None]], 1)
        return counts, worst, y_rms


def _empty_ring(HV, V, K, H):
    return [torch.zeros(1, 0, HV, V, dtype=F64), torch.zeros(1, 0, H, K, dtype=F64), torch.zeros(1, 0, HV, dtype=F64)]


def _gdn_refresh(c):
    """What a flush writes next to a GDN checkpoint (fp32): max |S|, |S|_F, and each read copy Q
    with |S - Q|_F."""
    stored32 = c["ckpt"].to(torch.float32)
    c["ckpt"] = stored32.to(F64)
    c["maxabs"] = c["ckpt"].abs().amax(dim=(-2, -1))
    c["frob"] = c["ckpt"].pow(2).sum(dim=(-2, -1)).sqrt()
    c["E"], c["Q"] = {}, {}
    for fmt in COARSE:
        c["Q"][fmt] = _format(fmt, stored32.shape[-1]).encode_rtn(stored32).dequantized.to(F64)
        c["E"][fmt] = (c["ckpt"] - c["Q"][fmt]).pow(2).sum(dim=(-2, -1)).sqrt()


def _format(fmt: str, K: int):
    spec = quant_format(fmt, K)
    return quant.FORMATS[spec] if isinstance(spec, str) else spec


def read_bytes(model, fmt: str) -> float:
    """Checkpoint bytes one (row, head) read moves in `fmt` (fp32 or a read copy, scales included)."""
    return state_bytes(model, fmt) / model.nheads


def _shape(p, flag: str, text: str):
    try:
        dims = tuple(int(v) for v in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 4 or min(dims) < 1:
        p.error(f"{flag}: four dims >= 1 expected, got {text!r}")
    return dims


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="mamba2,gdn", help="layer types, of mamba2, gdn (default both)")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"decay mixes, of {', '.join(MIXES)}")
    p.add_argument("--tol-rel", default="2e-3,2e-4", help="tolerances tau / rms(y), comma separated "
                                                         "(default 2e-3: half a bf16 ulp; 2e-4)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=256)
    p.add_argument("--window", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--mamba2-shape", default="32,64,128,2", help="H,P,N,G (default 32,64,128,2)")
    p.add_argument("--gdn-shape", default="16,128,128,4", help="HV,V,K,H (default 16,128,128,4)")
    p.add_argument("--mamba2-model", default="nemotron-super", help="shape the Mamba-2 byte totals are taken at")
    p.add_argument("--gdn-model", default="qwen3.5-122b", help="shape the GDN byte totals are taken at")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="CSV file (default sweeps/results/decay_skip_cpu_<date>.csv)")
    args = p.parse_args(argv)
    args.layers = [v.strip() for v in args.layers.split(",") if v.strip()]
    for v in args.layers:
        if v not in STUDIES:
            p.error(f"--layers: unknown layer {v!r}; use mamba2, gdn")
    args.mixes = [m.strip() for m in args.mixes.split(",") if m.strip()]
    for m in args.mixes:
        if m not in MIXES:
            p.error(f"--mixes: unknown mix {m!r}; use {', '.join(MIXES)}")
    try:
        args.tols = [float(t) for t in args.tol_rel.split(",") if t.strip()]
    except ValueError:
        p.error(f"--tol-rel: comma-separated numbers expected, got {args.tol_rel!r}")
    if not args.tols or any(t <= 0 for t in args.tols):
        p.error("--tol-rel: tolerances must be > 0")
    for flag in ("tokens", "window", "batch"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag}: must be >= 1")
    if args.window < 2:
        p.error("--window: must be >= 2 (window 1 flushes every step)")
    args.mamba2_shape = _shape(p, "--mamba2-shape", args.mamba2_shape)
    args.gdn_shape = _shape(p, "--gdn-shape", args.gdn_shape)
    for flag, (heads, _, inner, groups) in (("--mamba2-shape", args.mamba2_shape), ("--gdn-shape", args.gdn_shape)):
        if inner % 128:
            p.error(f"{flag}: the state's innermost dim a multiple of 128 (the fp8 copy's scale block)")
        if heads % groups:
            p.error(f"{flag}: heads a multiple of the groups / key heads")
    args.models = {}
    for layer in ("mamba2", "gdn"):
        flag = f"--{layer}-model"
        try:
            args.models[layer] = get_model(getattr(args, f"{layer}_model"))
        except ValueError as e:
            p.error(f"{flag}: {e}")
        if args.models[layer].layer != layer:
            p.error(f"{flag}: a {layer} model expected, got {args.models[layer].name} ({args.models[layer].layer})")
    args.out = args.out or default_out(PROG, "cpu")
    check_out(p, "--out", args.out)
    return args


def main(argv=None):
    import pandas as pd

    args = parse_args(argv)
    L = args.window
    fmts = ["skip", *COARSE, "fp32"]
    rows = []
    for layer in args.layers:
        model = args.models[layer]
        bytes_of = {"skip": 0.0, **{f: read_bytes(model, f) for f in (*COARSE, "fp32")}}
        for mi, mix in enumerate(args.mixes):
            gen = torch.Generator().manual_seed(args.seed + mi)
            counts, worst, y_rms = STUDIES[layer](args, mix, gen).run(args.tols, L, args.tokens, args.warmup)
            for t in args.tols:
                for k in range(1, L + 1):
                    c = counts[t, k]
                    frac = (c / c.sum()).tolist()
                    read = sum(f * bytes_of[n] for f, n in zip(frac, fmts)) / bytes_of["fp32"]
                    rows.append({"layer": layer, "mix": mix, "tol_rel": t, "k": k, "flush": k == L,
                                 **{f"frac_{n}": f for n, f in zip(fmts, frac)},
                                 "ckpt_read_rel": read, "max_err_over_tol": worst[t, k], "rms_y": y_rms})
    df = pd.DataFrame(rows)
    summary = []
    for (layer, mix, t), g in df.groupby(["layer", "mix", "tol_rel"], sort=False):
        # window-mean ideal bytes per row at the model's shape: the checkpoint reads as chosen in
        # place of one fp32 read per step; the flush write, ring records and activations unchanged
        model = args.models[layer]
        S_seq = state_bytes(model, "fp32")
        exact = ideal_bytes(model, 1, L)["window_mean"]
        bounded = exact - S_seq * (1 - g["ckpt_read_rel"].mean())
        nf = g[~g["flush"]]
        summary.append({"layer": layer, "mix": mix, "tol_rel": t,
                        "nonflush_skip": nf["frac_skip"].mean(),
                        "nonflush_coarse": nf[[f"frac_{c}" for c in COARSE]].sum(1).mean(),
                        "flush_skip": g[g["flush"]]["frac_skip"].mean(),
                        "window_bytes_rel": bounded / exact, "max_err_over_tol": g["max_err_over_tol"].max()})
    pd.set_option("display.width", 200)
    print(df.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print()
    print(pd.DataFrame(summary).to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    print(f"wrote {args.out}")


STUDIES = {"mamba2": Mamba2Study, "gdn": GDNStudy}


if __name__ == "__main__":
    main()
