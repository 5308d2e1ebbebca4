"""Gated DeltaNet speculative verification on a persistent, warp-specialised pipeline (fp32 checkpoint).

The step of ``kernels/gdn/verify.py`` (Algorithm 5: T drafts per row, outputs only, one checkpoint
read; the key products and GEMMs on tensor cores, TF32 hi / lo; the T x T forward substitution per
row on CUDA cores) with the residency of ``kernels/gdn/pipelined.py``: a fixed grid of CTAs loops
over work items, one per (batch row, value head), items ``bid, bid + grid, ...``. Warp 0 is the
producer, the other warps consume in ``consumer_groups`` groups (head_v_dim / 16 warps a group, a
16-row MMA tile each) that take turns at the items, group g the CTA's items g, g + G, ...:

- the producer fills a ring of ``stages`` shared-memory stages (protocol: kernels/pipeline.py),
  each with everything an item needs: the head's (V, K) checkpoint as one padded 16-row TMA box per
  consumer warp, the live ring records (the key head's k, the head's u and g; stale positions as
  zeros) by cp.async, the drafts' raw q, k (of the key head), v and gates by plain loads (q, k and v
  may be views into a packed ``mixed_qkv`` at any batch stride) and the item's scalars (slot, h,
  origin; A_log, dt_bias). The item's slot, h and origin are loaded a chunk of items ahead;
- the consumers wait for a stage, L2-normalise the drafts' k and q (a draft a warp in turn) and
  form the weighted key products ``W_{j,s} (k_col . x_s)`` for x in {k, q} (split over the warps,
  named barriers between), then each its 16 rows: ``U Dots^T`` (the committed corrections),
  ``S [k; q]^T``, the drafts' corrections by forward substitution and their outputs, the draft
  records and, where h + T > L, the fold of the h committed records into the checkpoint; then
  release the stage.

The scratch a group's warps share (the normalised drafts, the weighted products) is double-buffered
over the group's live items, as in ``kernels/mamba2/pipelined_verify.py``.

Units (``PipeVerifyConfig.heads_per_unit`` = U > 1, U dividing a key head's value heads): a group
takes U consecutive items of one row in turn (``pipeline.unit_item``), which share the key head's
drafts and keys. The unit's first item normalises the drafts and forms the raw key products
``k_col . x_s`` into the group's unit scratch (one buffer: a group barrier at the unit's start
waits for the last unit's readers); each item weighs them with its own decays element-wise
(``pipeline.weigh_unit_products`` with ``verify.weigh_key_product``) into its double-buffered
products, so an item after the first skips the normalisation, the key GEMM and two barriers. The producer loads the drafts' q and k for a
unit's first item only, and the ring keys only where the item forms the products or folds.

Tensor contract: as ``kernels/gdn/verify.py`` (same arguments, same order), restricted to an fp32
checkpoint without a read copy and without re-derivation (``GDNPipelinedVerify.check``): the
checkpoint scales, the read copy and the SR seed are None.

| name        | shape              | dtype | access | meaning                                      |
|-------------|--------------------|-------|--------|----------------------------------------------|
| checkpoint  | (S, HV, V, K)      | fp32  | R / W on flush | S_ckpt                               |
| q, k        | (b, T, H, K)       | act   | R      | raw; any row stride                          |
| v           | (b, T, HV, V)      | act   | R      |                                              |
| a, b        | (b, T, HV)         | gate  | R      | raw gates                                    |
| A_log, dt_bias | (HV,)           | param | R      |                                              |
| slot_ids    | (b,)               | int32 | R      | pad / out-of-range rows skip                 |
| out         | (b, T, HV, V)      | act   | W      | o of every draft (pad rows untouched)        |
| ring_u, ring_k, ring_g (ring_v, ring_beta) | as decode | | R / W | drafts written at (origin + h + s) % cap |
| plan        | (b, 4)             | int32 | R      | (slot, h, origin, sr_writes) before the step |

The kernel takes the drafts' tensors as a ``GDNToken`` and the records with the plan as a ``GDNRing``.
"""

