"""The stage protocol of the persistent, warp-specialised decode kernels (kernels/*/pipelined.py).

A CTA keeps ``stages`` shared-memory stages, each with a *full* mbarrier (the producer warp's 32
lanes arrive through ``cp.async.mbarrier.arrive.noinc`` once their copies land, and lane 0 once
more, carrying the TMA box's bytes) and an *empty* one (one arrival per consumer warp). Work item
number ``it`` of a CTA uses stage ``it % stages`` in phase ``(it // stages) % 2``: the producer
waits for the stage's previous use to be released (``acquire_stage``), fills it and publishes it
(``publish_stage``); the consumers wait for it (``wait_stage``) and release it (``release_stage``).
"""

from dataclasses import dataclass
from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from .common import MMA_ROWS, SMEM_PER_CTA, TILE_PAD, smem_fit
from .config_space import MAX_CTAS, MAX_STAGES, PREFETCH_CHOICES
from .limits import MAX_CAPACITY, MAX_DRAFT
from .state_io import CopyTensors

# Items whose inputs the producer loads in one round (``prefetch`` of the pipelined configs): 4 on sm_90a
# (measured on the H200), 2 where the compiler's register budget is tighter (sm_100a / sm_103a: at 4,
# ptxas spills in GDN's whole-head kernel and Mamba-2's headdim-80 one).
PREFETCH_BY_ARCH = {"sm_90a": 4}
PREFETCH_OTHER = 2
PRODUCER_ARRIVALS = 33  # the producer warp's 32 cp.async arrivals + lane 0's, which carries the TMA bytes
CONSUMER_BARRIER = 1  # named barrier of a CTA's consumer warps (0 is the CTA's)
META_SLOT, META_H, META_ORIGIN = 0, 1, 2  # a stage's int32 scalars: the item's slot and plan (h, origin)
MAX_BOX_ROWS = 256  # a TMA box's rows (an item's heads arrive in one)
READ_STATE_SCALE = 4  # the slot of a stage's fp32 scalars that holds an nvfp4 read copy's state scale
MAX_CONSUMER_GROUPS = 8  # named barriers CONSUMER_BARRIER .. + 7, one per group
MAX_WARPS = 32  # a CTA's warps: the producer and every group's consumers
MAX_CTAS_PER_SM = 4  # min_ctas_per_sm: more would cap registers below what a consumer needs
MAX_UNIT_HEADS = 4  # a pipelined verify's unit in the tuner's space: a key head's (GDN) or a group's heads (Mamba-2)


def stages_smem_bytes(stages: int, stage_bytes: int) -> int:
    """Shared memory of a ring of ``stages`` stages: the stages, a full and an empty mbarrier
    each, and slack for the allocator's alignment."""
    return stages * stage_bytes + 16 * stages + 512


def producer_prefetch(arch: str) -> int:
    """The producer's chunk of items (``PREFETCH_BY_ARCH``) for a target arch."""
    return PREFETCH_BY_ARCH.get(arch, PREFETCH_OTHER)


def pipeline_check(stages: int, ctas: int, smem_bytes: int, prefetch: int = 4) -> Optional[str]:
    """Why a pipelined kernel's stage ring, producer chunk and persistent grid cannot launch, or None."""
    if prefetch not in PREFETCH_CHOICES:
        return f"prefetch {prefetch}: expected one of {PREFETCH_CHOICES}"
    if not 2 <= stages <= MAX_STAGES:
        return f"stages {stages}: expected 2..{MAX_STAGES}"
    if not 1 <= ctas <= MAX_CTAS:
        return f"ctas {ctas}: expected 1..{MAX_CTAS}"
    if smem_bytes > SMEM_PER_CTA:
        return f"{stages} stages need {smem_bytes} bytes of shared memory (at most {SMEM_PER_CTA})"
    return None


