"""Mamba-2 decode step: ReplaySSM standard decoding, with the conventional step as window 1.

One kernel class serves both. With window L > 1 it runs Algorithm 1 of the paper: each row reads
its cursor h on the device, appends its record, and either computes its output from checkpoint +
ring without writing any state (non-flush, output-only route) or folds the ring into the
checkpoint and stores it (flush, when h + 1 == L). With L == 1 every step is a flush of the
current token alone, which is exactly the conventional load-update-store step, so the baseline and
ReplaySSM share one code path and one set of launch parameters.

Grid: (headdim // rows_per_cta, nheads, batch). A CTA owns rows [p0, p0 + rows_per_cta) of one
head's (P, N) state for one batch row; warp w handles rows w, w + num_warps, ...; each lane holds
N / 32 consecutive elements of a state row. The checkpoint tile is streamed with TMA
(cp.async.bulk.tensor), all stages issued up front.

Tensor contract (b = batch, S = slots, cap = window + max_draft, act = bf16 | fp16 | fp32):

| name        | shape            | dtype   | access | meaning                                        |
|-------------|------------------|---------|--------|------------------------------------------------|
| checkpoint  | (S, H, P, N)     | fp32    | R / W on flush | S_ckpt (the conventional state when L = 1) |
| x           | (b, H, P)        | act     | R      | value input; batch stride free                 |
| dt          | (b, H)           | act/fp32| R      | raw dt                                         |
| A           | (H,)             | fp32    | R      | negative decay rate                            |
| B, C        | (b, G, N)        | act     | R      | key / query, head h uses group h // (H // G)   |
| D           | (H,)             | fp32    | R, optional | skip connection                           |
| z           | (b, H, P)        | act     | R, optional | gate: y *= z * sigmoid(z)                 |
| dt_bias     | (H,)             | fp32    | R, optional | added to dt before softplus               |
| slot_ids    | (b,)             | int32   | R      | pool slot per row; pad / out-of-range rows skip|
| out         | (b, H, P)        | act     | W      | y (pad rows left untouched)                    |
| ring_x      | (S, cap, H, P)   | act     | R / W  | record x (L > 1 only)                          |
| ring_B      | (S, cap, G, N)   | act     | R / W  | record B, once per group                       |
| ring_dt     | (S, cap, H)      | fp32    | R / W  | record dt after softplus                       |
| cursor      | (S,)             | int32   | R / W  | committed records h                            |
| origin      | (S,)             | int32   | R      | ring index of record 0                         |
| arrivals    | (S,)             | int32   | R / W  | zero between steps; the last CTA of a row advances the cursor |
"""

from dataclasses import dataclass
from typing import Optional, Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..common import issue_tile_loads, make_row_tma, softplus, warp_sum


@dataclass(frozen=True)
class Mamba2Shape:
    """Everything static about one layer's decode: dims, window, dtypes and optional inputs."""

    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    window: int
    capacity: int
    act_dtype: Type[cutlass.Numeric] = cutlass.BFloat16
    dt_dtype: Type[cutlass.Numeric] = cutlass.BFloat16
    has_D: bool = True
    has_z: bool = False
    has_dt_bias: bool = True
    dt_softplus: bool = True
    pad_slot_id: int = -1

    def key(self):
        return (self.nheads, self.headdim, self.dstate, self.ngroups, self.window, self.capacity,
                self.act_dtype.__name__, self.dt_dtype.__name__, self.has_D, self.has_z,
                self.has_dt_bias, self.dt_softplus, self.pad_slot_id)


@dataclass(frozen=True)
class Mamba2Config:
    """Launch configuration. rows_per_cta divides headdim; stage_rows divides rows_per_cta and is
    a multiple of num_warps (so each unrolled row iteration waits on a static stage)."""

    rows_per_cta: int = 16
    stage_rows: int = 8
    num_warps: int = 4

    def key(self):
        return (self.rows_per_cta, self.stage_rows, self.num_warps)

    def check(self, shape: Mamba2Shape) -> Optional[str]:
        """None if valid for `shape`, else the reason."""
        P, N = shape.headdim, shape.dstate
        if N % 32 or N > 256:
            return f"dstate {N}: the kernel needs a multiple of 32 up to 256"
        if P % self.rows_per_cta:
            return f"rows_per_cta {self.rows_per_cta} does not divide headdim {P}"
        if self.rows_per_cta % self.stage_rows or self.stage_rows % self.num_warps:
            return "stage_rows must divide rows_per_cta and be a multiple of num_warps"
        if self.stage_rows > 256:
            return "stage_rows above the TMA box limit of 256"
        if shape.window > 32 * self.num_warps:
            return "window larger than the CTA's thread count"
        return None


