"""Mamba-2 speculative verification on a persistent, warp-specialised pipeline (fp32 checkpoint).

The step of ``kernels/mamba2/verify.py`` (Algorithm 2: T drafts per row, outputs only, one
checkpoint read; the same GEMMs on tensor cores, TF32 hi / lo) with the residency of
``kernels/mamba2/pipelined.py``: a fixed grid of CTAs loops over work items, one per (batch row,
head), items ``bid, bid + grid, ...``. Warp 0 is the producer, the other warps consume in
``consumer_groups`` groups (headdim / 16 warps a group, a 16-row MMA tile each) that take turns
at the items, group g the CTA's items g, g + G, ...:

- the producer fills a ring of ``stages`` shared-memory stages (protocol: kernels/pipeline.py),
  each with everything an item needs: the head's (P, N) checkpoint as one padded 16-row TMA box
  per consumer warp (rows TILE_PAD columns apart: conflict-free fragment reads), the head's live
  ring records x and dt and the group's B (stale positions as zeros), the drafts' x, z, B, C
  (cp.async, 16 bytes a lane), the drafts' dt and the item's scalars (slot, h, origin; A, D,
  dt_bias). The item's slot, h and origin are loaded a chunk of items ahead;
- the consumers wait for a stage, decode the drafts' C into fp32 and form the group's
  record-by-draft products ``Dots (q, t) = w_{j,t} B_q . C_t`` (split over the warps, a named
  barrier between), then each its 16 rows: ``X Dots^T`` (the records' and drafts' x), ``S C^T``,
  the T outputs, the drafts' x records and, where h + T > L, the fold of the h committed records
  into the checkpoint; then release the stage.

The scratch a group's warps share (the drafts' fp32 C and the weighted Dots) is double-buffered
over the group's live items (a pad row's item has no barrier), so two named barriers (one a group)
per item order it: a warp that writes a buffer has met every other warp of its group at the
barrier after they last read it.

Units (``PipeVerifyConfig.heads_per_unit`` = U > 1, U dividing a group's heads): a consumer group
takes U consecutive items of one row in turn (``pipeline.unit_item``), which share the group's B
and the drafts' C. The unit's first item decodes C and forms the raw Dots ``B_q . C_t`` into the
group's unit scratch (one buffer: a group barrier at the unit's start waits for the last unit's
readers); each item weighs them with its own dts and decay element-wise
(``pipeline.weigh_unit_products`` with ``verify.weigh_dot``), so an item after the first skips the
decode, the Dots GEMM and two barriers. The producer loads the drafts' C for a unit's first item
only, and the group's B (ring and drafts) for it and where an item folds.

Tensor contract: as ``kernels/mamba2/verify.py`` (same arguments, same order), restricted to an
fp32 checkpoint without a read copy (``Mamba2PipelinedVerify.check``): the checkpoint scales, the
read copy and the SR seed are None.

| name        | shape              | dtype    | access | meaning                                     |
|-------------|--------------------|----------|--------|---------------------------------------------|
| checkpoint  | (S, H, P, N)       | fp32     | R / W on flush | S_ckpt                              |
| x, z        | (b, T, H, P)       | act      | R      | draft values, gates (z optional)            |
| dt          | (b, T, H)          | act/fp32 | R      | raw dt                                      |
| A, D, dt_bias | (H,)             | fp32     | R      | decay rate, skip (optional), dt bias (optional) |
| B, C        | (b, T, G, N)       | act      | R      |                                             |
| slot_ids    | (b,)               | int32    | R      | pad / out-of-range rows skip                |
| out         | (b, T, H, P)       | act      | W      | y of every draft (pad rows untouched)       |
| ring_x, ring_B, ring_dt | (S, cap, H, P) / (S, cap, G, N) / (S, cap, H) | act / act / fp32 | R / W | draft records written at (origin + h + t) % cap |
| plan        | (b, 4)             | int32    | R      | (slot, h, origin, sr_writes) before the step |

The kernel takes the drafts' tensors as a ``Mamba2Token`` and the records with the plan as a
``Mamba2Ring``.
"""

from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from ..common import (MMA_ROWS, TILE_PAD, after_previous_kernel, cdiv, fold_cols, fold_into_checkpoint, launch,
                      lane_scan, make_padded_row_tma, round_up, rows_times_columns, rows_times_dots, slot_is_live, slot_rows,
                      softplus)
