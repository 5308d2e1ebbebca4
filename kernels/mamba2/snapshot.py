"""Mamba-2 conventional speculative baseline: load the state once, store a snapshot per draft.

What serving engines run today for speculative decoding of SSM layers, kept so that ReplaySSM's
verify is compared against a measured baseline, not an assumed one. Per row: the state of its
slot is read once; each of the T drafts updates it (``S = alpha S + dt x B^T``), gives its output
``y = S C + D x`` and stores the state after it into ``snapshots[row, t]``; the accepted snapshot
becomes the slot's state at commit (a copy or, in an engine, a pointer switch). The conventional
cache (window 1) is never written.

Grid and TMA loading as ``Mamba2Decode``; a warp keeps its rows in registers across the drafts.

Tensor contract (b = batch, S = slots, T = drafts, act as decode):

| name       | shape              | dtype | access | meaning                                   |
|------------|--------------------|-------|--------|-------------------------------------------|
| checkpoint | (S, H, P, N)       | fp32  | R      | the conventional state                    |
| x, z       | (b, T, H, P)       | act   | R      | z optional                                |
| dt         | (b, T, H)          | act/fp32 | R   | raw dt                                    |
| A, D, dt_bias | (H,)            | fp32  | R      | D, dt_bias optional                       |
| B, C       | (b, T, G, N)       | act   | R      |                                           |
| slot_ids   | (b,)               | int32 | R      | pad / out-of-range rows skip              |
| out        | (b, T, H, P)       | act   | W      |                                           |
| snapshots  | (b, T, H, P, N)    | fp32  | W      | state after each draft, by row            |
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from cutlass.memory import SmemAllocator

from ..common import (DraftStepKernel, after_previous_kernel, launch_tiles, make_row_tma, slot_is_live, slot_rows,
                      smem_fit, snapshot_check, softplus, start_tile_loads, warp_reduce_many)
from .config import Mamba2Config, Mamba2Shape


class Mamba2Snapshot(DraftStepKernel):
    """One conventional speculative step of T drafts (module docstring)."""

    @staticmethod
    def smem_bytes(shape: Mamba2Shape, config: Mamba2Config, num_drafts: int) -> int:
        return config.rows_per_cta * shape.dstate * 4 + 2 * num_drafts * shape.dstate * 4 + 8 * config.num_warps + 512

    @staticmethod
    def check(shape, config, num_drafts: int) -> Optional[str]:
        return (snapshot_check(shape, config, num_drafts)
                or smem_fit(Mamba2Snapshot.smem_bytes(shape, config, num_drafts), config.min_ctas_per_sm))

    @cute.jit
    def __call__(self, mCheckpoint: cute.Tensor, mX: cute.Tensor, mDt: cute.Tensor, mA: cute.Tensor,
                 mB: cute.Tensor, mC: cute.Tensor, mD: Optional[cute.Tensor], mZ: Optional[cute.Tensor],
                 mDtBias: Optional[cute.Tensor], mSlot: cute.Tensor, mOut: cute.Tensor,
                 mSnapshots: cute.Tensor, stream):
        s, c = self.shape, self.config
        H, P, N = s.nheads, s.headdim, s.dstate
        tma_atom, mRowsTma = make_row_tma(slot_rows(mCheckpoint, H * P, N), c.rows_per_warp, N)
        launch_tiles(self.kernel(tma_atom, mRowsTma, mCheckpoint, mX, mDt, mA, mB, mC, mD, mZ, mDtBias, mSlot, mOut,
                                 mSnapshots),
                     [P // c.rows_per_cta, H, mX.shape[0]], c, self.smem_bytes(s, c, self.num_drafts), stream)

    @cute.kernel
    def kernel(self, tma_atom: cute.CopyAtom, mRowsTma: cute.Tensor, mCheckpoint: cute.Tensor,
               mX: cute.Tensor, mDt: cute.Tensor, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor,
               mD: Optional[cute.Tensor], mZ: Optional[cute.Tensor], mDtBias: Optional[cute.Tensor],
               mSlot: cute.Tensor, mOut: cute.Tensor, mSnapshots: cute.Tensor):
        s, c, T = self.shape, self.config, self.num_drafts
        H, P, N, G = s.nheads, s.headdim, s.dstate, s.ngroups
        R, W = c.rows_per_cta, c.num_warps
        RW = R // W
        vec = N // 32
        r_shift = 5 - (RW.bit_length() - 1)
        act = s.act_dtype

        tidx, _, _ = cute.arch.thread_idx()
        ptile, head, row = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()

        after_previous_kernel()
        slot = mSlot[row]
        valid = slot_is_live(slot, mCheckpoint.shape[0], s.pad_slot_id)
        if valid:
            slot64 = Int64(slot)
            row64 = Int64(row)  # the snapshot buffer can pass 2^31 elements
            group = head // (H // G)
            p_warp = ptile * R + warp * RW

            smem = SmemAllocator()
            sState = smem.allocate_tensor(
                Float32, cute.make_layout((RW, N, W), stride=(N, 1, RW * N)), byte_alignment=128)
            mbar = smem.allocate_array(Int64, W, byte_alignment=8)
            sBC = smem.allocate_tensor(Float32, cute.make_layout((2 * T, N), stride=(N, 1)), byte_alignment=16)
            first_box = Int32((slot64 * (H * P) + head * P + ptile * R) // RW)
            start_tile_loads(tma_atom, mRowsTma, sState, mbar, first_box, W, RW * N * 4)

            # The drafts' B (rows 0..T-1) and C (rows T..2T-1) in fp32, staged by the warps.
            for tt in cutlass.range_constexpr(-(-2 * T // W)):
                if cutlass.const_expr(tt * W < 2 * T):
                    t_stage = tt * W + warp
                    if t_stage < 2 * T:
                        rV = cute.make_rmem_tensor((vec,), act)
                        if t_stage < T:
                            cute.autovec_copy(cute.local_tile(mB[row, t_stage, group, None], (vec,), (lane,)), rV)
                        else:
                            cute.autovec_copy(cute.local_tile(mC[row, t_stage - T, group, None], (vec,), (lane,)), rV)
                        rF = cute.make_rmem_tensor((vec,), Float32)
                        rF.store(rV.load().to(Float32))
                        cute.autovec_copy(rF, cute.local_tile(sBC[t_stage, None], (vec,), (lane,)))

            lr = lane % RW
            i_row = p_warp + lr
            A = mA[head].to(Float32)
            dt_t = Float32(0.0)  # lane t: dt of draft t
            if lane < T:
                dt_t = mDt[row, lane, head].to(Float32)
                if cutlass.const_expr(s.has_dt_bias):
                    dt_t = dt_t + mDtBias[head].to(Float32)
                if cutlass.const_expr(s.dt_softplus):
                    dt_t = softplus(dt_t)
            D = Float32(0.0)
            if cutlass.const_expr(s.has_D):
                D = mD[head].to(Float32)
            cute.arch.sync_threads()
            cute.arch.mbarrier_wait(mbar + warp, 0)
            rS = cute.make_rmem_tensor(cute.make_layout((RW, vec), stride=(vec, 1)), Float32)
            for r in cutlass.range_constexpr(RW):
                cute.autovec_copy(cute.local_tile(sState[r, None, warp], (vec,), (lane,)), rS[r, None])

            for t in cutlass.range_constexpr(T):
                dt = cute.arch.shuffle_sync(dt_t, t)
                alpha = cute.math.exp(A * dt, fastmath=False)
                x_t = mX[row, t, head, i_row].to(Float32)
                rB = cute.make_rmem_tensor((vec,), Float32)
                rC = cute.make_rmem_tensor((vec,), Float32)
                cute.autovec_copy(cute.local_tile(sBC[t, None], (vec,), (lane,)), rB)
                cute.autovec_copy(cute.local_tile(sBC[T + t, None], (vec,), (lane,)), rC)
                rY = cute.make_rmem_tensor((RW,), Float32)
                rY.fill(0.0)
                for r in cutlass.range_constexpr(RW):
                    coef = cute.arch.shuffle_sync(dt * x_t, r)
                    for v in cutlass.range_constexpr(vec):
                        rS[r, v] = alpha * rS[r, v] + coef * rB[v]
                        rY[r] = rY[r] + rS[r, v] * rC[v]
                    cute.autovec_copy(rS[r, None], cute.local_tile(
                        mSnapshots[row64, t, head, p_warp + r, None], (vec,), (lane,)))
                tot = warp_reduce_many(rY, RW)  # lane l holds row l >> r_shift
                y = cute.arch.shuffle_sync(tot, lr << r_shift) + D * x_t
                if cutlass.const_expr(s.has_z):
                    z = mZ[row, t, head, i_row].to(Float32)
                    y = y * z / (Float32(1.0) + cute.math.exp(-z, fastmath=False))
                if lane < RW:
                    mOut[row, t, head, i_row] = y.to(act)


def compile_snapshot(shape: Mamba2Shape, config: Mamba2Config, num_drafts: int, options: str):
    """Compile with `options`; launches on the caller's current CUDA stream."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    from ..state_io import COPY_ARGS
    from .verify import fake_inputs

    args = fake_inputs(shape, num_drafts)
    for name in ("mRingX", "mRingB", "mRingDt", "mPlan", *COPY_ARGS):
        args.pop(name)  # verify's, not the snapshot's
    H, P, N = shape.nheads, shape.headdim, shape.dstate
    args["mSnapshots"] = make_fake_compact_tensor(
        Float32, (cute.sym_int(), num_drafts, H, P, N), stride_order=(4, 3, 2, 1, 0), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(Mamba2Snapshot(shape, config, num_drafts), *args.values(), stream, options=options)
