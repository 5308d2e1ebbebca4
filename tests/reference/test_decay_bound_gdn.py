"""The Gated DeltaNet bound of docs/design.md section 11 (decay-aware checkpoint reads) on the
float64 ReplaySSM step: a step that drops its checkpoint term moves its output by at most
alpha gamma_h |S_ckpt|_F |q|_2, and the shift its cached correction leaves moves every later
output of the window, and the folded checkpoint, by at most e = beta alpha gamma_h |S_ckpt|_F
decayed since."""

import torch

from replayssm_cute.reference import gdn_gates, gdn_normalize, gdn_replay, gdn_replay_step

F64 = torch.float64
b, HV, H, V, K, WINDOW = 3, 4, 2, 16, 32, 8


def _token(gen):
    return (torch.randn(b, H, K, generator=gen, dtype=F64), torch.randn(b, H, K, generator=gen, dtype=F64),
            torch.randn(b, HV, V, generator=gen, dtype=F64), torch.randn(b, HV, generator=gen, dtype=F64),
            torch.randn(b, HV, generator=gen, dtype=F64))


def _per_value_head(t):
    return t.repeat_interleave(HV // H, dim=1)


def test_skipped_checkpoint_term_and_its_propagation_are_bounded():
    gen = torch.Generator().manual_seed(7)
    A_log = torch.log(torch.tensor([0.5, 2.0, 6.0, 12.0], dtype=F64))
    dt_bias = torch.full((HV,), -2.0, dtype=F64)
    ckpt = 3.0 * torch.randn(b, HV, V, K, generator=gen, dtype=F64)
    empty = (torch.zeros(b, 0, HV, V, dtype=F64), torch.zeros(b, 0, H, K, dtype=F64), torch.zeros(b, 0, HV, dtype=F64))
    # h = 3 committed records from the exact checkpoint
    ring = empty
    for _ in range(3):
        _, _, *ring = gdn_replay_step(ckpt, *ring, *_token(gen), A_log, dt_bias, window=WINDOW)
    # the step that skips: same inputs, checkpoint term dropped
    tok = _token(gen)
    o, _, *exact_ring = gdn_replay_step(ckpt, *ring, *tok, A_log, dt_bias, window=WINDOW)
    o_skip, _, *skip_ring = gdn_replay_step(torch.zeros_like(ckpt), *ring, *tok, A_log, dt_bias, window=WINDOW)
    qn, _ = gdn_normalize(tok[0], tok[1])
    g, beta = gdn_gates(tok[3], tok[4], A_log, dt_bias)
    alpha, gamma_h = torch.exp(g), torch.exp(ring[2].sum(1))
    frob = ckpt.pow(2).sum(dim=(-2, -1)).sqrt()
    q2 = _per_value_head(qn.pow(2).sum(-1).sqrt())
    err = (o_skip - o).abs().amax(-1)
    bound = alpha * gamma_h * frob * q2
    assert (err <= bound).all() and (err > 1e-3 * bound).all()  # within, and not vacuous
    # later steps read the checkpoint; the skipped record's shift e decays with them
    e = beta * alpha * gamma_h * frob
    decay = torch.ones_like(e)
    for _ in range(WINDOW - 5):
        tok = _token(gen)
        o, _, *exact_ring = gdn_replay_step(ckpt, *exact_ring, *tok, A_log, dt_bias, window=WINDOW)
        o_skip, _, *skip_ring = gdn_replay_step(ckpt, *skip_ring, *tok, A_log, dt_bias, window=WINDOW)
        qn, _ = gdn_normalize(tok[0], tok[1])
        decay = decay * torch.exp(gdn_gates(tok[3], tok[4], A_log, dt_bias)[0])
        err = (o_skip - o).abs().amax(-1)
        later = e * decay * _per_value_head(qn.pow(2).sum(-1).sqrt())
        assert (err <= later).all() and (err > 1e-4 * later).all()
    # a fold of the cached corrections carries the shift into the checkpoint, within e decayed
    diff = gdn_replay(ckpt, *skip_ring) - gdn_replay(ckpt, *exact_ring)
    assert (torch.linalg.matrix_norm(diff, ord=2) <= e * decay * (1 + 1e-12)).all()