from ..pipeline import (acquire_stage, as_column, consumer_place, copy_records_async, copy_rows_async,
                        default_verify_config, item_plan, item_plan_scalars, PipeVerifyConfig, publish_tile_boxes,
                        release_stage, rows_at, stage_barriers, stage_item_plan, stage_of, staged, stages_smem_bytes,
                        store_unit_products, unit_item, unit_lead, unit_scratch, unit_size, unit_uses,
                        verify_pipe_check, verify_space, wait_item, weigh_unit_products)
from .config import Mamba2Ring, Mamba2Shape, Mamba2Token
from .verify import fold_coefficients, raw_dots, weigh_dot, weighted_dots

META = 4  # scalars of an item staged by the producer (int32 / fp32 each)
META_A, META_D, META_DT_BIAS = 0, 1, 2  # its fp32 slots


@dataclass(frozen=True)
class Mamba2PipeVerifyDims:
    """What the kernel's methods derive from (shape, config, T), once; a plain dataclass, not a
    NamedTuple, which the DSL would take apart as a tree of values."""

    H: int  # heads
    P: int  # headdim
    N: int  # dstate
    G: int  # groups
    L: int  # window
    cap: int  # ring capacity
    T: int  # drafts
    TP: int  # drafts padded to the MMA's N (8)
    NQ: int  # dot columns: the ring positions, then the drafts
    NQP: int  # NQ padded to the dot GEMM's 16 rows
    ST: int  # stages
    PF: int  # the producer's chunk of items
    CW: int  # consumer warps of a group: a 16-row tile each
    CG: int  # consumer groups
    U: int  # heads a unit (1, or a divisor of a group's)
    W: int  # a padded state row (N + TILE_PAD)
    vec: int  # a lane's consecutive elements of a row (N / 32)
    heads_per_group: int
    act: type