from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from ..common import (MMA_ROWS, TILE_PAD, after_previous_kernel, cdiv, fold_cols, fold_into_checkpoint, lane_scan,
                      launch, make_padded_row_tma, round_up, rows_times_columns, rows_times_dots, slot_is_live,
                      slot_rows)
from ..pipeline import (acquire_stage, as_column, consumer_place, copy_records_async, default_verify_config, item_plan,
                        item_plan_scalars, PipeVerifyConfig, publish_tile_boxes, release_stage, rows_at,
                        stage_barriers, stage_item_plan, stage_of, staged, stages_smem_bytes, store_unit_products,
                        unit_item, unit_lead, unit_scratch, unit_size, unit_uses, verify_pipe_check, verify_space,
                        wait_item, weigh_unit_products)
from .common import gdn_gates, normalize_qk
from .config import GDNRing, GDNShape, GDNToken
from .verify import fold_coefficients, key_products, store_draft_records, weigh_key_product, weighted_key_products

META = 4  # scalars of an item staged by the producer (int32 / fp32 each)
META_A_LOG, META_DT_BIAS = 0, 1  # its fp32 slots


@dataclass(frozen=True)
class GDNPipeVerifyDims:
    """What the kernel's methods derive from (shape, config, T), once; a plain dataclass, not a
    NamedTuple, which the DSL would take apart as a tree of values."""

    HV: int  # value heads
    V: int  # head_v_dim: a head's state rows
    K: int  # head_k_dim: a row's columns
    rep: int  # value heads a key head
    L: int  # window
    cap: int  # ring capacity
    T: int  # drafts
    TP: int  # drafts padded to the MMA's N (8)
    NQ: int  # key columns: the ring positions, then the drafts
    NQP: int  # NQ padded to the dot GEMM's 16 rows
    KF: int  # k-steps over the ring positions
    ST: int  # stages
    PF: int  # the producer's chunk of items
    CW: int  # consumer warps of a group: a 16-row tile each
    CG: int  # consumer groups
    U: int  # value heads a unit (1, or a key head's)
    W: int  # a padded state row (K + TILE_PAD)
    vec: int  # a lane's consecutive elements of a K row
    act: type


def verify_dims(shape: GDNShape, config: PipeVerifyConfig, num_drafts: int) -> GDNPipeVerifyDims:
    s, T = shape, num_drafts
    return GDNPipeVerifyDims(
        HV=s.num_v_heads, V=s.head_v_dim, K=s.head_k_dim, rep=s.num_v_heads // s.num_k_heads, L=s.window,
        cap=s.capacity, T=T, TP=round_up(T, 8), NQ=s.capacity + T, NQP=round_up(s.capacity + T, 16),
        KF=cdiv(s.capacity, 8), ST=config.stages, PF=config.prefetch, CW=s.head_v_dim // MMA_ROWS, CG=config.consumer_groups,
        U=config.heads_per_unit, W=s.head_k_dim + TILE_PAD, vec=s.k_vec, act=s.act_dtype)


class GDNPipeVerifySmem(NamedTuple):
    """The pipelined verify's shared memory (``GDNPipelinedVerify.shared_storage``). Per stage (the
    last mode): the head's padded state tiles (block ``stage * CW + cw`` is consumer warp cw's 16
    rows), the ring keys (zero rows to the fold's last k-step), the drafts' raw k, q and v, the
    ring's corrections u and decays g, the drafts' raw gates and the item's scalars; then each
    consumer group's double-buffered scratch (the normalised drafts, the weighted key products:
    buffers 2 g and 2 g + 1 are group g's; in units, its raw key products, None otherwise) and each
    consumer warp's rows' pre-substitution terms;
    a full and an empty mbarrier per stage."""

    sState: cute.Tensor
    sKeys: cute.Tensor
    sDraftK: cute.Tensor
    sDraftQ: cute.Tensor
    sV: cute.Tensor
    sRingU: cute.Tensor
    sRingG: cute.Tensor
    sGates: cute.Tensor
    sMetaI: cute.Tensor
    sMetaF: cute.Tensor
    sDraft: cute.Tensor
    sDot: cute.Tensor
    sRaw: Optional[cute.Tensor]
    sPre: cute.Tensor
    full: cute.Pointer
    empty: cute.Pointer


