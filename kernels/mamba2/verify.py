"""Mamba-2 speculative verification: T draft tokens per row, output-only, one checkpoint read.

Algorithm 2 of the paper (replayssm.md section 4). Each row reads its cursor h on the device;
the T outputs come from the checkpoint tile and the h committed records plus the drafts before
each token (Eq. 6), never forming a state:

    y_t = gamma_t (S_ckpt C_t) + sum_{j <= h + t} w_{j,t} (B_j . C_t) x_j + D x_t,
    gamma_t = exp(A P_{h+t}),  w_{j,t} = dt_j exp(A (P_{h+t} - P_j)),  P the prefix sums of dt.

The T draft records are written behind the committed ones, at (origin + h + t) % cap. A row with
h + T > L folds its h committed records into the checkpoint in the same launch and stores it
(only committed records are folded). Cursor and origin are not touched here: the commit kernel
(``kernels/commit.py``) moves them once the accepted count is known, so the launch needs no
arrival counter. The ring is read at every physical position as soon as the slot is known, as in
the decode kernel.

Grid and warp layout as ``Mamba2Decode``. The (B_j . C_t) products (ring positions and drafts
against every draft's C) are computed once per CTA, 16 per warp reduction, and shared through
shared memory with their decay weights; a row's S . C_t for all t are reduced together.

Tensor contract (b = batch, S = slots, cap = window + max_draft, T = drafts, act as decode):

| name        | shape              | dtype    | access | meaning                                     |
|-------------|--------------------|----------|--------|---------------------------------------------|
| checkpoint  | (S, H, P, N)       | fp32     | R / W on flush |                                     |
| x           | (b, T, H, P)       | act      | R      | draft values; any row stride                |
| dt          | (b, T, H)          | act/fp32 | R      | raw dt                                      |
| A           | (H,)               | fp32     | R      |                                             |
| B, C        | (b, T, G, N)       | act      | R      |                                             |
| D           | (H,)               | fp32     | R, optional |                                        |
| z           | (b, T, H, P)       | act      | R, optional |                                        |
| dt_bias     | (H,)               | fp32     | R, optional |                                        |
| slot_ids    | (b,)               | int32    | R      | pad / out-of-range rows skip                |
| out         | (b, T, H, P)       | act      | W      | y of every draft (pad rows untouched)       |
| ring_x, ring_B, ring_dt | as decode | | R / W | draft records written at (origin + h + t) % cap |
| cursor, origin | (S,)            | int32    | R      | moved by the commit kernel                  |
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..common import cdiv, make_row_tma, pow2_at_least, slot_is_live, smem_fit, softplus, start_tile_loads, warp_reduce_many
from .decode import Mamba2Config, Mamba2Shape




class Mamba2Verify:
    """One verify step of T drafts of a Mamba-2 layer over a pool of slots (module docstring)."""

    def __init__(self, shape: Mamba2Shape, config: Mamba2Config, num_drafts: int):
        reason = self.check(shape, config, num_drafts)
        if reason is not None:
            raise ValueError(f"Mamba2Verify({config}, T={num_drafts}) invalid for {shape}: {reason}")
        self.shape, self.config, self.num_drafts = shape, config, num_drafts

    @staticmethod
    def smem_bytes(shape: Mamba2Shape, config: Mamba2Config, num_drafts: int) -> int:
        N, T = shape.dstate, num_drafts
        nq = shape.capacity + T
        return (config.rows_per_cta * N * 4 + nq * N * shape.act_dtype.width // 8 + T * N * 4
                + T * nq * 4 + 8 * config.num_warps + 768)

    @staticmethod
    def check(shape: Mamba2Shape, config: Mamba2Config, num_drafts: int) -> Optional[str]:
        reason = config.check(shape)
        if reason is not None:
            return reason
        if shape.window < 2:
            return "verification needs a ring (window >= 2)"
        if not 1 <= num_drafts <= min(16, shape.capacity - shape.window, shape.window):
            return (f"num_drafts {num_drafts}: needs 1 <= T <= min(16, max_draft "
                    f"{shape.capacity - shape.window}, window {shape.window})")
        return smem_fit(Mamba2Verify.smem_bytes(shape, config, num_drafts), config.min_ctas_per_sm)

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
        mRingX: cute.Tensor,
        mRingB: cute.Tensor,
        mRingDt: cute.Tensor,
        mCursor: cute.Tensor,
        mOrigin: cute.Tensor,
        stream,
    ):
        s, c = self.shape, self.config
        H, P, N = s.nheads, s.headdim, s.dstate
        mRows = cute.make_tensor(
            mCheckpoint.iterator,
            cute.make_layout((mCheckpoint.shape[0] * (H * P), N), stride=(N, 1)),
        )
        tma_atom, mRowsTma = make_row_tma(mRows, c.rows_per_warp, N)
        self.kernel(
            tma_atom, mRowsTma, mCheckpoint, mX, mDt, mA, mB, mC, mD, mZ, mDtBias, mSlot, mOut,
            mRingX, mRingB, mRingDt, mCursor, mOrigin,
        ).launch(
            grid=[P // c.rows_per_cta, H, mX.shape[0]],
            block=[32 * c.num_warps, 1, 1],
            smem=self.smem_bytes(s, c, self.num_drafts),
            stream=stream,
            min_blocks_per_mp=c.min_ctas_per_sm,
            preferred_smem_carveout=100,
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
        mRingX: cute.Tensor,
        mRingB: cute.Tensor,
        mRingDt: cute.Tensor,
        mCursor: cute.Tensor,
        mOrigin: cute.Tensor,
    ):
        s, c, T = self.shape, self.config, self.num_drafts
        H, P, N, G, L, cap = s.nheads, s.headdim, s.dstate, s.ngroups, s.window, s.capacity
        R, W = c.rows_per_cta, c.num_warps
        RW = R // W
        vec = N // 32
        NQ = cap + T  # dot columns: the ring positions, then the drafts
        RPW = cdiv(cap, W)  # ring positions whose B a warp stages
        TPW = cdiv(T, W)  # drafts whose B and C a warp stages
        CH = 16  # dot products per warp reduction
        n_chunks = cdiv(cdiv(T * NQ, W), CH)
        TP = pow2_at_least(T)
        t_shift = 5 - (TP.bit_length() - 1)
        JC = 4  # records folded per pass
        heads_per_group = H // G
        act = s.act_dtype

        tidx, _, _ = cute.arch.thread_idx()
        ptile, head, row = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()

        slot = mSlot[row]
        valid = slot_is_live(slot, mCheckpoint.shape[0], s.pad_slot_id)

        if valid:
            slot64 = Int64(slot)
            group = head // heads_per_group
            p_warp = ptile * R + warp * RW

            smem = SmemAllocator()
            sState = smem.allocate_tensor(
                Float32, cute.make_layout((RW, N, W), stride=(N, 1, RW * N)), byte_alignment=128
            )
            mbar = smem.allocate_array(Int64, W, byte_alignment=8)
            sB = smem.allocate_tensor(act, cute.make_layout((NQ, N), stride=(N, 1)), byte_alignment=16)
            sC = smem.allocate_tensor(Float32, cute.make_layout((T, N), stride=(N, 1)), byte_alignment=16)
            # w_{j,t} (B_j . C_t) per (draft t, column q); zero where q holds no record before t.
            sDot = smem.allocate_tensor(Float32, cute.make_layout((T, NQ), stride=(NQ, 1)), byte_alignment=16)
            first_box = Int32((slot64 * (H * P) + head * P + ptile * R) // RW)
            start_tile_loads(tma_atom, mRowsTma, sState, mbar, first_box, W, RW * N * 4)

            h = mCursor[slot]
            origin = mOrigin[slot]
            dt_phys = mRingDt[slot64, lane % cap, head]  # lane p: dt at position p
            flush = h + T > L

            lr = lane % RW
            i_row = p_warp + lr
            rX = cute.make_rmem_tensor((cap,), Float32)  # ring x_p[i] at every position
            for p in cutlass.range_constexpr(cap):
                rX[p] = mRingX[slot64, p, head, i_row].to(Float32)
            rXd = cute.make_rmem_tensor((T,), Float32)  # the drafts' x[i]
            for t in cutlass.range_constexpr(T):
                rXd[t] = mX[row, t, head, i_row].to(Float32)

            # Stage B of the ring positions and of the drafts, and the drafts' C, in shared memory.
            for pp in cutlass.range_constexpr(RPW):
                if cutlass.const_expr(pp * W < cap):
                    if pp * W + warp < cap:
                        rBp = cute.make_rmem_tensor((vec,), act)
                        cute.autovec_copy(cute.local_tile(mRingB[slot64, pp * W + warp, group, None], (vec,), (lane,)), rBp)
                        cute.autovec_copy(rBp, cute.local_tile(sB[pp * W + warp, None], (vec,), (lane,)))
            for tt in cutlass.range_constexpr(TPW):
                if cutlass.const_expr(tt * W < T):
                    t_stage = tt * W + warp
                    if t_stage < T:
                        rBt = cute.make_rmem_tensor((vec,), act)
                        rCt = cute.make_rmem_tensor((vec,), act)
                        cute.autovec_copy(cute.local_tile(mB[row, t_stage, group, None], (vec,), (lane,)), rBt)
                        cute.autovec_copy(cute.local_tile(mC[row, t_stage, group, None], (vec,), (lane,)), rCt)
                        cute.autovec_copy(rBt, cute.local_tile(sB[cap + t_stage, None], (vec,), (lane,)))
                        rCf = cute.make_rmem_tensor((vec,), Float32)
                        rCf.store(rCt.load().to(Float32))
                        cute.autovec_copy(rCf, cute.local_tile(sC[t_stage, None], (vec,), (lane,)))

            # Lane j: dt of record j in logical order (committed j < h, draft t at lane h + t).
            A = mA[head].to(Float32)
            dt_j = Float32(0.0)
            dt_rec = cute.arch.shuffle_sync(dt_phys, (origin + lane) % cap)
            if lane < h:
                dt_j = dt_rec
            if lane >= h and lane < h + T:
                dt_j = mDt[row, lane - h, head].to(Float32)
                if cutlass.const_expr(s.has_dt_bias):
                    dt_j = dt_j + mDtBias[head].to(Float32)
                if cutlass.const_expr(s.dt_softplus):
                    dt_j = softplus(dt_j)
            prefix = dt_j  # inclusive prefix sums P_j across lanes
            for k in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(prefix, 1 << k)
                if lane >= (1 << k):
                    prefix = prefix + other
            cute.arch.sync_threads()

            # (B_q . C_t) for every (t, q), CH per warp reduction; the holder lane adds the weight.
            for ch in cutlass.range_constexpr(n_chunks):
                rD = cute.make_rmem_tensor((CH,), Float32)
                rD.fill(0.0)
                for m in cutlass.range_constexpr(CH):
                    task = (ch * CH + m) * W + warp
                    if task < T * NQ:
                        rBq = cute.make_rmem_tensor((vec,), act)
                        rCq = cute.make_rmem_tensor((vec,), Float32)
                        cute.autovec_copy(cute.local_tile(sB[task % NQ, None], (vec,), (lane,)), rBq)
                        cute.autovec_copy(cute.local_tile(sC[task // NQ, None], (vec,), (lane,)), rCq)
                        for v in cutlass.range_constexpr(vec):
                            rD[m] = rD[m] + rBq[v].to(Float32) * rCq[v]
                dot = warp_reduce_many(rD, CH)
                task_l = (ch * CH + (lane >> 1)) * W + warp  # CH = 16: lanes 2m, 2m + 1 hold task m
                t_l = task_l // NQ
                q_l = task_l % NQ
                j_l = cutlass.select_(q_l < cap, (q_l - origin + cap) % cap, h + q_l - cap)
                live = cutlass.select_(q_l < cap, j_l < h, q_l - cap <= t_l)
                dt_l = cute.arch.shuffle_sync(dt_j, j_l % 32)
                p_j = cute.arch.shuffle_sync(prefix, j_l % 32)
                p_e = cute.arch.shuffle_sync(prefix, (h + t_l) % 32)
                if lane % 2 == 0 and task_l < T * NQ:
                    w = dt_l * cute.math.exp(A * (p_e - p_j), fastmath=False)
                    sDot[t_l, q_l] = cutlass.select_(live, w * dot, Float32(0.0))
            cute.arch.sync_threads()

            # Ring and draft terms of this lane's row for every draft.
            rTerm = cute.make_rmem_tensor((T,), Float32)
            for t in cutlass.range_constexpr(T):
                acc = Float32(0.0)
                for p in cutlass.range_constexpr(cap):
                    live_p = (p - origin + cap) % cap < h  # select: a stale position may hold anything
                    acc = acc + cutlass.select_(live_p, sDot[t, p] * rX[p], Float32(0.0))
                for d in cutlass.range_constexpr(t + 1):
                    acc = acc + sDot[t, cap + d] * rXd[d]
                rTerm[t] = acc

            D = Float32(0.0)
            if cutlass.const_expr(s.has_D):
                D = mD[head].to(Float32)
            cute.arch.mbarrier_wait(mbar + warp, 0)

            # S_ckpt[i] . C_t for all t, row by row; lane r collects its row's T totals.
            rY = cute.make_rmem_tensor((T,), Float32)
            rY.fill(0.0)
            for r in cutlass.range(RW):
                rS = cute.make_rmem_tensor((vec,), Float32)
                cute.autovec_copy(cute.local_tile(sState[r, None, warp], (vec,), (lane,)), rS)
                rP = cute.make_rmem_tensor((TP,), Float32)
                rP.fill(0.0)
                for t in cutlass.range_constexpr(T):
                    rCq = cute.make_rmem_tensor((vec,), Float32)
                    cute.autovec_copy(cute.local_tile(sC[t, None], (vec,), (lane,)), rCq)
                    for v in cutlass.range_constexpr(vec):
                        rP[t] = rP[t] + rS[v] * rCq[v]
                tot = warp_reduce_many(rP, TP)
                for t in cutlass.range_constexpr(T):
                    got = cute.arch.shuffle_sync(tot, t << t_shift)
                    rY[t] = cutlass.select_(lane == r, got, rY[t])

            for t in cutlass.range_constexpr(T):
                gamma_t = cute.math.exp(A * cute.arch.shuffle_sync(prefix, (h + t) % 32), fastmath=False)
                y = gamma_t * rY[t] + rTerm[t]
                if cutlass.const_expr(s.has_D):
                    y = y + D * rXd[t]
                if cutlass.const_expr(s.has_z):
                    z = mZ[row, t, head, i_row].to(Float32)
                    y = y * z / (Float32(1.0) + cute.math.exp(-z, fastmath=False))
                if lane < RW:
                    mOut[row, t, head, i_row] = y.to(act)
                    mRingX[slot64, (origin + h + t) % cap, head, i_row] = mX[row, t, head, i_row]

            if flush:
                # Fold the h committed records: S = gamma S + sum_{j < h} (w_j x_j[i]) B_j with
                # weights up to record h - 1 (the drafts are not folded).
                p_last = cute.arch.shuffle_sync(prefix, (h + 31) % 32)
                w_fold = dt_j * cute.math.exp(A * (p_last - prefix), fastmath=False)
                gamma = cute.math.exp(A * p_last, fastmath=False)
                n_pass = cdiv(cap, JC)
                for jc in cutlass.range_constexpr(n_pass):
                    items = min(JC, cap - jc * JC)
                    rBc = cute.make_rmem_tensor(cute.make_layout((JC, vec), stride=(vec, 1)), Float32)
                    rCoef = cute.make_rmem_tensor((JC,), Float32)
                    for jj in cutlass.range_constexpr(items):
                        p_item = jc * JC + jj
                        j_item = (p_item - origin + cap) % cap
                        w = cute.arch.shuffle_sync(w_fold, j_item)
                        rBs = cute.make_rmem_tensor((vec,), act)
                        cute.autovec_copy(cute.local_tile(sB[p_item, None], (vec,), (lane,)), rBs)
                        for v in cutlass.range_constexpr(vec):
                            rBc[jj, v] = rBs[v].to(Float32)
                        rCoef[jj] = cutlass.select_(j_item < h, w * rX[p_item], Float32(0.0))
                    for r in cutlass.range(RW, unroll=2):
                        tS = cute.local_tile(sState[r, None, warp], (vec,), (lane,))
                        rS = cute.make_rmem_tensor((vec,), Float32)
                        cute.autovec_copy(tS, rS)
                        if cutlass.const_expr(jc == 0):
                            for v in cutlass.range_constexpr(vec):
                                rS[v] = gamma * rS[v]
                        for jj in cutlass.range_constexpr(items):
                            coef = cute.arch.shuffle_sync(rCoef[jj], r)
                            for v in cutlass.range_constexpr(vec):
                                rS[v] = rS[v] + coef * rBc[jj, v]
                        if cutlass.const_expr(jc == n_pass - 1):
                            cute.autovec_copy(rS, cute.local_tile(
                                mCheckpoint[slot64, head, p_warp + r, None], (vec,), (lane,)))
                        else:
                            cute.autovec_copy(rS, tS)

            # The drafts' B (once per group) and dt records.
            if ptile == 0 and warp == 0:
                if head % heads_per_group == 0:
                    for t in cutlass.range_constexpr(T):
                        rBt = cute.make_rmem_tensor((vec,), act)
                        cute.autovec_copy(cute.local_tile(sB[cap + t, None], (vec,), (lane,)), rBt)
                        cute.autovec_copy(rBt, cute.local_tile(
                            mRingB[slot64, (origin + h + t) % cap, group, None], (vec,), (lane,)))
                if lane >= h and lane < h + T:
                    mRingDt[slot64, (origin + lane) % cap, head] = dt_j


def _fake_inputs(shape: Mamba2Shape, num_drafts: int):
    """Fake tensors with symbolic batch and slot dims; draft tokens laid out (b, T, ...)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    H, P, N, G, cap, T = shape.nheads, shape.headdim, shape.dstate, shape.ngroups, shape.capacity, num_drafts
    act = shape.act_dtype
    batch, slots = cute.sym_int(), cute.sym_int()
    per_16b = 16 * 8 // act.width

    def compact(dtype, dims, align=16):
        return make_fake_compact_tensor(dtype, dims, stride_order=tuple(reversed(range(len(dims)))),
                                        assumed_align=align)

    def rows(dtype, inner, align=16):
        strides, step = [], 1
        for d in reversed(inner):
            strides.insert(0, step)
            step *= d
        div = per_16b if align == 16 else 1
        return make_fake_tensor(dtype, (batch,) + tuple(inner),
                                (cute.sym_int64(divisibility=div),) + tuple(strides), assumed_align=align)

    return dict(
        mCheckpoint=compact(Float32, (slots, H, P, N)),
        mX=rows(act, (T, H, P)),
        mDt=rows(shape.dt_dtype, (T, H), align=None),
        mA=compact(Float32, (H,), align=4),
        mB=rows(act, (T, G, N)),
        mC=rows(act, (T, G, N)),
        mD=compact(Float32, (H,), align=4) if shape.has_D else None,
        mZ=rows(act, (T, H, P)) if shape.has_z else None,
        mDtBias=compact(Float32, (H,), align=4) if shape.has_dt_bias else None,
        mSlot=compact(Int32, (batch,), align=4),
        mOut=rows(act, (T, H, P)),
        mRingX=compact(act, (slots, cap, H, P)),
        mRingB=compact(act, (slots, cap, G, N)),
        mRingDt=compact(Float32, (slots, cap, H)),
        mCursor=compact(Int32, (slots,), align=4),
        mOrigin=compact(Int32, (slots,), align=4),
    )


def compile_verify(shape: Mamba2Shape, config: Mamba2Config, num_drafts: int, options: str):
    """Compile with `options`; launches on the caller's current CUDA stream (graph capturable)."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = _fake_inputs(shape, num_drafts)
    return cute.compile(Mamba2Verify(shape, config, num_drafts), *args.values(), stream, options=options)
