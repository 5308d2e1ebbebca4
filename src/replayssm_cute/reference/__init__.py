"""Float64 references of Mamba-2 and Gated DeltaNet decoding, conventional and ReplaySSM,
standard and speculative, on plain and low-precision caches: the oracle the GPU kernels are
tested against and the CPU backend of every op.

Written for clarity, not speed; every function computes in float64. The modules, by level:

* ``mamba2``, ``gdn``: the pure recurrences of each layer type, functions of tensors
  (conventional step, replay, output-only replay output and step, verify outputs, GDN gates,
  normalisation and draft corrections, the snapshot baseline); their docstrings hold the
  layer conventions. ``common``: the helpers both share (and ``softplus``).
* ``pool``: the decode steps and ``*_materialize`` on a cache (row loops, slot ids, ring
  reads and writes); ``pool_spec``: verify, commit and the snapshot baseline on a cache, with
  the ring, origin and cursor conventions; ``state``: how those steps reach a slot's state (the
  fp32 checkpoint of a plain cache, the state copies of a low-precision one, and their rules).

Every public function is importable from this package: ``reference.mamba2_conventional_step``.
"""

from . import common, gdn, mamba2, pool, pool_spec, state
from .common import softplus
from .gdn import (
    gdn_conventional_step,
    gdn_draft_corrections,
    gdn_gates,
    gdn_normalize,
    gdn_replay,
    gdn_replay_output,
    gdn_replay_rederive,
    gdn_replay_step,
    gdn_snapshot_verify,
    gdn_verify_output,
)
from .mamba2 import (
    mamba2_conventional_step,
    mamba2_dt,
    mamba2_replay,
    mamba2_replay_output,
    mamba2_replay_step,
    mamba2_snapshot_verify,
    mamba2_verify_output,
)
from .pool import (
    gdn_decode_cache_,
    gdn_decode_lowprec_cache_,
    gdn_materialize,
    mamba2_decode_cache_,
    mamba2_decode_lowprec_cache_,
    mamba2_materialize,
)
from .pool_spec import (
    commit_cache_,
    gdn_snapshot_verify_cache_,
    gdn_verify_cache_,
    gdn_verify_lowprec_cache_,
    mamba2_snapshot_verify_cache_,
    mamba2_verify_cache_,
    mamba2_verify_lowprec_cache_,
    snapshot_commit_cache_,
    snapshot_select,
    spec_flush,
)
from .state import STATE_COPIES, read_state_f64, store_state_

__all__ = common.__all__ + mamba2.__all__ + gdn.__all__ + pool.__all__ + pool_spec.__all__ + state.__all__
