"""Gated DeltaNet speculative verification: T drafts per row, output-only, one checkpoint read.

Algorithm 5 of the paper (docs/design.md section 4; Eq. 10-11). With P_j the prefix sums of the log
decays g over the records in order (h committed, then the T drafts), gamma_s = exp(P_{h+s}) and
W_{j,s} = exp(P_{h+s} - P_j), each row's draft corrections solve one unit-lower-triangular system
by forward substitution, per state row i:

    R_s = v_s - gamma_s (S_ckpt k_s) - sum_{j < h} W_{j,s} (k_j . k_s) u_j
    u_s = beta_s (R_s - sum_{d < s} W_{h+d,s} (k_{h+d} . k_s) u_{h+d})
    o_s = gamma_s (S_ckpt q_s) + sum_{j <= h+s} W_{j,s} (k_j . q_s) u_j

The products run on tensor cores as small GEMMs (m16n8k8 TF32 with fp32 operands split into
hi + lo parts, accuracy that of fp32): the key products ``(k_col . k_s)`` and ``(k_col . q_s)``
of every ring position and draft once per CTA, weighted into shared memory; per warp (16 state
rows) ``S_ckpt [k; q]^T`` and ``U Dots^T`` (U the rows' committed corrections); a flushing row's
fold ``S = gamma S + (w_j u_j) K^T``. Only the T x T substitution runs per row on CUDA cores. The
draft records (u fp16, normalised k once per key head, g, and v / beta for two-precision caches)
go behind the committed ones at (origin + h + s) % cap; a row with h + T > L folds its h
committed records into the checkpoint in the same launch. h and origin come from the step's plan
(kernels/table.py), loaded with the slot id; the commit kernel moves the sequence table.

Grid (head_v_dim // rows_per_cta, num_v_heads, batch); 16 rows per warp (the MMA's M), each
warp's rows one TMA stage into a tile whose rows are padded apart (conflict-free fragment reads).

Low-precision and two-precision caches (paper Algorithm 6; kernels/state_io.py): the entry tile
is the read copy (else the low-precision checkpoint), decoded into the fp32 tile, so the GEMMs
run unchanged and the drafts' corrections come from the read copy; a flushing row decodes the
recurrence checkpoint instead, folds in the fp32 tile and writes that one fp32 state into every
copy (SR into a low-precision checkpoint with the bits of the plan's sr_writes, which the commit
advances; RTN into the read copy). With re-derivation (``GDNShape.rederive``) a flush first
re-derives the committed corrections from the checkpoint (S_ckpt k_j, the keys' Gram matrix and
the records' v, beta: ``decode.rederive_corrections``) and uses them for the drafts, the outputs
and the fold, so read-copy rounding never enters the recurrence.

Tensor contract (b = batch, S = slots, cap = window + max_draft, T = drafts, act as decode):

| name        | shape              | dtype | access | meaning                                      |
|-------------|--------------------|-------|--------|----------------------------------------------|
| checkpoint  | (S, HV, V, K)      | fmt   | R / W on flush | format, scales as decode's            |
| q, k        | (b, T, H, K)       | act   | R      | raw; any row stride                          |
| v           | (b, T, HV, V)      | act   | R      |                                              |
| a, b        | (b, T, HV)         | gate  | R      | raw gates                                    |
| A_log, dt_bias | (HV,)           | param | R      |                                              |
| slot_ids    | (b,)               | int32 | R      | pad / out-of-range rows skip                 |
| out         | (b, T, HV, V)      | act   | W      | o of every draft (pad rows untouched)        |
| ring_u, ring_k, ring_g (ring_v, ring_beta) | as decode | | R / W | drafts written at (origin + h + s) % cap |
| plan        | (b, 4)            | int32 | R      | (slot, h, origin, sr_writes) before the step |
| read, scales, sr_seed | as decode | | R (W on flush) | read copy; SR seed                           |

The kernel takes the drafts' tensors as a ``GDNToken``, the records with the plan as a ``GDNRing``
and the copies' other tensors (scales, read copy, SR seed) as a ``state_io.CopyTensors``.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..common import (MMA_ROWS, TILE_PAD, DraftStepKernel, after_previous_kernel, cdiv, clear_stale_record, fold_cols,
                      lane_scan, launch_tiles, load_b_fragment, mma_tf32, padded_tile_layout, planned_positions,
                      ring_fold_fragments, round_up, rows_times_columns, rows_times_dots, slot_is_live, smem_fit,
                      verify_check)
from ..state_io import (CopyTensors, fake_copy_tensors, fill_work_tile, fold_work_tile, start_work_tile_loads,
                        work_tile_tma)
from .common import gdn_gates, normalize_qk
from .config import GDNConfig, GDNRing, GDNShape, GDNToken
from .decode import rederive_corrections, row_key_dots


@cute.jit
def weighted_key_products(sDot: cute.Tensor, sKeys: cute.Tensor, sDraft: cute.Tensor, q_tile: Int32, prefix: Float32,
                          origin: Int32, h: Int32, g4: Int32, c4: Int32, cap: cutlass.Constexpr[int],
                          T: cutlass.Constexpr[int], TP: cutlass.Constexpr[int], NQ: cutlass.Constexpr[int],
                          NT: cutlass.Constexpr[int], K: cutlass.Constexpr[int]):
    """A warp's 16 key columns from ``q_tile`` (ring positions, then the drafts' normalised keys)
    of Dots (col, x_s) = k_col . x_s for x in {k, q} (``key_products``), weighted into
    ``sDot[x_s, col]`` (``weigh_key_product``). ``prefix`` is lane j's inclusive prefix sum of the
    decays."""
    rDot = cute.make_rmem_tensor(cute.make_layout((4, 1, 2 * NT)), Float32)
    key_products(rDot, sKeys, sDraft, q_tile, g4, c4, cap, T, NT, K)
    for nt in cutlass.range_constexpr(2 * NT):
        for i in cutlass.range_constexpr(4):
            q = q_tile + g4 + 8 * (i // 2)
            xs = 8 * nt + 2 * c4 + i % 2  # 0..TP-1: k_s; TP..2TP-1: q_s
            sDot[xs, q] = weigh_key_product(rDot[i, 0, nt], xs, q, prefix, origin, h, cap, T, TP, NQ)


@cute.jit
def key_products(rDot: cute.Tensor, sKeys: cute.Tensor, sDraft: cute.Tensor, q_tile: Int32, g4: Int32, c4: Int32,
                 cap: cutlass.Constexpr[int], T: cutlass.Constexpr[int], NT: cutlass.Constexpr[int],
                 K: cutlass.Constexpr[int]):
    """A warp's accumulator fragments ``rDot`` (4, 1, 2 NT) of the raw key products k_col . x_s of
    its 16 key columns from ``q_tile`` (``sKeys``' ring positions, then ``sDraft``'s normalised
    draft keys) with the drafts' keys and queries (``sDraft``: k rows, then q rows, TP apart), on
    tensor cores: fragment (i, nt) is column ``q_tile + g4 + 8 (i // 2)``, x_s ``8 nt + 2 c4 + i % 2``."""
    rDot.fill(0.0)
    for kb in cutlass.range_constexpr(K // 8):
        rA = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
        for i in cutlass.range_constexpr(4):
            q = q_tile + g4 + 8 * (i % 2)
            kk = 8 * kb + c4 + 4 * (i // 2)
            ring_key = sKeys[cutlass.min(q, cap - 1), kk].to(Float32)
            draft_key = sDraft[cutlass.max(cutlass.min(q - cap, T - 1), 0), kk]
            rA[i, 0, 0] = cutlass.select_(q < cap, ring_key, draft_key)
        rX = cute.make_rmem_tensor(cute.make_layout((2, 2 * NT, 1)), Float32)
        load_b_fragment(rX, sDraft, 8 * kb, 2 * NT)
        mma_tf32(rDot, rA, rX, True, True)


@cute.jit
def weigh_key_product(raw: Float32, xs: Int32, q: Int32, prefix: Float32, origin: Int32, h: Int32,
                      cap: cutlass.Constexpr[int], T: cutlass.Constexpr[int], TP: cutlass.Constexpr[int],
                      NQ: cutlass.Constexpr[int]) -> Float32:
    """The weighted product of key column ``q`` and draft row ``xs`` (k_s for xs < TP, q_s after)
    from its raw dot: exp(P_s - P_j) (``prefix`` lane j's inclusive prefix sum of the decays) where
    the column counts, zero elsewhere: k-rows take committed records and earlier drafts, q-rows
    also the draft itself. Every lane of the warp calls it (shuffles)."""
    d = xs % TP
    j = cutlass.select_(q < cap, (q - origin + cap) % cap, h + q - cap)
    live = (q < NQ) & (d < T) & cutlass.select_(
        q < cap, j < h, cutlass.select_(xs < TP, q - cap < d, q - cap <= d))
    p_j = cute.arch.shuffle_sync(prefix, j % 32)
    p_e = cute.arch.shuffle_sync(prefix, (h + d) % 32)
    w = cute.math.exp(p_e - p_j, fastmath=False)
    return cutlass.select_(live, w * raw, Float32(0.0))


@cute.jit
def store_draft_records(mRingK: cute.Tensor, mRingG: cute.Tensor, mRingBeta: Optional[cute.Tensor], sDraft: cute.Tensor,
                        slot64: Int64, khead: Int32, vhead: Int32, with_keys, origin: Int32, h: Int32, g_j: Float32,
                        beta_j: Float32, lane: Int32, cap: cutlass.Constexpr[int], T: cutlass.Constexpr[int],
                        KL: cutlass.Constexpr[int], vec: cutlass.Constexpr[int]):
    """One warp stores the drafts' records past the h committed ones (ring position (origin + h +
    d) % cap): where ``with_keys`` (once per key head), the normalised keys of rows 0..T-1 of
    ``sDraft`` (lane < KL: ``vec`` elements of each); lane h + d, draft d's decay g (and beta where
    ``mRingBeta`` is given) of the value head."""
    if with_keys and lane < KL:
        for d in cutlass.range_constexpr(T):
            rKd = cute.make_rmem_tensor((vec,), Float32)
            cute.autovec_copy(cute.local_tile(sDraft[d, None], (vec,), (lane,)), rKd)
            for e in cutlass.range_constexpr(vec):
                mRingK[slot64, (origin + h + d) % cap, khead, lane * vec + e] = rKd[e].to(mRingK.element_type)
    if lane >= h and lane < h + T:
        mRingG[slot64, (origin + lane) % cap, vhead] = g_j
        if cutlass.const_expr(mRingBeta is not None):
            mRingBeta[slot64, (origin + lane) % cap, vhead] = beta_j


@cute.jit
def fold_coefficients(rCoef: cute.Tensor, rU: cute.Tensor, prefix: Float32, origin: Int32, h: Int32, c4: Int32,
                      cap: cutlass.Constexpr[int]) -> Float32:
    """A flush's fold of the h committed records, S = gamma S + sum_{j < h} (w_j u_j) k_j^T with
    decays up to record h - 1: the A fragments w_j u_j into ``rCoef``; returns gamma."""
    p_last = cute.arch.shuffle_sync(prefix, (h + 31) % 32)
    w_fold = cute.math.exp(p_last - prefix, fastmath=False)
    gamma = cute.math.exp(p_last, fastmath=False)
    ring_fold_fragments(rCoef, rU, w_fold, origin, c4, cap)
    return gamma


class GDNVerify(DraftStepKernel):
    """One verify step of T drafts of a GDN layer over a pool of slots (module docstring)."""

    @staticmethod
    def dims(shape: GDNShape, num_drafts: int):
        """(T padded to the MMA's N, ring + draft key columns padded to 16 rows of the dot GEMM)."""
        return round_up(num_drafts, 8), round_up(shape.capacity + num_drafts, 16)

    @staticmethod
    def smem_bytes(shape: GDNShape, config: GDNConfig, num_drafts: int) -> int:
        K = shape.head_k_dim
        TP, NQP = GDNVerify.dims(shape, num_drafts)
        return (config.rows_per_cta * (K + TILE_PAD) * 4 + round_up(shape.capacity, 8) * (K + 8) * shape.act_dtype.width // 8
                + 2 * TP * (K + 4) * 4 + 2 * TP * (NQP + 4) * 4 + config.num_warps * MMA_ROWS * (2 * TP + 1) * 4
                + 8 * config.num_warps + 1024
                + shape.copies.work_tile_smem_bytes(config.rows_per_cta, config.num_warps)
                + (GDNVerify.rederive_smem_bytes(shape, config) if shape.rederive else 0))

    @staticmethod
    def rederive_smem_bytes(shape: GDNShape, config: GDNConfig) -> int:
        """The keys' Gram matrix; S_ckpt k_p, v_p and the re-derived u per warp row and position."""
        cap = shape.capacity
        return 4 * cap * cap + 3 * 4 * cap * config.rows_per_cta + 48

    @staticmethod
    def check(shape, config, num_drafts: int) -> Optional[str]:
        reason = (verify_check(shape, config, num_drafts)
                  or shape.copies.check(shape.k_vec, config.rows_per_cta, shape.head_v_dim))
        if reason is not None:
            return reason
        if shape.rederive and not (shape.keep_v_beta and shape.window > 1):
            return "re-deriving corrections at a flush needs the records' v and beta (keep_v_beta, window > 1)"
        if shape.rederive and shape.head_k_dim != 32 * shape.k_vec:
            return f"re-deriving corrections needs head_k_dim a multiple of 32 (every lane a slice), not {shape.head_k_dim}"
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
        mPlan: cute.Tensor,
        mCheckpointScale: Optional[cute.Tensor],
        mCheckpointStateScale: Optional[cute.Tensor],
        mRead: Optional[cute.Tensor],
        mReadScale: Optional[cute.Tensor],
        mReadStateScale: Optional[cute.Tensor],
        mSrSeed: Optional[cute.Tensor],
        stream,
    ):
        s, c = self.shape, self.config
        HV, V = s.num_v_heads, s.head_v_dim
        copies = s.copies
        tma_atom, mRowsTma = work_tile_tma(copies, mCheckpoint, mRead, HV * V, MMA_ROWS)
        launch_tiles(self.kernel(
            tma_atom, mRowsTma, mCheckpoint, GDNToken(mQ, mK, mV, mA, mB, mALog, mDtBias), mSlot, mOut,
            GDNRing(mRingU, mRingK, mRingG, mRingV, mRingBeta, mPlan),
            CopyTensors(mCheckpointScale, mCheckpointStateScale, mRead, mReadScale, mReadStateScale, mSrSeed),
        ), [V // c.rows_per_cta, HV, mV.shape[0]], c, self.smem_bytes(s, c, self.num_drafts), stream)

    @cute.kernel
    def kernel(
        self,
        tma_atom: cute.CopyAtom,
        mRowsTma: cute.Tensor,
        mCheckpoint: cute.Tensor,
        token: GDNToken,
        mSlot: cute.Tensor,
        mOut: cute.Tensor,
        records: GDNRing,
        tensors: CopyTensors,
    ):
        mQ, mK, mV, mA, mB, mALog, mDtBias = token
        mRingU, mRingK, mRingG, mRingV, mRingBeta, mPlan = records
        s, c, T = self.shape, self.config, self.num_drafts
        HV, V, K, H, L, cap = s.num_v_heads, s.head_v_dim, s.head_k_dim, s.num_k_heads, s.window, s.capacity
        R, W = c.rows_per_cta, c.num_warps
        TP, NQP = self.dims(s, T)
        NT = TP // 8  # n-tiles of drafts (k columns; the q columns follow)
        NQ = cap + T  # key columns: the ring positions, then the drafts
        KF = cdiv(cap, 8)  # k-steps over ring positions
        vec = s.k_vec
        KL = K // vec  # lanes holding a K row
        rep = HV // H
        act = s.act_dtype
        exact = act.width < 32  # bf16 / fp16 ring keys are exact in TF32
        copies = s.copies
        rederive = s.rederive

        tidx, _, _ = cute.arch.thread_idx()
        ptile, vhead, row = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()
        after_previous_kernel()
        g4 = lane // 4
        c4 = lane % 4

        slot = mSlot[row]
        h, origin, sr_count = planned_positions(mPlan, row, True, copies.stochastic)
        valid = slot_is_live(slot, mCheckpoint.shape[0], s.pad_slot_id)

        if valid:
            slot64 = Int64(slot)
            khead = vhead // rep
            i_warp = ptile * R + warp * MMA_ROWS

            smem = SmemAllocator()
            sState = smem.allocate_tensor(Float32, padded_tile_layout(MMA_ROWS, K, W), byte_alignment=128)
            mbar = smem.allocate_array(Int64, W, byte_alignment=8)
            # Ring keys by position, zero rows up to the fold's last k-step.
            sKeys = smem.allocate_tensor(act, cute.make_layout((8 * KF, K), stride=(K + 8, 1)), byte_alignment=16)
            # The drafts' normalised keys (rows 0..T-1) and queries (rows TP..TP+T-1), fp32, zero between.
            sDraft = smem.allocate_tensor(Float32, cute.make_layout((2 * TP, K), stride=(K + 4, 1)), byte_alignment=16)
            # W_{j,s} (k_col . x_s) per (x in {k, q} x draft s, column col); zero where not used.
            sDot = smem.allocate_tensor(Float32, cute.make_layout((2 * TP, NQP), stride=(NQP + 4, 1)), byte_alignment=16)
            # Per warp: gamma_s S_ckpt x_s + the ring part, per (row, x_s), for the substitution.
            sPre = smem.allocate_tensor(
                Float32, cute.make_layout((MMA_ROWS, 2 * TP, W), stride=(2 * TP + 1, 1, MMA_ROWS * (2 * TP + 1))),
                byte_alignment=16)
            first_box = Int32((slot64 * (HV * V) + vhead * V + ptile * R) // MMA_ROWS)
            sEntry, sAmax, sEntryScale, entry_state_scale, sr_key = start_work_tile_loads(
                copies, smem, sState, mbar, tma_atom, mRowsTma, first_box, i_warp, slot, slot64, vhead,
                tensors, sr_count)
            sGram, sSk, sUre, sVre = None, None, None, None
            if cutlass.const_expr(rederive):
                sGram = smem.allocate_tensor(Float32, cute.make_layout((cap, cap), stride=(cap, 1)), byte_alignment=16)
                rows_layout = cute.make_layout((cap, MMA_ROWS, W), stride=(MMA_ROWS, 1, cap * MMA_ROWS))
                sSk = smem.allocate_tensor(Float32, rows_layout, byte_alignment=16)
                sUre = smem.allocate_tensor(Float32, rows_layout, byte_alignment=16)
                sVre = smem.allocate_tensor(Float32, rows_layout, byte_alignment=16)

            g_phys = mRingG[slot64, lane % cap, vhead]
            flush = h + T > L

            # U fragments: the rows' committed corrections at every ring position (live ones).
            rU = cute.make_rmem_tensor(cute.make_layout((4, KF)), Float32)
            for kf in cutlass.range_constexpr(KF):
                for i in cutlass.range_constexpr(4):
                    q = 8 * kf + c4 + 4 * (i // 2)
                    uv = Float32(0.0)
                    if q < cap:
                        live = (q - origin + cap) % cap < h  # select: a stale position may hold anything
                        uv = cutlass.select_(live, mRingU[slot64, q, vhead, i_warp + g4 + 8 * (i % 2)].to(Float32),
                                             Float32(0.0))
                    rU[i, kf] = uv

            # The drafts' v of this lane's substitution row (lanes < 16), loaded now rather than at
            # the end, where the dependent load would add a memory latency to the CTA.
            rV = cute.make_rmem_tensor((T,), act)
            for d in cutlass.range_constexpr(T):
                rV[d] = mV[row, d, vhead, i_warp + lane % MMA_ROWS]

            # Stage the ring keys and the drafts' normalised k and q (warp w: drafts w, w + W, ...).
            for pp in cutlass.range_constexpr(cdiv(8 * KF, W)):
                p_stage = pp * W + warp
                if p_stage < 8 * KF and lane < KL:
                    rKp = cute.make_rmem_tensor((vec,), act)
                    rKp.fill(0.0)
                    if p_stage < cap:
                        for e in cutlass.range_constexpr(vec):
                            rKp[e] = mRingK[slot64, p_stage, khead, lane * vec + e]
                    tKey = cute.local_tile(sKeys[p_stage, None], (vec,), (lane,))
                    cute.autovec_copy(rKp, tKey)
                    if p_stage < cap:
                        clear_stale_record(tKey, p_stage, origin, h, cap)
            for tt in cutlass.range_constexpr(cdiv(TP, W)):
                d_stage = tt * W + warp
                if d_stage < TP:
                    rK = cute.make_rmem_tensor((vec,), Float32)
                    rQ = cute.make_rmem_tensor((vec,), Float32)
                    rK.fill(0.0)
                    rQ.fill(0.0)
                    if d_stage < T and lane < KL:
                        for e in cutlass.range_constexpr(vec):
                            rK[e] = mK[row, d_stage, khead, lane * vec + e].to(Float32)
                            rQ[e] = mQ[row, d_stage, khead, lane * vec + e].to(Float32)
                    normalize_qk(rK, rQ, vec, s.q_scale)
                    if lane < KL:
                        cute.autovec_copy(rK, cute.local_tile(sDraft[d_stage, None], (vec,), (lane,)))
                        cute.autovec_copy(rQ, cute.local_tile(sDraft[TP + d_stage, None], (vec,), (lane,)))

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
            prefix = lane_scan(g_j)  # inclusive prefix sums P_j across lanes
            cute.arch.sync_threads()

            # Dots (col, x_s) = k_col . x_s for x in {k, q}: 16 key columns per warp GEMM, weighted.
            for mt in cutlass.range_constexpr(cdiv(NQP // 16, W)):
                q_tile = (mt * W + warp) * 16
                if q_tile < NQP:
                    weighted_key_products(sDot, sKeys, sDraft, q_tile, prefix, origin, h, g4, c4, cap, T, TP, NQ, NT, K)
            cute.arch.sync_threads()

            # Ring parts U Dots^T (before the tile has landed, unless a flush re-derives U from it),
            # then S_ckpt [k; q]^T.
            rRing = cute.make_rmem_tensor(cute.make_layout((4, 1, 2 * NT)), Float32)
            if cutlass.const_expr(not rederive):
                rows_times_dots(rRing, rU, sDot, False)
            cute.arch.mbarrier_wait(mbar + warp, 0)
            # a low-precision read copy, or on a flush the recurrence checkpoint, decoded into the tile
            fill_work_tile(copies, sState, sEntry, sEntryScale, entry_state_scale, flush, mCheckpoint, tensors, slot64,
                           vhead, i_warp)
            if cutlass.const_expr(rederive):
                if flush:  # Algorithm 6: the committed corrections from the checkpoint, by record
                    for r in cutlass.range(MMA_ROWS, unroll=1):
                        rS = cute.make_rmem_tensor((vec,), Float32)
                        cute.autovec_copy(cute.local_tile(sState[r, None, warp], (vec,), (lane,)), rS)
                        row_key_dots(rS, sKeys, sSk[None, None, warp], r, cap, vec, act)
                    rUrow = cute.make_rmem_tensor((cap,), Float32)
                    rederive_corrections(sKeys, sGram, sSk, sUre, sVre, mRingV, mRingBeta, rUrow, g_j, slot64, vhead,
                                         i_warp + lane % MMA_ROWS, origin, h, MMA_ROWS, W, cap, vec, act)
                    for kf in cutlass.range_constexpr(KF):
                        for i in cutlass.range_constexpr(4):
                            q = 8 * kf + c4 + 4 * (i // 2)
                            j = (q - origin + cap) % cap
                            rU[i, kf] = cutlass.select_((q < cap) & (j < h), sUre[j, g4 + 8 * (i % 2), warp],
                                                        Float32(0.0))
                rows_times_dots(rRing, rU, sDot, True)
            rSX = cute.make_rmem_tensor(cute.make_layout((4, 1, 2 * NT)), Float32)
            rSX.fill(0.0)
            rows_times_columns(rSX, sState, warp, sDraft, K // 8, False)
            for nt in cutlass.range_constexpr(2 * NT):
                for i in cutlass.range_constexpr(4):
                    xs = 8 * nt + 2 * c4 + i % 2
                    gamma_s = cute.math.exp(cute.arch.shuffle_sync(prefix, (h + xs % TP) % 32), fastmath=False)
                    sPre[g4 + 8 * (i // 2), xs, warp] = gamma_s * rSX[i, 0, nt] + rRing[i, 0, nt]
            rBeta = cute.make_rmem_tensor((T,), Float32)
            for d in cutlass.range_constexpr(T):
                rBeta[d] = cute.arch.shuffle_sync(beta_j, (h + d) % 32)
            cute.arch.sync_warp()

            # Forward substitution for the drafts' u, then the outputs: lane r < 16 takes row r.
            if lane < MMA_ROWS:
                i_row = i_warp + lane
                rUd = cute.make_rmem_tensor((T,), Float32)
                for d in cutlass.range_constexpr(T):
                    resid = rV[d].to(Float32) - sPre[lane, d, warp]
                    for e in cutlass.range_constexpr(d):
                        resid = resid - sDot[d, cap + e] * rUd[e]
                    rUd[d] = rBeta[d] * resid
                    o = sPre[lane, TP + d, warp]
                    for e in cutlass.range_constexpr(d + 1):
                        o = o + sDot[TP + d, cap + e] * rUd[e]
                    mOut[row, d, vhead, i_row] = o.to(act)
                    pos_d = (origin + h + d) % cap
                    mRingU[slot64, pos_d, vhead, i_row] = rUd[d].to(cutlass.Float16)
                    if cutlass.const_expr(s.keep_v_beta):
                        mRingV[slot64, pos_d, vhead, i_row] = rV[d]

            if flush:
                # Fold the h committed records as a GEMM over ring positions.
                rCoef = cute.make_rmem_tensor(cute.make_layout((4, KF)), Float32)
                gamma = fold_coefficients(rCoef, rU, prefix, origin, h, c4, cap)
                fold_work_tile(copies, sState, rCoef, sKeys, gamma, fold_cols(K), exact, mCheckpoint, tensors, slot64,
                               vhead, i_warp, sAmax, sr_key)

            # The drafts' keys (once per key head) and decays (once per value head).
            if ptile == 0 and warp == 0:
                store_draft_records(mRingK, mRingG, mRingBeta, sDraft, slot64, khead,
                                    vhead, vhead % rep == 0, origin, h, g_j, beta_j, lane, cap, T, KL, vec)


def fake_inputs(shape: GDNShape, num_drafts: int):
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
    state = fake_copy_tensors(shape.copies, slots, HV, V)
    return dict(
        mCheckpoint=state.pop("mCheckpoint"),
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
        mPlan=compact(Int32, (batch, 4)),
        **state,
    )


def compile_verify(shape: GDNShape, config: GDNConfig, num_drafts: int, options: str):
    """Compile with `options`; launches on the caller's current CUDA stream (graph capturable)."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = fake_inputs(shape, num_drafts)
    return cute.compile(GDNVerify(shape, config, num_drafts), *args.values(), stream, options=options)
