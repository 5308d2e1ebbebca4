"""Mamba-2 decode step on a persistent, warp-specialised pipeline (fp32 checkpoint).

Same step as ``kernels/mamba2/decode.py`` (ReplaySSM standard decoding; window 1 is the
conventional step), with a different residency: the grid is a fixed number of CTAs that loop over
work items, one item per (batch row, ``heads_per_item`` consecutive heads of one group), items
``bid, bid + grid, ...``. Warp 0 of a CTA is the producer, the other warps consume:

- the producer fills a ring of ``stages`` shared-memory stages (protocol: kernels/pipeline.py),
  each holding everything one item needs: its heads' (P, N) state tiles one after the other (one
  TMA box; see read copies below), the live ring records of the heads (x, dt) and of their group
  (B; stale positions stored as zeros), this token's x, z, B, C (cp.async, 16 bytes a lane) and
  the item's scalars (slot, h, origin; dt, A, D, dt_bias per head), loaded a chunk of items ahead
  and stored into the stage. B sits in a key matrix: row 0 this token's, row 1 + p position p's,
  zero rows up to a multiple of 8;
- the consumers wait for a stage, compute the group's quantities once (this token's and every
  ring position's B . C), then each head from shared memory only (no
  global load in their path): the output, the ring append or the folded checkpoint rows (tensor
  cores: the coefficients as MMA A fragments against the key matrix; or CUDA cores), and release
  the stage to the producer (one arrival per consumer warp).

So the bytes in flight per SM come from the stages (``stages - 1`` items ahead of the consumers),
not from how long a CTA lives. Consumer warp c owns state rows [c RW, (c + 1) RW) (RW <= 16, one
lane per row for the per-row terms); each lane holds N / 32 consecutive columns of a row.

Read copies (fp16, fp8, nvfp4 next to the fp32 checkpoint): a non-flushing item's tile is the head's
read copy (its TMA box, the block scales by cp.async), whose rows the consumers dot with C (fp8 and
nvfp4 on tensor cores, ``state_io.mma_row_dots``; fp16 decoded on CUDA cores); a flushing item's stage holds no tile: the producer prefetches the
head's checkpoint into L2, the consumers load their rows from it, fold them in registers and store the
checkpoint and the read copy (RTN; nvfp4's state scale reduced over the consumer warps). Stages are
then smaller, so more of them fit. With ``flush_tile`` the stages have room for the fp32 tile
instead: a flush's checkpoint arrives by TMA, folds as on the fp32 path (in place in the stage) and
both copies are stored from the tile; a non-flushing item's read copy shares that room.

Tensor contract: as ``kernels/mamba2/decode.py`` (same arguments, same order), restricted to an
fp32 checkpoint, with or without a read copy (``Mamba2PipeConfig.check``): the checkpoint scales and
the SR seed are None.

| name        | shape            | dtype   | access | meaning                                        |
|-------------|------------------|---------|--------|------------------------------------------------|
| checkpoint  | (S, H, P, N)     | fp32    | R / W on flush | S_ckpt (the conventional state when L = 1) |
| x, z        | (b, H, P)        | act     | R      | value input, gate (z optional)                 |
| dt          | (b, H)           | act/fp32| R      | raw dt                                         |
| A, D, dt_bias | (H,)           | fp32    | R      | decay rate, skip (optional), dt bias (optional)|
| B, C        | (b, G, N)        | act     | R      | key / query of head h's group h // (H // G)    |
| slot_ids    | (b,)             | int32   | R      | pool slot per row; pad / out-of-range rows skip|
| out         | (b, H, P)        | act     | W      | y (pad rows left untouched)                    |
| ring_x / ring_B / ring_dt | (S, cap, H, P) / (S, cap, G, N) / (S, cap, H) | act / act / fp32 | R / W | records (L > 1) |
| plan        | (b, 4)           | int32   | R      | (slot, h, origin, sr_writes) (L > 1)           |
| read / read_scale / read_state_scale | state_io's table | fp16 / fp8 / nvfp4 | R / W on flush | read copy (optional) |

The kernel takes this token's tensors as a ``Mamba2Token``, the records with the plan as a
``Mamba2Ring`` and the copies' other tensors (the read copy with its scales) as a
``state_io.CopyTensors``.
"""

from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from ..common import (after_previous_kernel, fold_cols, fold_into_checkpoint, launch, load_past_l1, pow2_at_least,
                      prefetch_l2, record_values, slot_is_live, smem_fit, softplus, warp_reduce_many, warp_sum)
from ..config_space import HEADS_PER_ITEM_CHOICES, PIPELINE_STAGE_CHOICES
from ..limits import MAX_CAPACITY, programmatic_launch
from ..pipeline import (CONSUMER_BARRIER, MAX_BOX_ROWS, MAX_STAGES, READ_STATE_SCALE, acquire_stage, as_column, as_row,
                        box_partition, copy_read_scales_async, copy_records_async, copy_rows_async, flat, item_plan,
                        pipeline_check, producer_prefetch, publish_stage, release_stage, residency_check,
                        stage_barriers, stage_item_plan, stage_of, staged, stages_smem_bytes, wait_item)
from ..state_io import (CopyTensors, copy_rows_tma, decode_slice, entry_tma, lane_amax, max_nan, mma_row_dots,
                        scale_per_row, smem_scale, store_copies, vector_b_fragments, warps_state_scale)
from .config import Mamba2Ring, Mamba2Shape, Mamba2Token, rows_on_tensor_cores

TWO_CTA_READ_HEADDIM = 64  # read-copy default: two register-capped CTAs per SM up to this head size
ROWS_PER_WARP = (16, 32)  # a consumer warp's rows: a lane per row for the row terms
META = 8  # scalars of an item staged by the producer (int32 / fp32 each)
GROUP_DOTS = 33  # a consumer warp's B . C of the item's group: lane l's ring value, then this token's
META_DT, META_A, META_D, META_DT_BIAS = 0, 1, 2, 3  # its fp32 slots (chunk_inputs' order; READ_STATE_SCALE after)


class Mamba2PipeSmem(NamedTuple):
    """The pipelined decode's shared memory (``Mamba2PipelinedDecode.shared_storage``); None where
    the shape or config has no such tensor. Per stage (the last mode): the item's state tiles (the
    fp32 checkpoint's, or the read copy's and its scales), its ring records and keys, this token's
    activations and the item's scalars; then each consumer warp's B . C of its item's group; a full
    and an empty mbarrier per stage."""

    sState: Optional[cute.Tensor]
    sRead: Optional[cute.Tensor]
    sReadScale: Optional[cute.Tensor]
    sAmax: Optional[cute.Tensor]
    sRingX: Optional[cute.Tensor]
    sKeys: cute.Tensor
    sX: cute.Tensor
    sZ: cute.Tensor
    sC: cute.Tensor
    sRingDt: cute.Tensor
    sMetaI: cute.Tensor
    sMetaF: cute.Tensor
    sGroupDots: cute.Tensor
    full: cute.Pointer
    empty: cute.Pointer


class ConsumerWarp(NamedTuple):
    """A consumer warp's place: its group, its place in the group, its first row of a head, the
    lane's row in the warp, the warp (of the CTA), the lane."""

    group: Int32
    warp_in_group: Int32
    first_row: Int32
    lane_row: Int32
    warp: Int32
    lane: Int32


class StagedItem(NamedTuple):
    """The item a consumer warp computes: its stage, batch row, first head and group; its slot (a
    live one), ring length h, origin, whether it flushes, and the ring position this token takes."""

    stage: Int32
    row: Int32
    head0: Int32
    group: Int32
    slot64: Int64
    h: Int32
    origin: Int32
    flush: cutlass.Boolean
    pos_h: Int32


