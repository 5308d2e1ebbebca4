"""Float64 reference for decoding on low-precision caches (docs/design.md section 5; paper
Section 6, Algorithms 3 and 6, Appendices B.4 and E.4.1), Mamba-2 and Gated DeltaNet.

Written for clarity, not speed. Arithmetic is float64 as in ``reference``; a value is rounded
only where it is stored: a record in its ring dtype, a state copy in its format. Layouts, the
formats and the stochastic-rounding bits are those of ``replayssm_cute.cache`` (module
docstring); ``cache.read_state`` decodes a copy and ``cache._write_state_`` writes one fp32
state into every copy (SR into a low-precision checkpoint, RTN into the read copy).

Standard decoding (T = 1), per active row with h = cursor[slot] (pad rows as in ``reference``):

* non-flush (h + 1 < window): the state read is the **read copy** (or, without one, the
  checkpoint: the shared configuration), decoded exactly to float64; output and record as in
  ``reference.*_replay_step`` from that state and the h records as stored; the record is
  written at (origin + h) % capacity, cursor += 1. No state copy is written.
* flush (h + 1 >= window; every step at window 1): the state read is the **recurrence
  checkpoint**, decoded; the state after the token is rebuilt from it in float64 and its
  output computed from the rebuilt state; the rebuilt state is rounded once to fp32 and that
  one fp32 state is written into every copy (never one copy from the other); cursor = 0.
  GDN with ``flush_corrections == "rederive"`` (paper Algorithm 6) ignores the cached u_j:
  ``u_j = beta_j (v_j - alpha_j S_{j-1} k_j)`` along the recurrence from the checkpoint, with
  (k, g, v, beta) as stored (``reference.gdn_replay_rederive``), then the token's own step;
  "fold" folds the cached u_j (``reference.gdn_replay_step``).

With an fp32 checkpoint and no read copy (and GDN folding) this is ``reference.*_decode_cache_``
bit for bit: both run the same float64 step on the same values and store its fp32 rounding.

Speculative verify (``*_verify_lowprec_cache_``, paper Algorithms 3 and 6): as
``reference_spec.*_verify_cache_`` with the state read chosen by the flush rule: the
checkpoint when h + T > window (the flush step), else the read copy. The draft outputs (and
GDN draft corrections) come from that state; a flush rebuilds the committed records from the
checkpoint and writes every copy. GDN "rederive" re-derives the committed corrections from the
checkpoint first and uses them for the drafts and outputs too (``gdn_verify_lowprec_cache_``).
``reference_spec.commit_cache_`` is unchanged (it moves cursors only).

The row loops, layer math and materialize are those of ``reference`` and ``reference_spec``
(which run a cache that is not plain through ``STATE_COPIES``); this module holds the state
access and the entry points that take it on any cache.
"""

from __future__ import annotations

import torch

from .reference import _StateAccess, _f64, _gdn_decode_, _mamba2_decode_
from .reference_spec import _gdn_verify_, _mamba2_verify_

__all__ = [
    "read_state_f64",
    "store_state_",
    "STATE_COPIES",
    "mamba2_decode_lowprec_cache_",
    "gdn_decode_lowprec_cache_",
    "mamba2_verify_lowprec_cache_",
    "gdn_verify_lowprec_cache_",
]

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- state copies


def read_state_f64(cache, slot: int, flush: bool) -> Tensor:
    """The state a step of ``slot`` reads, decoded to float64 (1, *state shape): the recurrence
    checkpoint on a flush step, else the read copy (the checkpoint when there is none)."""
    copy = "checkpoint" if flush or cache.read_copy is None else "read_copy"
    return _f64(cache.read_state([slot], copy))


def store_state_(cache, slot: int, state: Tensor) -> None:
    """A flush of ``slot``: round ``state`` (float64) once to fp32 and write that fp32 state into
    every copy (``cache._write_state_``); cursor = 0. Origin and ring are not touched."""
    cache._write_state_([slot], state.reshape((1,) + tuple(cache._state_shape)).to(torch.float32))
    cache.cursor[slot] = 0


# How the reference steps reach the state of any cache (the module docstring's rules).
STATE_COPIES = _StateAccess(read_state_f64, store_state_)


# ----------------------------------------------------------------------------- entry points


def mamba2_decode_lowprec_cache_(cache, x, dt, A, B, C, slot_ids, D=None, z=None, dt_bias=None, dt_softplus=False,
                                 out=None) -> Tensor:
    """In-place reference decode step (T = 1) on any ``Mamba2Cache`` (module docstring);
    arguments, pad rows and ``out`` as ``reference.mamba2_decode_cache_``. Returns ``out``."""
    return _mamba2_decode_(STATE_COPIES, cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out)


def gdn_decode_lowprec_cache_(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale=None, out=None) -> Tensor:
    """In-place reference GDN decode step (T = 1) on any ``GDNCache`` (module docstring);
    arguments, pad rows and ``out`` as ``reference.gdn_decode_cache_``. Returns ``out``.

    A flush with ``cache.flush_corrections == "rederive"`` rebuilds the state before the token
    with ``reference.gdn_replay_rederive`` from the decoded checkpoint and the records' (k, g,
    v, beta), then takes the token's step (``reference.gdn_conventional_step``: u from that
    state, o = S_new q); with "fold" it is ``reference.gdn_replay_step`` from the decoded
    checkpoint.
    """
    return _gdn_decode_(STATE_COPIES, cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out)


def mamba2_verify_lowprec_cache_(cache, x, dt, A, B, C, slot_ids, D=None, z=None, dt_bias=None, dt_softplus=False,
                                 out=None) -> Tensor:
    """``reference_spec.mamba2_verify_cache_`` on any ``Mamba2Cache`` (paper Algorithm 3): the
    outputs read the checkpoint when h + T > window, else the read copy; a flush writes every
    copy. Arguments and effects otherwise as there."""
    return _mamba2_verify_(STATE_COPIES, cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out)


def gdn_verify_lowprec_cache_(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale=None, out=None) -> Tensor:
    """``reference_spec.gdn_verify_cache_`` on any ``GDNCache`` (paper Algorithm 6): the draft
    corrections and outputs come from the checkpoint when h + T > window, else from the read
    copy with the cached committed corrections; a flush folds the committed records and writes
    every copy.

    With ``flush_corrections == "rederive"`` a flush step first re-derives the committed
    corrections from the checkpoint (``reference.gdn_replay_rederive``, Algorithm 6 line 8) and
    uses them for the draft corrections and outputs as well as for the fold, so nothing a flush
    step returns or stores depends on the read copy (as in the decode flush). The paper's line
    order solves the drafts (line 4) with the cached corrections before re-deriving; the
    re-derivation reads only S_ckpt k_j of the same pass over the checkpoint, so a kernel
    can take either order. "fold" uses the cached corrections throughout."""
    return _gdn_verify_(STATE_COPIES, cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out)