def residency_check(stages: int, consumer_groups: int, warps: int, min_ctas_per_sm: int) -> Optional[str]:
    """Why a pipelined config's consumer groups, warps or register cap cannot launch, or None."""
    if not 1 <= consumer_groups <= MAX_CONSUMER_GROUPS:
        return f"consumer_groups {consumer_groups}: expected 1..{MAX_CONSUMER_GROUPS}"
    if stages % consumer_groups:
        # a stage is then always used by the same group, in order: a group a lap ahead of
        # another's pending use of a stage would see that use's mbarrier phase as its own
        return f"consumer_groups {consumer_groups}: must divide the stages ({stages})"
    if warps > MAX_WARPS:
        return f"{warps} warps a CTA (at most {MAX_WARPS})"
    if not 0 <= min_ctas_per_sm <= MAX_CTAS_PER_SM:
        return f"min_ctas_per_sm {min_ctas_per_sm}: expected 0..{MAX_CTAS_PER_SM}"
    return None


def staged(smem, dtype, dims: tuple, stages: int, byte_alignment: int = 16, row_pad: int = 0) -> cute.Tensor:
    """A shared-memory tensor ``dims + (stages,)``: one row-major ``dims`` block per stage, its
    innermost rows ``row_pad`` elements apart (to spread column reads over the banks)."""
    strides, step = [], 1
    for i, d in enumerate(reversed(dims)):
        strides.insert(0, step)
        step *= d + (row_pad if i == 0 else 0)
    return smem.allocate_tensor(dtype, cute.make_layout(tuple(dims) + (stages,), stride=tuple(strides) + (step,)),
                                byte_alignment=byte_alignment)


@cute.jit
def stage_barriers(smem, stages: cutlass.Constexpr[int], consumer_warps: cutlass.Constexpr[int]):
    """(full, empty): every stage's two mbarriers, initialised by thread 0 before the CTA goes on."""
    full = smem.allocate_array(Int64, stages, byte_alignment=8)
    empty = smem.allocate_array(Int64, stages, byte_alignment=8)
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        for st in cutlass.range_constexpr(stages):
            cute.arch.mbarrier_init(full + st, PRODUCER_ARRIVALS)
            cute.arch.mbarrier_init(empty + st, consumer_warps)
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    return full, empty


def box_partition(tma_atom: cute.CopyAtom, mTma: cute.Tensor, sBoxes: cute.Tensor, box: tuple):
    """(tDst, tSrc) of the TMA atom: ``tDst[None, stage]`` a stage of ``sBoxes`` (box + stages),
    ``tSrc[None, i]`` box i of the global rows view ``mTma`` (``common.make_row_tma``)."""
    g_boxes = cute.local_tile(mTma, box, (None, 0))
    return cpasync.tma_partition(tma_atom, 0, cute.make_layout(1), cute.group_modes(sBoxes, 0, 2),
                                 cute.group_modes(g_boxes, 0, 2))