class Mamba2Decode:
    """One decode step of a Mamba-2 layer over a pool of slots (see module docstring)."""

    def __init__(self, shape: Mamba2Shape, config: Mamba2Config):
        reason = config.check(shape)
        if reason is not None:
            raise ValueError(f"Mamba2Config {config} invalid for {shape}: {reason}")
        self.shape = shape
        self.config = config

    def smem_bytes(self) -> int:
        s, c = self.shape, self.config
        state = c.rows_per_cta * s.dstate * 4
        return state + 8 * (c.rows_per_cta // c.stage_rows) + 4 * (3 * s.window + 1) \
            + 4 * c.rows_per_cta * (s.window + 1) + 512

    @cute.jit
    def __call__(
        self,
        mCheckpoint: cute.Tensor,
        mX: cute.Tensor,
        mDt: cute.Tensor,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mD: Optional[cute.Tensor],
        mZ: Optional[cute.Tensor],
        mDtBias: Optional[cute.Tensor],
        mSlot: cute.Tensor,
        mOut: cute.Tensor,
        mRingX: Optional[cute.Tensor],
        mRingB: Optional[cute.Tensor],
        mRingDt: Optional[cute.Tensor],
        mCursor: Optional[cute.Tensor],
        mOrigin: Optional[cute.Tensor],
        mArrivals: Optional[cute.Tensor],
        stream,
    ):
        s, c = self.shape, self.config
        H, P, N = s.nheads, s.headdim, s.dstate
        # The checkpoint as (slots * H * P, N) rows so a TMA box is `stage_rows` state rows.
        mRows = cute.make_tensor(
            mCheckpoint.iterator,
            cute.make_layout((mCheckpoint.shape[0] * (H * P), N), stride=(N, 1)),
        )
        tma_atom, mRowsTma = make_row_tma(mRows, c.stage_rows, N)
        self.kernel(
            tma_atom, mRowsTma, mCheckpoint, mX, mDt, mA, mB, mC, mD, mZ, mDtBias, mSlot, mOut,
            mRingX, mRingB, mRingDt, mCursor, mOrigin, mArrivals,
        ).launch(
            grid=[P // c.rows_per_cta, H, mX.shape[0]],
            block=[32 * c.num_warps, 1, 1],
            smem=self.smem_bytes(),
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_atom: cute.CopyAtom,
        mRowsTma: cute.Tensor,
        mCheckpoint: cute.Tensor,
        mX: cute.Tensor,
        mDt: cute.Tensor,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mD: Optional[cute.Tensor],
        mZ: Optional[cute.Tensor],
        mDtBias: Optional[cute.Tensor],
        mSlot: cute.Tensor,
        mOut: cute.Tensor,
        mRingX: Optional[cute.Tensor],
        mRingB: Optional[cute.Tensor],
        mRingDt: Optional[cute.Tensor],
        mCursor: Optional[cute.Tensor],
        mOrigin: Optional[cute.Tensor],
        mArrivals: Optional[cute.Tensor],
    ):
        s, c = self.shape, self.config
        H, P, N, G, L, cap = s.nheads, s.headdim, s.dstate, s.ngroups, s.window, s.capacity
        R, SR, W = c.rows_per_cta, c.stage_rows, c.num_warps
        stages = R // SR
        nthreads = 32 * W
        vec = N // 32
        heads_per_group = H // G
        act = s.act_dtype

        tidx, _, _ = cute.arch.thread_idx()
        ptile, head, row = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32

        slot = mSlot[row]
        valid = (slot >= 0) & (slot < mCheckpoint.shape[0])
        if cutlass.const_expr(s.pad_slot_id == 0):
            valid = valid & (slot != 0)

        if valid:
            slot64 = Int64(slot)
            group = head // heads_per_group
            p0 = ptile * R

            smem = SmemAllocator()
            sState = smem.allocate_tensor(
                Float32, cute.make_layout((SR, N, stages), stride=(N, 1, SR * N)), byte_alignment=128
            )
            mbar = smem.allocate_array(Int64, stages, byte_alignment=8)
            sDt = smem.allocate_tensor(Float32, cute.make_layout(L), byte_alignment=16)
            sW = smem.allocate_tensor(Float32, cute.make_layout(L), byte_alignment=16)
            sBC = smem.allocate_tensor(Float32, cute.make_layout(L), byte_alignment=16)
            sGamma = smem.allocate_tensor(Float32, cute.make_layout(1), byte_alignment=16)
            sCoef = smem.allocate_tensor(Float32, cute.make_layout((L, R), stride=(R, 1)), byte_alignment=16)
            sRing = smem.allocate_tensor(Float32, cute.make_layout(R), byte_alignment=16)

            # Stream this CTA's checkpoint rows while the step's scalars are formed.
            if warp == 0:
                for st in cutlass.range_constexpr(stages):
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_init(mbar + st, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            if warp == 0:
                first_box = Int32((slot64 * (H * P) + head * P + p0) // SR)
                issue_tile_loads(tma_atom, mRowsTma, sState, mbar, first_box, stages, SR * N * 4)

            A = mA[head].to(Float32)
            dt_cur = mDt[row, head].to(Float32)
            if cutlass.const_expr(s.has_dt_bias):
                dt_cur = dt_cur + mDtBias[head].to(Float32)
            if cutlass.const_expr(s.dt_softplus):
                dt_cur = softplus(dt_cur)

            h = Int32(0)
            origin = Int32(0)
            if cutlass.const_expr(L > 1):
                h = mCursor[slot]
                origin = mOrigin[slot]
            flush = h + 1 == L

            # Record j's weight w_j = dt_j * exp(A * sum_{i in (j, h]} dt_i); gamma = decay of all.
            if tidx <= h:
                dt_j = dt_cur
                if cutlass.const_expr(L > 1):
                    if tidx < h:
                        dt_j = mRingDt[slot64, (origin + tidx) % cap, head]
                sDt[tidx] = dt_j
            cute.arch.sync_threads()
            if tidx <= h:
                suffix = Float32(0.0)
                for i in cutlass.range(tidx + 1, h + 1):
                    suffix = suffix + sDt[i]
                sW[tidx] = sDt[tidx] * cute.math.exp(A * suffix, fastmath=False)
                if tidx == 0:
                    sGamma[0] = cute.math.exp(A * (suffix + sDt[0]), fastmath=False)

            rC = cute.make_rmem_tensor((vec,), Float32)
            for v in cutlass.range_constexpr(vec):
                rC[v] = mC[row, group, lane * vec + v].to(Float32)
            rB = cute.make_rmem_tensor((L * vec,), Float32)
            cute.arch.sync_threads()

            if flush:
                # Fold: S = gamma * S_ckpt + sum_j (w_j x_j) B_j^T; lanes keep their B columns.
                for t in cutlass.range(tidx, R, nthreads):
                    for j in cutlass.range_constexpr(L):
                        if cutlass.const_expr(j < L - 1):
                            sCoef[j, t] = sW[j] * mRingX[slot64, (origin + j) % cap, head, p0 + t].to(Float32)
                        else:
                            sCoef[j, t] = sW[j] * mX[row, head, p0 + t].to(Float32)
                for j in cutlass.range_constexpr(L):
                    for v in cutlass.range_constexpr(vec):
                        if cutlass.const_expr(j < L - 1):
                            rB[j * vec + v] = mRingB[slot64, (origin + j) % cap, group, lane * vec + v].to(Float32)
                        else:
                            rB[j * vec + v] = mB[row, group, lane * vec + v].to(Float32)
            else:
                if cutlass.const_expr(L > 1):
                    # Output-only route: B_j . C once per record, shared by the P rows.
                    for j in cutlass.range(warp, h + 1, W):
                        part = Float32(0.0)
                        for v in cutlass.range_constexpr(vec):
                            b_jv = mB[row, group, lane * vec + v].to(Float32)
                            if j < h:
                                b_jv = mRingB[slot64, (origin + j) % cap, group, lane * vec + v].to(Float32)
                            part = part + b_jv * rC[v]
                        part = warp_sum(part)
                        if lane == 0:
                            sBC[j] = part
                    cute.arch.sync_threads()
                    pos = (origin + h) % cap
                    for t in cutlass.range(tidx, R, nthreads):
                        x_now = mX[row, head, p0 + t]
                        acc = sW[h] * sBC[h] * x_now.to(Float32)
                        for j in cutlass.range(0, h):
                            acc = acc + sW[j] * sBC[j] * mRingX[slot64, (origin + j) % cap, head, p0 + t].to(Float32)
                        sRing[t] = acc
                        mRingX[slot64, pos, head, p0 + t] = x_now
                    if ptile == 0:
                        if head % heads_per_group == 0:
                            for n in cutlass.range(tidx, N, nthreads):
                                mRingB[slot64, pos, group, n] = mB[row, group, n]
                        if tidx == 0:
                            mRingDt[slot64, pos, head] = dt_cur
            cute.arch.sync_threads()

            gamma = sGamma[0]
            for it in cutlass.range_constexpr(R // W):
                r = it * W + warp
                st = (it * W) // SR
                cute.arch.mbarrier_wait(mbar + st, 0)
                rS = cute.make_rmem_tensor((vec,), Float32)
                cute.autovec_copy(cute.local_tile(sState[r % SR, None, st], (vec,), (lane,)), rS)
                if flush:
                    for v in cutlass.range_constexpr(vec):
                        acc = gamma * rS[v]
                        for j in cutlass.range_constexpr(L):
                            acc = acc + sCoef[j, r] * rB[j * vec + v]
                        rS[v] = acc
                    cute.autovec_copy(rS, cute.local_tile(mCheckpoint[slot64, head, p0 + r, None], (vec,), (lane,)))
                part = Float32(0.0)
                for v in cutlass.range_constexpr(vec):
                    part = part + rS[v] * rC[v]
                dot = warp_sum(part)
                if lane == 0:
                    y = gamma * dot
                    if flush:
                        y = dot
                    else:
                        y = y + sRing[r]
                    x_now = mX[row, head, p0 + r].to(Float32)
                    if cutlass.const_expr(s.has_D):
                        y = y + mD[head].to(Float32) * x_now
                    if cutlass.const_expr(s.has_z):
                        z = mZ[row, head, p0 + r].to(Float32)
                        y = y * z / (Float32(1.0) + cute.math.exp(-z, fastmath=False))
                    mOut[row, head, p0 + r] = y.to(act)

            if cutlass.const_expr(L > 1):
                # The last CTA of this row to finish advances the cursor: every CTA has read h by now.
                cute.arch.sync_threads()
                if tidx == 0:
                    cute.arch.fence_acq_rel_gpu()
                    done = cute.arch.atomic_add(
                        mArrivals.iterator + slot64, Int32(1), sem="acq_rel", scope="gpu"
                    )
                    if done == H * (P // R) - 1:
                        next_h = h + 1
                        if flush:
                            next_h = Int32(0)
                        mCursor[slot] = next_h
                        mArrivals[slot] = Int32(0)


def _fake_inputs(shape: Mamba2Shape):
    """Fake tensors with symbolic batch and slot dims, matching what the API passes."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    H, P, N, G, cap = shape.nheads, shape.headdim, shape.dstate, shape.ngroups, shape.capacity
    act = shape.act_dtype
    batch, slots = cute.sym_int(), cute.sym_int()

    def compact(dtype, dims, align=None):
        return make_fake_compact_tensor(dtype, dims, stride_order=tuple(reversed(range(len(dims)))),
                                        assumed_align=align)

    def batch_strided(dtype, dims):
        # Rows may be a view into a wider activation tensor: the batch stride is free.
        inner = [1]
        for d in reversed(dims[2:] if len(dims) > 2 else ()):
            inner.insert(0, inner[0] * d)
        stride = (cute.sym_int64(),) + tuple(inner[-(len(dims) - 1):])
        return make_fake_tensor(dtype, (batch,) + tuple(dims[1:]), stride)

    replay = shape.window > 1
    return dict(
        mCheckpoint=compact(Float32, (slots, H, P, N), align=16),
        mX=batch_strided(act, (batch, H, P)),
        mDt=batch_strided(shape.dt_dtype, (batch, H)),
        mA=compact(Float32, (H,)),
        mB=batch_strided(act, (batch, G, N)),
        mC=batch_strided(act, (batch, G, N)),
        mD=compact(Float32, (H,)) if shape.has_D else None,
        mZ=batch_strided(act, (batch, H, P)) if shape.has_z else None,
        mDtBias=compact(Float32, (H,)) if shape.has_dt_bias else None,
        mSlot=compact(Int32, (batch,)),
        mOut=batch_strided(act, (batch, H, P)),
        mRingX=compact(act, (slots, cap, H, P)) if replay else None,
        mRingB=compact(act, (slots, cap, G, N)) if replay else None,
        mRingDt=compact(Float32, (slots, cap, H)) if replay else None,
        mCursor=compact(Int32, (slots,)) if replay else None,
        mOrigin=compact(Int32, (slots,)) if replay else None,
        mArrivals=compact(Int32, (slots,)) if replay else None,
    )


def compile_decode(shape: Mamba2Shape, config: Mamba2Config, options: str):
    """Compile with `options` (TVM-FFI and the target arch); the entry point launches on the
    caller's current CUDA stream, so CUDA-graph capture records it."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = _fake_inputs(shape)
    return cute.compile(Mamba2Decode(shape, config), *args.values(), stream, options=options)
