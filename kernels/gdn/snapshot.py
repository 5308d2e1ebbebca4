"""Gated DeltaNet conventional speculative baseline: load the state once, store a snapshot per draft.

What serving engines run today for speculative decoding of GDN layers, kept so that ReplaySSM's
verify is compared against a measured baseline, not an assumed one. Per row: the state of its
slot is read once; each of the T drafts runs the plain gated delta rule on it in registers, with
the conventions of ``GDNDecode`` (q, k L2-normalised in fp32, q scaled; g = -exp(A_log)
softplus(a + dt_bias), alpha = exp(g), beta = sigmoid(b)):

    u = beta (v - alpha S k),   o = alpha (S q) + u (k . q),   S = alpha S + u k^T

and stores the state after it into ``snapshots[row, t]``; the accepted snapshot becomes the
slot's state at commit (a copy or, in an engine, a pointer switch; not part of this kernel). The
conventional cache (window 1) is never written.

Grid, warp layout and TMA loading as ``GDNDecode`` at window 1; a warp keeps its state rows in
registers across the drafts. The drafts' normalised k and q (and k . q) are formed once per CTA
in shared memory; S k and S q of all the warp's rows take one reduction per draft.

Tensor contract (b = batch, S = slots, T = drafts, act as decode):

| name        | shape              | dtype | access | meaning                                      |
|-------------|--------------------|-------|--------|----------------------------------------------|
| checkpoint  | (S, HV, V, K)      | fp32  | R      | the conventional state                       |
| q, k        | (b, T, H, K)       | act   | R      | raw; any batch stride                        |
| v           | (b, T, HV, V)      | act   | R      |                                              |
| a, b        | (b, T, HV)         | gate  | R      | raw gates                                    |
| A_log, dt_bias | (HV,)           | param | R      |                                              |
| slot_ids    | (b,)               | int32 | R      | pad / out-of-range rows skip                 |
| out         | (b, T, HV, V)      | act   | W      | o of every draft (pad rows untouched)        |
| snapshots   | (b, T, HV, V, K)   | fp32  | W      | state after each draft, by row (pad rows untouched) |
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..common import (DraftStepKernel, after_previous_kernel, cdiv, launch_tiles, make_row_tma, slot_is_live, slot_rows,
                      smem_fit, snapshot_check, start_tile_loads, warp_reduce_many)
from .common import gdn_gates, normalize_qk
from .config import GDNConfig, GDNShape


class GDNSnapshot(DraftStepKernel):
    """One conventional speculative step of T drafts of a GDN layer (module docstring)."""

    @staticmethod
    def smem_bytes(shape: GDNShape, config: GDNConfig, num_drafts: int) -> int:
        """The state tile, the drafts' k and q (fp32) and k . q, mbarriers, alignment slack."""
        K, T = shape.head_k_dim, num_drafts
        return config.rows_per_cta * K * 4 + 2 * T * K * 4 + T * 4 + 8 * config.num_warps + 512

    @staticmethod
    def check(shape, config, num_drafts: int) -> Optional[str]:
        return (snapshot_check(shape, config, num_drafts)
                or smem_fit(GDNSnapshot.smem_bytes(shape, config, num_drafts), config.min_ctas_per_sm))

    @cute.jit
    def __call__(self, mCheckpoint: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mA: cute.Tensor, mB: cute.Tensor, mALog: cute.Tensor, mDtBias: cute.Tensor,
                 mSlot: cute.Tensor, mOut: cute.Tensor, mSnapshots: cute.Tensor, stream):
        s, c = self.shape, self.config
        HV, V, K = s.num_v_heads, s.head_v_dim, s.head_k_dim
        tma_atom, mRowsTma = make_row_tma(slot_rows(mCheckpoint, HV * V, K), c.rows_per_warp, K)
        launch_tiles(self.kernel(tma_atom, mRowsTma, mCheckpoint, mQ, mK, mV, mA, mB, mALog, mDtBias, mSlot, mOut,
                                 mSnapshots),
                     [V // c.rows_per_cta, HV, mV.shape[0]], c, self.smem_bytes(s, c, self.num_drafts), stream)

    @cute.kernel
    def kernel(self, tma_atom: cute.CopyAtom, mRowsTma: cute.Tensor, mCheckpoint: cute.Tensor,
               mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mA: cute.Tensor, mB: cute.Tensor,
               mALog: cute.Tensor, mDtBias: cute.Tensor, mSlot: cute.Tensor, mOut: cute.Tensor,
               mSnapshots: cute.Tensor):
        s, c, T = self.shape, self.config, self.num_drafts
        HV, V, K, H = s.num_v_heads, s.head_v_dim, s.head_k_dim, s.num_k_heads
        R, W = c.rows_per_cta, c.num_warps
        RW = R // W
        vec = s.k_vec
        KL = K // vec  # lanes that hold part of a K row
        shift = 5 - (2 * RW).bit_length() + 1  # lane l of the row reduction holds value l >> shift
        act = s.act_dtype

        tidx, _, _ = cute.arch.thread_idx()
        ptile, vhead, row = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()

        after_previous_kernel()
        slot = mSlot[row]
        valid = slot_is_live(slot, mCheckpoint.shape[0], s.pad_slot_id)
        if valid:
            slot64 = Int64(slot)
            row64 = Int64(row)  # the snapshot buffer can pass 2^31 elements
            khead = vhead // (HV // H)
            i_warp = ptile * R + warp * RW  # first state row of this warp

            smem = SmemAllocator()
            sState = smem.allocate_tensor(
                Float32, cute.make_layout((RW, K, W), stride=(K, 1, RW * K)), byte_alignment=128)
            mbar = smem.allocate_array(Int64, W, byte_alignment=8)
            # The drafts' normalised keys (rows 0..T-1) and scaled queries (rows T..2T-1), and k . q.
            sDraft = smem.allocate_tensor(Float32, cute.make_layout((2 * T, K), stride=(K, 1)), byte_alignment=16)
            sKQ = smem.allocate_tensor(Float32, cute.make_layout((T,)), byte_alignment=16)
            first_box = Int32((slot64 * (HV * V) + vhead * V + ptile * R) // RW)
            start_tile_loads(tma_atom, mRowsTma, sState, mbar, first_box, W, RW * K * 4)

            # Lane r (mod RW) owns row i_warp + r: its v of every draft.
            lr = lane % RW
            i_row = i_warp + lr
            rV = cute.make_rmem_tensor((T,), Float32)
            for t in cutlass.range_constexpr(T):
                rV[t] = mV[row, t, vhead, i_row].to(Float32)

            # Normalise the drafts' k and q once per CTA (warp w: drafts w, w + W, ...); scalar
            # loads take any batch stride.
            for tt in cutlass.range_constexpr(cdiv(T, W)):
                if cutlass.const_expr(tt * W < T):
                    t_stage = tt * W + warp
                    if t_stage < T:
                        rK = cute.make_rmem_tensor((vec,), Float32)
                        rQ = cute.make_rmem_tensor((vec,), Float32)
                        rK.fill(0.0)
                        rQ.fill(0.0)
                        if lane < KL:
                            for e in cutlass.range_constexpr(vec):
                                rK[e] = mK[row, t_stage, khead, lane * vec + e].to(Float32)
                                rQ[e] = mQ[row, t_stage, khead, lane * vec + e].to(Float32)
                        kq = normalize_qk(rK, rQ, vec, s.q_scale)
                        if lane < KL:
                            cute.autovec_copy(rK, cute.local_tile(sDraft[t_stage, None], (vec,), (lane,)))
                            cute.autovec_copy(rQ, cute.local_tile(sDraft[T + t_stage, None], (vec,), (lane,)))
                        if lane == 0:
                            sKQ[t_stage] = kq

            # Lane t: alpha and beta of draft t.
            alpha_t = Float32(0.0)
            beta_t = Float32(0.0)
            if lane < T:
                g_t, b_t = gdn_gates(mA[row, lane, vhead].to(Float32), mB[row, lane, vhead].to(Float32),
                                     mALog[vhead].to(Float32), mDtBias[vhead].to(Float32))
                alpha_t = cute.math.exp(g_t, fastmath=False)
                beta_t = b_t
            cute.arch.sync_threads()

            cute.arch.mbarrier_wait(mbar + warp, 0)
            rS = cute.make_rmem_tensor(cute.make_layout((RW, vec), stride=(vec, 1)), Float32)
            if lane < KL:
                for r in cutlass.range_constexpr(RW):
                    cute.autovec_copy(cute.local_tile(sState[r, None, warp], (vec,), (lane,)), rS[r, None])

            for t in cutlass.range_constexpr(T):
                # S k and S q of the state before draft t, for all the warp's rows in one reduction.
                rK = cute.make_rmem_tensor((vec,), Float32)
                rQ = cute.make_rmem_tensor((vec,), Float32)
                rRows = cute.make_rmem_tensor((2 * RW,), Float32)
                rRows.fill(0.0)
                if lane < KL:
                    cute.autovec_copy(cute.local_tile(sDraft[t, None], (vec,), (lane,)), rK)
                    cute.autovec_copy(cute.local_tile(sDraft[T + t, None], (vec,), (lane,)), rQ)
                    for r in cutlass.range_constexpr(RW):
                        for e in cutlass.range_constexpr(vec):
                            rRows[2 * r] = rRows[2 * r] + rS[r, e] * rK[e]
                            rRows[2 * r + 1] = rRows[2 * r + 1] + rS[r, e] * rQ[e]
                rows = warp_reduce_many(rRows, 2 * RW)
                s_k = cute.arch.shuffle_sync(rows, (2 * lr) << shift)
                s_q = cute.arch.shuffle_sync(rows, (2 * lr + 1) << shift)
                alpha = cute.arch.shuffle_sync(alpha_t, t)
                beta = cute.arch.shuffle_sync(beta_t, t)

                u = beta * (rV[t] - alpha * s_k)
                if lane < RW:
                    mOut[row, t, vhead, i_row] = (alpha * s_q + u * sKQ[t]).to(act)
                for r in cutlass.range_constexpr(RW):
                    coef = cute.arch.shuffle_sync(u, r)
                    if lane < KL:
                        for e in cutlass.range_constexpr(vec):
                            rS[r, e] = alpha * rS[r, e] + coef * rK[e]
                        cute.autovec_copy(rS[r, None], cute.local_tile(
                            mSnapshots[row64, t, vhead, i_warp + r, None], (vec,), (lane,)))


def compile_snapshot(shape: GDNShape, config: GDNConfig, num_drafts: int, options: str):
    """Compile with `options`; launches on the caller's current CUDA stream."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    from ..state_io import COPY_ARGS
    from .verify import fake_inputs

    args = fake_inputs(shape, num_drafts)
    for name in ("mRingU", "mRingK", "mRingG", "mRingV", "mRingBeta", "mPlan", *COPY_ARGS):
        args.pop(name)  # verify's, not the snapshot's
    HV, V, K = shape.num_v_heads, shape.head_v_dim, shape.head_k_dim
    args["mSnapshots"] = make_fake_compact_tensor(
        Float32, (cute.sym_int(), num_drafts, HV, V, K), stride_order=(4, 3, 2, 1, 0), assumed_align=16)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(GDNSnapshot(shape, config, num_drafts), *args.values(), stream, options=options)