def verify_dims(shape: Mamba2Shape, config: PipeVerifyConfig, num_drafts: int) -> Mamba2PipeVerifyDims:
    s, T = shape, num_drafts
    NQ = s.capacity + T
    return Mamba2PipeVerifyDims(
        H=s.nheads, P=s.headdim, N=s.dstate, G=s.ngroups, L=s.window, cap=s.capacity, T=T, TP=round_up(T, 8), NQ=NQ,
        NQP=round_up(NQ, 16), ST=config.stages, PF=config.prefetch, CW=s.headdim // MMA_ROWS, CG=config.consumer_groups,
        U=config.heads_per_unit, W=s.dstate + TILE_PAD, vec=s.dstate // 32, heads_per_group=s.nheads // s.ngroups, act=s.act_dtype)


class Mamba2PipeVerifySmem(NamedTuple):
    """The pipelined verify's shared memory (``Mamba2PipelinedVerify.shared_storage``). Per stage
    (the last mode): the head's padded state tiles (block ``stage * CW + cw`` is consumer warp
    cw's 16 rows), the keys (B at every ring position, then the drafts', zero rows after), the
    values (x likewise), the drafts' z and C, the ring's and the drafts' dt and the item's
    scalars; then each consumer group's double-buffered scratch (the drafts' fp32 C, the weighted
    Dots: buffers 2 g and 2 g + 1 are group g's) and, in units, its raw Dots (None otherwise); a
    full and an empty mbarrier per stage."""

    sState: cute.Tensor
    sKeys: cute.Tensor
    sValues: cute.Tensor
    sZ: Optional[cute.Tensor]
    sC: cute.Tensor
    sRingDt: cute.Tensor
    sDraftDt: cute.Tensor
    sMetaI: cute.Tensor
    sMetaF: cute.Tensor
    sCf: cute.Tensor
    sDot: cute.Tensor
    sRaw: Optional[cute.Tensor]
    full: cute.Pointer
    empty: cute.Pointer


class Mamba2PipelinedVerify:
    """One verify step of T drafts of a Mamba-2 layer over a pool of slots (module docstring)."""

    def __init__(self, shape: Mamba2Shape, config: PipeVerifyConfig, num_drafts: int):
        reason = self.check(shape, config, num_drafts)
        if reason is not None:
            raise ValueError(f"{config} (T={num_drafts}) invalid for {shape}: {reason}")
        self.shape, self.config, self.num_drafts = shape, config, num_drafts
        self.dims = verify_dims(shape, config, num_drafts)

    @staticmethod
    def stage_bytes(shape: Mamba2Shape, config: PipeVerifyConfig, num_drafts: int) -> int:
        """A stage: the padded state tiles, keys and values of every ring position and draft, the
        drafts' z and C, the dts and the item's scalars."""
        d = verify_dims(shape, config, num_drafts)
        act = d.act.width // 8
        z = d.T * d.P * act if shape.has_z else 0
        return (d.P * d.W * 4 + d.NQP * (d.N + 8) * act + d.NQP * d.P * act + z + d.T * d.N * act
                + (32 + d.TP) * 4 + 8 * META + 128)

    @staticmethod
    def smem_bytes(shape: Mamba2Shape, config: PipeVerifyConfig, num_drafts: int) -> int:
        """The stages, and each consumer group's scratch: the drafts' fp32 C (in two buffers, or one
        a unit with the unit's raw Dots) and the weighted Dots in two buffers."""
        d = verify_dims(shape, config, num_drafts)
        drafts, dots = d.TP * (d.N + 4) * 4, d.TP * (d.NQP + 4) * 4
        units = drafts + dots if d.U > 1 else 2 * drafts
        scratch = d.CG * (units + 2 * dots) + 64
        return stages_smem_bytes(config.stages, Mamba2PipelinedVerify.stage_bytes(shape, config, num_drafts)) + scratch

    @staticmethod
    def check(shape: Mamba2Shape, config: PipeVerifyConfig, num_drafts: int) -> Optional[str]:
        return verify_pipe_check(config, shape, num_drafts, shape.headdim, shape.dstate,
                                 Mamba2PipelinedVerify.smem_bytes(shape, config, num_drafts),
                                 sharing_heads(shape))

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
        # the state copies past the checkpoint are None (an fp32 checkpoint alone: config.check)
        s, c, d = self.shape, self.config, self.dims
        tma_atom, mRowsTma = make_padded_row_tma(slot_rows(mCheckpoint, d.H * d.P, d.N), MMA_ROWS, d.N)
        launch(self.kernel(
            tma_atom, mRowsTma, mCheckpoint, Mamba2Token(mX, mDt, mA, mB, mC, mD, mZ, mDtBias), mSlot, mOut,
            Mamba2Ring(mRingX, mRingB, mRingDt, mPlan),
        ), [c.ctas, 1, 1], [32 * (1 + d.CG * d.CW), 1, 1], stream, self.smem_bytes(s, c, self.num_drafts), c.min_ctas_per_sm)

    @cute.kernel
    def kernel(self, tma_atom: cute.CopyAtom, mRowsTma: cute.Tensor, mCheckpoint: cute.Tensor, token: Mamba2Token,
               mSlot: cute.Tensor, mOut: cute.Tensor, records: Mamba2Ring):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        total = token.mX.shape[0] * self.dims.H
        sm = self.shared_storage()
        after_previous_kernel()
        if warp == 0:
            self.produce(tma_atom, mRowsTma, mCheckpoint, token, mSlot, records, sm, bid, grid, lane, total)
        else:
            self.consume(mCheckpoint, mOut, records, sm, bid, grid, warp - 1, lane, total)

    @cute.jit
    def shared_storage(self) -> Mamba2PipeVerifySmem:
        """The kernel's shared memory (``Mamba2PipeVerifySmem``), its mbarriers initialised."""
        s, d = self.shape, self.dims
        P, N, T, TP, NQP, ST, CW, W, act = d.P, d.N, d.T, d.TP, d.NQP, d.ST, d.CW, d.W, d.act
        smem = SmemAllocator()
        sState = smem.allocate_tensor(Float32, cute.make_layout((MMA_ROWS, W, CW * ST), stride=(W, 1, MMA_ROWS * W)),
                                      byte_alignment=128)
        # key rows 8 apart in banks (the Dots GEMM's A fragments read 8 rows of one column)
        sKeys = staged(smem, act, (NQP, N), ST, row_pad=8)
        sValues = staged(smem, act, (NQP, P), ST)
        sZ = staged(smem, act, (T, P), ST) if s.has_z else None
        sC = staged(smem, act, (T, N), ST)
        sRingDt = staged(smem, Float32, (32,), ST)
        sDraftDt = staged(smem, Float32, (TP,), ST)
        sMetaI = staged(smem, Int32, (META,), ST)
        sMetaF = staged(smem, Float32, (META,), ST)
        sCf = staged(smem, Float32, (TP, N), d.CG if d.U > 1 else 2 * d.CG, row_pad=4)
        sDot = staged(smem, Float32, (TP, NQP), 2 * d.CG, row_pad=4)
        sRaw = staged(smem, Float32, (TP, NQP), d.CG, row_pad=4) if d.U > 1 else None
        full, empty = stage_barriers(smem, ST, CW)
        return Mamba2PipeVerifySmem(sState, sKeys, sValues, sZ, sC, sRingDt, sDraftDt, sMetaI, sMetaF, sCf, sDot,
                                    sRaw, full, empty)

    @cute.jit
    def produce(self, tma_atom: cute.CopyAtom, mRowsTma: cute.Tensor, mCheckpoint: cute.Tensor, token: Mamba2Token,
                mSlot: cute.Tensor, records: Mamba2Ring, sm: Mamba2PipeVerifySmem, bid: Int32, grid: Int32,
                lane: Int32, total: Int32):
        """Warp 0: fill the stages with the CTA's items bid, bid + grid, ... (module docstring)."""
        s, d = self.shape, self.dims
        H, P, N, cap, T, NQ, NQP, ST, PF, CW, W, act = (d.H, d.P, d.N, d.cap, d.T, d.NQ, d.NQP, d.ST, d.PF, d.CW,
                                                          d.W, d.act)
        mX, mDt, mA, mB, mC, mD, mZ, mDtBias = token
        mRingX, mRingB, mRingDt, mPlan = records
        per16 = 128 // act.width  # act elements per 16-byte cp.async
        box_bytes = MMA_ROWS * W * 4
        num_slots = mCheckpoint.shape[0]
        g_boxes = cute.local_tile(mRowsTma, (MMA_ROWS, W), (None, 0))
        t_s, t_g = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sm.sState, 0, 2),
                                         cute.group_modes(g_boxes, 0, 2))
        # the keys' and values' rows past the drafts stay zero (published with each stage's first use)
        for st in cutlass.range_constexpr(ST):
            for r in cutlass.range_constexpr(NQ, NQP):
                for v in cutlass.range_constexpr(N // 32):
                    sm.sKeys[r, lane * (N // 32) + v, st] = act(0.0)
                for v in cutlass.range_constexpr(cdiv(P, 32)):
                    if lane + 32 * v < P:
                        sm.sValues[r, lane + 32 * v, st] = act(0.0)
        copy16 = cute.make_copy_atom(cpasync.CopyG2SOp(), act, num_bits_per_copy=128)
        copy4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        # Lane u < PF holds (slot, h, origin) of the chunk's item u; the next chunk's load while
        # this one is issued, so their latency is paid once per chunk.
        rInt = cute.make_rmem_tensor((3,), Int32)
        rIntNext = cute.make_rmem_tensor((3,), Int32)
        item_plan_scalars(unit_item(bid, grid, lane % PF, d.U, d.CG), total, H, mSlot, mPlan, rInt)
        for first in cutlass.range(0, unit_uses(bid, grid, total, d.U, d.CG), PF, unroll=1):
            item_plan_scalars(unit_item(bid, grid, first + PF + lane % PF, d.U, d.CG), total, H, mSlot, mPlan,
                              rIntNext)
            for u in cutlass.range_constexpr(PF):
                item = unit_item(bid, grid, first + u, d.U, d.CG)
                if item < total:
                    row = item // H
                    head = item % H
                    group = head // d.heads_per_group
                    stage, phase = stage_of(first + u, ST)
                    lead = unit_lead(item, d.U)  # the unit's first item: its Dots need the group's B and C
                    slot = cute.arch.shuffle_sync(rInt[0], u)
                    h = cute.arch.shuffle_sync(rInt[1], u)
                    origin = cute.arch.shuffle_sync(rInt[2], u)
                    live = slot_is_live(slot, num_slots, s.pad_slot_id)
                    acquire_stage(sm.empty, stage, phase)
                    if live:
                        slot64 = Int64(slot)
                        sKeys = sm.sKeys[None, None, stage]
                        sValues = sm.sValues[None, None, stage]
                        # the live records (stale positions as zeros), then the drafts'
                        copy_records_async(copy16, mRingX[slot64, None, head, None], rows_at(sValues, 0, cap), per16,
                                           origin, h)
                        copy_rows_async(copy16, mX[row, None, head, None], rows_at(sValues, cap, T), per16)
                        # the group's B where the item forms the Dots or folds (the fold's last k-step
                        # reaches the drafts' rows, weighted by zeros: they must be finite), its C where
                        # the item forms the Dots
                        if lead or h + T > d.L:
                            copy_records_async(copy16, mRingB[slot64, None, group, None], rows_at(sKeys, 0, cap),
                                               per16, origin, h)
                            copy_rows_async(copy16, mB[row, None, group, None], rows_at(sKeys, cap, T), per16)
                        if lead:
                            copy_rows_async(copy16, mC[row, None, group, None], sm.sC[None, None, stage], per16)
                        if cutlass.const_expr(s.has_z):
                            copy_rows_async(copy16, mZ[row, None, head, None], sm.sZ[None, None, stage], per16)
                        sRingDt = cute.make_tensor(sm.sRingDt[None, stage].iterator, cute.make_layout((cap,)))
                        copy_records_async(copy4, as_column(mRingDt[slot64, None, head]), as_column(sRingDt), 1,
                                           origin, h)
                        if lane < T:
                            sm.sDraftDt[lane, stage] = mDt[row, lane, head].to(Float32)
                        if lane == 0:
                            sm.sMetaF[META_A, stage] = mA[head].to(Float32)
                            if cutlass.const_expr(s.has_D):
                                sm.sMetaF[META_D, stage] = mD[head].to(Float32)
                            if cutlass.const_expr(s.has_dt_bias):
                                sm.sMetaF[META_DT_BIAS, stage] = mDtBias[head].to(Float32)
                    if lane == 0:
                        stage_item_plan(sm.sMetaI, stage, slot, h, origin)
                    box0 = Int32((Int64(slot) * (H * P) + head * P) // MMA_ROWS)
                    publish_tile_boxes(sm.full, stage, live, CW, box_bytes, tma_atom, t_g, box0, t_s)
            rInt.store(rIntNext.load())

    @cute.jit
    def consume(self, mCheckpoint: cute.Tensor, mOut: cute.Tensor, records: Mamba2Ring, sm: Mamba2PipeVerifySmem,
                bid: Int32, grid: Int32, consumer: Int32, lane: Int32, total: Int32):
        """Consumer warp number ``consumer``: warp ``cw`` (rows 16 cw ..) of group ``cg``; the
        group's items of the CTA, each from its stage (module docstring), then the stage released."""
        s, d = self.shape, self.dims
        H, N, L, cap, T, TP, NQ, NQP, ST, CW, vec, act = (d.H, d.N, d.L, d.cap, d.T, d.TP, d.NQ, d.NQP, d.ST, d.CW,
                                                            d.vec, d.act)
        mRingX, mRingB, mRingDt, _ = records
        NT = TP // 8  # n-tiles of drafts
        KQ = NQP // 8  # k-steps over the dot columns
        KF = cdiv(cap, 8)  # k-steps of the fold (ring positions only)
        exact = act.width < 32  # bf16 / fp16 values are exact in TF32
        num_slots = mCheckpoint.shape[0]
        g4 = lane // 4  # fragment row group
        c4 = lane % 4  # fragment column in the group
        CG = d.CG
        cg, cw, group_barrier = consumer_place(consumer, CW, CG)
        p_warp = cw * MMA_ROWS
        live_items = Int32(0)  # the group's scratch buffer alternates over its live items, which meet at the barriers
        for n in cutlass.range(cg, unit_uses(bid, grid, total, d.U, CG), CG, unroll=1):
            item = unit_item(bid, grid, n, d.U, CG)
            if item < total:
                row = item // H
                head = item % H
                group = head // d.heads_per_group
                stage, phase = stage_of(n, ST)
                slot = wait_item(sm.full, sm.sMetaI, stage, phase)
                if slot_is_live(slot, num_slots, s.pad_slot_id):
                    slot64 = Int64(slot)
                    h, origin = item_plan(sm.sMetaI, stage)
                    flush = h + T > L
                    sKeys = sm.sKeys[None, None, stage]
                    sValues = sm.sValues[None, None, stage]
                    # the unit's first item decodes the drafts' C and forms the raw Dots
                    buf, lead, draft_buf = unit_scratch(item, d.U, cg, live_items, group_barrier, 32 * CW)
                    sDot = sm.sDot[None, None, buf]
                    sCf = sm.sCf[None, None, draft_buf]
                    if lead:
                        # The drafts' C in fp32 (rows from T on zero), a row a warp in turn.
                        for tt in cutlass.range_constexpr(cdiv(TP, CW)):
                            t_row = tt * CW + cw
                            if t_row < TP:
                                rCf = cute.make_rmem_tensor((vec,), Float32)
                                rCf.fill(0.0)
                                if t_row < T:
                                    rCt = cute.make_rmem_tensor((vec,), act)
                                    cute.autovec_copy(cute.local_tile(sm.sC[t_row, None, stage], (vec,), (lane,)), rCt)
                                    rCf.store(rCt.load().to(Float32))
                                cute.autovec_copy(rCf, cute.local_tile(sCf[t_row, None], (vec,), (lane,)))
                        if cutlass.const_expr(d.U > 1):
                            # the unit's raw Dots B_q . C_t: 16 columns q a warp GEMM
                            cute.arch.barrier(barrier_id=group_barrier, number_of_threads=32 * CW)
                            for mt in cutlass.range_constexpr(cdiv(NQP // 16, CW)):
                                q_tile = (mt * CW + cw) * 16
                                if q_tile < NQP:
                                    rDot = cute.make_rmem_tensor(cute.make_layout((4, 1, NT)), Float32)
                                    raw_dots(rDot, sKeys, sCf, q_tile, g4, c4, NT, N, exact)
                                    store_unit_products(sm.sRaw[None, None, cg], rDot, q_tile, g4, c4)

                    # Lane j: dt of record j in logical order (committed j < h, draft t at lane h + t),
                    # and the inclusive prefix sums P_j.
                    A = sm.sMetaF[META_A, stage]
                    dt_rec = sm.sRingDt[(origin + lane) % cap, stage]
                    dt_j = Float32(0.0)
                    if lane < h:
                        dt_j = dt_rec
                    if lane >= h and lane < h + T:
                        dt_j = sm.sDraftDt[lane - h, stage]
                        if cutlass.const_expr(s.has_dt_bias):
                            dt_j = dt_j + sm.sMetaF[META_DT_BIAS, stage]
                        if cutlass.const_expr(s.dt_softplus):
                            dt_j = softplus(dt_j)
                    prefix = lane_scan(dt_j)
                    if cutlass.const_expr(d.U > 1):
                        # the head's weights on the unit's raw Dots, element-wise
                        if lead:
                            cute.arch.barrier(barrier_id=group_barrier, number_of_threads=32 * CW)
                        weigh_unit_products(sDot, sm.sRaw[None, None, cg], cw * 32 + lane, 32 * CW, weigh_dot,
                                            (dt_j, prefix, A, origin, h, cap, T, NQ))
                    else:
                        cute.arch.barrier(barrier_id=group_barrier, number_of_threads=32 * CW)
                        # Dots (q, t) = B_q . C_t, 16 columns q a warp GEMM, weighted into sDot.
                        for mt in cutlass.range_constexpr(cdiv(NQP // 16, CW)):
                            q_tile = (mt * CW + cw) * 16
                            if q_tile < NQP:
                                weighted_dots(sDot, sKeys, sCf, q_tile, dt_j, prefix, A, origin, h, g4, c4, cap, T, NQ, NT,
                                              N, exact)
                    cute.arch.barrier(barrier_id=group_barrier, number_of_threads=32 * CW)

                    # X fragments: the warp's rows' x at every ring position (zero where stale) and
                    # draft, zero beyond; then the ring and draft terms X Dots^T.
                    rX = cute.make_rmem_tensor(cute.make_layout((4, KQ)), Float32)
                    for kq in cutlass.range_constexpr(KQ):
                        for i in cutlass.range_constexpr(4):
                            rX[i, kq] = sValues[8 * kq + c4 + 4 * (i // 2), p_warp + g4 + 8 * (i % 2)].to(Float32)
                    rRing = cute.make_rmem_tensor(cute.make_layout((4, 1, NT)), Float32)
                    rows_times_dots(rRing, rX, sDot, not exact)
                    # S_ckpt C^T from the stage's tile
                    rSC = cute.make_rmem_tensor(cute.make_layout((4, 1, NT)), Float32)
                    rSC.fill(0.0)
                    rows_times_columns(rSC, sm.sState, stage * CW + cw, sCf, N // 8, exact)

                    D = Float32(0.0)
                    if cutlass.const_expr(s.has_D):
                        D = sm.sMetaF[META_D, stage]
                    for nt in cutlass.range_constexpr(NT):
                        for i in cutlass.range_constexpr(4):
                            t = 8 * nt + 2 * c4 + i % 2
                            r = p_warp + g4 + 8 * (i // 2)
                            gamma_t = cute.math.exp(A * cute.arch.shuffle_sync(prefix, (h + t) % 32), fastmath=False)
                            if t < T:
                                x_t = sValues[cap + t, r]
                                y = gamma_t * rSC[i, 0, nt] + rRing[i, 0, nt]
                                if cutlass.const_expr(s.has_D):
                                    y = y + D * x_t.to(Float32)
                                if cutlass.const_expr(s.has_z):
                                    z = sm.sZ[t, r, stage].to(Float32)
                                    y = y * z / (Float32(1.0) + cute.math.exp(-z, fastmath=False))
                                mOut[row, t, head, r] = y.to(act)
                                mRingX[slot64, (origin + h + t) % cap, head, r] = x_t

                    if flush:
                        # Fold the h committed records as a GEMM over ring positions.
                        rCoef = cute.make_rmem_tensor(cute.make_layout((4, KF)), Float32)
                        gamma = fold_coefficients(rCoef, rX, dt_j, prefix, A, origin, h, c4, cap)
                        fold_into_checkpoint(cute.local_tile(mCheckpoint[slot64, head, None, None], (MMA_ROWS, N), (cw, 0)),
                                             sm.sState, stage * CW + cw, rCoef, sKeys, gamma, fold_cols(N), exact)

                    # The drafts' B (once per group) and dt records.
                    if cw == 0:
                        if head % d.heads_per_group == 0:
                            for t in cutlass.range_constexpr(T):
                                rBt = cute.make_rmem_tensor((vec,), act)
                                cute.autovec_copy(cute.local_tile(sKeys[cap + t, None], (vec,), (lane,)), rBt)
                                cute.autovec_copy(rBt, cute.local_tile(
                                    mRingB[slot64, (origin + h + t) % cap, group, None], (vec,), (lane,)))
                        if lane >= h and lane < h + T:
                            mRingDt[slot64, (origin + lane) % cap, head] = dt_j
                    live_items = live_items + 1
                release_stage(sm.empty, stage)


def compile_pipelined_verify(shape: Mamba2Shape, config: PipeVerifyConfig, num_drafts: int, options: str):
    """Compile with `options` from the verify kernel's fake tensors (same arguments); launches on
    the caller's current CUDA stream (graph capturable)."""
    from .verify import fake_inputs

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = fake_inputs(shape, num_drafts)
    return cute.compile(Mamba2PipelinedVerify(shape, config, num_drafts), *args.values(), stream, options=options)


def pipelined_verify_config(shape: Mamba2Shape, sm_count: int, arch: str, bucket: int = 1) -> Optional[PipeVerifyConfig]:
    """The default launch config at batch bucket ``bucket`` (``pipeline.default_verify_config``),
    None where the kernel cannot take the shape."""
    return default_verify_config(shape, Mamba2PipelinedVerify.check, sm_count, arch, bucket, shape.nheads,
                                 unit_size(sharing_heads(shape)))


def pipelined_verify_space(shape: Mamba2Shape, sm_count: int, arch: str) -> List[PipeVerifyConfig]:
    """The configs the tuner times (``pipeline.verify_space``)."""
    return verify_space(shape, Mamba2PipelinedVerify.check, sm_count, arch, unit_size(sharing_heads(shape)))


def sharing_heads(shape: Mamba2Shape) -> int:
    """Heads that share their products (the heads of a group): a unit's heads divide them."""
    return shape.nheads // shape.ngroups