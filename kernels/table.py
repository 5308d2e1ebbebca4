"""The sequence table's two kernels: the plan of a model step, and the commit of a verify step.

A model's layers share one sequence table (``replayssm_cute.SequenceTable``): per slot the
committed record count h, the ring origin and the SR write counter. The layer kernels never read
it through the slot id and never write it; they read a **plan**, one int32 row per batch row
made once per model step:

    plan[r] = (slot, h, origin, sr_writes)    as the table held them before the step

so a layer kernel's ring positions arrive in a load indexed by the batch row, issued alongside
the slot id instead of after it.

``TablePlan`` writes the plan. For standard decode (``num_drafts == 0``) it also advances the
table in the same pass, since every layer of the step reads the plan, not the table: per live
row, with flush = h + 1 >= L,

    h = 0 if flush else h + 1;    sr_writes += flush       (origin is untouched)

For a verify step (``num_drafts == T``) it only gathers; ``TableCommit`` then applies the
accepted counts a (1 <= a <= T, a device tensor) from the verify's plan, without reading the
table:

    if h + T > L:  origin = (origin + h) % cap;  h = a;  sr_writes += 1   (the verify folded)
    else:          h = h + a

Rejected drafts are dropped by not counting them; no record moves. Pad rows and rows whose slot
lies outside the table are copied into the plan as they are (every layer kernel skips them) and
leave the table untouched.

Tensor contract (b = batch, S = slots):

| name          | shape  | dtype | access                     | meaning                                  |
|---------------|--------|-------|----------------------------|------------------------------------------|
| slot_ids      | (b,)   | int32 | R (plan)                   | pool slot per row                        |
| plan          | (b, 4) | int32 | W (plan) / R (commit)      | (slot, h, origin, sr_writes) per row     |
| num_accepted  | (b,)   | int32 | R (commit)                 | accepted drafts of the row, 1..T         |
| committed     | (S,)   | int32 | R / W                      | committed records h                      |
| origin        | (S,)   | int32 | R (plan) / W (commit)      | ring index of record 0                   |
| sr_writes     | (S,)   | int32 | R / W                      | SR writes of the slot so far             |
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .common import after_previous_kernel, launch, slot_is_live
from .limits import PLAN_COLUMNS

_THREADS = 128


@dataclass(frozen=True)
class TableShape:
    """What the table kernels are compiled for: window L, ring capacity, the step's draft count
    (0: standard decode) and the pad sentinel."""

    window: int
    capacity: int
    num_drafts: int = 0
    pad_slot_id: int = -1

    def key(self):
        return (self.window, self.capacity, self.num_drafts, self.pad_slot_id)

    def check(self):
        """None if the kernels take this shape, else why not."""
        if self.window < 1 or self.capacity < self.window:
            return f"window {self.window} and capacity {self.capacity}: need 1 <= window <= capacity"
        if self.num_drafts and not 1 <= self.num_drafts <= self.capacity - self.window:
            return (f"num_drafts {self.num_drafts} does not fit a ring of {self.capacity} records with window "
                    f"{self.window}")
        return None


def _launch_rows(kernel_call, rows, stream):
    """Launch one thread per batch row."""
    launch(kernel_call, [(rows + _THREADS - 1) // _THREADS, 1, 1], [_THREADS, 1, 1], stream)


@cute.jit
def _this_row() -> Int32:
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    return bidx * _THREADS + tidx


class TablePlan:
    """The plan of a step (module docstring); advances the table too for standard decode. One
    thread per row."""

    def __init__(self, shape: TableShape):
        reason = shape.check()
        if reason is not None:
            raise ValueError(f"TablePlan: {reason}")
        self.shape = shape

    @cute.jit
    def __call__(self, mSlot: cute.Tensor, mPlan: cute.Tensor, mCommitted: cute.Tensor, mOrigin: cute.Tensor,
                 mSrWrites: cute.Tensor, stream):
        _launch_rows(self.kernel(mSlot, mPlan, mCommitted, mOrigin, mSrWrites), mSlot.shape[0], stream)

    @cute.kernel
    def kernel(self, mSlot: cute.Tensor, mPlan: cute.Tensor, mCommitted: cute.Tensor, mOrigin: cute.Tensor,
               mSrWrites: cute.Tensor):
        s = self.shape
        after_previous_kernel()
        row = _this_row()
        if row < mSlot.shape[0]:
            slot = mSlot[row]
            h = Int32(0)
            origin = Int32(0)
            writes = Int32(0)
            if slot_is_live(slot, mCommitted.shape[0], s.pad_slot_id):
                h = mCommitted[slot]
                origin = mOrigin[slot]
                writes = mSrWrites[slot]
                if cutlass.const_expr(s.num_drafts == 0):
                    # h == L only after a speculative commit: that step folds all L records too.
                    flush = h + 1 >= s.window
                    mCommitted[slot] = cutlass.select_(flush, Int32(0), h + 1)
                    if flush:
                        mSrWrites[slot] = writes + 1
            mPlan[row, 0] = slot
            mPlan[row, 1] = h
            mPlan[row, 2] = origin
            mPlan[row, 3] = writes


class TableCommit:
    """The commit of a verify step from its plan (module docstring). One thread per row."""

    def __init__(self, shape: TableShape):
        reason = shape.check()
        if reason is None and shape.num_drafts == 0:
            reason = "a commit needs the verify step's draft count (num_drafts >= 1)"
        if reason is not None:
            raise ValueError(f"TableCommit: {reason}")
        self.shape = shape

    @cute.jit
    def __call__(self, mPlan: cute.Tensor, mAccepted: cute.Tensor, mCommitted: cute.Tensor, mOrigin: cute.Tensor,
                 mSrWrites: cute.Tensor, stream):
        _launch_rows(self.kernel(mPlan, mAccepted, mCommitted, mOrigin, mSrWrites), mPlan.shape[0], stream)

    @cute.kernel
    def kernel(self, mPlan: cute.Tensor, mAccepted: cute.Tensor, mCommitted: cute.Tensor, mOrigin: cute.Tensor,
               mSrWrites: cute.Tensor):
        s = self.shape
        after_previous_kernel()
        row = _this_row()
        if row < mPlan.shape[0]:
            slot = mPlan[row, 0]
            if slot_is_live(slot, mCommitted.shape[0], s.pad_slot_id):
                h = mPlan[row, 1]
                a = mAccepted[row]
                if h + s.num_drafts > s.window:
                    mOrigin[slot] = (mPlan[row, 2] + h) % s.capacity
                    mCommitted[slot] = a
                    mSrWrites[slot] = mPlan[row, 3] + 1
                else:
                    mCommitted[slot] = h + a


def _fake_tables():
    from cutlass.cute.runtime import make_fake_compact_tensor

    batch, slots = cute.sym_int(), cute.sym_int()
    plan = make_fake_compact_tensor(Int32, (batch, PLAN_COLUMNS), stride_order=(1, 0), assumed_align=16)
    per_slot = [make_fake_compact_tensor(Int32, (slots,), assumed_align=4) for _ in range(3)]
    return make_fake_compact_tensor(Int32, (batch,), assumed_align=4), plan, per_slot


def compile_plan(shape: TableShape, options: str):
    """Compile ``TablePlan`` with `options`; launches on the caller's current CUDA stream."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    rows, plan, per_slot = _fake_tables()
    return cute.compile(TablePlan(shape), rows, plan, *per_slot, stream, options=options)


def compile_commit(shape: TableShape, options: str):
    """Compile ``TableCommit`` with `options`; launches on the caller's current CUDA stream."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    rows, plan, per_slot = _fake_tables()
    return cute.compile(TableCommit(shape), plan, rows, *per_slot, stream, options=options)