class GDNPipelinedVerify:
    """One verify step of T drafts of a GDN layer over a pool of slots (module docstring)."""

    def __init__(self, shape: GDNShape, config: PipeVerifyConfig, num_drafts: int):
        reason = self.check(shape, config, num_drafts)
        if reason is not None:
            raise ValueError(f"{config} (T={num_drafts}) invalid for {shape}: {reason}")
        self.shape, self.config, self.num_drafts = shape, config, num_drafts
        self.dims = verify_dims(shape, config, num_drafts)

    @staticmethod
    def stage_bytes(shape: GDNShape, config: PipeVerifyConfig, num_drafts: int) -> int:
        """A stage: the padded state tiles, the ring keys, the drafts' k, q and v, the ring's u and
        g, the drafts' gates and the item's scalars."""
        d = verify_dims(shape, config, num_drafts)
        act = d.act.width // 8
        return (d.V * d.W * 4 + 8 * d.KF * (d.K + 8) * act + 2 * d.T * d.K * act + d.T * d.V * act
                + d.cap * d.V * 2 + (32 + 2 * d.TP) * 4 + 8 * META + 128)

    @staticmethod
    def smem_bytes(shape: GDNShape, config: PipeVerifyConfig, num_drafts: int) -> int:
        """The stages; each consumer group's scratch (the normalised drafts, in two buffers or one
        a unit with the unit's raw products; the weighted products in two buffers) and each
        consumer warp's pre-substitution terms."""
        d = verify_dims(shape, config, num_drafts)
        drafts, dots = 2 * d.TP * (d.K + 4) * 4, 2 * d.TP * (d.NQP + 4) * 4
        units = drafts + dots if d.U > 1 else 2 * drafts  # a unit's drafts and raw products, or per item
        scratch = d.CG * (units + 2 * dots + d.CW * MMA_ROWS * (2 * d.TP + 1) * 4)
        return stages_smem_bytes(config.stages, GDNPipelinedVerify.stage_bytes(shape, config, num_drafts)) + scratch + 64

    @staticmethod
    def check(shape: GDNShape, config: PipeVerifyConfig, num_drafts: int) -> Optional[str]:
        if shape.rederive:
            return "the pipelined verify does not re-derive corrections (a read-copy cache's flush)"
        return verify_pipe_check(config, shape, num_drafts, shape.head_v_dim, shape.head_k_dim,
                                 GDNPipelinedVerify.smem_bytes(shape, config, num_drafts),
                                 sharing_heads(shape))

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
        # the state copies past the checkpoint are None (an fp32 checkpoint alone: check)
        s, c, d = self.shape, self.config, self.dims
        tma_atom, mRowsTma = make_padded_row_tma(slot_rows(mCheckpoint, d.HV * d.V, d.K), MMA_ROWS, d.K)
        launch(self.kernel(
            tma_atom, mRowsTma, mCheckpoint, GDNToken(mQ, mK, mV, mA, mB, mALog, mDtBias), mSlot, mOut,
            GDNRing(mRingU, mRingK, mRingG, mRingV, mRingBeta, mPlan),
        ), [c.ctas, 1, 1], [32 * (1 + d.CG * d.CW), 1, 1], stream, self.smem_bytes(s, c, self.num_drafts), c.min_ctas_per_sm)

    @cute.kernel
    def kernel(self, tma_atom: cute.CopyAtom, mRowsTma: cute.Tensor, mCheckpoint: cute.Tensor, token: GDNToken,
               mSlot: cute.Tensor, mOut: cute.Tensor, records: GDNRing):
        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        total = token.mV.shape[0] * self.dims.HV
        sm = self.shared_storage()
        after_previous_kernel()
        if warp == 0:
            self.produce(tma_atom, mRowsTma, mCheckpoint, token, mSlot, records, sm, bid, grid, lane, total)
        else:
            self.consume(mCheckpoint, mOut, records, sm, bid, grid, warp - 1, lane, total)

    @cute.jit
    def shared_storage(self) -> GDNPipeVerifySmem:
        """The kernel's shared memory (``GDNPipeVerifySmem``), its mbarriers initialised."""
        d = self.dims
        V, K, T, TP, NQP, KF, cap, ST, CW, W, act = d.V, d.K, d.T, d.TP, d.NQP, d.KF, d.cap, d.ST, d.CW, d.W, d.act
        smem = SmemAllocator()
        sState = smem.allocate_tensor(Float32, cute.make_layout((MMA_ROWS, W, CW * ST), stride=(W, 1, MMA_ROWS * W)),
                                      byte_alignment=128)
        # key rows 8 apart in banks (the key GEMM's A fragments read 8 rows of one column)
        sKeys = staged(smem, act, (8 * KF, K), ST, row_pad=8)
        sDraftK = staged(smem, act, (T, K), ST)
        sDraftQ = staged(smem, act, (T, K), ST)
        sV = staged(smem, act, (T, V), ST)
        sRingU = staged(smem, cutlass.Float16, (cap, V), ST)
        sRingG = staged(smem, Float32, (32,), ST)
        sGates = staged(smem, Float32, (2, TP), ST)
        sMetaI = staged(smem, Int32, (META,), ST)
        sMetaF = staged(smem, Float32, (META,), ST)
        sDraft = staged(smem, Float32, (2 * TP, K), d.CG if d.U > 1 else 2 * d.CG, row_pad=4)
        sDot = staged(smem, Float32, (2 * TP, NQP), 2 * d.CG, row_pad=4)
        sRaw = staged(smem, Float32, (2 * TP, NQP), d.CG, row_pad=4) if d.U > 1 else None
        sPre = smem.allocate_tensor(Float32, cute.make_layout(
            (MMA_ROWS, 2 * TP, d.CG * CW), stride=(2 * TP + 1, 1, MMA_ROWS * (2 * TP + 1))), byte_alignment=16)
        full, empty = stage_barriers(smem, ST, CW)
        return GDNPipeVerifySmem(sState, sKeys, sDraftK, sDraftQ, sV, sRingU, sRingG, sGates, sMetaI, sMetaF, sDraft,
                                 sDot, sRaw, sPre, full, empty)

    @cute.jit
    def produce(self, tma_atom: cute.CopyAtom, mRowsTma: cute.Tensor, mCheckpoint: cute.Tensor, token: GDNToken,
                mSlot: cute.Tensor, records: GDNRing, sm: GDNPipeVerifySmem, bid: Int32, grid: Int32, lane: Int32,
                total: Int32):
        """Warp 0: fill the stages with the CTA's items bid, bid + grid, ... (module docstring)."""
        s, d = self.shape, self.dims
        HV, V, K, rep, cap, T, KF, ST, PF, CW, W, act = (d.HV, d.V, d.K, d.rep, d.cap, d.T, d.KF, d.ST, d.PF, d.CW,
                                                          d.W, d.act)
        mQ, mK, mV, mA, mB, mALog, mDtBias = token
        mRingU, mRingK, mRingG, _, _, mPlan = records
        per16 = 128 // act.width  # act elements per 16-byte cp.async
        box_bytes = MMA_ROWS * W * 4
        num_slots = mCheckpoint.shape[0]
        g_boxes = cute.local_tile(mRowsTma, (MMA_ROWS, W), (None, 0))
        t_s, t_g = cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sm.sState, 0, 2),
                                         cute.group_modes(g_boxes, 0, 2))
        # the key rows past the ring stay zero (published with each stage's first use)
        for st in cutlass.range_constexpr(ST):
            for r in cutlass.range_constexpr(cap, 8 * KF):
                for v in cutlass.range_constexpr(K // 32):
                    sm.sKeys[r, lane * (K // 32) + v, st] = act(0.0)
        copy_key = cute.make_copy_atom(cpasync.CopyG2SOp(), act, num_bits_per_copy=128)
        copy_u = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Float16, num_bits_per_copy=128)
        copy4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        rInt = cute.make_rmem_tensor((3,), Int32)
        rIntNext = cute.make_rmem_tensor((3,), Int32)
        item_plan_scalars(unit_item(bid, grid, lane % PF, d.U, d.CG), total, HV, mSlot, mPlan, rInt)
        for first in cutlass.range(0, unit_uses(bid, grid, total, d.U, d.CG), PF, unroll=1):
            item_plan_scalars(unit_item(bid, grid, first + PF + lane % PF, d.U, d.CG), total, HV, mSlot, mPlan,
                              rIntNext)
            for u in cutlass.range_constexpr(PF):
                item = unit_item(bid, grid, first + u, d.U, d.CG)
                if item < total:
                    row = item // HV
                    vhead = item % HV
                    khead = vhead // rep
                    stage, phase = stage_of(first + u, ST)
                    lead = unit_lead(item, d.U)  # the unit's first item: its products need the keys and drafts
                    slot = cute.arch.shuffle_sync(rInt[0], u)
                    h = cute.arch.shuffle_sync(rInt[1], u)
                    origin = cute.arch.shuffle_sync(rInt[2], u)
                    live = slot_is_live(slot, num_slots, s.pad_slot_id)
                    acquire_stage(sm.empty, stage, phase)
                    if live:
                        slot64 = Int64(slot)
                        # the live records (stale positions as zeros); keys for the products or a fold
                        if lead or h + T > d.L:
                            copy_records_async(copy_key, mRingK[slot64, None, khead, None],
                                               rows_at(sm.sKeys[None, None, stage], 0, cap), per16, origin, h)
                        copy_records_async(copy_u, mRingU[slot64, None, vhead, None], sm.sRingU[None, None, stage], 8,
                                           origin, h)
                        sRingG = cute.make_tensor(sm.sRingG[None, stage].iterator, cute.make_layout((cap,)))
                        copy_records_async(copy4, as_column(mRingG[slot64, None, vhead]), as_column(sRingG), 1,
                                           origin, h)
                        # the drafts' raw k, q, v and gates, plain loads (any batch stride)
                        if lead:
                            for e in cutlass.range_constexpr(cdiv(T * K, 32)):
                                i = e * 32 + lane
                                if i < T * K:
                                    sm.sDraftK[i // K, i % K, stage] = mK[row, i // K, khead, i % K]
                                    sm.sDraftQ[i // K, i % K, stage] = mQ[row, i // K, khead, i % K]
                        for e in cutlass.range_constexpr(cdiv(T * V, 32)):
                            i = e * 32 + lane
                            if i < T * V:
                                sm.sV[i // V, i % V, stage] = mV[row, i // V, vhead, i % V]
                        if lane < T:
                            sm.sGates[0, lane, stage] = mA[row, lane, vhead].to(Float32)
                            sm.sGates[1, lane, stage] = mB[row, lane, vhead].to(Float32)
                        if lane == 0:
                            sm.sMetaF[META_A_LOG, stage] = mALog[vhead].to(Float32)
                            sm.sMetaF[META_DT_BIAS, stage] = mDtBias[vhead].to(Float32)
                    if lane == 0:
                        stage_item_plan(sm.sMetaI, stage, slot, h, origin)
                    box0 = Int32((Int64(slot) * (HV * V) + vhead * V) // MMA_ROWS)
                    publish_tile_boxes(sm.full, stage, live, CW, box_bytes, tma_atom, t_g, box0, t_s)
            rInt.store(rIntNext.load())

    @cute.jit
    def consume(self, mCheckpoint: cute.Tensor, mOut: cute.Tensor, records: GDNRing, sm: GDNPipeVerifySmem,
                bid: Int32, grid: Int32, consumer: Int32, lane: Int32, total: Int32):
        """Consumer warp number ``consumer``: warp ``cw`` (rows 16 cw ..) of group ``cg``; the
        group's items of the CTA, each from its stage (module docstring), then the stage released."""
        s, d = self.shape, self.dims
        HV, K, rep, L, cap, T, TP, NQ, NQP, KF, ST, CW, vec, act = (d.HV, d.K, d.rep, d.L, d.cap, d.T, d.TP, d.NQ,
                                                                      d.NQP, d.KF, d.ST, d.CW, d.vec, d.act)
        mRingU, mRingK, mRingG, mRingV, mRingBeta, _ = records
        NT = TP // 8  # n-tiles of drafts (k columns; the q columns follow)
        KL = K // vec  # lanes holding a K row
        exact = act.width < 32  # bf16 / fp16 ring keys are exact in TF32
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
                row = item // HV
                vhead = item % HV
                khead = vhead // rep
                stage, phase = stage_of(n, ST)
                slot = wait_item(sm.full, sm.sMetaI, stage, phase)
                if slot_is_live(slot, num_slots, s.pad_slot_id):
                    slot64 = Int64(slot)
                    h, origin = item_plan(sm.sMetaI, stage)
                    flush = h + T > L
                    sKeys = sm.sKeys[None, None, stage]
                    # the unit's first item normalises the drafts and forms the raw products
                    buf, lead, draft_buf = unit_scratch(item, d.U, cg, live_items, group_barrier, 32 * CW)
                    sDot = sm.sDot[None, None, buf]
                    sDraft = sm.sDraft[None, None, draft_buf]
                    if lead:
                        # The drafts' normalised keys (rows 0..T-1) and queries (rows TP..TP+T-1),
                        # zero between: a draft a warp in turn.
                        for tt in cutlass.range_constexpr(cdiv(TP, CW)):
                            d_row = tt * CW + cw
                            if d_row < TP:
                                rK = cute.make_rmem_tensor((vec,), Float32)
                                rQ = cute.make_rmem_tensor((vec,), Float32)
                                rK.fill(0.0)
                                rQ.fill(0.0)
                                if d_row < T and lane < KL:
                                    for e in cutlass.range_constexpr(vec):
                                        rK[e] = sm.sDraftK[d_row, lane * vec + e, stage].to(Float32)
                                        rQ[e] = sm.sDraftQ[d_row, lane * vec + e, stage].to(Float32)
                                normalize_qk(rK, rQ, vec, s.q_scale)
                                if lane < KL:
                                    cute.autovec_copy(rK, cute.local_tile(sDraft[d_row, None], (vec,), (lane,)))
                                    cute.autovec_copy(rQ, cute.local_tile(sDraft[TP + d_row, None], (vec,), (lane,)))
                        if cutlass.const_expr(d.U > 1):
                            # the unit's raw products k_col . x_s: 16 key columns a warp GEMM
                            cute.arch.barrier(barrier_id=group_barrier, number_of_threads=32 * CW)
                            for mt in cutlass.range_constexpr(cdiv(NQP // 16, CW)):
                                q_tile = (mt * CW + cw) * 16
                                if q_tile < NQP:
                                    rDot = cute.make_rmem_tensor(cute.make_layout((4, 1, 2 * NT)), Float32)
                                    key_products(rDot, sKeys, sDraft, q_tile, g4, c4, cap, T, NT, K)
                                    store_unit_products(sm.sRaw[None, None, cg], rDot, q_tile, g4, c4)

                    # Lane j: g of record j in order (committed j < h, draft d at lane h + d); beta of
                    # draft d at lane h + d; the inclusive prefix sums P_j.
                    g_rec = sm.sRingG[(origin + lane) % cap, stage]
                    g_j = Float32(0.0)
                    beta_j = Float32(0.0)
                    if lane < h:
                        g_j = g_rec
                    if lane >= h and lane < h + T:
                        g_d, beta_d = gdn_gates(sm.sGates[0, lane - h, stage], sm.sGates[1, lane - h, stage],
                                                sm.sMetaF[META_A_LOG, stage], sm.sMetaF[META_DT_BIAS, stage])
                        g_j = g_d
                        beta_j = beta_d
                    prefix = lane_scan(g_j)
                    if cutlass.const_expr(d.U > 1):
                        # the head's weights on the unit's raw products, element-wise
                        if lead:
                            cute.arch.barrier(barrier_id=group_barrier, number_of_threads=32 * CW)
                        weigh_unit_products(sDot, sm.sRaw[None, None, cg], cw * 32 + lane, 32 * CW, weigh_key_product,
                                            (prefix, origin, h, cap, T, TP, NQ))
                    else:
                        cute.arch.barrier(barrier_id=group_barrier, number_of_threads=32 * CW)
                        # Dots (col, x_s) = k_col . x_s for x in {k, q}: 16 key columns a warp GEMM, weighted.
                        for mt in cutlass.range_constexpr(cdiv(NQP // 16, CW)):
                            q_tile = (mt * CW + cw) * 16
                            if q_tile < NQP:
                                weighted_key_products(sDot, sKeys, sDraft, q_tile, prefix, origin, h, g4, c4, cap, T,
                                                      TP, NQ, NT, K)
                    cute.arch.barrier(barrier_id=group_barrier, number_of_threads=32 * CW)

                    # The drafts' keys (once per key head) and decays (once per value head), here so that their
                    # values need no registers through the GEMMs below (no item reads a draft's position).
                    if cw == 0:
                        store_draft_records(mRingK, mRingG, mRingBeta, sDraft, slot64, khead,
                                            vhead, vhead % rep == 0, origin, h, g_j, beta_j, lane, cap, T, KL, vec)
                    # U fragments: the rows' committed corrections at every ring position (zero where
                    # stale); the ring parts U Dots^T, then S_ckpt [k; q]^T from the stage's tile.
                    rU = cute.make_rmem_tensor(cute.make_layout((4, KF)), Float32)
                    ring_corrections(rU, sm.sRingU[None, None, stage], p_warp, g4, c4, cap)
                    rRing = cute.make_rmem_tensor(cute.make_layout((4, 1, 2 * NT)), Float32)
                    rows_times_dots(rRing, rU, sDot, False)
                    rSX = cute.make_rmem_tensor(cute.make_layout((4, 1, 2 * NT)), Float32)
                    rSX.fill(0.0)
                    rows_times_columns(rSX, sm.sState, stage * CW + cw, sDraft, K // 8, False)
                    for nt in cutlass.range_constexpr(2 * NT):
                        for i in cutlass.range_constexpr(4):
                            xs = 8 * nt + 2 * c4 + i % 2
                            gamma_s = cute.math.exp(cute.arch.shuffle_sync(prefix, (h + xs % TP) % 32), fastmath=False)
                            sm.sPre[g4 + 8 * (i // 2), xs, consumer] = gamma_s * rSX[i, 0, nt] + rRing[i, 0, nt]
                    rBeta = cute.make_rmem_tensor((T,), Float32)
                    for dd in cutlass.range_constexpr(T):
                        rBeta[dd] = cute.arch.shuffle_sync(beta_j, (h + dd) % 32)
                    cute.arch.sync_warp()

                    # Forward substitution for the drafts' u, then the outputs: lane r < 16 takes row r.
                    if lane < MMA_ROWS:
                        i_row = p_warp + lane
                        rUd = cute.make_rmem_tensor((T,), Float32)
                        for dd in cutlass.range_constexpr(T):
                            v_d = sm.sV[dd, i_row, stage]
                            resid = v_d.to(Float32) - sm.sPre[lane, dd, consumer]
                            for e in cutlass.range_constexpr(dd):
                                resid = resid - sDot[dd, cap + e] * rUd[e]
                            rUd[dd] = rBeta[dd] * resid
                            o = sm.sPre[lane, TP + dd, consumer]
                            for e in cutlass.range_constexpr(dd + 1):
                                o = o + sDot[TP + dd, cap + e] * rUd[e]
                            mOut[row, dd, vhead, i_row] = o.to(act)
                            pos_d = (origin + h + dd) % cap
                            mRingU[slot64, pos_d, vhead, i_row] = rUd[dd].to(cutlass.Float16)
                            if cutlass.const_expr(s.keep_v_beta):
                                mRingV[slot64, pos_d, vhead, i_row] = v_d

                    if flush:
                        # Fold the h committed records as a GEMM over ring positions.
                        # (U reloaded, not held in registers through the GEMMs above)
                        ring_corrections(rU, sm.sRingU[None, None, stage], p_warp, g4, c4, cap)
                        rCoef = cute.make_rmem_tensor(cute.make_layout((4, KF)), Float32)
                        gamma = fold_coefficients(rCoef, rU, prefix, origin, h, c4, cap)
                        fold_into_checkpoint(cute.local_tile(mCheckpoint[slot64, vhead, None, None], (MMA_ROWS, K), (cw, 0)),
                                             sm.sState, stage * CW + cw, rCoef, sKeys, gamma, fold_cols(K), exact)

                    live_items = live_items + 1
                release_stage(sm.empty, stage)


@cute.jit
def ring_corrections(rU: cute.Tensor, sRingU: cute.Tensor, p_warp: Int32, g4: Int32, c4: Int32,
                     cap: cutlass.Constexpr[int]):
    """A consumer warp's A fragments (4, KF) of its 16 rows' committed corrections at every ring
    position from a stage's (cap, V) fp16 ``sRingU`` (zero past the ring)."""
    for kf in cutlass.range_constexpr(cute.size(rU, mode=[1])):
        for i in cutlass.range_constexpr(4):
            q = 8 * kf + c4 + 4 * (i // 2)
            uv = sRingU[cutlass.min(q, cap - 1), p_warp + g4 + 8 * (i % 2)].to(Float32)
            rU[i, kf] = cutlass.select_(q < cap, uv, Float32(0.0))


def pipelined_verify_config(shape: GDNShape, sm_count: int, arch: str, bucket: int = 1) -> Optional[PipeVerifyConfig]:
    """The default launch config at batch bucket ``bucket`` (``pipeline.default_verify_config``),
    None where the kernel cannot take the shape."""
    return default_verify_config(shape, GDNPipelinedVerify.check, sm_count, arch, bucket, shape.num_v_heads,
                                 unit_size(sharing_heads(shape)))


def pipelined_verify_space(shape: GDNShape, sm_count: int, arch: str) -> List[PipeVerifyConfig]:
    """The configs the tuner times (``pipeline.verify_space``)."""
    return verify_space(shape, GDNPipelinedVerify.check, sm_count, arch, unit_size(sharing_heads(shape)))


def sharing_heads(shape: GDNShape) -> int:
    """Heads that share their products (the value heads of a key head): a unit's heads divide them."""
    return shape.num_v_heads // shape.num_k_heads


def compile_pipelined_verify(shape: GDNShape, config: PipeVerifyConfig, num_drafts: int, options: str):
    """Compile with `options` from the verify kernel's fake tensors (same arguments); launches on
    the caller's current CUDA stream (graph capturable)."""
    from .verify import fake_inputs

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = fake_inputs(shape, num_drafts)
    return cute.compile(GDNPipelinedVerify(shape, config, num_drafts), *args.values(), stream, options=options)
