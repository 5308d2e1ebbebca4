"""Commit of a speculative step: move each row's cursor (and origin) by its accepted count.

Runs after a verify launch of T drafts, for either layer type (it touches only the per-slot
indices). Per row, with h and origin as the verify step read them and a = num_accepted[row]
(1 <= a <= T, from a device tensor, so nothing reads back to the host):

    if h + T > L (the verify step flushed the h committed records into the checkpoint):
        origin = (origin + h) % cap; cursor = a     (the accepted drafts are records 0..a-1)
        sr_counter += 1                             (a low-precision checkpoint: the verify
                                                     step's SR write took the counter's bits)
    else:
        cursor = h + a

Rejected drafts are dropped by not counting them; no record moves. The next step's flush is
decided from the cursor on the device (h + T > L for verify, h + 1 >= L for decode).

Tensor contract (b = batch, S = slots):

| name          | shape | dtype | access | meaning                                         |
|---------------|-------|-------|--------|-------------------------------------------------|
| slot_ids      | (b,)  | int32 | R      | pad / out-of-range rows skip                    |
| num_accepted  | (b,)  | int32 | R      | accepted drafts of the row, 1..T                |
| cursor        | (S,)  | int32 | R / W  |                                                 |
| origin        | (S,)  | int32 | R / W  |                                                 |
| sr_counter    | (S,)  | int32 | R / W  | SR writes per slot (stochastic checkpoints only) |
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .common import slot_is_live

_THREADS = 128


@dataclass(frozen=True)
class CommitShape:
    window: int
    capacity: int
    num_drafts: int
    pad_slot_id: int = -1
    stochastic: bool = False  # an SR checkpoint: a flush advances the slot's write counter

    def key(self):
        return (self.window, self.capacity, self.num_drafts, self.pad_slot_id, self.stochastic)


class Commit:
    """Cursor / origin update of a verify step (module docstring); one thread per row."""

    def __init__(self, shape: CommitShape):
        if not 1 <= shape.num_drafts <= shape.capacity - shape.window:
            raise ValueError(f"num_drafts {shape.num_drafts} does not fit a ring of {shape.capacity} "
                             f"records with window {shape.window}")
        self.shape = shape

    @cute.jit
    def __call__(self, mSlot: cute.Tensor, mAccepted: cute.Tensor, mCursor: cute.Tensor,
                 mOrigin: cute.Tensor, mSrCounter: Optional[cute.Tensor], stream):
        self.kernel(mSlot, mAccepted, mCursor, mOrigin, mSrCounter).launch(
            grid=[(mSlot.shape[0] + _THREADS - 1) // _THREADS, 1, 1],
            block=[_THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, mSlot: cute.Tensor, mAccepted: cute.Tensor, mCursor: cute.Tensor, mOrigin: cute.Tensor,
               mSrCounter: Optional[cute.Tensor]):
        s = self.shape
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * _THREADS + tidx
        if row < mSlot.shape[0]:
            slot = mSlot[row]
            valid = slot_is_live(slot, mCursor.shape[0], s.pad_slot_id)
            if valid:
                h = mCursor[slot]
                a = mAccepted[row]
                if h + s.num_drafts > s.window:
                    mOrigin[slot] = (mOrigin[slot] + h) % s.capacity
                    mCursor[slot] = a
                    if cutlass.const_expr(s.stochastic):
                        mSrCounter[slot] = mSrCounter[slot] + 1
                else:
                    mCursor[slot] = h + a


def compile_commit(shape: CommitShape, options: str):
    from cutlass.cute.runtime import make_fake_compact_tensor

    batch, slots = cute.sym_int(), cute.sym_int()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = [make_fake_compact_tensor(Int32, (n,), assumed_align=4) for n in (batch, batch, slots, slots)]
    args.append(make_fake_compact_tensor(Int32, (slots,), assumed_align=4) if shape.stochastic else None)
    return cute.compile(Commit(shape), *args, stream, options=options)