@cute.jit
def stage_of(it: Int32, stages: cutlass.Constexpr[int]):
    """(stage, phase) of a CTA's work item number ``it``."""
    return it % stages, (it // stages) % 2


@cute.jit
def acquire_stage(empty: cute.Pointer, stage: Int32, phase: Int32):
    """Producer: wait until the consumers released the stage's previous use (none at first)."""
    cute.arch.mbarrier_wait(empty + stage, phase ^ 1)


@cute.jit
def publish_stage(full: cute.Pointer, stage: Int32, with_box, box_bytes: cutlass.Constexpr[int],
                  tma_atom: cute.CopyAtom, tSrc: cute.Tensor, tDst: cute.Tensor):
    """Producer (whole warp), after its copies and lane 0's scalar stores into the stage: lane 0
    arrives (with the box's bytes if ``with_box``), the warp issues the TMA box ``tSrc`` -> ``tDst``
    if ``with_box`` (its elect.sync must see every lane: in a one-lane branch it deadlocks once a
    stage is reused), and every lane's cp.async arrival follows its copies."""
    cute.arch.sync_warp()  # every lane's plain stores into the stage precede lane 0's release
    if cute.arch.lane_idx() == 0:
        if with_box:
            cute.arch.mbarrier_arrive_and_expect_tx(full + stage, box_bytes)
        else:
            cute.arch.mbarrier_arrive(full + stage)
    if with_box:
        cute.copy(tma_atom, tSrc, tDst, tma_bar_ptr=full + stage)
    cute.arch.cp_async_mbarrier_arrive_noinc(full + stage)


@cute.jit
def wait_stage(full: cute.Pointer, stage: Int32, phase: Int32):
    """Consumer: wait until the producer's copies into the stage have landed."""
    cute.arch.mbarrier_wait(full + stage, phase)


@cute.jit
def stage_item_plan(sMetaI: cute.Tensor, stage: Int32, slot: Int32, h: Int32, origin: Int32):
    """Producer (one lane): the item's slot and plan (h, origin) into its stage's int32 scalars."""
    sMetaI[META_SLOT, stage] = slot
    sMetaI[META_H, stage] = h
    sMetaI[META_ORIGIN, stage] = origin


@cute.jit
def wait_item(full: cute.Pointer, sMetaI: cute.Tensor, stage: Int32, phase: Int32) -> Int32:
    """Consumer: wait for the stage (``wait_stage``), then its item's slot."""
    wait_stage(full, stage, phase)
    return sMetaI[META_SLOT, stage]


@cute.jit
def item_plan(sMetaI: cute.Tensor, stage: Int32):
    """Consumer at a live item: its plan (h, origin) from the stage."""
    return sMetaI[META_H, stage], sMetaI[META_ORIGIN, stage]


@cute.jit
def release_stage(empty: cute.Pointer, stage: Int32):
    """Consumer warp: once every lane is done reading the stage, one arrival frees it."""
    cute.arch.sync_warp()
    if cute.arch.lane_idx() == 0:
        cute.arch.mbarrier_arrive(empty + stage)


@cute.jit
def copy_rows_async(atom: cute.CopyAtom, gRows: cute.Tensor, sRows: cute.Tensor, piece: cutlass.Constexpr[int]):
    """The producer warp copies the (rows, cols) tensor ``gRows`` into ``sRows`` with cp.async,
    ``piece`` elements (the atom's 16 bytes) at a time, the pieces spread over the lanes."""
    lane = cute.arch.lane_idx()
    rows, cols = cute.size(gRows, mode=[0]), cute.size(gRows, mode=[1])
    per_row = cols // piece
    count = rows * per_row
    for k in cutlass.range_constexpr((count + 31) // 32):
        chunk = k * 32 + lane
        if chunk < count:
            r = chunk // per_row
            c = chunk % per_row
            cute.copy(atom, cute.local_tile(gRows[r, None], (piece,), (c,)), cute.local_tile(sRows[r, None], (piece,), (c,)))


def as_row(t: cute.Tensor) -> cute.Tensor:
    """A 1-D tensor as a (1, n) one, for ``copy_rows_async``."""
    return cute.make_tensor(t.iterator, cute.make_layout((1, cute.size(t)), stride=(0, t.layout.stride[0])))


def as_column(t: cute.Tensor) -> cute.Tensor:
    """A 1-D tensor as an (n, 1) one, for ``copy_rows_async`` with one element per piece."""
    return cute.make_tensor(t.iterator, cute.make_layout((cute.size(t), 1), stride=(t.layout.stride[0], 0)))


@cute.jit
def copy_records_async(atom: cute.CopyAtom, gRecords: cute.Tensor, sRecords: cute.Tensor,
                       piece: cutlass.Constexpr[int], origin: Int32, h: Int32):
    """``copy_rows_async`` of a ring's (positions, cols) records, only where a position holds one
    of the ``h`` committed records (record (p - origin) mod positions); the others are stored as
    zeros, so a stale value (a NaN of a reused slot, a rejected draft) never reaches a product."""
    lane = cute.arch.lane_idx()
    rows, cols = cute.size(gRecords, mode=[0]), cute.size(gRecords, mode=[1])
    per_row = cols // piece
    count = rows * per_row
    rZero = cute.make_rmem_tensor((piece,), sRecords.element_type)
    rZero.fill(0.0)
    for k in cutlass.range_constexpr((count + 31) // 32):
        chunk = k * 32 + lane
        if chunk < count:
            r = chunk // per_row
            c = chunk % per_row
            dst = cute.local_tile(sRecords[r, None], (piece,), (c,))
            if (r - origin + rows) % rows < h:
                cute.copy(atom, cute.local_tile(gRecords[r, None], (piece,), (c,)), dst)
            else:
                cute.autovec_copy(rZero, dst)


def flat(t: cute.Tensor, count: int) -> cute.Tensor:
    """The ``count`` contiguous elements from ``t``'s first one as a (1, count) row (``copy_rows_async``)."""
    return cute.make_tensor(t.iterator, cute.make_layout((1, count), stride=(0, 1)))


@cute.jit
def copy_read_scales_async(read: cutlass.Constexpr, copy: CopyTensors, slot64: Int64, head: Int32, box: Int32,
                           rows: cutlass.Constexpr[int], sScale, sMetaF: cute.Tensor, stage: Int32):
    """Producer, an item whose stage holds read-copy rows (box ``box`` of ``rows`` rows of the
    head): their block scales into ``sScale[None, None, stage]`` and nvfp4's state scale into
    ``sMetaF[READ_STATE_SCALE, stage]``, by cp.async (4 bytes a copy)."""
    if cutlass.const_expr(read.scale_dtype is not None):
        count = rows * read.scales_per_row
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(), read.scale_dtype, num_bits_per_copy=32)
        gScale = cute.local_tile(copy.mReadScale[slot64, head, None, None], (rows, read.scales_per_row), (box, 0))
        copy_rows_async(atom, flat(gScale, count), flat(sScale[None, None, stage], count), 32 // read.scale_dtype.width)
    if cutlass.const_expr(read.has_state_scale):
        copy4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        copy_rows_async(copy4, flat(cute.local_tile(copy.mReadStateScale[slot64, None], (1,), (head,)), 1),
                        flat(cute.local_tile(sMetaF[None, stage], (1,), (READ_STATE_SCALE,)), 1), 1)


# ----------------------------------------------------------------------------- the pipelined verify


@dataclass(frozen=True)
class PipeVerifyConfig:
    """Launch configuration of a pipelined verify (kernels/mamba2/pipelined_verify.py,
    kernels/gdn/pipelined_verify.py): ``stages`` items in shared memory per CTA, ``ctas`` CTAs in
    the persistent grid, ``prefetch`` items whose slot and plan the producer loads in one round
    (a lane each), ``min_ctas_per_sm`` > 0 caps registers so that many CTAs fit an SM;
    ``consumer_groups`` groups of consumer warps take turns at the items (group g the CTA's items
    g, g + G, ...), so that a CTA computes that many items at once. A group's warps follow from a
    head's state rows (16 each, the MMA's M). ``heads_per_unit`` > 1 (GDN: the value heads of a
    key head) hands a group units of that many consecutive items of one row (``unit_item``), so
    that what the heads share is computed once per unit."""

    stages: int = 3
    ctas: int = 132
    prefetch: int = 4
    min_ctas_per_sm: int = 0
    consumer_groups: int = 1
    heads_per_unit: int = 1

    def key(self):
        return ("pipeverify", self.stages, self.ctas, self.prefetch, self.min_ctas_per_sm, self.consumer_groups,
                self.heads_per_unit)


def verify_pipe_check(config: PipeVerifyConfig, shape, num_drafts: int, rows: int, cols: int,
                      smem_bytes: int, unit_heads: int = 1) -> Optional[str]:
    """Why a pipelined verify cannot take (shape, config, T), or None: an fp32 checkpoint without
    a read copy, ``rows`` state rows a head in 16-row warp tiles, ``cols`` columns (a multiple of
    32) in one padded TMA box a row, a ring, 1 <= T <= min(16, max_draft, window), the ring in one
    lane per record, heads a unit dividing ``unit_heads`` (the heads that share a unit's work), and
    the warps, stages and ``smem_bytes`` of shared memory."""
    T = num_drafts
    if config.heads_per_unit < 1 or unit_heads % config.heads_per_unit:
        return f"heads_per_unit {config.heads_per_unit}: expected a divisor of {unit_heads}"
    if shape.checkpoint_format != "fp32" or shape.read_copy is not None:
        return "the pipelined verify takes an fp32 checkpoint without a read copy"
    if cols % 32 or cols + TILE_PAD > 256:
        return f"{cols} state columns: the kernel needs a multiple of 32 up to {256 - TILE_PAD} (one TMA box a row)"
    if rows % MMA_ROWS:
        return f"{rows} state rows a head: the kernel needs a multiple of {MMA_ROWS} (a 16-row MMA tile a warp)"
    if shape.window < 2:
        return "verification needs a ring (window >= 2)"
    if not 1 <= T <= min(MAX_DRAFT, shape.capacity - shape.window, shape.window):
        return (f"num_drafts {T}: needs 1 <= T <= min({MAX_DRAFT}, max_draft "
                f"{shape.capacity - shape.window}, window {shape.window})")
    if shape.capacity > MAX_CAPACITY:
        return f"ring capacity {shape.capacity} above {MAX_CAPACITY} (one lane per record)"
    warps = 1 + config.consumer_groups * (rows // MMA_ROWS)
    return (residency_check(config.stages, config.consumer_groups, warps, config.min_ctas_per_sm)
            or pipeline_check(config.stages, config.ctas, smem_bytes, config.prefetch)
            or smem_fit(smem_bytes, config.min_ctas_per_sm))


# (CTAs an SM, consumer groups a CTA) of a pipelined verify, in the space's (and so the default's)
# order: two items in flight an SM first. Measured on the H200 (Nemotron-3-Super, T = 2 / 4 / 8,
# batch 64 / 256): two CTAs of 2 stages took 0.72-0.85x the time of one of 4, whose 4 consumer warps
# sat idle through an item's barriers and dependent loads. Where a second CTA does not fit (GDN's
# whole-head stages), two groups took 0.94-0.99x the time of one (H100, Qwen3.5-122B, T = 2 / 4,
# batch 64 / 256); where it fits it beats a second group (Nemotron-3-Super: two CTAs an SM took
# 0.85-0.92x the time of one CTA of two groups).
VERIFY_RESIDENCIES = ((2, 1), (1, 2), (1, 1))
VERIFY_STAGE_CHOICES = (4, 3, 2)


def verify_space(shape, check: Callable, sm_count: int, arch: str, unit_heads: int = 1) -> list:
    """The pipelined verify configs ``check(shape, config, T)`` takes at the cache's largest draft
    count T: the residencies of ``VERIFY_RESIDENCIES`` in order (two CTAs an SM with registers
    capped for them, one of two consumer groups, one of one), each with 2-4 stages, most first,
    and the target's producer chunk; items of one head, then (``unit_heads`` > 1) units of
    ``unit_heads`` heads (``unit_size``). [] where the cache has no room for a draft."""
    largest = min(MAX_DRAFT, shape.capacity - shape.window, shape.window)
    if largest < 1:
        return []
    # plain loops: the DSL's preprocessor of this module's jit functions trips on comprehensions' closures
    space = []
    for heads in sorted({1, unit_heads}):
        for per_sm, groups in VERIFY_RESIDENCIES:
            for stages in VERIFY_STAGE_CHOICES:
                config = PipeVerifyConfig(stages, per_sm * sm_count, producer_prefetch(arch),
                                          per_sm if per_sm > 1 else 0, groups, heads)
                if check(shape, config, largest) is None:
                    space.append(config)
    return space


def unit_size(sharing: int) -> int:
    """Heads a unit of the pipelined verify's space, of ``sharing`` heads that share their
    products: the largest divisor up to MAX_UNIT_HEADS, so that a CTA's last units stay short."""
    return max(u for u in range(1, MAX_UNIT_HEADS + 1) if sharing % u == 0)


def default_verify_config(shape, check: Callable, sm_count: int, arch: str, bucket: int, heads: int,
                          unit_heads: int) -> Optional[PipeVerifyConfig]:
    """A pipelined verify's default at batch bucket ``bucket`` of rows of ``heads`` heads: units of
    ``unit_heads`` sharing heads (``unit_size``) where the batch's units fill the grid (``bucket
    heads >= heads_per_unit ctas``), the first such config of ``verify_space`` with one consumer
    group; else the first of the space (items of one head: two CTAs an SM where they fit, else
    one of two consumer groups; the most stages); None where it is empty.

    Why: a unit serialises its heads in one group, which pays where every CTA has units to walk
    and loses where the grid is not filled (batch 1: 20 against 12 us on Qwen3.5-122B, T = 4);
    two groups of a two-stage CTA each hold a stage through their unit, leaving none to prefetch
    (GDN Qwen3.5-122B, H100: one group took 0.84-0.95x the time of two). sweeps/results/README.md,
    "Verify in units"."""
    space = verify_space(shape, check, sm_count, arch, unit_heads)
    for config in space:
        if config.heads_per_unit > 1 and config.consumer_groups == 1:
            if bucket * heads >= config.heads_per_unit * config.ctas:
                return config
            break
    return space[0] if space else None


@cute.jit
def plan_scalars(first: Int32, stride: Int32, total: Int32, heads: cutlass.Constexpr[int], prefetch: cutlass.Constexpr[int],
                 mSlot: cute.Tensor, mPlan: cute.Tensor, rInt: cute.Tensor):
    """Lane u < prefetch: (slot, h, origin) of item ``first + u stride`` (``item_plan_scalars``)."""
    item_plan_scalars(first + (cute.arch.lane_idx() % prefetch) * stride, total, heads, mSlot, mPlan, rInt)


@cute.jit
def item_plan_scalars(item: Int32, total: Int32, heads: cutlass.Constexpr[int], mSlot: cute.Tensor, mPlan: cute.Tensor,
                      rInt: cute.Tensor):
    """(slot, h, origin) of a lane's ``item`` (clamped to the last item; ``heads`` items a batch
    row) into ``rInt``, loaded by batch row."""
    item = cutlass.min(item, total - 1)
    row = item // heads
    rInt[0] = mSlot[row]
    rInt[1] = mPlan[row, 1]
    rInt[2] = mPlan[row, 2]


@cute.jit
def unit_item(bid: Int32, grid: Int32, n: Int32, heads_per_unit: cutlass.Constexpr[int],
              groups: cutlass.Constexpr[int]) -> Int32:
    """The item of CTA ``bid``'s stage use number ``n`` (stage ``n % stages``, consumer group ``n %
    groups``, that group's use ``n // groups``): with one head a unit, item ``bid + n grid``; with
    U heads a unit, the group's ``(n // groups) // U``-th unit of the CTA's units ``bid, bid + grid,
    ...`` (the group's every ``groups``-th from ``n % groups``), its item ``(n // groups) % U``; a
    unit's U items are ``unit U ..``. Beyond the last item where the CTA's units run out."""
    item = bid + n * grid
    if cutlass.const_expr(heads_per_unit > 1):
        use = n // groups
        unit = bid + ((use // heads_per_unit) * groups + n % groups) * grid
        item = unit * heads_per_unit + use % heads_per_unit
    return item


@cute.jit
def unit_uses(bid: Int32, grid: Int32, total: Int32, heads_per_unit: cutlass.Constexpr[int],
              groups: cutlass.Constexpr[int]) -> Int32:
    """How many stage uses ``n`` CTA ``bid`` numbers (``unit_item``): every group's units, padded
    to whole rounds of the groups (uses past the last item are skipped)."""
    units = total // heads_per_unit
    mine = (units - bid + grid - 1) // grid  # >= 0: bid < grid
    return ((mine + groups - 1) // groups) * groups * heads_per_unit


@cute.jit
def unit_lead(item: Int32, heads_per_unit: cutlass.Constexpr[int]):
    """Whether ``item`` is its unit's first (``unit_item``), the one that forms what the unit's
    heads share: every item with one head a unit."""
    lead = True
    if cutlass.const_expr(heads_per_unit > 1):
        lead = item % heads_per_unit == 0
    return lead


@cute.jit
def unit_scratch(item: Int32, heads_per_unit: cutlass.Constexpr[int], group: Int32, live_items: Int32,
                 barrier: Int32, threads: cutlass.Constexpr[int]):
    """A consumer warp of group ``group`` at its ``live_items``-th live item: (the item's buffer of
    the group's double-buffered scratch, 2 group + live_items % 2, which alternates over its live
    items; whether the item leads its unit, forming what the unit's heads share; the buffer of
    that). With one head a unit every item leads and shares the item's buffer; with units the
    group has one buffer, and its warps meet at the group's ``barrier`` before a unit's first item
    writes it, so the last unit's readers are done."""
    item_buffer = 2 * group + live_items % 2
    lead, buffer = unit_lead(item, heads_per_unit), item_buffer
    if cutlass.const_expr(heads_per_unit > 1):
        buffer = group
        if lead:
            cute.arch.barrier(barrier_id=barrier, number_of_threads=threads)
    return item_buffer, lead, buffer


@cute.jit
def store_unit_products(sRaw: cute.Tensor, rAcc: cute.Tensor, q_tile: Int32, g4: Int32, c4: Int32):
    """A warp's MMA accumulators ``rAcc`` (4, 1, n-tiles of 8 rows) of the 16 columns from
    ``q_tile`` into a unit's raw products ``sRaw[row, col]``, for every head of the unit to weigh."""
    for nt in cutlass.range_constexpr(cute.size(rAcc, mode=[2])):
        for i in cutlass.range_constexpr(4):
            sRaw[8 * nt + 2 * c4 + i % 2, q_tile + g4 + 8 * (i // 2)] = rAcc[i, 0, nt]


@cute.jit
def weigh_unit_products(sDot: cute.Tensor, sRaw: cute.Tensor, thread: Int32, threads: cutlass.Constexpr[int],
                        weigh: Callable, weights: tuple):
    """A consumer group's ``threads`` weigh a unit's raw products ``sRaw`` (rows, cols) into the
    item's ``sDot``: ``weigh(raw, row, col, *weights)``, the layer's weights of its head (its
    decays); element ``thread`` and every ``threads``-th after it. Every lane runs every round
    (the weights' shuffles)."""
    cols = cute.size(sRaw, mode=[1])
    count = cute.size(sRaw, mode=[0]) * cols
    for r in cutlass.range_constexpr((count + threads - 1) // threads):
        e = cutlass.min(r * threads + thread, count - 1)
        row = e // cols
        col = e % cols
        weighted = weigh(sRaw[row, col], row, col, *weights)
        if r * threads + thread < count:
            sDot[row, col] = weighted


@cute.jit
def consumer_place(consumer: Int32, warps: cutlass.Constexpr[int], groups: cutlass.Constexpr[int]):
    """(group, warp in the group, the group's named barrier id) of consumer warp number
    ``consumer`` of a pipelined verify, ``groups`` groups of ``warps``; with one group the group
    and barrier are constants."""
    group, warp, barrier = 0, consumer, CONSUMER_BARRIER
    if cutlass.const_expr(groups > 1):
        group = consumer // warps
        warp = consumer % warps
        barrier = CONSUMER_BARRIER + group
    return group, warp, barrier


@cute.jit
def publish_tile_boxes(full: cute.Pointer, stage: Int32, live, boxes: cutlass.Constexpr[int],
                       box_bytes: cutlass.Constexpr[int], tma_atom: cute.CopyAtom, tSrc: cute.Tensor, first_box: Int32,
                       tDst: cute.Tensor):
    """Producer (whole warp), after its copies and lane 0's scalar stores into the stage: lane 0
    arrives (with the bytes of ``boxes`` TMA boxes if ``live``), the warp issues boxes ``first_box
    ..`` of ``tSrc`` into blocks ``stage * boxes ..`` of ``tDst`` (every lane: the TMA's
    elect.sync), and every lane's cp.async arrival follows its copies."""
    cute.arch.sync_warp()  # every lane's plain stores into the stage precede lane 0's release
    if cute.arch.lane_idx() == 0:
        if live:
            cute.arch.mbarrier_arrive_and_expect_tx(full + stage, boxes * box_bytes)
        else:
            cute.arch.mbarrier_arrive(full + stage)
    if live:
        for b in cutlass.range_constexpr(boxes):
            cute.copy(tma_atom, tSrc[None, first_box + b], tDst[None, stage * boxes + b], tma_bar_ptr=full + stage)
    cute.arch.cp_async_mbarrier_arrive_noinc(full + stage)


def rows_at(sRows: cute.Tensor, first: int, rows: int) -> cute.Tensor:
    """Rows ``first ..`` of a 2-D shared-memory (rows, cols) tensor as a (rows, cols) one."""
    cols = cute.size(sRows, mode=[1])
    return cute.make_tensor(sRows.iterator + first * sRows.layout.stride[0],
                            cute.make_layout((rows, cols), stride=(sRows.layout.stride[0], 1)))
