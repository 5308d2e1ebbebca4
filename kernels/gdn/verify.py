"""Gated DeltaNet speculative verification: T drafts per row, output-only, one checkpoint read.

Algorithm 5 of the paper (replayssm.md section 4, Eq. 10-11). With P_j the prefix sums of the log
decays g over the records in order (h committed, then the T drafts), gamma_s = exp(P_{h+s}) and
W_{j,s} = exp(P_{h+s} - P_j), each row's draft corrections solve one unit-lower-triangular system
by forward substitution, per state row i:

    R_s = v_s - gamma_s (S_ckpt k_s) - sum_{j < h} W_{j,s} (k_j . k_s) u_j
    u_s = beta_s (R_s - sum_{d < s} W_{h+d,s} (k_{h+d} . k_s) u_{h+d})
    o_s = gamma_s (S_ckpt q_s) + sum_{j <= h+s} W_{j,s} (k_j . q_s) u_j

S_ckpt k_s and S_ckpt q_s come from one pass over the checkpoint tile; the key products once per
CTA (shared memory, 16 per warp reduction). The draft records (u fp16, normalised k once per key
head, g, and v / beta for two-precision caches) go behind the committed ones at
(origin + h + s) % cap; a row with h + T > L folds its h committed records into the checkpoint in
the same launch. Cursor and origin are moved by the commit kernel (``kernels/commit.py``).

Grid and warp layout as ``GDNDecode``; the ring is read at every physical position as soon as the
slot is known.

Tensor contract (b = batch, S = slots, cap = window + max_draft, T = drafts, act as decode):

| name        | shape              | dtype | access | meaning                                      |
|-------------|--------------------|-------|--------|----------------------------------------------|
| checkpoint  | (S, HV, V, K)      | fp32  | R / W on flush |                                      |
| q, k        | (b, T, H, K)       | act   | R      | raw; any row stride                          |
| v           | (b, T, HV, V)      | act   | R      |                                              |
| a, b        | (b, T, HV)         | gate  | R      | raw gates                                    |
| A_log, dt_bias | (HV,)           | param | R      |                                              |
| slot_ids    | (b,)               | int32 | R      | pad / out-of-range rows skip                 |
| out         | (b, T, HV, V)      | act   | W      | o of every draft (pad rows untouched)        |
| ring_u, ring_k, ring_g (ring_v, ring_beta) | as decode | | R / W | drafts written at (origin + h + s) % cap |
| cursor, origin | (S,)            | int32 | R      | moved by the commit kernel                   |
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..common import cdiv, make_row_tma, pow2_at_least, slot_is_live, smem_fit, start_tile_loads, warp_reduce_many
from .common import gdn_gates, normalize_qk
from .decode import GDNConfig, GDNShape




class GDNVerify:
    """One verify step of T drafts of a GDN layer over a pool of slots (module docstring)."""

    def __init__(self, shape: GDNShape, config: GDNConfig, num_drafts: int):
        reason = self.check(shape, config, num_drafts)
        if reason is not None:
            raise ValueError(f"GDNVerify({config}, T={num_drafts}) invalid for {shape}: {reason}")
        self.shape, self.config, self.num_drafts = shape, config, num_drafts

    @staticmethod
    def smem_bytes(shape: GDNShape, config: GDNConfig, num_drafts: int) -> int:
        K, T, cap = shape.head_k_dim, num_drafts, shape.capacity
        return (config.rows_per_cta * K * 4 + cap * K * shape.act_dtype.width // 8 + 2 * T * K * 4
                + 2 * T * (cap + T) * 4 + 8 * config.num_warps + 768)

    @staticmethod
    def check(shape: GDNShape, config: GDNConfig, num_drafts: int) -> Optional[str]:
        reason = config.check(shape)
        if reason is not None:
            return reason
        if shape.window < 2:
            return "verification needs a ring (window >= 2)"
        if not 1 <= num_drafts <= min(16, shape.capacity - shape.window, shape.window):
            return (f"num_drafts {num_drafts}: needs 1 <= T <= min(16, max_draft "
                    f"{shape.capacity - shape.window}, window {shape.window})")
        return smem_fit(GDNVerify.smem_bytes(shape, config, num_drafts), config.min_ctas_per_sm)

    @cute.jit
    def __call__(
        self,
        mCheckpoint: cute.Tensor,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias: cute.Tensor,
        mSlot: cute.Tensor,
        mOut: cute.Tensor,
        mRingU: cute.Tensor,
        mRingK: cute.Tensor,
        mRingG: cute.Tensor,
        mRingV: Optional[cute.Tensor],
        mRingBeta: Optional[cute.Tensor],
        mCursor: cute.Tensor,
        mOrigin: cute.Tensor,
        stream,
    ):
        s, c = self.shape, self.config
        HV, V, K = s.num_v_heads, s.head_v_dim, s.head_k_dim
        mRows = cute.make_tensor(
            mCheckpoint.iterator,
            cute.make_layout((mCheckpoint.shape[0] * (HV * V), K), stride=(K, 1)),
        )
        tma_atom, mRowsTma = make_row_tma(mRows, c.rows_per_warp, K)
        self.kernel(
            tma_atom, mRowsTma, mCheckpoint, mQ, mK, mV, mA, mB, mALog, mDtBias, mSlot, mOut,
            mRingU, mRingK, mRingG, mRingV, mRingBeta, mCursor, mOrigin,
        ).launch(
            grid=[V // c.rows_per_cta, HV, mV.shape[0]],
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
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias: cute.Tensor,
        mSlot: cute.Tensor,
        mOut: cute.Tensor,
        mRingU: cute.Tensor,
        mRingK: cute.Tensor,
        mRingG: cute.Tensor,
        mRingV: Optional[cute.Tensor],
        mRingBeta: Optional[cute.Tensor],
        mCursor: cute.Tensor,
        mOrigin: cute.Tensor,
    ):
        s, c, T = self.shape, self.config, self.num_drafts
        HV, V, K, H, L, cap = s.num_v_heads, s.head_v_dim, s.head_k_dim, s.num_k_heads, s.window, s.capacity
        R, W = c.rows_per_cta, c.num_warps
        RW = R // W
        vec = s.k_vec
        KL = K // vec
        NQ = cap + T  # key columns: the ring positions, then the drafts
        RPW = cdiv(cap, W)
        TPW = cdiv(T, W)
        CH = 16  # dot products per warp reduction
        n_chunks = cdiv(cdiv(2 * T * NQ, W), CH)
        TP2 = pow2_at_least(2 * T)
        t_shift = 5 - (TP2.bit_length() - 1)
        JC = 4
        rep = HV // H
        act = s.act_dtype

        tidx, _, _ = cute.arch.thread_idx()
        ptile, vhead, row = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()

        slot = mSlot[row]
        valid = slot_is_live(slot, mCheckpoint.shape[0], s.pad_slot_id)

        if valid:
            slot64 = Int64(slot)
            khead = vhead // rep
            i_warp = ptile * R + warp * RW

            smem = SmemAllocator()
            sState = smem.allocate_tensor(
                Float32, cute.make_layout((RW, K, W), stride=(K, 1, RW * K)), byte_alignment=128
            )
            mbar = smem.allocate_array(Int64, W, byte_alignment=8)
            sKeys = smem.allocate_tensor(act, cute.make_layout((cap, K), stride=(K, 1)), byte_alignment=16)
            # The drafts' normalised keys (rows 0..T-1) and queries (rows T..2T-1), fp32.
            sDraft = smem.allocate_tensor(Float32, cute.make_layout((2 * T, K), stride=(K, 1)), byte_alignment=16)
            # W_{j,s} (k_j . x_s) per (x in {k, q} x draft s, column q); zero where not used.
            sDot = smem.allocate_tensor(Float32, cute.make_layout((2 * T, NQ), stride=(NQ, 1)), byte_alignment=16)
            first_box = Int32((slot64 * (HV * V) + vhead * V + ptile * R) // RW)
            start_tile_loads(tma_atom, mRowsTma, sState, mbar, first_box, W, RW * K * 4)

            h = mCursor[slot]
            origin = mOrigin[slot]
            g_phys = mRingG[slot64, lane % cap, vhead]
            flush = h + T > L

            lr = lane % RW
            i_row = i_warp + lr
            rU = cute.make_rmem_tensor((cap,), Float32)  # ring u_p[i] at every position
            for p in cutlass.range_constexpr(cap):
                rU[p] = mRingU[slot64, p, vhead, i_row].to(Float32)
            rV = cute.make_rmem_tensor((T,), Float32)
            for d in cutlass.range_constexpr(T):
                rV[d] = mV[row, d, vhead, i_row].to(Float32)

            # Stage the ring keys and the drafts' normalised k and q (warp w: drafts w, w + W, ...).
            if lane < KL:
                for pp in cutlass.range_constexpr(RPW):
                    if cutlass.const_expr(pp * W < cap):
                        if pp * W + warp < cap:
                            rKp = cute.make_rmem_tensor((vec,), act)
                            for e in cutlass.range_constexpr(vec):
                                rKp[e] = mRingK[slot64, pp * W + warp, khead, lane * vec + e]
                            cute.autovec_copy(rKp, cute.local_tile(sKeys[pp * W + warp, None], (vec,), (lane,)))
            for tt in cutlass.range_constexpr(TPW):
                if cutlass.const_expr(tt * W < T):
                    d_stage = tt * W + warp
                    if d_stage < T:
                        rK = cute.make_rmem_tensor((vec,), Float32)
                        rQ = cute.make_rmem_tensor((vec,), Float32)
                        rK.fill(0.0)
                        rQ.fill(0.0)
                        if lane < KL:
                            for e in cutlass.range_constexpr(vec):
                                rK[e] = mK[row, d_stage, khead, lane * vec + e].to(Float32)
                                rQ[e] = mQ[row, d_stage, khead, lane * vec + e].to(Float32)
                        normalize_qk(rK, rQ, vec, s.q_scale)
                        if lane < KL:
                            cute.autovec_copy(rK, cute.local_tile(sDraft[d_stage, None], (vec,), (lane,)))
                            cute.autovec_copy(rQ, cute.local_tile(sDraft[T + d_stage, None], (vec,), (lane,)))

            # Lane j: g of record j in order (committed j < h, draft d at lane h + d); beta of
            # draft d at lane h + d.
            g_j = Float32(0.0)
            beta_j = Float32(0.0)
            g_rec = cute.arch.shuffle_sync(g_phys, (origin + lane) % cap)
            if lane < h:
                g_j = g_rec
            if lane >= h and lane < h + T:
                g_d, beta_d = gdn_gates(mA[row, lane - h, vhead].to(Float32), mB[row, lane - h, vhead].to(Float32),
                                        mALog[vhead].to(Float32), mDtBias[vhead].to(Float32))
                g_j = g_d
                beta_j = beta_d
            prefix = g_j  # inclusive prefix sums P_j across lanes
            for k in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(prefix, 1 << k)
                if lane >= (1 << k):
                    prefix = prefix + other
            cute.arch.sync_threads()

            # (k_col . x_s) for x in {k, q}, every draft s and column col, with their weights.
            for ch in cutlass.range_constexpr(n_chunks):
                rD = cute.make_rmem_tensor((CH,), Float32)
                rD.fill(0.0)
                for m in cutlass.range_constexpr(CH):
                    task = (ch * CH + m) * W + warp
                    if task < 2 * T * NQ and lane < KL:
                        col = task % NQ
                        rX = cute.make_rmem_tensor((vec,), Float32)
                        cute.autovec_copy(cute.local_tile(sDraft[task // NQ, None], (vec,), (lane,)), rX)
                        rKc = cute.make_rmem_tensor((vec,), Float32)
                        if col < cap:
                            rKa = cute.make_rmem_tensor((vec,), act)
                            cute.autovec_copy(cute.local_tile(sKeys[col, None], (vec,), (lane,)), rKa)
                            rKc.store(rKa.load().to(Float32))
                        else:
                            cute.autovec_copy(cute.local_tile(sDraft[col - cap, None], (vec,), (lane,)), rKc)
                        for e in cutlass.range_constexpr(vec):
                            rD[m] = rD[m] + rKc[e] * rX[e]
                dot = warp_reduce_many(rD, CH)
                task_l = (ch * CH + (lane >> 1)) * W + warp  # CH = 16: lanes 2m, 2m + 1 hold task m
                xs_l = task_l // NQ  # 0..T-1: k_s; T..2T-1: q_s
                d_l = xs_l % T
                col_l = task_l % NQ
                j_l = cutlass.select_(col_l < cap, (col_l - origin + cap) % cap, h + col_l - cap)
                # k-rows use committed records and earlier drafts; q-rows also the draft itself.
                live = cutlass.select_(col_l < cap, j_l < h,
                                       cutlass.select_(xs_l < T, col_l - cap < d_l, col_l - cap <= d_l))
                p_j = cute.arch.shuffle_sync(prefix, j_l % 32)
                p_e = cute.arch.shuffle_sync(prefix, (h + d_l) % 32)
                if lane % 2 == 0 and task_l < 2 * T * NQ:
                    w = cute.math.exp(p_e - p_j, fastmath=False)
                    sDot[xs_l, col_l] = cutlass.select_(live, w * dot, Float32(0.0))
            cute.arch.sync_threads()

            # Ring parts of R_s and o_s for this lane's row.
            rRk = cute.make_rmem_tensor((T,), Float32)
            rRq = cute.make_rmem_tensor((T,), Float32)
            for d in cutlass.range_constexpr(T):
                acc_k = Float32(0.0)
                acc_q = Float32(0.0)
                for p in cutlass.range_constexpr(cap):
                    live_p = (p - origin + cap) % cap < h  # select: a stale position may hold anything
                    acc_k = acc_k + cutlass.select_(live_p, sDot[d, p] * rU[p], Float32(0.0))
                    acc_q = acc_q + cutlass.select_(live_p, sDot[T + d, p] * rU[p], Float32(0.0))
                rRk[d] = acc_k
                rRq[d] = acc_q

            # S_ckpt[i] . k_s and . q_s for all s, row by row; lane r collects its row's totals.
            cute.arch.mbarrier_wait(mbar + warp, 0)
            rSk = cute.make_rmem_tensor((T,), Float32)
            rSq = cute.make_rmem_tensor((T,), Float32)
            rSk.fill(0.0)
            rSq.fill(0.0)
            for r in cutlass.range(RW):
                rS = cute.make_rmem_tensor((vec,), Float32)
                rS.fill(0.0)
                if lane < KL:
                    cute.autovec_copy(cute.local_tile(sState[r, None, warp], (vec,), (lane,)), rS)
                rP = cute.make_rmem_tensor((TP2,), Float32)
                rP.fill(0.0)
                if lane < KL:
                    for xs in cutlass.range_constexpr(2 * T):
                        rX = cute.make_rmem_tensor((vec,), Float32)
                        cute.autovec_copy(cute.local_tile(sDraft[xs, None], (vec,), (lane,)), rX)
                        for e in cutlass.range_constexpr(vec):
                            rP[xs] = rP[xs] + rS[e] * rX[e]
                tot = warp_reduce_many(rP, TP2)
                for d in cutlass.range_constexpr(T):
                    got_k = cute.arch.shuffle_sync(tot, d << t_shift)
                    got_q = cute.arch.shuffle_sync(tot, (T + d) << t_shift)
                    rSk[d] = cutlass.select_(lane == r, got_k, rSk[d])
                    rSq[d] = cutlass.select_(lane == r, got_q, rSq[d])

            # Forward substitution for the drafts' u, then the outputs.
            rUd = cute.make_rmem_tensor((T,), Float32)
            for d in cutlass.range_constexpr(T):
                gamma_d = cute.math.exp(cute.arch.shuffle_sync(prefix, (h + d) % 32), fastmath=False)
                beta_d = cute.arch.shuffle_sync(beta_j, (h + d) % 32)
                resid = rV[d] - gamma_d * rSk[d] - rRk[d]
                for e in cutlass.range_constexpr(d):
                    resid = resid - sDot[d, cap + e] * rUd[e]
                rUd[d] = beta_d * resid
                o = gamma_d * rSq[d] + rRq[d]
                for e in cutlass.range_constexpr(d + 1):
                    o = o + sDot[T + d, cap + e] * rUd[e]
                if lane < RW:
                    mOut[row, d, vhead, i_row] = o.to(act)
                    pos_d = (origin + h + d) % cap
                    mRingU[slot64, pos_d, vhead, i_row] = rUd[d].to(cutlass.Float16)
                    if cutlass.const_expr(s.keep_v_beta):
                        mRingV[slot64, pos_d, vhead, i_row] = mV[row, d, vhead, i_row]

            if flush:
                # Fold the h committed records: S = gamma S + sum_{j < h} (w_j u_j[i]) k_j with
                # decays up to record h - 1 (the drafts are not folded).
                p_last = cute.arch.shuffle_sync(prefix, (h + 31) % 32)
                w_fold = cute.math.exp(p_last - prefix, fastmath=False)
                gamma = cute.math.exp(p_last, fastmath=False)
                n_pass = cdiv(cap, JC)
                for jc in cutlass.range_constexpr(n_pass):
                    items = min(JC, cap - jc * JC)
                    rKf = cute.make_rmem_tensor(cute.make_layout((JC, vec), stride=(vec, 1)), Float32)
                    rCoef = cute.make_rmem_tensor((JC,), Float32)
                    for jj in cutlass.range_constexpr(items):
                        p_item = jc * JC + jj
                        j_item = (p_item - origin + cap) % cap
                        w = cute.arch.shuffle_sync(w_fold, j_item)
                        if lane < KL:
                            rKs = cute.make_rmem_tensor((vec,), act)
                            cute.autovec_copy(cute.local_tile(sKeys[p_item, None], (vec,), (lane,)), rKs)
                            for e in cutlass.range_constexpr(vec):
                                rKf[jj, e] = rKs[e].to(Float32)
                        rCoef[jj] = cutlass.select_(j_item < h, w * rU[p_item], Float32(0.0))
                    for r in cutlass.range(RW, unroll=2):
                        rS = cute.make_rmem_tensor((vec,), Float32)
                        tS = cute.local_tile(sState[r, None, warp], (vec,), (lane,))
                        if lane < KL:
                            cute.autovec_copy(tS, rS)
                        if cutlass.const_expr(jc == 0):
                            for e in cutlass.range_constexpr(vec):
                                rS[e] = gamma * rS[e]
                        for jj in cutlass.range_constexpr(items):
                            coef = cute.arch.shuffle_sync(rCoef[jj], r)
                            for e in cutlass.range_constexpr(vec):
                                rS[e] = rS[e] + coef * rKf[jj, e]
                        if lane < KL:
                            if cutlass.const_expr(jc == n_pass - 1):
                                cute.autovec_copy(rS, cute.local_tile(
                                    mCheckpoint[slot64, vhead, i_warp + r, None], (vec,), (lane,)))
                            else:
                                cute.autovec_copy(rS, tS)

            # The drafts' keys (once per key head) and decays (once per value head).
            if ptile == 0 and warp == 0:
                if vhead % rep == 0 and lane < KL:
                    for d in cutlass.range_constexpr(T):
                        rKd = cute.make_rmem_tensor((vec,), Float32)
                        cute.autovec_copy(cute.local_tile(sDraft[d, None], (vec,), (lane,)), rKd)
                        for e in cutlass.range_constexpr(vec):
                            mRingK[slot64, (origin + h + d) % cap, khead, lane * vec + e] = rKd[e].to(act)
                if lane >= h and lane < h + T:
                    mRingG[slot64, (origin + lane) % cap, vhead] = g_j
                    if cutlass.const_expr(s.keep_v_beta):
                        mRingBeta[slot64, (origin + lane) % cap, vhead] = beta_j


def _fake_inputs(shape: GDNShape, num_drafts: int):
    """Fake tensors with symbolic batch and slot dims; draft tokens laid out (b, T, ...), any
    batch stride (q, k, v may be views into a packed mixed_qkv)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    HV, V, K, H, cap, T = (shape.num_v_heads, shape.head_v_dim, shape.head_k_dim, shape.num_k_heads,
                           shape.capacity, num_drafts)
    act = shape.act_dtype
    batch, slots = cute.sym_int(), cute.sym_int()

    def compact(dtype, dims, align=16):
        return make_fake_compact_tensor(dtype, dims, stride_order=tuple(reversed(range(len(dims)))),
                                        assumed_align=align)

    def rows(dtype, inner):
        strides, step = [], 1
        for d in reversed(inner):
            strides.insert(0, step)
            step *= d
        return make_fake_tensor(dtype, (batch,) + tuple(inner), (cute.sym_int64(),) + tuple(strides),
                                assumed_align=dtype.width // 8)

    keep = shape.keep_v_beta
    return dict(
        mCheckpoint=compact(Float32, (slots, HV, V, K)),
        mQ=rows(act, (T, H, K)),
        mK=rows(act, (T, H, K)),
        mV=rows(act, (T, HV, V)),
        mA=rows(shape.gate_dtype, (T, HV)),
        mB=rows(shape.gate_dtype, (T, HV)),
        mALog=compact(shape.A_log_dtype, (HV,), align=4),
        mDtBias=compact(shape.dt_bias_dtype, (HV,), align=4),
        mSlot=compact(Int32, (batch,), align=4),
        mOut=rows(act, (T, HV, V)),
        mRingU=compact(cutlass.Float16, (slots, cap, HV, V)),
        mRingK=compact(act, (slots, cap, H, K)),
        mRingG=compact(Float32, (slots, cap, HV)),
        mRingV=compact(act, (slots, cap, HV, V)) if keep else None,
        mRingBeta=compact(Float32, (slots, cap, HV)) if keep else None,
        mCursor=compact(Int32, (slots,), align=4),
        mOrigin=compact(Int32, (slots,), align=4),
    )


def compile_verify(shape: GDNShape, config: GDNConfig, num_drafts: int, options: str):
    """Compile with `options`; launches on the caller's current CUDA stream (graph capturable)."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = _fake_inputs(shape, num_drafts)
    return cute.compile(GDNVerify(shape, config, num_drafts), *args.values(), stream, options=options)
