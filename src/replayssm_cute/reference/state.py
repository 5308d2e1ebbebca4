"""How the pool-level reference steps (``pool``, ``pool_spec``) reach a slot's state: the fp32
checkpoint of a plain cache, read and written as is, or the state copies of a cache with
low-precision state or re-derived flush corrections (docs/design.md section 5; paper Section 6,
Algorithms 3 and 6, Appendices B.4 and E.4.1).

Arithmetic is float64 as in the rest of the reference; a value is rounded only where it is
stored: a record in its ring dtype, a state copy in its format. Layouts, the formats and the
stochastic-rounding bits are those of ``replayssm_cute.cache`` (module docstring);
``cache.read_state`` decodes a copy and ``cache._write_state_`` writes one fp32 state into every
copy (SR into a low-precision checkpoint, RTN into the read copy).

Standard decoding (T = 1) through the state copies, per active row with h from the step's plan
(pad rows as in ``reference.*_decode_cache_``; the table advances when the plan is made):

* non-flush (h + 1 < window): the state read is the **read copy** (or, without one, the
  checkpoint: the shared configuration), decoded exactly to float64; output and record as in
  ``reference.*_replay_step`` from that state and the h records as stored; the record is
  written at (origin + h) % capacity. No state copy is written.
* flush (h + 1 >= window; every step at window 1): the state read is the **recurrence
  checkpoint**, decoded; the state after the token is rebuilt from it in float64 and its
  output computed from the rebuilt state; the rebuilt state is rounded once to fp32 and that
  one fp32 state is written into every copy (never one copy from the other).
  GDN with ``flush_corrections == "rederive"`` (paper Algorithm 6) ignores the cached u_j:
  ``u_j = beta_j (v_j - alpha_j S_{j-1} k_j)`` along the recurrence from the checkpoint, with
  (k, g, v, beta) as stored (``reference.gdn_replay_rederive``), then the token's own step;
  "fold" folds the cached u_j (``reference.gdn_replay_step``).

With an fp32 checkpoint and no read copy (and GDN folding) this is the plain
``reference.*_decode_cache_`` bit for bit: both run the same float64 step on the same values and
store its fp32 rounding.

Speculative verify (``reference.*_verify_lowprec_cache_``, paper Algorithms 3 and 6): as
``reference.*_verify_cache_`` with the state read chosen by the flush rule: the checkpoint when
h + T > window (the flush step), else the read copy. The draft outputs (and GDN draft
corrections) come from that state; a flush rebuilds the committed records from the checkpoint
and writes every copy. GDN "rederive" re-derives the committed corrections from the checkpoint
first and uses them for the drafts and outputs too (``reference.gdn_verify_lowprec_cache_``).
``reference.commit_cache_`` moves the table as after any verify.

The row loops, layer math and materialize are those of ``pool`` and ``pool_spec``, which run a
cache that is not plain through ``STATE_COPIES`` (``state_access``); their
``*_lowprec_cache_`` entry points take ``STATE_COPIES`` on any cache.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .common import f64

__all__ = ["read_state_f64", "store_state_", "STATE_COPIES"]

Tensor = torch.Tensor


class StateAccess(NamedTuple):
    """How a cache-level step reaches a slot's state: ``read(cache, slot, flush)`` gives the state
    (1, *state shape) a step starts from (``flush``: the step folds the ring into the checkpoint);
    ``store_(cache, slot, state, sr_write)`` stores the float64 state a flush built, as SR write
    ``sr_write`` of the slot (the step's plan). Positions are the table's (``replayssm_cute.table``):
    a store does not touch them."""

    read: Callable[[object, int, bool], Tensor]
    store_: Callable[[object, int, Tensor, int], None]


def _store_checkpoint_(cache, slot: int, new_ckpt: Tensor, sr_write: int) -> None:
    """A flush: the slot's checkpoint = new_ckpt (cast to its dtype); fp32, so no SR write."""
    cache.checkpoint[slot] = new_ckpt.to(dtype=cache.checkpoint.dtype)


# A plain cache: its fp32 checkpoint, read and written as is.
PLAIN_CHECKPOINT = StateAccess(lambda cache, slot, flush: cache.checkpoint[slot : slot + 1], _store_checkpoint_)


# ----------------------------------------------------------------------------- state copies


def read_state_f64(cache, slot: int, flush: bool) -> Tensor:
    """The state a step of ``slot`` reads, decoded to float64 (1, *state shape): the recurrence
    checkpoint on a flush step, else the read copy (the checkpoint when there is none)."""
    copy = "checkpoint" if flush or cache.read_copy is None else "read_copy"
    return f64(cache._decoded([slot], copy))


def store_state_(cache, slot: int, state: Tensor, sr_write: int) -> None:
    """A flush of ``slot``: round ``state`` (float64) once to fp32 and write that fp32 state into
    every copy (``cache._write_state_``), SR with the bits of write ``sr_write``. Positions and
    ring are not touched."""
    cache._write_state_([slot], state.reshape((1,) + tuple(cache._state_shape)).to(torch.float32), [sr_write])


# How the reference steps reach the state of any cache (the module docstring's rules).
STATE_COPIES = StateAccess(read_state_f64, store_state_)


def state_access(cache) -> StateAccess:
    """The fp32 checkpoint of a plain cache, else the state copies (``STATE_COPIES``)."""
    if getattr(cache, "is_plain", True):
        return PLAIN_CHECKPOINT
    return STATE_COPIES
