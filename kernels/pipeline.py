"""The stage protocol of the persistent, warp-specialised decode kernels (kernels/*/pipelined.py).

A CTA keeps ``stages`` shared-memory stages, each with a *full* mbarrier (the producer warp's 32
lanes arrive through ``cp.async.mbarrier.arrive.noinc`` once their copies land, and lane 0 once
more, carrying the TMA box's bytes) and an *empty* one (one arrival per consumer warp). Work item
number ``it`` of a CTA uses stage ``it % stages`` in phase ``(it // stages) % 2``: the producer
waits for the stage's previous use to be released (``acquire_stage``), fills it and publishes it
(``publish_stage``); the consumers wait for it (``wait_stage``) and release it (``release_stage``).
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import cpasync

from .common import SMEM_PER_CTA
from .config_space import MAX_CTAS, MAX_STAGES, PREFETCH_CHOICES
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


def stages_smem_bytes(stages: int, stage_bytes: int) -> int:
    """Shared memory of a ring of ``stages`` stages: the stages, a full and an empty mbarrier
    each, and slack for the allocator's alignment."""
    return stages * stage_bytes + 16 * stages + 512


def producer_prefetch(arch: str) -> int:
    """The producer's chunk of items (``PREFETCH_BY_ARCH``) for a target arch."""
    return PREFETCH_BY_ARCH.get(arch, PREFETCH_OTHER)


def pipeline_check(stages: int, ctas: int, smem_bytes: int, prefetch: int = 4) -> Optional[str]:
    """Why a pipelined decode's stage ring, producer chunk and persistent grid cannot launch, or None."""
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