@dataclass(frozen=True)
class Mamba2PipeDims:
    """What the kernel's methods derive from (shape, config), once (``pipe_dims``); a plain
    dataclass, not a NamedTuple, which the DSL would take apart as a tree of values."""

    H: int  # heads
    P: int  # headdim: a head's rows
    N: int  # dstate: a row's columns
    G: int  # groups
    L: int  # window
    cap: int  # ring capacity
    ST: int  # stages
    PF: int  # the producer's chunk of items
    HI: int  # an item's heads
    PI: int  # an item's rows: its heads' tiles one after the other
    CW: int  # consumer warps of a group
    RW: int  # a consumer warp's rows
    vec: int  # a lane's consecutive elements of a row (N / 32)
    heads_per_group: int
    items_per_row: int
    act: type  # activation dtype
    ring: bool  # L > 1
    KR: int  # key rows of a stage (key_rows)
    read: object  # the read copy's CopyFormat, or None
    box_bytes: int  # an item's TMA box
    n_rows: int  # rows reduced together (RW padded to a power of two)
    n_pos: int  # ring positions reduced together (cap padded to a power of two)
    pos_shift: int  # lane l holds ring position l >> pos_shift after their reduction
    mma_reads: bool  # a read copy's rows meet C on tensor cores


def pipe_dims(shape: Mamba2Shape, config: "Mamba2PipeConfig") -> Mamba2PipeDims:
    """The ``Mamba2PipeDims`` of a kernel of ``shape`` launched with ``config``."""
    s, c = shape, config
    H, P, HI, CW = s.nheads, s.headdim, c.heads_per_item, c.consumer_warps(s)
    n_pos = pow2_at_least(s.capacity)
    read = s.copies.read
    return Mamba2PipeDims(
        H=H, P=P, N=s.dstate, G=s.ngroups, L=s.window, cap=s.capacity, ST=c.stages, PF=c.prefetch, HI=HI, PI=HI * P,
        CW=CW, RW=P // CW, vec=s.dstate // 32, heads_per_group=H // s.ngroups, items_per_row=H // HI,
        act=s.act_dtype, ring=s.window > 1, KR=key_rows(s), read=read, box_bytes=HI * P * s.copies.entry.row_bytes,
        n_rows=pow2_at_least(P // CW), n_pos=n_pos, pos_shift=5 - (n_pos.bit_length() - 1),
        mma_reads=read is not None and rows_on_tensor_cores(read, P // CW))


@dataclass(frozen=True)
class Mamba2PipeConfig:
    """Launch configuration of the pipelined decode: ``stages`` items in shared memory per CTA,
    ``ctas`` CTAs in the persistent grid (the SM count, or a multiple of it); an item's consumer
    warps follow from headdim (RW = P / warps rows each, at most ``rows_per_warp``, 16 or 32), and
    ``consumer_groups`` groups of them take turns at the items (group g the CTA's items g, g + G,
    ...), so that many items are computed at once; ``prefetch`` items whose scalars the producer
    loads in one round (a lane each; kernels/pipeline.py); ``min_ctas_per_sm`` > 0 caps registers
    so that many CTAs fit an SM (as the tile configs' field); ``heads_per_item`` consecutive heads of
    one group per item: the group's B . C (this token's and the ring's) is
    computed once for them, and a stage holds their tiles (one TMA box), so that small read-copy
    tiles keep more bytes in flight."""

    stages: int = 4
    ctas: int = 132
    mma_fold: bool = True  # a flush folds on tensor cores (16-row warps), else on CUDA cores
    prefetch: int = 4
    min_ctas_per_sm: int = 0
    rows_per_warp: int = 16
    consumer_groups: int = 1
    flush_tile: bool = False  # next to a read copy: stages hold a flush's fp32 checkpoint tile too
    heads_per_item: int = 1

    def tile_bytes(self, shape: Mamba2Shape) -> int:
        """A stage's state tiles: the item's heads' fp32 checkpoint, or read copy with its block
        scales (what a step loads at entry: ``StateCopies.entry``)."""
        entry = shape.copies.entry
        rows = self.heads_per_item * shape.headdim
        return rows * entry.row_bytes + entry.scale_smem_bytes(rows)

    def consumer_warps(self, shape: Mamba2Shape) -> int:
        """An item's consumer warps: the fewest that split headdim into at most ``rows_per_warp`` rows each."""
        return next(w for w in range(1, shape.headdim + 1)
                    if shape.headdim % w == 0 and shape.headdim // w <= self.rows_per_warp)

    def warps(self, shape: Mamba2Shape) -> int:
        """A CTA's warps: the producer and every group's consumers."""
        return 1 + self.consumer_groups * self.consumer_warps(shape)

    def stage_tile_bytes(self, shape: Mamba2Shape) -> int:
        """A stage's tile: ``tile_bytes``, or with ``flush_tile`` the fp32 checkpoint tile, which
        a non-flushing item's read copy shares (its block scales after it)."""
        if not self.flush_tile:
            return self.tile_bytes(shape)
        rows = self.heads_per_item * shape.headdim
        return rows * shape.dstate * 4 + shape.copies.entry.scale_smem_bytes(rows)

    def stage_bytes(self, shape: Mamba2Shape) -> int:
        HI, N, cap = self.heads_per_item, shape.dstate, shape.capacity
        P = HI * shape.headdim  # the item's rows
        act = shape.act_dtype.width // 8
        ring = cap * P * act if shape.window > 1 else 0
        return (self.stage_tile_bytes(shape) + ring + key_rows(shape) * N * act + (2 * P + N) * act + HI * 32 * 4
                + (1 + HI) * META * 4 + (4 * self.consumer_warps(shape) * HI if shape.copies.whole_state else 0) + 128)

    def smem_bytes(self, shape: Mamba2Shape) -> int:
        # and per consumer warp its item's group dots (GROUP_DOTS, not staged)
        return stages_smem_bytes(self.stages, self.stage_bytes(shape)) + GROUP_DOTS * 4 * self.consumer_groups * \
            self.consumer_warps(shape)

    def key(self):
        return ("pipe", self.stages, self.ctas, self.mma_fold, self.prefetch, self.min_ctas_per_sm, self.rows_per_warp,
                self.consumer_groups, self.flush_tile, self.heads_per_item)

    def check(self, shape: Mamba2Shape) -> Optional[str]:
        P, N = shape.headdim, shape.dstate
        if shape.checkpoint_format != "fp32":
            return "the pipelined decode takes an fp32 checkpoint (with or without a read copy)"
        if N % 32 or N > 256:
            return f"dstate {N}: the kernel needs a multiple of 32 up to 256"
        if shape.read_copy is not None:
            reason = shape.copies.check(N // 32, P, P)
            if reason is not None:
                return reason
            if self.mma_fold and not self.flush_tile:
                return "a flush next to a read copy folds its rows in registers (without flush_tile): mma_fold must be False"
        elif self.flush_tile:
            return "flush_tile is for read copies (an fp32 tile is always the checkpoint's)"
        if P > 256 or P % 8:
            return f"headdim {P}: the kernel needs a multiple of 8 up to 256 (one TMA box per head)"
        heads_per_group = shape.nheads // shape.ngroups
        if self.heads_per_item < 1 or heads_per_group % self.heads_per_item:
            return (f"heads_per_item {self.heads_per_item}: expected a divisor of the heads per group "
                    f"({heads_per_group})")
        if self.heads_per_item * P > MAX_BOX_ROWS:
            return (f"heads_per_item {self.heads_per_item}: {self.heads_per_item} heads of {P} rows are more than "
                    f"one TMA box holds ({MAX_BOX_ROWS} rows)")
        if shape.capacity > MAX_CAPACITY:
            return f"ring capacity {shape.capacity} (window + drafts) above {MAX_CAPACITY} (one lane per record)"
        if self.rows_per_warp not in ROWS_PER_WARP:
            return f"rows_per_warp {self.rows_per_warp}: expected one of {ROWS_PER_WARP}"
        reason = residency_check(self.stages, self.consumer_groups, self.warps(shape), self.min_ctas_per_sm)
        if reason is not None:
            return reason
        if self.mma_fold and (P // self.consumer_warps(shape)) % 16:
            return (f"headdim {P}: the tensor-core fold needs warps of whole 16-row tiles (mma_fold=False folds on "
                    "CUDA cores)")
        return (pipeline_check(self.stages, self.ctas, self.smem_bytes(shape), self.prefetch)
                or smem_fit(self.smem_bytes(shape), self.min_ctas_per_sm))


def key_rows(shape: Mamba2Shape) -> int:
    """Rows of a stage's key matrix: this token's B, then B at every ring position, zero rows up
    to a multiple of 8 (the k of an m16n8k8 MMA)."""
    return -(-(1 + (shape.capacity if shape.window > 1 else 0)) // 8) * 8


def ring_keys(sKeys: cute.Tensor, stage, cap: int, N: int, KR: int) -> cute.Tensor:
    """Rows 1 .. cap of a stage's key matrix: B at each ring position."""
    return cute.make_tensor(sKeys[None, None, stage].iterator + N, cute.make_layout((cap, N), stride=(N, 1)))


@cute.jit
def fold_coefficients(sX: cute.Tensor, sRingX: cute.Tensor, stage, p_warp: Int32, dt_cur: Float32, w_j: Float32,
                      origin: Int32, h: Int32, cap: cutlass.Constexpr[int], KR: cutlass.Constexpr[int],
                      ring: cutlass.Constexpr[bool]) -> cute.Tensor:
    """The warp's (16, KR) fold coefficients as m16n8k8 A fragments (4, KR / 8): column 0 this
    token's dt x[row], column 1 + p the weight of ring position p's record times its x[row] (zero
    where p holds no committed record), zero columns after."""
    lane = cute.arch.lane_idx()
    rCoef = cute.make_rmem_tensor(cute.make_layout((4, KR // 8), stride=(1, 4)), Float32)
    for kf in cutlass.range_constexpr(KR // 8):
        for i in cutlass.range_constexpr(4):
            r = lane // 4 + 8 * (i % 2)
            k = lane % 4 + 4 * (i // 2) + 8 * kf
            coef = cutlass.select_(k == 0, dt_cur * sX[p_warp + r, stage].to(Float32), Float32(0.0))
            if cutlass.const_expr(ring):
                p = cutlass.min(cutlass.max(k - 1, 0), cap - 1)
                j = (p - origin + cap) % cap
                w = cute.arch.shuffle_sync(w_j, j)
                x_p = sRingX[p, p_warp + r, stage].to(Float32)
                coef = cutlass.select_((k >= 1) & (k <= cap) & (j < h), w * x_p, coef)
            rCoef[i, kf] = coef
    return rCoef


@cute.jit
def load_slice(sRow: cute.Tensor, lane: Int32, vec: cutlass.Constexpr[int]) -> cute.Tensor:
    """This lane's ``vec`` consecutive values of a shared-memory row (vector loads), as fp32."""
    rRaw = cute.make_rmem_tensor((vec,), sRow.element_type)
    cute.autovec_copy(cute.local_tile(sRow, (vec,), (lane,)), rRaw)
    rOut = cute.make_rmem_tensor((vec,), Float32)
    rOut.store(rRaw.load().to(Float32))
    return rOut


@cute.jit
def fold_rows(rRows: cute.Tensor, first: cutlass.Constexpr[int], gamma: Float32, own: Float32, rBa: cute.Tensor,
              sKeys: cute.Tensor, sRingX, w_j: Float32, origin: Int32, h: Int32, stage, p_warp: Int32, lr: Int32,
              cap: cutlass.Constexpr[int], ring: cutlass.Constexpr[bool]):
    """A flush's fold on CUDA cores of the warp's rows first .. first + R - 1 held in ``rRows``
    (R, vec): S = gamma S + own B (this token; lane r holds warp row r's ``own`` = dt x[r],
    ``rBa`` the lane's slice of B) + the live ring positions' w_j x_j[r] B_j (lane r reads x_j of
    warp row ``lr``, lane mod rows)."""
    lane = cute.arch.lane_idx()
    R, vec = cute.size(rRows, mode=[0]), cute.size(rRows, mode=[1])
    for r in cutlass.range_constexpr(R):
        coef = cute.arch.shuffle_sync(own, first + r)
        for v in cutlass.range_constexpr(vec):
            rRows[r, v] = gamma * rRows[r, v] + coef * rBa[v]
    if cutlass.const_expr(ring):
        for p in cutlass.range_constexpr(cap):
            j = (p - origin + cap) % cap
            w = cute.arch.shuffle_sync(w_j, j)
            x_p = sRingX[p, p_warp + lr, stage].to(Float32)
            coef_p = cutlass.select_(j < h, w * x_p, Float32(0.0))
            rBp = load_slice(sKeys[1 + p, None, stage], lane, vec)
            for r in cutlass.range_constexpr(R):
                coef = cute.arch.shuffle_sync(coef_p, first + r)
                for v in cutlass.range_constexpr(vec):
                    rRows[r, v] = rRows[r, v] + coef * rBp[v]


class Mamba2PipelinedDecode:
    """One decode step of a Mamba-2 layer over a pool of slots (see module docstring)."""

    def __init__(self, shape: Mamba2Shape, config: Mamba2PipeConfig):
        reason = config.check(shape)
        if reason is not None:
            raise ValueError(f"Mamba2PipeConfig {config} invalid for {shape}: {reason}")
        self.shape = shape
        self.config = config
        self.consumer_warps = config.consumer_warps(shape)
        self.dims = pipe_dims(shape, config)

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
        mPlan: Optional[cute.Tensor],
        mCheckpointScale: Optional[cute.Tensor],
        mCheckpointStateScale: Optional[cute.Tensor],
        mRead: Optional[cute.Tensor],
        mReadScale: Optional[cute.Tensor],
        mReadStateScale: Optional[cute.Tensor],
        mSrSeed: Optional[cute.Tensor],
        stream,
    ):
        s, c, d = self.shape, self.config, self.dims
        H, P, PI = d.H, d.P, d.PI
        tma_state, mStateTma = entry_tma(s.copies, mCheckpoint, mRead, H * P, PI)
        tma_ckpt, mCkptTma = tma_state, mStateTma
        if cutlass.const_expr(c.flush_tile):  # a flushing item's checkpoint tiles
            tma_ckpt, mCkptTma = copy_rows_tma(mCheckpoint, d.N, H * P, PI)
        launch(self.kernel(
            tma_state, mStateTma, tma_ckpt, mCkptTma, mCheckpoint, Mamba2Token(mX, mDt, mA, mB, mC, mD, mZ, mDtBias),
            mSlot, mOut,
            Mamba2Ring(mRingX, mRingB, mRingDt, mPlan),
            CopyTensors(mCheckpointScale, mCheckpointStateScale, mRead, mReadScale, mReadStateScale, mSrSeed),
        ), [c.ctas, 1, 1], [32 * c.warps(s), 1, 1], stream, c.smem_bytes(s), c.min_ctas_per_sm)

    @cute.kernel
    def kernel(
        self,
        tma_state: cute.CopyAtom,
        mStateTma: cute.Tensor,
        tma_ckpt: cute.CopyAtom,
        mCkptTma: cute.Tensor,
        mCheckpoint: cute.Tensor,
        token: Mamba2Token,
        mSlot: cute.Tensor,
        mOut: cute.Tensor,
        records: Mamba2Ring,
        copy: CopyTensors,
    ):
        s, d = self.shape, self.dims
        PF, HI, items_per_row, box_bytes = d.PF, d.HI, d.items_per_row, d.box_bytes
        copies = s.copies

        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        num_slots = mCheckpoint.shape[0]
        total = token.mX.shape[0] * items_per_row
        sm = self.shared_storage()

        # While the previous kernel finishes: lane u of the producer asks L2 for the state tile
        # (the entry copy) of the CTA's item u (by a slot id that may still change: only a
        # prefetch depends on it).
        if cutlass.const_expr(programmatic_launch()):  # a plain launch has nothing to overlap
            if (warp == 0) & (lane < PF):
                item = bid + lane * grid
                if item < total:
                    slot = load_past_l1(mSlot, item // items_per_row)
                    if slot_is_live(slot, num_slots, s.pad_slot_id):
                        entry = copy.mRead if copies.separate else mCheckpoint
                        prefetch_l2(entry[Int64(slot), (item % items_per_row) * HI, None, None], box_bytes)
        after_previous_kernel()

        if warp == 0:
            self.produce(tma_state, mStateTma, tma_ckpt, mCkptTma, mCheckpoint, token, mSlot, records, copy, sm, bid,
                         grid, lane, num_slots, total)
        else:
            self.consume(mCheckpoint, mOut, records, copy, sm, bid, grid, warp, lane, num_slots, total)

    @cute.jit
    def shared_storage(self) -> Mamba2PipeSmem:
        """The kernel's shared memory (``Mamba2PipeSmem``), its mbarriers initialised."""
        s, c, d = self.shape, self.config, self.dims
        N, cap, ST, CW, HI, PI, act, ring, KR, read = d.N, d.cap, d.ST, d.CW, d.HI, d.PI, d.act, d.ring, d.KR, d.read
        copies = s.copies

        # Shared memory, declared once: per stage the item's state tiles (the fp32 checkpoint, or
        # the read copy and its scales; head i's rows from i P), ring records, this token's
        # activations and scalars (per head where they are a head's); a full and an empty mbarrier
        # per stage.
        smem = SmemAllocator()
        sState, sRead, sReadScale, sAmax = None, None, None, None
        if cutlass.const_expr(read is None or c.flush_tile):
            sState = staged(smem, Float32, (PI, N), ST, byte_alignment=128)
        if cutlass.const_expr(read is not None):
            if cutlass.const_expr(c.flush_tile):  # a non-flushing item's read copy in the checkpoint tile's place
                sRead = cute.make_tensor(cute.recast_ptr(sState.iterator, dtype=read.storage), cute.make_layout(
                    (PI, read.cols, ST), stride=(read.cols, 1, PI * N * 32 // read.storage.width)))
            else:
                sRead = staged(smem, read.storage, (PI, read.cols), ST, byte_alignment=128)
            if cutlass.const_expr(read.scale_dtype is not None):
                sReadScale = staged(smem, read.scale_dtype, (PI, read.scales_per_row), ST)
            if cutlass.const_expr(copies.whole_state):
                sAmax = staged(smem, Float32, (CW, HI), ST)
        sRingX = None
        if cutlass.const_expr(ring):
            sRingX = staged(smem, act, (cap, PI), ST)
        # Keys: row 0 this token's B, row 1 + p the B at ring position p, zero rows after (MMA k).
        sKeys = staged(smem, act, (KR, N), ST)
        sX = staged(smem, act, (PI,), ST)
        sZ = staged(smem, act, (PI,), ST)
        sC = staged(smem, act, (N,), ST)
        sRingDt = staged(smem, Float32, (32, HI), ST)
        sMetaI = staged(smem, Int32, (META,), ST)
        sMetaF = staged(smem, Float32, (META, HI), ST)
        # each consumer warp's B . C of its item's group, kept there for the item's heads (in
        # registers they would be live through the register-heavy flush paths)
        sGroupDots = smem.allocate_tensor(Float32, cute.make_layout((GROUP_DOTS, c.consumer_groups * CW)),
                                          byte_alignment=16)
        full, empty = stage_barriers(smem, ST, CW)
        return Mamba2PipeSmem(sState, sRead, sReadScale, sAmax, sRingX, sKeys, sX, sZ, sC, sRingDt, sMetaI, sMetaF,
                              sGroupDots, full, empty)

    @cute.jit
    def produce(self, tma_state: cute.CopyAtom, mStateTma: cute.Tensor, tma_ckpt: cute.CopyAtom, mCkptTma: cute.Tensor,
                mCheckpoint: cute.Tensor, token: Mamba2Token, mSlot: cute.Tensor, records: Mamba2Ring,
                copy: CopyTensors, sm: Mamba2PipeSmem, bid: Int32, grid: Int32, lane: Int32, num_slots: Int32,
                total: Int32):
        """Warp 0: fill the stages with the CTA's items bid, bid + grid, ... (module docstring)."""
        mX, mB, mC, mZ = token.mX, token.mB, token.mC, token.mZ
        mRingX, mRingB, mRingDt, mPlan = records
        s, c, d = self.shape, self.config, self.dims
        H, P, N, L, cap, ST, PF, HI, PI, KR = d.H, d.P, d.N, d.L, d.cap, d.ST, d.PF, d.HI, d.PI, d.KR
        heads_per_group, items_per_row, act, ring, read, box_bytes = (d.heads_per_group, d.items_per_row, d.act,
                                                                      d.ring, d.read, d.box_bytes)
        per16 = 128 // act.width  # act elements per 16-byte cp.async
        copies = s.copies
        sState, sRead, sReadScale, sRingX, sKeys = sm.sState, sm.sRead, sm.sReadScale, sm.sRingX, sm.sKeys
        sX, sZ, sC, sRingDt, sMetaI, sMetaF, full, empty = (sm.sX, sm.sZ, sm.sC, sm.sRingDt, sm.sMetaI, sm.sMetaF,
                                                            sm.full, sm.empty)
        t_s, t_g = box_partition(tma_state, mStateTma, sState if read is None else sRead, (PI, copies.entry.cols))
        t_sc, t_gc = t_s, t_g
        if cutlass.const_expr(c.flush_tile):
            t_sc, t_gc = box_partition(tma_ckpt, mCkptTma, sState, (PI, N))
        # key rows past the ring stay zero (published with each stage's first use)
        first_pad = 1 + cap if ring else 1
        for st in cutlass.range_constexpr(ST):
            for r in cutlass.range_constexpr(first_pad, KR):
                for v in cutlass.range_constexpr(N // 32):
                    sKeys[r, lane * (N // 32) + v, st] = act(0.0)
        copy16 = cute.make_copy_atom(cpasync.CopyG2SOp(), act, num_bits_per_copy=128)
        copy4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        # The producer walks its items in chunks of PF: lane u holds the scalars of the
        # chunk's item u, and the next chunk's are loaded while this one is issued, so a
        # load's latency is paid once per chunk behind PF stage waits, not per item.
        rInt = cute.make_rmem_tensor((3,), Int32)
        rFloat = cute.make_rmem_tensor((4, HI), Float32)
        rIntNext = cute.make_rmem_tensor((3,), Int32)
        rFloatNext = cute.make_rmem_tensor((4, HI), Float32)
        self.chunk_scalars(bid, grid, total, mSlot, mPlan, token, rInt, rFloat)
        chunk = Int32(0)
        for first in cutlass.range(bid, total, grid * PF, unroll=1):
            self.chunk_scalars(first + grid * PF, grid, total, mSlot, mPlan, token, rIntNext, rFloatNext)
            for u in cutlass.range_constexpr(PF):
                item = first + u * grid
                if item < total:
                    row = item // items_per_row
                    head0 = (item % items_per_row) * HI  # the item's first head
                    group = head0 // heads_per_group
                    stage, phase = stage_of(chunk * PF + u, ST)
                    slot = cute.arch.shuffle_sync(rInt[0], u)
                    box = slot * items_per_row + head0 // HI  # its tiles' TMA box
                    h = cute.arch.shuffle_sync(rInt[1], u)
                    origin = cute.arch.shuffle_sync(rInt[2], u)
                    live = slot_is_live(slot, num_slots, s.pad_slot_id)
                    with_box = live
                    flush_item = h + 1 >= L
                    if cutlass.const_expr(read is not None):
                        with_box = live & (h + 1 < L)  # a flush reads the checkpoint, not the copy
                    acquire_stage(empty, stage, phase)
                    if live:
                        slot64 = Int64(slot)
                        if cutlass.const_expr(read is not None):
                            self.load_read_copy_extras(with_box, mCheckpoint, copy, slot64, head0, stage,
                                                       sReadScale, sMetaF)
                        # this token's activations and the live ring records (stale positions
                        # as zeros), 16 bytes a lane; the item's heads are consecutive in each
                        copy_rows_async(copy16, flat(mX[row, head0, None], PI), flat(sX[None, stage], PI), per16)
                        if cutlass.const_expr(s.has_z):
                            copy_rows_async(copy16, flat(mZ[row, head0, None], PI), flat(sZ[None, stage], PI), per16)
                        copy_rows_async(copy16, as_row(mB[row, group, None]), as_row(sKeys[0, None, stage]), per16)
                        copy_rows_async(copy16, as_row(mC[row, group, None]), as_row(sC[None, stage]), per16)
                        if cutlass.const_expr(ring):
                            gRingX = cute.make_tensor(mRingX[slot64, None, head0, None].iterator,
                                                      cute.make_layout((cap, PI), stride=(H * P, 1)))
                            copy_records_async(copy16, gRingX, sRingX[None, None, stage], per16, origin, h)
                            copy_records_async(copy16, mRingB[slot64, None, group, None],
                                               ring_keys(sKeys, stage, cap, N, KR), per16, origin, h)
                            for i in cutlass.range_constexpr(HI):
                                copy_records_async(copy4, as_column(mRingDt[slot64, None, head0 + i]),
                                                   as_column(cute.local_tile(sRingDt[None, i, stage], (cap,), (0,))),
                                                   1, origin, h)
                    scalars_f = [[cute.arch.shuffle_sync(rFloat[k, i], u) for k in range(4)] for i in range(HI)]
                    if lane == 0:
                        stage_item_plan(sMetaI, stage, slot, h, origin)
                        for i in cutlass.range_constexpr(HI):
                            for k in cutlass.range_constexpr(4):
                                sMetaF[k, i, stage] = scalars_f[i][k]
                    if cutlass.const_expr(c.flush_tile):
                        if flush_item:  # the checkpoint tiles, to fold on the consumers' side
                            publish_stage(full, stage, live, PI * N * 4, tma_ckpt, t_gc[None, box], t_sc[None, stage])
                        else:
                            publish_stage(full, stage, with_box, box_bytes, tma_state, t_g[None, box],
                                          t_s[None, stage])
                    else:
                        publish_stage(full, stage, with_box, box_bytes, tma_state, t_g[None, box], t_s[None, stage])
            rInt.store(rIntNext.load())
            rFloat.store(rFloatNext.load())
            chunk = chunk + 1

    @cute.jit
    def consume(self, mCheckpoint: cute.Tensor, mOut: cute.Tensor, records: Mamba2Ring, copy: CopyTensors,
                sm: Mamba2PipeSmem, bid: Int32, grid: Int32, warp: Int32, lane: Int32, num_slots: Int32, total: Int32):
        """A consumer warp: its group's items of the CTA, each from its stage: the group's B . C
        once, then head by head (``consume_head``), then the stage released."""
        s, c, d = self.shape, self.config, self.dims
        L, cap, ST, CW, HI, RW, vec, n_pos = d.L, d.cap, d.ST, d.CW, d.HI, d.RW, d.vec, d.n_pos
        heads_per_group, items_per_row, ring = d.heads_per_group, d.items_per_row, d.ring
        sKeys, sC, sMetaI, sGroupDots, full, empty = sm.sKeys, sm.sC, sm.sMetaI, sm.sGroupDots, sm.full, sm.empty
        # consumer group g computes the CTA's items g, g + G, ...; cw is the warp's place in it
        g = (warp - 1) // CW
        cw = (warp - 1) % CW
        p_warp = cw * RW  # the warp's first row of a head
        lr = lane % RW
        it = Int32(0)
        for item in cutlass.range(bid + g * grid, total, grid * c.consumer_groups, unroll=1):
            row = item // items_per_row
            head0 = (item % items_per_row) * HI
            group = head0 // heads_per_group
            stage, phase = stage_of(it * c.consumer_groups + g, ST)
            slot = wait_item(full, sMetaI, stage, phase)
            if slot_is_live(slot, num_slots, s.pad_slot_id):
                slot64 = Int64(slot)
                h, origin = item_plan(sMetaI, stage)
                flush = h + 1 >= L  # h == L only after a speculative commit
                pos_h = (origin + h) % cap

                # The group's quantities, once for the item's heads: this token's B . C, and
                # (lane l) B_p . C of ring position p = l >> pos_shift, into the warp's
                # sGroupDots.
                rC = load_slice(sC[None, stage], lane, vec)
                rBa = load_slice(sKeys[0, None, stage], lane, vec)
                part = Float32(0.0)
                for v in cutlass.range_constexpr(vec):
                    part = part + rBa[v] * rC[v]
                bc_own = warp_sum(part)
                if lane == 0:
                    sGroupDots[GROUP_DOTS - 1, warp - 1] = bc_own
                if cutlass.const_expr(ring):
                    rPos = cute.make_rmem_tensor((n_pos,), Float32)
                    rPos.fill(0.0)
                    for p in cutlass.range_constexpr(cap):
                        rBp = load_slice(sKeys[1 + p, None, stage], lane, vec)
                        for v in cutlass.range_constexpr(vec):
                            rPos[p] = rPos[p] + rBp[v] * rC[v]
                    sGroupDots[lane, warp - 1] = warp_reduce_many(rPos, n_pos)
                cute.arch.sync_warp()

                for i in cutlass.range(HI, unroll=1):
                    self.consume_head(mCheckpoint, mOut, records, copy, sm, ConsumerWarp(g, cw, p_warp, lr, warp, lane),
                                      StagedItem(stage, row, head0, group, slot64, h, origin, flush, pos_h), i, rC, rBa)
            release_stage(empty, stage)
            it = it + 1

    @cute.jit
    def consume_head(self, mCheckpoint: cute.Tensor, mOut: cute.Tensor, records: Mamba2Ring, copy: CopyTensors,
                     sm: Mamba2PipeSmem, w: ConsumerWarp, item: StagedItem, i: Int32, rC: cute.Tensor,
                     rBa: cute.Tensor):
        """The warp's rows of the item's head ``i``: load (the head's dt, gates and record weights),
        compute (S . C of the rows, from the read copy or the fp32 tile, the ring term), store (a
        flush's fold, else the ring's record; the output)."""
        mRingX, mRingB, mRingDt, _ = records
        s, c, d = self.shape, self.config, self.dims
        P, N, cap, CW, RW, vec, heads_per_group, act, ring, read = (d.P, d.N, d.cap, d.CW, d.RW, d.vec, d.heads_per_group,
                                                                    d.act, d.ring, d.read)
        n_rows, pos_shift, mma_reads = d.n_rows, d.pos_shift, d.mma_reads
        _, cw, p_warp, lr, warp, lane = w
        stage, row, head0, group, slot64, h, origin, flush, pos_h = item
        sState, sRead, sReadScale = sm.sState, sm.sRead, sm.sReadScale
        sRingX, sKeys = sm.sRingX, sm.sKeys
        sX, sZ, sC, sRingDt, sMetaF, sGroupDots = sm.sX, sm.sZ, sm.sC, sm.sRingDt, sm.sMetaF, sm.sGroupDots
        head = head0 + i
        p_item = i * P + p_warp  # the warp's first row in the stage
        A = sMetaF[META_A, i, stage]
        dt_cur = sMetaF[META_DT, i, stage]
        if cutlass.const_expr(s.has_dt_bias):
            dt_cur = dt_cur + sMetaF[META_DT_BIAS, i, stage]
        if cutlass.const_expr(s.dt_softplus):
            dt_cur = softplus(dt_cur)
        x_raw = sX[p_item + lr, stage]
        x_cur = x_raw.to(Float32)

        # Lane j: record j's dt and weight w_j = dt_j exp(A (sum of later dts)).
        dt_rec = Float32(0.0)
        if cutlass.const_expr(ring):
            dt_rec = sRingDt[(origin + lane) % cap, i, stage]
        dt_j, tail = record_values(dt_cur, dt_rec, h, ring)
        w_j = dt_j * cute.math.exp(A * (tail - dt_j), fastmath=False)
        gamma = cute.math.exp(A * cute.arch.shuffle_sync(tail, 0), fastmath=False)

        # y = gamma (S . C) + dt (B . C) x + sum over live records of w_j (B_j . C) x_j:
        # the same whether or not the row folds (C . S_new expands to it).
        # dot_row: lane lr's row of S . C (per-lane partial dots reduced over the warp, or
        # a read copy's rows on tensor cores)
        rDots = cute.make_rmem_tensor((n_rows,), Float32)
        rDots.fill(0.0)
        dot_row = Float32(0.0)
        if cutlass.const_expr(read is None):
            dot_row = self.tile_dot(sState, stage, p_item, rC, rDots)
        elif flush:
            if cutlass.const_expr(c.flush_tile):  # the checkpoint tiles are in the stage
                dot_row = self.tile_dot(sState, stage, p_item, rC, rDots)
            else:  # the dots come with the fold, from the checkpoint's rows
                self.flush_next_to_read_copy(rDots, rC, rBa, gamma, dt_cur * x_cur, w_j, mCheckpoint, copy, sm, w,
                                             item, i, head)
                dot_row = self.row_total(rDots)
        else:
            state_scale = Float32(1.0)
            if cutlass.const_expr(read.has_state_scale):
                state_scale = sMetaF[READ_STATE_SCALE, i, stage]
            if cutlass.const_expr(mma_reads):
                sScaleRows = None
                if cutlass.const_expr(read.scale_dtype is not None):
                    sScaleRows = cute.local_tile(sReadScale[None, None, stage],
                                                 (RW, read.scales_per_row), (i * CW + cw, 0))
                # C's fragments per head: held through the loop they would spill in the flush paths
                rB, factor = vector_b_fragments(read, sC[None, stage], rC)
                dot_row = mma_row_dots(read, cute.local_tile(sRead[None, None, stage], (RW, read.cols),
                                                             (i * CW + cw, 0)),
                                       sScaleRows, rB, 1, state_scale)[0] * factor
            else:
                for r in cutlass.range_constexpr(RW):
                    rS = cute.make_rmem_tensor((vec,), Float32)
                    scale = None  # a row's one scale is taken after its dot (below)
                    if cutlass.const_expr(not scale_per_row(read)):
                        scale = smem_scale(read, sReadScale, stage, p_item + r, lane * vec, state_scale)
                    decode_slice(read, cute.local_tile(sRead[p_item + r, None, stage],
                                                       (read.per_lane(vec),), (lane,)), scale, rS)
                    for v in cutlass.range_constexpr(vec):
                        rDots[r] = rDots[r] + rS[v] * rC[v]
                dot_row = self.row_total(rDots)
                if cutlass.const_expr(scale_per_row(read)):
                    dot_row = dot_row * smem_scale(read, sReadScale, stage, p_item + lr, Int32(0), Float32(1.0))
        y_row = gamma * dot_row
        ring_term = dt_cur * sGroupDots[GROUP_DOTS - 1, warp - 1] * x_cur
        if cutlass.const_expr(ring):
            j_l = ((lane >> pos_shift) - origin + cap) % cap
            bc = cute.arch.shuffle_sync(w_j, j_l) * sGroupDots[lane, warp - 1]
            for p in cutlass.range_constexpr(cap):
                bc_p = cute.arch.shuffle_sync(bc, p << pos_shift)
                live_p = (p - origin + cap) % cap < h
                x_p = sRingX[p, p_item + lr, stage].to(Float32)
                ring_term = ring_term + cutlass.select_(live_p, bc_p * x_p, Float32(0.0))
        if flush:
            # S = gamma S + dt x B (this token) + sum over live positions of w_j x_j B_j
            # (next to a read copy without flush_tile: folded with the dots above)
            if cutlass.const_expr(read is None):
                self.fold_tile(mCheckpoint[slot64, head, None, None], rBa, dt_cur, x_cur, w_j, gamma, sm, w, item, i)
            elif cutlass.const_expr(c.flush_tile):  # in place, then from the tile into both copies
                self.fold_tile(cute.local_tile(sState[None, None, stage], (P, N), (i, 0)), rBa, dt_cur, x_cur, w_j,
                               gamma, sm, w, item, i)
                self.store_folded_tile(mCheckpoint, copy, sm, w, item, i, head)
        else:
            if cutlass.const_expr(ring):
                # append this token's record (B and dt once per group / head)
                if cw == 0:
                    if head % heads_per_group == 0:
                        rBraw = cute.make_rmem_tensor((vec,), act)
                        cute.autovec_copy(cute.local_tile(sKeys[0, None, stage], (vec,), (lane,)), rBraw)
                        cute.autovec_copy(rBraw, cute.local_tile(mRingB[slot64, pos_h, group, None],
                                                                 (vec,), (lane,)))
                    if lane == 0:
                        mRingDt[slot64, pos_h, head] = dt_cur
        if lane < RW:
            y = y_row + ring_term
            if cutlass.const_expr(s.has_D):
                y = y + sMetaF[META_D, i, stage] * x_cur
            if cutlass.const_expr(s.has_z):
                z = sZ[p_item + lane, stage].to(Float32)
                y = y * z / (Float32(1.0) + cute.math.exp(-z, fastmath=False))
            mOut[row, head, p_warp + lane] = y.to(act)
            if cutlass.const_expr(ring):
                if not flush:
                    mRingX[slot64, pos_h, head, p_warp + lane] = x_raw

    @cute.jit
    def row_total(self, rDots: cute.Tensor) -> Float32:
        """Lane r: the warp's total of its rows' per-lane partial dots ``rDots`` for row r (mod the
        warp's rows)."""
        RW = self.shape.headdim // self.consumer_warps
        n_rows = pow2_at_least(RW)
        lane = cute.arch.lane_idx()
        return cute.arch.shuffle_sync(warp_reduce_many(rDots, n_rows), (lane % RW) << (5 - (n_rows.bit_length() - 1)))

    @cute.jit
    def tile_dot(self, sState: cute.Tensor, stage: Int32, p_item: Int32, rC: cute.Tensor, rDots: cute.Tensor) -> Float32:
        """Lane r's row p_item + r (mod the warp's rows) of the fp32 tiles in ``stage``, dotted with C
        (``rC`` the lane's slice), by per-lane partial dots (``rDots``) reduced over the warp."""
        RW = self.shape.headdim // self.consumer_warps
        vec = self.shape.dstate // 32
        lane = cute.arch.lane_idx()
        for r in cutlass.range_constexpr(RW):
            rS = load_slice(sState[p_item + r, None, stage], lane, vec)
            for v in cutlass.range_constexpr(vec):
                rDots[r] = rDots[r] + rS[v] * rC[v]
        return self.row_total(rDots)

    @cute.jit
    def head_state_scale(self, amax: Float32, copy: CopyTensors, sm: Mamba2PipeSmem, w: ConsumerWarp, item: StagedItem,
                         i: Int32, head: Int32) -> Float32:
        """nvfp4's state scale of the item's ``i``-th head (``head``) from each consumer warp's
        ``amax``, reduced over the warp's group at its named barrier (a slot per warp and head: a
        warp may go on to the next head before the others have read this one's); the group's
        warp 0 stores it."""
        CW = self.consumer_warps
        g, cw = w.group, w.warp_in_group
        stage, slot64, sAmax = item.stage, item.slot64, sm.sAmax
        state_scale = warps_state_scale(amax, sAmax[None, i, stage], cw, CONSUMER_BARRIER + g, 32 * CW)
        if cw == 0:
            if cute.arch.lane_idx() == 0:
                copy.mReadStateScale[slot64, head] = state_scale
        return state_scale

    @cute.jit
    def fold_tile(self, mDst: cute.Tensor, rBa: cute.Tensor, dt_cur: Float32, x_cur: Float32, w_j: Float32,
                  gamma: Float32, sm: Mamba2PipeSmem, w: ConsumerWarp, item: StagedItem, i: Int32):
        """A flush of the warp's rows of the item's ``i``-th head (its tile in the item's stage) into
        ``mDst`` (P, N): the checkpoint, or the tile itself (each element is read before it is
        written, by the same lane): on tensor cores a 16-row tile at a time
        (``fold_into_checkpoint``), or on CUDA cores."""
        head_row = i * self.shape.headdim  # the head's first row in the stage
        sState, sX, sRingX, sKeys = sm.sState, sm.sX, sm.sRingX, sm.sKeys
        stage, origin, h, p_warp = item.stage, item.origin, item.h, w.first_row
        s, c = self.shape, self.config
        P, N, cap = s.headdim, s.dstate, s.capacity
        RW = P // self.consumer_warps
        vec = N // 32
        ST = c.stages
        ring = s.window > 1
        lane = cute.arch.lane_idx()
        p_item = head_row + p_warp  # the warp's first row in the stage
        if cutlass.const_expr(c.mma_fold):
            for mt in cutlass.range_constexpr(RW // 16):
                first = p_item + 16 * mt
                rCoef = fold_coefficients(sX, sRingX, stage, first, dt_cur, w_j, origin, h, cap, key_rows(s), ring)
                fold_into_checkpoint(cute.local_tile(mDst, (16, N), (p_warp // 16 + mt, 0)),
                                     cute.make_tensor(sState.iterator + first * N, cute.make_layout(
                                         (16, N, ST), stride=(N, 1, c.heads_per_item * P * N))),
                                     stage, rCoef, sKeys[None, None, stage], gamma, fold_cols(N), s.act_dtype.width <= 16)
        else:
            rAcc = cute.make_rmem_tensor(cute.make_layout((RW, vec), stride=(vec, 1)), Float32)
            for r in cutlass.range_constexpr(RW):
                cute.autovec_copy(load_slice(sState[p_item + r, None, stage], lane, vec), rAcc[r, None])
            fold_rows(rAcc, 0, gamma, dt_cur * x_cur, rBa, sKeys, sRingX, w_j, origin, h, stage, p_item, lane % RW, cap,
                      ring)
            for r in cutlass.range_constexpr(RW):
                cute.autovec_copy(rAcc[r, None], cute.local_tile(mDst[p_warp + r, None], (vec,), (lane,)))

    @cute.jit
    def store_folded_tile(self, mCheckpoint: cute.Tensor, copy: CopyTensors, sm: Mamba2PipeSmem, w: ConsumerWarp,
                          item: StagedItem, i: Int32, head: Int32):
        """A consumer warp after ``fold_tile`` into the stage: its folded rows of the item's ``i``-th
        head (``head``) into the checkpoint and the read copy (RTN), coalesced from the tile;
        nvfp4's state scale first, reduced over the group's consumer warps."""
        sState, stage, slot64, cw = sm.sState, item.stage, item.slot64, w.warp_in_group
        s = self.shape
        copies = s.copies
        CW = self.consumer_warps
        RW = s.headdim // CW
        vec = s.dstate // 32
        lane = cute.arch.lane_idx()
        p_warp = cw * RW
        p_item = i * s.headdim + p_warp
        cute.arch.sync_warp()  # the fold's writes (fragment layout) before the lanes' row reads
        state_scale = Float32(1.0)
        if cutlass.const_expr(copies.whole_state):
            amax = Float32(0.0)
            for r in cutlass.range_constexpr(RW):
                amax = max_nan(amax, lane_amax(load_slice(sState[p_item + r, None, stage], lane, vec)))
            state_scale = self.head_state_scale(amax, copy, sm, w, item, i, head)
        for r in cutlass.range_constexpr(RW):
            store_copies(copies, load_slice(sState[p_item + r, None, stage], lane, vec), mCheckpoint, copy,
                         slot64, head, p_warp + r, state_scale, Uint32(0))

    @cute.jit
    def flush_next_to_read_copy(self, rDots: cute.Tensor, rC: cute.Tensor, rBa: cute.Tensor, gamma: Float32,
                                own: Float32, w_j: Float32, mCheckpoint: cute.Tensor, copy: CopyTensors,
                                sm: Mamba2PipeSmem, w: ConsumerWarp, item: StagedItem, i: Int32, head: Int32):
        """A consumer warp, a flushing item next to a read copy: its rows of the checkpoint of the
        item's ``i``-th head (``head``; prefetched into L2 by the producer) a chunk at a time from
        global memory into registers, their dots with C into ``rDots``, folded (``fold_rows``) and
        stored into the checkpoint and the read copy (RTN). nvfp4's state scale needs the whole
        head first: one pass folds for the amax (reduced over the consumer warps), a second loads,
        folds and stores again."""
        sKeys, sRingX, cw = sm.sKeys, sm.sRingX, w.warp_in_group
        stage, slot64, origin, h = item.stage, item.slot64, item.origin, item.h
        s = self.shape
        copies = s.copies
        P, N, cap = s.headdim, s.dstate, s.capacity
        CW = self.consumer_warps
        RW = P // CW
        vec = N // 32
        chunk = min(RW, max(1, 32 // vec))  # rows held at once: 32 values a lane
        lane = cute.arch.lane_idx()
        p_warp = cw * RW
        p_item = i * P + p_warp  # the warp's first row in the stage (its ring x)
        lr = lane % RW
        ring = s.window > 1
        passes = 2 if copies.whole_state else 1
        state_scale = Float32(1.0)
        amax = Float32(0.0)
        for pass_ in cutlass.range_constexpr(passes):
            for first in cutlass.range_constexpr(0, RW, chunk):
                rows = min(chunk, RW - first)
                rRows = cute.make_rmem_tensor(cute.make_layout((rows, vec), stride=(vec, 1)), Float32)
                for r in cutlass.range_constexpr(rows):
                    cute.autovec_copy(cute.local_tile(mCheckpoint[slot64, head, p_warp + first + r, None], (vec,),
                                                      (lane,)), rRows[r, None])
                if cutlass.const_expr(pass_ == 0):
                    for r in cutlass.range_constexpr(rows):
                        for v in cutlass.range_constexpr(vec):
                            rDots[first + r] = rDots[first + r] + rRows[r, v] * rC[v]
                fold_rows(rRows, first, gamma, own, rBa, sKeys, sRingX, w_j, origin, h, stage, p_item, lr, cap, ring)
                if cutlass.const_expr(pass_ + 1 < passes):
                    amax = max_nan(amax, lane_amax(rRows))
                else:
                    for r in cutlass.range_constexpr(rows):
                        store_copies(copies, rRows[r, None], mCheckpoint, copy, slot64, head,
                                     p_warp + first + r, state_scale, Uint32(0))
            if cutlass.const_expr(pass_ + 1 < passes):
                state_scale = self.head_state_scale(amax, copy, sm, w, item, i, head)

    @cute.jit
    def load_read_copy_extras(self, with_box, mCheckpoint: cute.Tensor, copy: CopyTensors, slot64: Int64, head0: Int32,
                              stage: Int32, sReadScale, sMetaF: cute.Tensor):
        """Producer, a live item next to a read copy: with the tiles (``with_box``, a non-flushing
        item) each head's block scales and nvfp4 state scale by cp.async into the stage; else (a
        flush) the heads' checkpoint prefetched into L2 for the consumers' row loads."""
        s = self.shape
        read = s.copies.read
        P, N, HI = s.headdim, s.dstate, self.config.heads_per_item
        if with_box:
            for i in cutlass.range_constexpr(HI):
                sHeadScale = None
                if cutlass.const_expr(read.scale_dtype is not None):
                    sHeadScale = cute.local_tile(sReadScale, (P, read.scales_per_row, self.config.stages), (i, 0, 0))
                copy_read_scales_async(read, copy, slot64, head0 + i, Int32(0), P, sHeadScale, sMetaF[None, i, None],
                                       stage)
        elif cutlass.const_expr(not self.config.flush_tile):
            if cute.arch.lane_idx() == 0:
                prefetch_l2(mCheckpoint[slot64, head0, None, None], HI * P * N * 4)

    @cute.jit
    def chunk_scalars(self, first: Int32, stride: Int32, total: Int32, mSlot: cute.Tensor,
                      mPlan: Optional[cute.Tensor], token: Mamba2Token, rInt: cute.Tensor, rFloat: cute.Tensor):
        """Lane u < prefetch: (slot, h, origin) into ``rInt`` and (raw dt, A, D, dt_bias) of each
        head i into ``rFloat[None, i]`` of item ``first + u stride`` (clamped to the last item;
        row-indexed loads)."""
        s = self.shape
        HI = self.config.heads_per_item
        mDt, mA, mD, mDtBias = token.mDt, token.mA, token.mD, token.mDtBias
        item = cutlass.min(first + (cute.arch.lane_idx() % self.config.prefetch) * stride, total - 1)
        row = item // (s.nheads // HI)
        head0 = (item % (s.nheads // HI)) * HI
        rInt[0] = mSlot[row]
        rInt[1] = Int32(0)
        rInt[2] = Int32(0)
        if cutlass.const_expr(s.window > 1):
            rInt[1] = mPlan[row, 1]
            rInt[2] = mPlan[row, 2]
        for i in cutlass.range_constexpr(HI):
            head = head0 + i
            rFloat[0, i] = mDt[row, head].to(Float32)
            rFloat[1, i] = mA[head]
            rFloat[2, i] = Float32(0.0)
            if cutlass.const_expr(s.has_D):
                rFloat[2, i] = mD[head]
            rFloat[3, i] = Float32(0.0)
            if cutlass.const_expr(s.has_dt_bias):
                rFloat[3, i] = mDtBias[head]


def compile_pipelined_decode(shape: Mamba2Shape, config: Mamba2PipeConfig, options: str):
    """Compile with `options` (TVM-FFI and the target arch) from the decode kernel's fake
    inputs; launches on the caller's current CUDA stream."""
    from .decode import fake_inputs

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = fake_inputs(shape)
    return cute.compile(Mamba2PipelinedDecode(shape, config), *args.values(), stream, options=options)


def pipelined_space(shape: Mamba2Shape, sm_count: int, arch: str) -> List[Mamba2PipeConfig]:
    """The configs the tuner times (replayssm_cute.tune) where ``pipelined_config`` serves
    ``shape``: one or two CTAs per SM (registers capped for two of several consumer groups), one or
    two consumer groups of 16- or 32-row warps, the stage counts of PIPELINE_STAGE_CHOICES that fit
    (multiples of the groups), the default's fold where the warps have its 16 rows, the target's
    producer chunk; next to a read copy each also with ``flush_tile`` (a tensor-core fold; measured
    on the H200, Nemotron-3-Super fp8, batch 256: flush 1268 against 2137 us, window mean 269
    against 281 us, with 2 x 2 stages), and items of several heads (``HEADS_PER_ITEM_CHOICES``:
    the copy's small tiles, the group's work shared); [] where it serves nothing."""
    default = pipelined_config(shape, sm_count, arch)
    if default is None:
        return []
    configs = []
    copy = shape.read_copy is not None
    # next to a read copy also stages with room for a flush's checkpoint tile (folded on tensor cores)
    for flush_tile in (False, True) if copy else (False,):
        for heads in HEADS_PER_ITEM_CHOICES if copy else (1,):
            for per_sm in (1, 2):
                for groups in (1, 2):
                    for rows in ROWS_PER_WARP:
                        for stages in PIPELINE_STAGE_CHOICES:
                            config = Mamba2PipeConfig(stages, per_sm * sm_count,
                                                      flush_tile or (default.mma_fold and rows == 16), default.prefetch,
                                                      per_sm if per_sm > 1 and groups > 1 else 0, rows, groups,
                                                      flush_tile, heads)
                            if config.check(shape) is None and smem_fit(config.smem_bytes(shape), per_sm) is None:
                                configs.append(config)
    return configs


def pipelined_config(shape: Mamba2Shape, sm_count: int, arch: str) -> Optional[Mamba2PipeConfig]:
    """Two CTAs per SM where two stages of each fit in half the SM's shared memory (two consumer
    groups overlap one item's compute with the other's; measured on the H200 with Nemotron-3-Super:
    305 against 316 us at batch 256 for one CTA of five stages), else one CTA per SM with as many
    stages as fit (up to 6); None if the kernel cannot take `shape`. The conventional step
    (window 1: a rank-1 update, one FMA per element) and a flush next to a read copy (its rows
    come from global memory into registers) fold on CUDA cores, in plain fp32. The producer's
    chunk is the target's (kernels/pipeline.py).

    Next to a read copy the stages are small and the consumers' work per item (decoding the copy)
    is the limit, so more items are computed at once: two CTAs per SM (registers capped to fit),
    each with two consumer groups of 32-row warps, and the most stages that fit (measured on the
    H200, Nemotron-3-Super with an fp16 copy, batch 256, non-flush step: 148 us, against 195 us
    for one 16-row group per CTA and 206-277 us with one CTA per SM; sweeps/results/README.md)."""
    if shape.read_copy is not None:
        # registers capped for two CTAs per SM spill past 64-row heads (Nemotron-Nano, P = 80: 2 KB
        # of stack per thread at sm_90a): one uncapped CTA per SM there
        per_sm = 2 if shape.headdim <= TWO_CTA_READ_HEADDIM else 1
        for stages in range(MAX_STAGES, 1, -1):
            config = Mamba2PipeConfig(stages=stages, ctas=per_sm * sm_count, mma_fold=False,
                                      prefetch=producer_prefetch(arch), min_ctas_per_sm=per_sm if per_sm > 1 else 0,
                                      rows_per_warp=32, consumer_groups=2)
            if config.check(shape) is None:
                return config
    mma_fold = shape.headdim % 16 == 0 and shape.window > 1 and shape.read_copy is None
    for ctas_per_sm in (2, 1):
        for stages in range(6, 1, -1):
            config = Mamba2PipeConfig(stages=stages, ctas=ctas_per_sm * sm_count, mma_fold=mma_fold,
                                      prefetch=producer_prefetch(arch))
            if config.check(shape) is None and smem_fit(config.smem_bytes(shape), ctas_per_sm) is None:
                return config
    return None
