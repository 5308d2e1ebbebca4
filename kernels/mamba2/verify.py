"""Mamba-2 speculative verification: T draft tokens per row, output-only, one checkpoint read.

Algorithm 2 of the paper (docs/design.md section 4). Each row reads its committed count h from the
step's plan (kernels/table.py);
the T outputs come from the checkpoint tile and the h committed records plus the drafts before
each token (Eq. 6), never forming a state:

    y_t = gamma_t (S_ckpt C_t) + sum_{j <= h + t} w_{j,t} (B_j . C_t) x_j + D x_t,
    gamma_t = exp(A P_{h+t}),  w_{j,t} = dt_j exp(A (P_{h+t} - P_j)),  P the prefix sums of dt.

Every product runs on tensor cores as small GEMMs (m16n8k8 TF32, fp32 operands split into
hi + lo TF32 parts, so accuracy stays that of fp32; bf16 / fp16 operands are exact in TF32):

- ``Dots (q, t) = B_q . C_t`` for every ring position and draft q, once per CTA, weighted by
  w_{j,t} (zero where record q is not before draft t) into shared memory;
- per warp (16 state rows): ``S_ckpt C^T`` (16 x T) and ``X Dots^T`` (16 x T) where X holds the
  rows' x at every ring position and draft;
- a row with h + T > L folds its h committed records in the same launch as one more GEMM,
  ``S = gamma S + (w_j x_j) B^T`` over ring positions, and stores the checkpoint (drafts are not
  folded).

The T draft records are written behind the committed ones, at (origin + h + t) % cap. The
sequence table is not touched here: the commit kernel (``kernels/table.py``) moves it from this
step's plan once the accepted count is known. The plan row is loaded with the slot id (both
indexed by the batch row).

Low-precision and two-precision caches (paper Algorithm 3; kernels/state_io.py): the entry tile
is the read copy (else the low-precision checkpoint), decoded into the fp32 tile, so the GEMMs
above run unchanged; a flushing row decodes the recurrence checkpoint instead, folds in the fp32
tile and writes that one fp32 state into every copy (SR into a low-precision checkpoint, with the
bits of the plan's sr_writes, which the commit advances; RTN into the read copy).

Grid (headdim // rows_per_cta, nheads, batch); 16 rows per warp (the MMA's M), each warp's rows
one TMA stage into a tile whose rows are padded apart (conflict-free fragment reads).

Tensor contract (b = batch, S = slots, cap = window + max_draft, T = drafts, act as decode):

| name        | shape              | dtype    | access | meaning                                     |
|-------------|--------------------|----------|--------|---------------------------------------------|
| checkpoint  | (S, H, P, N)       | fmt      | R / W on flush | format, scales as decode's           |
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
| plan        | (b, 4)             | int32    | R      | (slot, h, origin, sr_writes) before the step |
| read, scales, sr_seed | as decode  |          | R (W on flush) | read copy; SR seed                   |

The kernel takes the drafts' tensors as a ``Mamba2Token``, the records with the plan as a
``Mamba2Ring`` and the copies' other tensors (scales, read copy, SR seed) as a
``state_io.CopyTensors``.
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..common import (MMA_ROWS, TILE_PAD, DraftStepKernel, after_previous_kernel, cdiv, clear_stale_record, fold_cols,
                      lane_scan, launch_tiles, load_b_fragment, mma_tf32, padded_tile_layout, planned_positions,
                      ring_fold_fragments, round_up, rows_times_columns, rows_times_dots, slot_is_live, smem_fit,
                      softplus, verify_check)
from ..state_io import (CopyTensors, fake_copy_tensors, fill_work_tile, fold_work_tile, start_work_tile_loads,
                        work_tile_tma)
from .config import Mamba2Config, Mamba2Ring, Mamba2Shape, Mamba2Token


@cute.jit
def weighted_dots(sDot: cute.Tensor, sB: cute.Tensor, sC: cute.Tensor, q_tile: Int32, dt_j: Float32, prefix: Float32,
                  A: Float32, origin: Int32, h: Int32, g4: Int32, c4: Int32, cap: cutlass.Constexpr[int],
                  T: cutlass.Constexpr[int], NQ: cutlass.Constexpr[int], NT: cutlass.Constexpr[int],
                  N: cutlass.Constexpr[int], exact: cutlass.Constexpr[bool]):
    """A warp's 16 columns q from ``q_tile`` of Dots (q, t) = B_q . C_t (``raw_dots``), weighted
    into ``sDot[t, q]`` (``weigh_dot``). ``dt_j`` and ``prefix`` are lane j's dt and inclusive
    prefix sum over the live positions."""
    rDot = cute.make_rmem_tensor(cute.make_layout((4, 1, NT)), Float32)
    raw_dots(rDot, sB, sC, q_tile, g4, c4, NT, N, exact)
    for nt in cutlass.range_constexpr(NT):
        for i in cutlass.range_constexpr(4):
            q = q_tile + g4 + 8 * (i // 2)
            t = 8 * nt + 2 * c4 + i % 2
            sDot[t, q] = weigh_dot(rDot[i, 0, nt], t, q, dt_j, prefix, A, origin, h, cap, T, NQ)


@cute.jit
def raw_dots(rDot: cute.Tensor, sB: cute.Tensor, sC: cute.Tensor, q_tile: Int32, g4: Int32, c4: Int32,
             NT: cutlass.Constexpr[int], N: cutlass.Constexpr[int], exact: cutlass.Constexpr[bool]):
    """A warp's accumulator fragments ``rDot`` (4, 1, NT) of B_q . C_t for its 16 columns q from
    ``q_tile`` (``sB``'s rows: the ring positions, then the drafts) and the drafts' fp32 C
    (``sC``), on tensor cores: fragment (i, nt) is column ``q_tile + g4 + 8 (i // 2)``, draft
    ``8 nt + 2 c4 + i % 2``."""
    rDot.fill(0.0)
    for kb in cutlass.range_constexpr(N // 8):
        rA = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
        for i in cutlass.range_constexpr(4):
            rA[i, 0, 0] = sB[q_tile + g4 + 8 * (i % 2), 8 * kb + c4 + 4 * (i // 2)].to(Float32)
        rCb = cute.make_rmem_tensor(cute.make_layout((2, NT, 1)), Float32)
        load_b_fragment(rCb, sC, 8 * kb, NT)
        mma_tf32(rDot, rA, rCb, not exact, not exact)


@cute.jit
def weigh_dot(raw: Float32, t: Int32, q: Int32, dt_j: Float32, prefix: Float32, A: Float32, origin: Int32, h: Int32,
              cap: cutlass.Constexpr[int], T: cutlass.Constexpr[int], NQ: cutlass.Constexpr[int]) -> Float32:
    """Column q's weighted dot for draft t from its raw B_q . C_t: dt_q exp(A (P_t - P_q)) where
    column q (a ring position, then a draft) counts for draft t (committed records before h,
    drafts up to t), zero elsewhere. Every lane of the warp calls it (shuffles)."""
    j = cutlass.select_(q < cap, (q - origin + cap) % cap, h + q - cap)
    live = (q < NQ) & (t < T) & cutlass.select_(q < cap, j < h, q - cap <= t)
    dt_q = cute.arch.shuffle_sync(dt_j, j % 32)
    p_q = cute.arch.shuffle_sync(prefix, j % 32)
    p_t = cute.arch.shuffle_sync(prefix, (h + t) % 32)
    w = dt_q * cute.math.exp(A * (p_t - p_q), fastmath=False)
    return cutlass.select_(live, w * raw, Float32(0.0))


@cute.jit
def fold_coefficients(rCoef: cute.Tensor, rX: cute.Tensor, dt_j: Float32, prefix: Float32, A: Float32, origin: Int32,
                      h: Int32, c4: Int32, cap: cutlass.Constexpr[int]) -> Float32:
    """A flush's fold of the h committed records, S = gamma S + sum_{j < h} (w_j x_j) B_j^T with
    weights up to record h - 1: the A fragments w_j x_j into ``rCoef``; returns gamma."""
    p_last = cute.arch.shuffle_sync(prefix, (h + 31) % 32)
    w_fold = dt_j * cute.math.exp(A * (p_last - prefix), fastmath=False)
    gamma = cute.math.exp(A * p_last, fastmath=False)
    ring_fold_fragments(rCoef, rX, w_fold, origin, c4, cap)
    return gamma


class Mamba2Verify(DraftStepKernel):
    """One verify step of T drafts of a Mamba-2 layer over a pool of slots (module docstring)."""

    @staticmethod
    def dims(shape: Mamba2Shape, num_drafts: int):
        """(T padded to the MMA's N, ring + draft columns padded to 16 rows of the dot GEMM)."""
        return round_up(num_drafts, 8), round_up(shape.capacity + num_drafts, 16)

    @staticmethod
    def smem_bytes(shape: Mamba2Shape, config: Mamba2Config, num_drafts: int) -> int:
        N = shape.dstate
        TP, NQP = Mamba2Verify.dims(shape, num_drafts)
        return (config.rows_per_cta * (N + TILE_PAD) * 4 + NQP * (N + 8) * shape.act_dtype.width // 8 + TP * (N + 4) * 4
                + TP * (NQP + 4) * 4 + 8 * config.num_warps + 2048
                + shape.copies.work_tile_smem_bytes(config.rows_per_cta, config.num_warps))

    @staticmethod
    def check(shape, config, num_drafts: int) -> Optional[str]:
        return (verify_check(shape, config, num_drafts)
                or shape.copies.check(shape.dstate // 32, config.rows_per_cta, shape.headdim)
                or smem_fit(Mamba2Verify.smem_bytes(shape, config, num_drafts), config.min_ctas_per_sm))

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
        H, P = s.nheads, s.headdim
        copies = s.copies
        tma_atom, mRowsTma = work_tile_tma(copies, mCheckpoint, mRead, H * P, MMA_ROWS)
        launch_tiles(self.kernel(
            tma_atom, mRowsTma, mCheckpoint, Mamba2Token(mX, mDt, mA, mB, mC, mD, mZ, mDtBias), mSlot, mOut,
            Mamba2Ring(mRingX, mRingB, mRingDt, mPlan),
            CopyTensors(mCheckpointScale, mCheckpointStateScale, mRead, mReadScale, mReadStateScale, mSrSeed),
        ), [P // c.rows_per_cta, H, mX.shape[0]], c, self.smem_bytes(s, c, self.num_drafts), stream)

    @cute.kernel
    def kernel(
        self,
        tma_atom: cute.CopyAtom,
        mRowsTma: cute.Tensor,
        mCheckpoint: cute.Tensor,
        token: Mamba2Token,
        mSlot: cute.Tensor,
        mOut: cute.Tensor,
        records: Mamba2Ring,
        tensors: CopyTensors,
    ):
        mX, mDt, mA, mB, mC, mD, mZ, mDtBias = token
        mRingX, mRingB, mRingDt, mPlan = records
        s, c, T = self.shape, self.config, self.num_drafts
        H, P, N, G, L, cap = s.nheads, s.headdim, s.dstate, s.ngroups, s.window, s.capacity
        R, W = c.rows_per_cta, c.num_warps
        TP, NQP = self.dims(s, T)
        NT = TP // 8  # n-tiles of drafts
        NQ = cap + T  # dot columns: the ring positions, then the drafts
        KQ = NQP // 8  # k-steps over those columns
        KF = cdiv(cap, 8)  # k-steps of the fold (ring positions only)
        vec = N // 32
        RPW = cdiv(NQP, W)  # rows of sB a warp stages
        TPW = cdiv(TP, W)  # rows of sC a warp stages
        heads_per_group = H // G
        act = s.act_dtype
        exact = act.width < 32  # bf16 / fp16 values are exact in TF32
        copies = s.copies

        tidx, _, _ = cute.arch.thread_idx()
        ptile, head, row = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()
        after_previous_kernel()
        g4 = lane // 4  # fragment row group
        c4 = lane % 4  # fragment column in the group

        slot = mSlot[row]
        h, origin, sr_count = planned_positions(mPlan, row, True, copies.stochastic)
        valid = slot_is_live(slot, mCheckpoint.shape[0], s.pad_slot_id)

        if valid:
            slot64 = Int64(slot)
            group = head // heads_per_group
            p_warp = ptile * R + warp * MMA_ROWS

            smem = SmemAllocator()
            sState = smem.allocate_tensor(Float32, padded_tile_layout(MMA_ROWS, N, W), byte_alignment=128)
            mbar = smem.allocate_array(Int64, W, byte_alignment=8)
            # B of the ring positions (rows 0..cap-1) and drafts (cap..NQ-1), zero below; padded rows
            # keep the fragment reads on distinct banks.
            sB = smem.allocate_tensor(act, cute.make_layout((NQP, N), stride=(N + 8, 1)), byte_alignment=16)
            sC = smem.allocate_tensor(Float32, cute.make_layout((TP, N), stride=(N + 4, 1)), byte_alignment=16)
            # w_{j,t} (B_q . C_t) per (draft t, column q); zero where q holds no record before t.
            sDot = smem.allocate_tensor(Float32, cute.make_layout((TP, NQP), stride=(NQP + 4, 1)), byte_alignment=16)
            first_box = Int32((slot64 * (H * P) + head * P + p_warp - warp * MMA_ROWS) // MMA_ROWS)
            sEntry, sAmax, sEntryScale, entry_state_scale, sr_key = start_work_tile_loads(
                copies, smem, sState, mbar, tma_atom, mRowsTma, first_box, p_warp, slot, slot64, head,
                tensors, sr_count)

            dt_phys = mRingDt[slot64, lane % cap, head]  # lane p: dt at position p
            flush = h + T > L

            # X fragments: the rows' x at every ring position (live ones) and draft, zero beyond.
            rX = cute.make_rmem_tensor(cute.make_layout((4, KQ)), Float32)
            for kq in cutlass.range_constexpr(KQ):
                for i in cutlass.range_constexpr(4):
                    q = 8 * kq + c4 + 4 * (i // 2)
                    r = p_warp + g4 + 8 * (i % 2)
                    xv = Float32(0.0)
                    if q < cap:
                        live = (q - origin + cap) % cap < h  # select: a stale position may hold anything
                        xv = cutlass.select_(live, mRingX[slot64, q, head, r].to(Float32), Float32(0.0))
                    if q >= cap and q < NQ:
                        xv = mX[row, q - cap, head, r].to(Float32)
                    rX[i, kq] = xv

            # The drafts' x (and z) at the output positions of the accumulators, D: loaded now, not
            # at the end, where each dependent load would add a memory latency to the CTA.
            rXo = cute.make_rmem_tensor(cute.make_layout((4, NT)), act)
            rZo = cute.make_rmem_tensor(cute.make_layout((4, NT)), act)
            for nt in cutlass.range_constexpr(NT):
                for i in cutlass.range_constexpr(4):
                    t = 8 * nt + 2 * c4 + i % 2
                    r = p_warp + g4 + 8 * (i // 2)
                    if t < T:
                        rXo[i, nt] = mX[row, t, head, r]
                        if cutlass.const_expr(s.has_z):
                            rZo[i, nt] = mZ[row, t, head, r]
            D = Float32(0.0)
            if cutlass.const_expr(s.has_D):
                D = mD[head].to(Float32)

            # Stage B of the ring positions and drafts, and the drafts' C, in shared memory.
            for pp in cutlass.range_constexpr(RPW):
                q_stage = pp * W + warp
                if q_stage < NQP:
                    rBq = cute.make_rmem_tensor((vec,), act)
                    rBq.fill(0.0)
                    if q_stage < cap:
                        cute.autovec_copy(cute.local_tile(mRingB[slot64, q_stage, group, None], (vec,), (lane,)), rBq)
                    if q_stage >= cap and q_stage < NQ:
                        cute.autovec_copy(cute.local_tile(mB[row, q_stage - cap, group, None], (vec,), (lane,)), rBq)
                    tB = cute.local_tile(sB[q_stage, None], (vec,), (lane,))
                    cute.autovec_copy(rBq, tB)
                    if q_stage < cap:
                        clear_stale_record(tB, q_stage, origin, h, cap)
            for tt in cutlass.range_constexpr(TPW):
                t_stage = tt * W + warp
                if t_stage < TP:
                    rCf = cute.make_rmem_tensor((vec,), Float32)
                    rCf.fill(0.0)
                    if t_stage < T:
                        rCt = cute.make_rmem_tensor((vec,), act)
                        cute.autovec_copy(cute.local_tile(mC[row, t_stage, group, None], (vec,), (lane,)), rCt)
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
            prefix = lane_scan(dt_j)  # inclusive prefix sums P_j across lanes
            cute.arch.sync_threads()

            # Dots (q, t) = B_q . C_t, 16 columns q per warp GEMM, weighted into sDot.
            for mt in cutlass.range_constexpr(cdiv(NQP // 16, W)):
                q_tile = (mt * W + warp) * 16
                if q_tile < NQP:
                    weighted_dots(sDot, sB, sC, q_tile, dt_j, prefix, A, origin, h, g4, c4, cap, T, NQ, NT, N, exact)
            cute.arch.sync_threads()

            # The ring and draft terms X Dots^T, then S_ckpt C^T once the tile has landed.
            rRing = cute.make_rmem_tensor(cute.make_layout((4, 1, NT)), Float32)
            rows_times_dots(rRing, rX, sDot, not exact)
            cute.arch.mbarrier_wait(mbar + warp, 0)
            # a low-precision read copy, or on a flush the recurrence checkpoint, decoded into the tile
            fill_work_tile(copies, sState, sEntry, sEntryScale, entry_state_scale, flush, mCheckpoint, tensors, slot64,
                           head, p_warp)
            rSC = cute.make_rmem_tensor(cute.make_layout((4, 1, NT)), Float32)
            rSC.fill(0.0)
            rows_times_columns(rSC, sState, warp, sC, N // 8, exact)

            for nt in cutlass.range_constexpr(NT):
                for i in cutlass.range_constexpr(4):
                    t = 8 * nt + 2 * c4 + i % 2
                    r = p_warp + g4 + 8 * (i // 2)
                    gamma_t = cute.math.exp(A * cute.arch.shuffle_sync(prefix, (h + t) % 32), fastmath=False)
                    if t < T:
                        x_t = rXo[i, nt]
                        y = gamma_t * rSC[i, 0, nt] + rRing[i, 0, nt]
                        if cutlass.const_expr(s.has_D):
                            y = y + D * x_t.to(Float32)
                        if cutlass.const_expr(s.has_z):
                            z = rZo[i, nt].to(Float32)
                            y = y * z / (Float32(1.0) + cute.math.exp(-z, fastmath=False))
                        mOut[row, t, head, r] = y.to(act)
                        mRingX[slot64, (origin + h + t) % cap, head, r] = x_t

            if flush:
                # Fold the h committed records as a GEMM over ring positions.
                rCoef = cute.make_rmem_tensor(cute.make_layout((4, KF)), Float32)
                gamma = fold_coefficients(rCoef, rX, dt_j, prefix, A, origin, h, c4, cap)
                fold_work_tile(copies, sState, rCoef, sB, gamma, fold_cols(N), exact, mCheckpoint, tensors, slot64,
                               head, p_warp, sAmax, sr_key)

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


def fake_inputs(shape: Mamba2Shape, num_drafts: int):
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

    state = fake_copy_tensors(shape.copies, slots, H, P)
    return dict(
        mCheckpoint=state.pop("mCheckpoint"),
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
        mPlan=compact(Int32, (batch, 4)),
        **state,
    )


def compile_verify(shape: Mamba2Shape, config: Mamba2Config, num_drafts: int, options: str):
    """Compile with `options`; launches on the caller's current CUDA stream (graph capturable)."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = fake_inputs(shape, num_drafts)
    return cute.compile(Mamba2Verify(shape, config, num_drafts), *args.values(), stream, options=options)
