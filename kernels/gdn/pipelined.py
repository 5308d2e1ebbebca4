"""Gated DeltaNet decode step on a persistent, warp-specialised pipeline (fp32 checkpoint, with
or without a read copy).

Same step as ``kernels/gdn/decode.py`` (ReplaySSM standard decoding, Algorithm 4; window 1 is
the conventional fused step), with the residency of ``kernels/mamba2/pipelined.py``: a fixed grid
of CTAs loops over work items, one per (batch row, value head, half of the head's V rows), or with
``heads_per_item`` H > 1 per (batch row, H consecutive value heads of one key head), items
``bid, bid + grid, ...``. Warp 0 produces, the other warps consume:

- the producer fills ``stages`` shared-memory stages (protocol: kernels/pipeline.py), each with
  everything one item needs: its heads' (rows_per_item, K) checkpoint rows one after the other
  (one TMA box), the live ring records (u of those rows, the key head's keys once, each value
  head's g; stale positions stored as zeros) by cp.async, and, loaded a chunk of items ahead,
  this token's q, k, v (plain loads: q, k and v may be views with any batch stride) and the
  item's scalars (slot, h, origin, each head's raw gates, A_log, dt_bias), which it turns into
  what every consumer warp of the item would otherwise repeat before its first dot: k and q
  L2-normalised (q scaled) and their dot (once per item), each head's gates g and beta, stored
  into the stage;
- the consumers compute the item from shared memory only and release the stage (one arrival
  per consumer warp). With ``consumer_groups`` G > 1 the consumer warps form G groups, group g
  taking the CTA's items g, g + G, ... (its own stages, named barrier and scratch), so G items are
  computed at once and one item's chain of latencies hides behind another's. Consumer warp c (of
  a group) owns ``rows_per_warp`` of each head's rows (a lane per row
  for the row terms, ``k_vec`` consecutive elements of K per lane) and takes the item's heads in
  turn. The key head's ring dots (k_p . k, k_p . q) are the same for every row of every head: the
  consumer warps split the positions between them, store the dots in the stage and meet at their
  group's named barrier before reading them all; each warp weights them with its head's record
  weights into its own scratch.

Read copies (fp16, fp8, nvfp4 next to the fp32 checkpoint): a non-flushing item's box is its rows
of the read copy (block scales and nvfp4's state scale by cp.async); a 16-row warp's rows meet the
normalised k and q on tensor cores (``state_io.mma_row_dots``: the codes exact in fp16, k and q as
fp16 hi + lo parts, k in MMA column 0 and q in column 1, or in an n-tile each for nvfp4's 8 blocks
a row; their B fragments gathered once per item, split over the consumer warps next to the ring
dots, and staged for every warp: ``state_io.share_b_fragments``), where ``mma_dots``, else they are decoded row by
row on CUDA cores; a flushing item's stage holds no box: the producer prefetches its checkpoint rows into
L2, and each consumer warp loads its rows into registers, dots them, folds them and stores both
copies (RTN; nvfp4's state scale reduced over the consumer warps, whole heads per item). Where the
cache re-derives a flush's corrections (``flush_corrections="rederive"``), a flushing item's stage
also holds the records' v and beta, the consumer warps split the records' coupling between them
(``solve_matrix``, the keys' Gram matrix on tensor cores), and each warp takes S_ckpt k_p of its rows from the registers that hold
them for the fold (``checkpoint_key_dots``) and runs their forward substitution
(``coupled_substitution``); with ``keep_v_beta`` a non-flushing item appends v and beta too.
A 16-row warp's flush next to a read copy runs on tensor cores (``mma_flush``, K a multiple of 32
up to 128): its rows are loaded in the m16n8k8 fragment layout (``fragment_rows``: a lane holds a
quarter of K of two rows, which serves as A fragments and as accumulators), S_ckpt k_p
(``fragment_key_dots``) and the fold's rank-cap update (``fragment_fold``) are TF32 MMAs with the
fp32 operand split into hi + lo (the keys exact in TF32 where act is 16-bit), and the rows are
stored from that layout (``state_io.store_copies_at``); the row dots with k and q and this token's
term stay on CUDA cores in fp32.

Tensor contract: as ``kernels/gdn/decode.py`` (same arguments, same order), restricted to an
fp32 checkpoint (``GDNPipeConfig.check``): the checkpoint scales and the SR seed are None.

| name        | shape             | dtype    | access | meaning                                     |
|-------------|-------------------|----------|--------|---------------------------------------------|
| checkpoint  | (S, HV, V, K)     | fp32     | R / W on flush | S_ckpt (the state when L = 1)       |
| q, k        | (b, H, K)         | act      | R      | raw query / key; any batch stride           |
| v           | (b, HV, V)        | act      | R      | value, any batch stride                     |
| a, b        | (b, HV)           | gate     | R      | raw gates                                   |
| A_log, dt_bias | (HV,)          | param    | R      |                                             |
| slot_ids    | (b,)              | int32    | R      | pool slot per row; pad / out-of-range rows skip |
| out         | (b, HV, V)        | act      | W      | o (pad rows left untouched)                 |
| ring_u / ring_k / ring_g | (S, cap, HV, V) / (S, cap, H, K) / (S, cap, HV) | fp16 / act / fp32 | R / W | records (L > 1) |
| ring_v / ring_beta | (S, cap, HV, V) / (S, cap, HV) | act / fp32 | W; R at a re-deriving flush | keep_v_beta |
| plan        | (b, 4)            | int32    | R      | (slot, h, origin, sr_writes) (L > 1)         |
| read / read_scale / read_state_scale | state_io's table | fp16 / fp8 / nvfp4 | R / W on flush | read copy (optional) |

The kernel takes this token's tensors as a ``GDNToken``, the records with the plan as a
``GDNRing`` and the copies' other tensors (the read copy with its scales) as a
``state_io.CopyTensors``.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator

from ..common import (add_coef_keys, after_previous_kernel, lane_scan, launch, load_past_l1, loop_variant, mma_tf32,
                      pow2_at_least, prefetch_l2, record_values, slot_is_live, smem_fit, warp_reduce_many)
from ..config_space import HEADS_PER_ITEM_CHOICES, PIPELINE_STAGE_CHOICES, PREFETCH_CHOICES
from ..limits import MAX_CAPACITY, programmatic_launch
from ..pipeline import (CONSUMER_BARRIER, MAX_BOX_ROWS, READ_STATE_SCALE, acquire_stage, as_column, box_partition,
                        copy_read_scales_async, copy_records_async, item_plan, pipeline_check, producer_prefetch,
                        publish_stage, release_stage, residency_check, stage_barriers, stage_item_plan, stage_of,
                        staged, stages_smem_bytes, wait_item)
from ..state_io import (CopyTensors, decode_slice, dot_fragments, entry_tma, lane_amax, max_nan, mma_row_dots,
                        ring_coefficients, scale_per_row, share_b_fragments, shared_b_fragments, smem_scale,
                        store_copies, store_copies_at, warps_state_scale)
from .common import gdn_gates, normalize_qk
from .config import CUDA_CORE_DOT_READS, GDNRing, GDNShape, GDNToken, rows_fit_tensor_cores
from .decode import rederived_by_position

ROWS_PER_WARP = (8, 16)  # a consumer warp's rows: 2 x rows row dots reduced at once, the folded rows in registers
ROW_LANES = (8, 16, 32)  # lanes sharing a state row in the CUDA-core row dots (GDNPipeConfig.row_lanes)
META = 8  # scalars of an item staged by the producer (the fp32 ones per value head)
META_G, META_BETA, META_KQ = 0, 1, 2  # its fp32 slots: the gates, k . q (head 0's) and READ_STATE_SCALE (nvfp4's)
# The default's stage count where fewer stages than fit were measured faster: an fp8 read copy
# takes 2 (H200, both registry GDN shapes, batches 32-1024: 4-9% faster than 6, the tuner's
# winner at every bucket; sweeps/results/README.md, "GDN read copies on the pipeline by default").
MAX_DEFAULT_STAGES = {"fp8": 2}
# Items of two value heads next to a read copy, in two stages (H200, Qwen3.5-122B, batch 64 / 256:
# window mean 1.13-1.17x one-head items for fp8 and nvfp4, 0.99-1.03x for fp16; more stages of them
# were slower; sweeps/results/README.md, "GDN items of two value heads by default").
READ_COPY_HEADS_PER_ITEM = 2
MMA_FLUSH_ROWS = 16  # a tensor-core flush's warp rows: one m16 tile, lane 4 g + t holding rows g and g + 8
RING_KEY_PAD = 8  # elements after each staged ring key: the tensor-core flush's column reads of the keys spread over the banks
MAX_GROUPED_WARPS = 9  # tuner: consumer groups only where an SM's warps leave ptxas 168 registers a thread


def kq_fragment_scales(q_scale: float):
    """Powers of two that take the normalised k (|k_i| <= 1) and q (|q_i| <= q_scale) to at most
    2^14 for their fp16 B fragments (state_io.share_b_fragments)."""
    return 2.0 ** 14, 2.0 ** (14 - math.ceil(math.log2(q_scale)))


def item_rows(gHead: cute.Tensor, rows: int, part) -> cute.Tensor:
    """An item's (positions, rows) ring records from those of its first value head ``gHead``
    (positions, head_v_dim; the ring's tensors are compact, so the next heads' rows follow at
    each position): part ``part`` of one head, or whole consecutive heads."""
    positions, V = cute.size(gHead, mode=[0]), cute.size(gHead, mode=[1])
    if rows <= V:
        return cute.local_tile(gHead, (positions, rows), (0, part))
    return cute.make_tensor(gHead.iterator, cute.make_layout((positions, rows), stride=(gHead.stride[0], 1)))


@cute.jit
def lane_vectors(sK: cute.Tensor, sQ: cute.Tensor, vec: cutlass.Constexpr[int]):
    """(rK, rQ): this lane's ``vec`` consecutive elements of the staged fp32 k and q (zeros past K)."""
    lane = cute.arch.lane_idx()
    rK = cute.make_rmem_tensor((vec,), Float32)
    rQ = cute.make_rmem_tensor((vec,), Float32)
    rK.fill(0.0)
    rQ.fill(0.0)
    if lane < cute.size(sK) // vec:
        for e in cutlass.range_constexpr(vec):
            rK[e] = sK[lane * vec + e]
            rQ[e] = sQ[lane * vec + e]
    return rK, rQ


@cute.jit
def key_head_ring_dots(sRingK: cute.Tensor, rK: cute.Tensor, rQ: cute.Tensor, sRingDot: cute.Tensor, worker: Int32,
                       workers: cutlass.Constexpr[int], cap: cutlass.Constexpr[int], vec: cutlass.Constexpr[int]):
    """``sRingDot[0, p]`` = k_p . k and ``sRingDot[1, p]`` = k_p . q for the staged ring keys
    ``sRingK`` (cap, K; stale ones zero) and this token's fp32 k and q (``rK``, ``rQ``: the lane's
    ``vec`` consecutive elements, ``lane_vectors``): the same for every value head of the key head,
    split over ``workers`` warps (this one is ``worker``: positions worker, worker + workers, ...;
    a lane's value 2 i / 2 i + 1 are those of its i-th)."""
    lane = cute.arch.lane_idx()
    K = cute.size(sRingK, mode=[1])
    pos_per_warp = (cap + workers - 1) // workers
    n_dots = pow2_at_least(2 * pos_per_warp)
    dot_shift = 5 - (n_dots.bit_length() - 1)
    rDots = cute.make_rmem_tensor((n_dots,), Float32)
    rDots.fill(0.0)
    if lane < K // vec:
        for i in cutlass.range_constexpr(pos_per_warp):
            p = worker + workers * i
            if p < cap:
                rKey = cute.make_rmem_tensor((vec,), sRingK.element_type)
                cute.autovec_copy(cute.local_tile(sRingK[p, None], (vec,), (lane,)), rKey)
                for e in cutlass.range_constexpr(vec):
                    rDots[2 * i] = rDots[2 * i] + rKey[e].to(Float32) * rK[e]
                    rDots[2 * i + 1] = rDots[2 * i + 1] + rKey[e].to(Float32) * rQ[e]
    dot = warp_reduce_many(rDots, n_dots)  # lane l: value l >> dot_shift
    value = lane >> dot_shift
    p_l = worker + workers * (value // 2)
    if lane % (1 << dot_shift) == 0 and value < 2 * pos_per_warp and p_l < cap:
        sRingDot[value % 2, p_l] = dot


@cute.jit
def row_totals(rRows: cute.Tensor, lr: Int32, rows_per_warp: cutlass.Constexpr[int]):
    """(S k, S q) of the warp's row ``lr`` from each lane's partial dots ``rRows`` (2 per row)."""
    rows = warp_reduce_many(rRows, 2 * rows_per_warp)
    shift = 5 - (2 * rows_per_warp).bit_length() + 1
    return (cute.arch.shuffle_sync(rows, (2 * lr) << shift), cute.arch.shuffle_sync(rows, (2 * lr + 1) << shift))


def row_piece(shape: GDNShape, row_lanes: int) -> int:
    """The consecutive elements of a row a lane loads at once in ``grouped_row_dots``: 16 bytes
    of the staged rows, or its whole share where that is less."""
    entry = shape.copies.entry
    return min(16 * 8 // entry.storage.width, shape.head_k_dim // row_lanes)


@cute.jit
def grouped_row_dots(read: cutlass.Constexpr, sRows: cute.Tensor, sReadScale, stage: Int32, sK: cute.Tensor,
                     sQ: cute.Tensor, first_row: Int32, rows: cutlass.Constexpr[int], lanes: cutlass.Constexpr[int],
                     piece: cutlass.Constexpr[int]):
    """(S k, S q) of the warp's row ``first_row + lane % rows`` of the staged rows ``sRows``
    (rows, cols; the fp32 checkpoint's, or an fp16 / fp8 read copy's with its row scales
    ``sReadScale`` of stage ``stage``), on CUDA cores with ``lanes`` lanes to a row: the warp takes
    32 / lanes rows at a time, lane t of a row's group its pieces t, t + lanes, ... of ``piece``
    elements (a group reads whole 16-byte bank rows), and each group sums its 2 rows / (32 /
    lanes) partial dots over its own lanes (``warp_reduce_many``). An fp8 row's one scale is
    taken after its dots."""
    lane = cute.arch.lane_idx()
    K = cute.size(sK)
    pieces = K // (lanes * piece)  # a lane's pieces of a row
    group_rows = 32 // lanes  # rows a pass takes
    passes = rows // group_rows
    g, t = lane // lanes, lane % lanes
    rK = cute.make_rmem_tensor((pieces * piece,), Float32)
    rQ = cute.make_rmem_tensor((pieces * piece,), Float32)
    for j in cutlass.range_constexpr(pieces):
        for e in cutlass.range_constexpr(piece):
            rK[j * piece + e] = sK[(j * lanes + t) * piece + e]
            rQ[j * piece + e] = sQ[(j * lanes + t) * piece + e]
    rDots = cute.make_rmem_tensor((2 * passes,), Float32)
    for p in cutlass.range_constexpr(passes):
        row = first_row + p * group_rows + g
        dot_k = Float32(0.0)
        dot_q = Float32(0.0)
        for j in cutlass.range_constexpr(pieces):
            rS = cute.make_rmem_tensor((piece,), Float32)
            if cutlass.const_expr(read is None):
                cute.autovec_copy(cute.local_tile(sRows[row, None], (piece,), (j * lanes + t,)), rS)
            else:
                decode_slice(read, cute.local_tile(sRows[row, None], (read.per_lane(piece),), (j * lanes + t,)), None,
                             rS)
            for e in cutlass.range_constexpr(piece):
                dot_k = dot_k + rS[e] * rK[j * piece + e]
                dot_q = dot_q + rS[e] * rQ[j * piece + e]
        rDots[2 * p] = dot_k
        rDots[2 * p + 1] = dot_q
    n = 2 * passes
    total = warp_reduce_many(rDots, n, lanes)  # lane t of group g: value t >> shift of the group's rows
    shift = (lanes.bit_length() - 1) - (n.bit_length() - 1)
    lr = lane % rows
    pass_r, group_r = lr // group_rows, lr % group_rows  # row lr's pass and group
    s_k = cute.arch.shuffle_sync(total, group_r * lanes + ((2 * pass_r) << shift))
    s_q = cute.arch.shuffle_sync(total, group_r * lanes + ((2 * pass_r + 1) << shift))
    if cutlass.const_expr(read is not None and scale_per_row(read)):
        row_scale = smem_scale(read, sReadScale, stage, first_row + lr, Int32(0), Float32(1.0))
        s_k, s_q = s_k * row_scale, s_q * row_scale
    return s_k, s_q


@cute.jit
def solve_matrix(sKeys: cute.Tensor, sSolve: cute.Tensor, g_j: Float32, beta_lane: Float32, origin: Int32, h: Int32,
                 worker: Int32, workers: cutlass.Constexpr[int], cap: cutlass.Constexpr[int],
                 keys_exact: cutlass.Constexpr[bool]):
    """The records' coupling in a flush's re-derivation, the same for every row of the value head:
    ``sSolve[i, j] = beta_j D(i, j) (k_i . k_j)`` for records i < j < h, with D(i, j) = alpha_{i+1}
    ... alpha_j the decay between them, zero elsewhere (record order; ``sKeys`` by ring position,
    stale ones finite). The keys' Gram matrix on tensor cores (TF32, exact for 16-bit keys, else
    3xTF32), a 16 x 8 block of positions per warp pass, the blocks split over ``workers`` warps
    (this one is number ``worker``); lane j: ``g_j`` and ``beta_lane`` of record j."""
    lane = cute.arch.lane_idx()
    g = lane // 4
    t = lane % 4
    K = cute.size(sKeys, mode=[1])
    # every record's decay alpha_t in every lane; D as a product over t in (i, j] (no exp per pair)
    alpha_lane = cute.math.exp(g_j, fastmath=False)
    rAlpha = cute.make_rmem_tensor((cap,), Float32)
    for r in cutlass.range_constexpr(cap):
        rAlpha[r] = cute.arch.shuffle_sync(alpha_lane, r)
    m_tiles = (cap + 15) // 16
    n_tiles = (cap + 7) // 8
    for bb in cutlass.range_constexpr((m_tiles * n_tiles + workers - 1) // workers):
        block = bb * workers + worker
        if block < m_tiles * n_tiles:
            p0 = block // n_tiles * 16
            q0 = block % n_tiles * 8
            # positions past the ring: a real key, its result unused; k slots t / t + 4 of step s
            # are columns 8 s + 2 t and 8 s + 2 t + 1 (one pair load), the same in both operands
            rows = (cutlass.min(p0 + g, cap - 1), cutlass.min(p0 + g + 8, cap - 1), cutlass.min(q0 + g, cap - 1))
            acc = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
            acc.fill(0.0)
            for step in cutlass.range_constexpr(K // 8):
                rPairs = cute.make_rmem_tensor(cute.make_layout((3, 2), stride=(2, 1)), sKeys.element_type)
                for k in cutlass.range_constexpr(3):
                    cute.autovec_copy(cute.local_tile(sKeys[rows[k], None], (2,), (4 * step + t,)), rPairs[k, None])
                rA = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
                rB = cute.make_rmem_tensor(cute.make_layout((2, 1, 1)), Float32)
                for i in cutlass.range_constexpr(4):
                    rA[i, 0, 0] = rPairs[i % 2, i // 2].to(Float32)
                for i in cutlass.range_constexpr(2):
                    rB[i, 0, 0] = rPairs[2, i].to(Float32)
                mma_tf32(acc, rA, rB, not keys_exact, not keys_exact)
            for c in cutlass.range_constexpr(4):
                p = p0 + g + 8 * (c // 2)
                q = q0 + 2 * t + c % 2
                i = (p - origin + cap) % cap  # the records at the two positions
                j = (q - origin + cap) % cap
                decay = Float32(1.0)
                for r in cutlass.range_constexpr(cap):
                    decay = decay * cutlass.select_((i < r) & (r <= j), rAlpha[r], Float32(1.0))
                beta_j = cute.arch.shuffle_sync(beta_lane, j)
                if (p < cap) & (q < cap):
                    sSolve[i, j] = cutlass.select_((i < j) & (j < h), beta_j * decay * acc[c, 0, 0], Float32(0.0))


@cute.jit
def checkpoint_key_dots(rRows: cute.Tensor, sKeys: cute.Tensor, sSk: cute.Tensor, rows: cutlass.Constexpr[int],
                        cap: cutlass.Constexpr[int], vec: cutlass.Constexpr[int], act: cutlass.Constexpr):
    """sSk[p, r] = S_ckpt[row r] . k_p for the warp's ``rows`` rows held in registers (``rRows``:
    (rows, vec), the lane's slice of each) and every position p: one key load per position for
    all rows (the tile kernels' ``decode.row_key_dots`` takes a row at a time)."""
    lane = cute.arch.lane_idx()
    shift = 5 - (rows.bit_length() - 1)
    for p in cutlass.range(cap, unroll=2):
        rKey = cute.make_rmem_tensor((vec,), act)
        cute.autovec_copy(cute.local_tile(sKeys[p, None], (vec,), (lane,)), rKey)
        rDots = cute.make_rmem_tensor((rows,), Float32)
        for r in cutlass.range_constexpr(rows):
            acc = Float32(0.0)
            for e in cutlass.range_constexpr(vec):
                acc = acc + rRows[r, e] * rKey[e].to(Float32)
            rDots[r] = acc
        total = warp_reduce_many(rDots, rows)  # lane l: row l >> shift
        if lane % (1 << shift) == 0:
            sSk[p, lane >> shift] = total


@cute.jit
def coupled_substitution(sSolve: cute.Tensor, sSk: cute.Tensor, sV: cute.Tensor, sUre: cute.Tensor, beta_lane: Float32,
                         rU: cute.Tensor, g_j: Float32, origin: Int32, h: Int32, rows: cutlass.Constexpr[int],
                         cap: cutlass.Constexpr[int]):
    """Paper Algorithm 6 for this lane's row (lane mod ``rows`` of the warp's), as
    ``decode.forward_substitution`` computes it for the tile kernels, here right-looking with the
    records' coupling precomputed (``solve_matrix``): for the records
    j = 0 .. h-1 in order, ``u_j = beta_j (v_j - alpha_j S_{j-1} k_j)`` with
    ``alpha_j S_{j-1} k_j = e^{P_j} (S_ckpt k_j) + sum_{i<j} D(i, j) (k_i . k_j) u_i`` (P the
    prefix sums of g, D the decay between records), replacing the cached ones in ``rU`` (by ring
    position; zero at stale positions), so that read-copy rounding never enters the recurrence.
    The warp's (cap, rows) tensors by ring position: ``sSk`` S_ckpt k_p, ``sV`` the records' v (any
    dtype), ``sUre`` scratch; ``sSolve`` the records' coupling (``solve_matrix``); lane j: ``g_j``
    and ``beta_lane`` of record j. The tile kernels keep the left-looking loop: this form's
    registers slowed their non-flush steps (fp16 read copy, Qwen3.5-122B, batch 256: 321 against
    282 us in one call), while the pipeline's flush gains 1.3-1.65x from it."""
    lane = cute.arch.lane_idx()
    lr = lane % rows
    prefix = lane_scan(g_j)  # inclusive prefix sums P_j across lanes
    ckpt_lane = beta_lane * cute.math.exp(prefix, fastmath=False)  # lane j: beta_j e^{P_j}

    # Each record's right-hand side beta_j (v_j - e^{P_j} S_ckpt k_j), then the records in order:
    # u_j is final once the earlier ones are subtracted, and is subtracted from every later one
    # at once (coupling row j from shared memory, the same for every lane), so no dependent
    # chain runs longer than the records.
    rRhs = cute.make_rmem_tensor((cap,), Float32)
    for j in cutlass.range_constexpr(cap):
        p = cutlass.select_(origin + j >= cap, origin + j - cap, origin + j)
        rRhs[j] = (cute.arch.shuffle_sync(beta_lane, j) * sV[p, lr].to(Float32)
                   - cute.arch.shuffle_sync(ckpt_lane, j) * sSk[p, lr])
    for j in cutlass.range_constexpr(cap):
        if j < h:
            sUre[j, lr] = rRhs[j]
            if cutlass.const_expr(j + 1 < cap):
                rCoupling = cute.make_rmem_tensor((cap,), Float32)
                cute.autovec_copy(sSolve[j, None], rCoupling)
                for later in cutlass.range_constexpr(j + 1, cap):
                    rRhs[later] = rRhs[later] - rCoupling[later] * rRhs[j]
    rederived_by_position(sUre, rU, origin, h, lr, cap)


def flush_fits_tensor_cores(shape: GDNShape, rows_per_warp: int) -> bool:
    """Whether a flush next to a read copy can run on tensor cores (``fragment_rows``): 16-row
    warps whose lanes each hold a quarter of K (K a multiple of 32 up to 128: 8 to 32 values a
    row, so an fp8 copy's scale block is the whole row)."""
    K = shape.head_k_dim
    return shape.read_copy is not None and rows_per_warp == MMA_FLUSH_ROWS and K % 32 == 0 and K <= 128


def fragment_piece(shape: GDNShape) -> int:
    """Consecutive columns of a row a lane holds in the tensor-core flush (``fragment_rows``): 4,
    so that a quad loads and stores 64 contiguous bytes of fp32 at a time; next to an nvfp4 copy
    its 16-column scale block (or the most of it a quarter of K takes), so that a lane encodes
    whole blocks (their software E2M1 rounding and scale once per block, not per lane)."""
    quarter = shape.head_k_dim // 4
    return next(p for p in (16, 8, 4) if quarter % p == 0) if shape.read_copy == "nvfp4" else 4


@cute.jit
def fragment_rows(rRows: cute.Tensor, mRows: cute.Tensor, first_row: Int32, piece: cutlass.Constexpr[int]):
    """The tensor-core flush's layout of a warp's 16 fp32 rows ``first_row ..`` of ``mRows`` (rows,
    K): lane 4 g + t holds rows g and g + 8 (``rRows[0]``, ``rRows[1]``), a quarter of K each, its
    element e column ``fragment_col(t, e, piece)``: pieces of ``piece`` columns, the quad's lanes
    side by side (``fragment_piece``). MMA step s takes
    elements 2 s and 2 s + 1 as k slots t and t + 4 (a permutation of K, the same in every operand),
    so the rows are at once the A fragments of their dots with the keys and the accumulators
    (columns 2 t, 2 t + 1 of n-tile s) of the fold."""
    lane = cute.arch.lane_idx()
    pieces = cute.size(rRows, mode=[1]) // piece
    for half in cutlass.range_constexpr(2):
        row = mRows[first_row + lane // 4 + 8 * half, None]
        for pc in cutlass.range_constexpr(pieces):
            cute.autovec_copy(cute.local_tile(row, (piece,), (4 * pc + lane % 4,)),
                              cute.local_tile(rRows[half, None], (piece,), (pc,)))


def fragment_col(t, e: int, piece: int):
    """The column of element ``e`` of quad lane ``t`` in ``fragment_rows``' layout."""
    return 4 * piece * (e // piece) + piece * t + e % piece


@cute.jit
def fragment_row_dots(rRows: cute.Tensor, sK: cute.Tensor, sQ: cute.Tensor, piece: cutlass.Constexpr[int]):
    """(S k, S q) of row lane % 16 of the warp for the rows in ``fragment_rows``' layout and the
    staged fp32 k and q (K,): each lane's quarter dots, summed over its quad."""
    lane = cute.arch.lane_idx()
    pieces = cute.size(rRows, mode=[1]) // piece
    rDots = cute.make_rmem_tensor((4,), Float32)  # rows g, g + 8 with k, then with q
    rDots.fill(0.0)
    for pc in cutlass.range_constexpr(pieces):
        rK = cute.make_rmem_tensor((piece,), Float32)
        rQ = cute.make_rmem_tensor((piece,), Float32)
        cute.autovec_copy(cute.local_tile(sK, (piece,), (4 * pc + lane % 4,)), rK)
        cute.autovec_copy(cute.local_tile(sQ, (piece,), (4 * pc + lane % 4,)), rQ)
        for half in cutlass.range_constexpr(2):
            for e in cutlass.range_constexpr(piece):
                rDots[half] = rDots[half] + rRows[half, pc * piece + e] * rK[e]
                rDots[2 + half] = rDots[2 + half] + rRows[half, pc * piece + e] * rQ[e]
    for i in cutlass.range_constexpr(4):
        for offset in (1, 2):
            rDots[i] = rDots[i] + cute.arch.shuffle_sync_bfly(rDots[i], offset=offset)
    source = 4 * (lane % 8)  # row lane % 16: row g = lane % 8 of quad lane % 8, in its second half from lane 8
    second = (lane % 16) >= 8
    s_k = cutlass.select_(second, cute.arch.shuffle_sync(rDots[1], source), cute.arch.shuffle_sync(rDots[0], source))
    s_q = cutlass.select_(second, cute.arch.shuffle_sync(rDots[3], source), cute.arch.shuffle_sync(rDots[2], source))
    return s_k, s_q


@cute.jit
def fragment_key_dots(rRows: cute.Tensor, sKeys: cute.Tensor, sSk: cute.Tensor, cap: cutlass.Constexpr[int],
                      keys_exact: cutlass.Constexpr[bool], piece: cutlass.Constexpr[int]):
    """``checkpoint_key_dots`` on tensor cores for rows in ``fragment_rows``' layout:
    sSk[p, r] = S_ckpt[row r] . k_p for the warp's 16 rows and every ring position p, 3xTF32 (the
    rows split into hi + lo, the keys exact where act is 16-bit)."""
    lane = cute.arch.lane_idx()
    g = lane // 4
    t = lane % 4
    quarter = cute.size(rRows, mode=[1])
    nt = (cap + 7) // 8
    acc = cute.make_rmem_tensor(cute.make_layout((4, 1, nt)), Float32)
    acc.fill(0.0)
    for step in cutlass.range_constexpr(quarter // 2):
        rA = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
        for i in cutlass.range_constexpr(4):
            rA[i, 0, 0] = rRows[i % 2, 2 * step + i // 2]
        rB = cute.make_rmem_tensor(cute.make_layout((2, nt, 1)), Float32)
        for n in cutlass.range_constexpr(nt):
            rPair = cute.make_rmem_tensor((2,), sKeys.element_type)
            p = cutlass.min(8 * n + g, cap - 1)  # past the ring: a real key, its column unused
            cute.autovec_copy(cute.local_tile(sKeys[p, None], (2,), (fragment_col(t, 2 * step, piece) // 2,)), rPair)
            for i in cutlass.range_constexpr(2):
                rB[i, n, 0] = rPair[i].to(Float32)
        mma_tf32(acc, rA, rB, True, not keys_exact)
    for n in cutlass.range_constexpr(nt):
        for i in cutlass.range_constexpr(4):
            p = 8 * n + 2 * t + i % 2
            if p < cap:
                sSk[p, g + 8 * (i // 2)] = acc[i, 0, n]


@cute.jit
def fragment_fold(rRows: cute.Tensor, sK: cute.Tensor, u: Float32, gamma: Float32, rCoefs: cute.Tensor,
                  sCoef: cute.Tensor, sKeys: cute.Tensor, cap: cutlass.Constexpr[int],
                  ring: cutlass.Constexpr[bool], keys_exact: cutlass.Constexpr[bool], piece: cutlass.Constexpr[int]):
    """A flush's fold of the warp's 16 rows in ``fragment_rows``' layout:
    S = gamma S + u k (this token: lane r's ``u``, the staged fp32 k, on CUDA cores) + Coef Keys
    on tensor cores (3xTF32: Coef (16, cap) the records' coefficients, lane r's ``rCoefs`` by ring
    position through the warp's (cap, 16) scratch ``sCoef``, split into hi + lo; the ring keys
    exact where act is 16-bit; stale positions are zero in both)."""
    lane = cute.arch.lane_idx()
    g = lane // 4
    t = lane % 4
    quarter = cute.size(rRows, mode=[1])
    for half in cutlass.range_constexpr(2):
        coef = cute.arch.shuffle_sync(u, g + 8 * half)
        for pc in cutlass.range_constexpr(quarter // piece):
            rK = cute.make_rmem_tensor((piece,), Float32)
            cute.autovec_copy(cute.local_tile(sK, (piece,), (4 * pc + t,)), rK)
            for e in cutlass.range_constexpr(piece):
                i = pc * piece + e
                rRows[half, i] = gamma * rRows[half, i] + coef * rK[e]
    if cutlass.const_expr(ring):
        if lane < MMA_FLUSH_ROWS:
            for p in cutlass.range_constexpr(cap):
                sCoef[p, lane] = rCoefs[p]
        cute.arch.sync_warp()
        kf_steps = (cap + 7) // 8
        rA = cute.make_rmem_tensor(cute.make_layout((4, kf_steps)), Float32)  # rows g / g + 8, records t / t + 4
        for kf in cutlass.range_constexpr(kf_steps):
            for i in cutlass.range_constexpr(4):
                p = 8 * kf + t + 4 * (i // 2)
                rA[i, kf] = cutlass.select_(p < cap, sCoef[cutlass.min(p, cap - 1), g + 8 * (i % 2)], Float32(0.0))
        tiles = 4  # n-tiles of accumulators per pass
        for nc in cutlass.range_constexpr(quarter // (2 * tiles)):
            acc = cute.make_rmem_tensor(cute.make_layout((4, 1, tiles)), Float32)
            for n in cutlass.range_constexpr(tiles):
                for i in cutlass.range_constexpr(4):
                    acc[i, 0, n] = rRows[i // 2, 2 * (nc * tiles + n) + i % 2]
            # B column g of n-tile m: the column quad lane g // 2 holds as accumulator element g % 2
            cols = [fragment_col(g // 2, 2 * (nc * tiles + n), piece) + g % 2 for n in range(tiles)]
            add_coef_keys(acc, rA, sKeys, cols, cap, keys_exact)
            for n in cutlass.range_constexpr(tiles):
                for i in cutlass.range_constexpr(4):
                    rRows[i // 2, 2 * (nc * tiles + n) + i % 2] = acc[i, 0, n]


class GDNPipeSmem(NamedTuple):
    """The pipelined decode's shared memory (``GDNPipelinedDecode.shared_storage``); None where the
    shape has no such tensor. Per stage (the last mode): the item's state rows and their scales,
    its ring records, this token's q, k, v, the item's scalars; then per consumer group or warp the
    scratch that outlives a stage; a full and an empty mbarrier per stage."""

    sState: cute.Tensor
    sReadScale: Optional[cute.Tensor]
    sAmax: Optional[cute.Tensor]
    sRingU: Optional[cute.Tensor]
    sRingK: Optional[cute.Tensor]
    sRingDot: Optional[cute.Tensor]
    sWeightedDots: Optional[cute.Tensor]
    sRingV: Optional[cute.Tensor]
    sRingBeta: Optional[cute.Tensor]
    sSolve: Optional[cute.Tensor]
    sSk: Optional[cute.Tensor]
    sUre: Optional[cute.Tensor]
    sKQFragments: Optional[cute.Tensor]
    sQ: cute.Tensor
    sK: cute.Tensor
    sV: cute.Tensor
    sRingG: cute.Tensor
    sMetaI: cute.Tensor
    sMetaF: cute.Tensor
    full: cute.Pointer
    empty: cute.Pointer


class ConsumerWarp(NamedTuple):
    """A consumer warp's place: its group, its place in the group, its scratch slot, the group's
    named barrier, the lane's row in the warp, the warp's first row of a head's part and the
    lane's row in that part, the lane."""

    group: Int32
    warp_in_group: Int32
    scratch: Int32
    group_barrier: Int32
    lane_row: Int32
    first_row: Int32
    part_row: Int32
    lane: Int32


class StagedItem(NamedTuple):
    """One head of the item a consumer warp computes: its stage, batch row, value head and part;
    its slot (a live one), ring length h, origin, whether it flushes, the ring position this token
    takes, k . q, and the buffer of its B fragments."""

    stage: Int32
    row: Int32
    vhead: Int32
    part: Int32
    slot64: Int64
    h: Int32
    origin: Int32
    flush: cutlass.Boolean
    pos_h: Int32
    kq: Float32
    fragments_buffer: Int32


@dataclass(frozen=True)
class GDNPipeDims:
    """What the kernel's methods derive from (shape, config), once (``pipe_dims``); a plain
    dataclass, not a NamedTuple, which the DSL would take apart as a tree of values."""

    HV: int  # value heads
    V: int  # a value head's rows
    K: int  # a row's columns (head_k_dim)
    L: int  # window
    cap: int  # ring capacity
    ST: int  # stages
    PF: int  # the producer's chunk of items
    R: int  # an item's rows of each of its heads
    HI: int  # an item's value heads
    RI: int  # an item's rows: its heads' one after the other
    parts: int  # items per value head (1 where an item has several heads)
    HVI: int  # a row's items per part: its groups of HI value heads
    CW: int  # consumer warps of a group
    G: int  # consumer groups
    RW: int  # a consumer warp's rows
    vec: int  # a lane's consecutive elements of a K row
    KL: int  # lanes that hold part of a K row
    rep: int  # value heads per key head
    act: type  # activation dtype
    ring: bool  # L > 1
    read: object  # the read copy's CopyFormat, or None
    entry: object  # the CopyFormat a non-flushing item's stage holds
    mma_reads: bool  # a read copy's rows meet k and q on tensor cores
    mma_flush: bool  # a flush next to a read copy folds on tensor cores
    flush_rows: tuple  # a flush's fp32 rows in a lane's registers
    piece: int  # fragment_piece
    kq_ups: tuple  # kq_fragment_scales
    box_bytes: int  # an item's TMA box
    row_lanes: int  # lanes sharing a state row in the CUDA-core row dots
    row_piece: int  # a lane's consecutive elements of a row there (grouped_row_dots)


def pipe_dims(shape: GDNShape, config: "GDNPipeConfig") -> GDNPipeDims:
    """The ``GDNPipeDims`` of a kernel of ``shape`` launched with ``config``."""
    s, c = shape, config
    V, K, R, HI, RW = s.head_v_dim, s.head_k_dim, c.rows_per_item, c.heads_per_item, c.rows_per_warp
    mma_flush = c.tensor_core_flush(s)
    return GDNPipeDims(
        HV=s.num_v_heads, V=V, K=K, L=s.window, cap=s.capacity, ST=c.stages, PF=c.prefetch, R=R, HI=HI, RI=HI * R,
        parts=V // R, HVI=s.num_v_heads // HI, CW=c.consumer_warps(), G=c.consumer_groups, RW=RW, vec=s.k_vec,
        KL=K // s.k_vec, rep=s.num_v_heads // s.num_k_heads, act=s.act_dtype, ring=s.window > 1, read=s.copies.read,
        entry=s.copies.entry, mma_reads=c.tensor_core_reads(s), mma_flush=mma_flush,
        flush_rows=(2, K // 4) if mma_flush else (RW, s.k_vec), piece=fragment_piece(s),
        kq_ups=kq_fragment_scales(s.q_scale), box_bytes=HI * R * s.copies.entry.row_bytes, row_lanes=c.row_lanes,
        row_piece=row_piece(s, c.row_lanes))


@dataclass(frozen=True)
class GDNPipeConfig:
    """Launch configuration of the pipelined decode: ``stages`` items in shared memory per CTA,
    ``ctas`` CTAs in the persistent grid, ``rows_per_item`` state rows per item (a divisor of
    head_v_dim), ``rows_per_warp`` of them per consumer warp (8 or 16: more warps hide more of
    the per-item latency, fewer repeat less of the per-warp work), ``prefetch`` items whose inputs
    the producer loads in one round (kernels/pipeline.py); ``consumer_groups`` groups of an item's
    consumer warps take turns at the items (group g the CTA's items g, g + G, ...), so that many
    items are computed at once; ``min_ctas_per_sm`` > 0 caps registers so that many CTAs fit an SM;
    ``mma_dots``: a read copy's rows meet k and q on tensor cores where ``rows_fit_tensor_cores``
    takes them, else on CUDA cores; ``mma_flush``: a flush next to a read copy re-derives (S_ckpt
    k_p) and folds on tensor cores where ``flush_fits_tensor_cores`` takes it, else on CUDA cores;
    ``heads_per_item`` consecutive value heads of one key head per item (whole heads): the key
    head's work (k and q normalised, the ring keys staged, their dots with k and q) is done once
    for them, and a stage holds their rows (one TMA box), so that a read copy's small rows keep
    more bytes in flight; ``row_lanes``: the lanes that share a state row in a non-flushing
    item's row dots on CUDA cores (``grouped_row_dots``): 32 (each lane a slice of every row of the
    warp, reduced over the warp), or 8 / 16 (each lane a longer slice of fewer rows: fewer partial
    dots to reduce, over fewer lanes)."""

    stages: int = 4
    ctas: int = 132
    rows_per_item: int = 64
    rows_per_warp: int = 16
    prefetch: int = 4
    consumer_groups: int = 1
    min_ctas_per_sm: int = 0
    mma_dots: bool = True
    mma_flush: bool = True
    heads_per_item: int = 1
    row_lanes: int = 32

    def tensor_core_flush(self, shape: GDNShape) -> bool:
        return self.mma_flush and flush_fits_tensor_cores(shape, self.rows_per_warp)

    def tensor_core_reads(self, shape: GDNShape) -> bool:
        return self.mma_dots and rows_fit_tensor_cores(shape.copies.read, self.rows_per_warp, shape.k_vec)

    def ring_key_pad(self, shape: GDNShape) -> int:
        """Elements after each staged ring key: only the tensor-core flush's operand loads gain
        from it (elsewhere it cost the fp32 flush 3%)."""
        return RING_KEY_PAD if self.tensor_core_flush(shape) else 0

    def row_lanes_check(self, shape: GDNShape) -> Optional[str]:
        """Why ``row_lanes`` cannot serve ``shape``, or None."""
        if self.row_lanes not in ROW_LANES:
            return f"row_lanes {self.row_lanes}: expected one of {ROW_LANES}"
        if self.row_lanes == 32:
            return None
        read = shape.copies.read
        if self.tensor_core_reads(shape):
            return f"row_lanes {self.row_lanes}: the read copy's rows are on tensor cores (mma_dots)"
        if read is not None and not (read.name == "fp16" or scale_per_row(read)):
            return f"row_lanes {self.row_lanes}: a {read.name} read copy's rows take 32 lanes (scales per block)"
        if shape.head_k_dim % (self.row_lanes * row_piece(shape, self.row_lanes)):
            return f"row_lanes {self.row_lanes}: head_k_dim {shape.head_k_dim} is not a whole number of pieces a lane"
        return None

    def consumer_warps(self) -> int:
        """An item's consumer warps (one group's)."""
        return self.rows_per_item // self.rows_per_warp

    def warps(self) -> int:
        """A CTA's warps: the producer and every group's consumers."""
        return 1 + self.consumer_groups * self.consumer_warps()

    def stage_bytes(self, shape: GDNShape) -> int:
        HI, K, cap = self.heads_per_item, shape.head_k_dim, shape.capacity
        R = HI * self.rows_per_item  # the item's rows, its heads' one after the other
        act = shape.act_dtype.width // 8
        entry = shape.copies.entry
        box = R * entry.row_bytes + entry.scale_smem_bytes(R)  # the checkpoint's rows or the read copy's
        ring = (cap * R * 2 + cap * (K + self.ring_key_pad(shape)) * act + 2 * cap * 4) if shape.window > 1 else 0
        rederive = (cap * R * act + HI * 32 * 4) if shape.rederive else 0  # the records' v, each head's beta
        amax = 4 * self.consumer_warps() * HI if shape.copies.whole_state else 0
        return box + ring + rederive + amax + (2 * K + R) * 4 + HI * 32 * 4 + (1 + HI) * META * 4 + 128

    def smem_bytes(self, shape: GDNShape) -> int:
        # not staged: per consumer warp, by position and row, a re-deriving flush's S_ckpt k_p and
        # re-derived u, the latter also the tensor-core flush's fold coefficients, and the weighted
        # ring dots of the head it computes; per consumer group each head's coupling of the records
        # and two buffers of B fragments
        cap, G, warps = shape.capacity, self.consumer_groups, self.consumer_groups * self.consumer_warps()
        per_scratch = self.rows_per_item * G * cap * 4 + 16
        scratch = per_scratch * (2 if shape.rederive else 1 if self.tensor_core_flush(shape) else 0)
        weighted_dots = 2 * cap * 4 * warps + 16 if shape.window > 1 else 0
        coupling = G * self.heads_per_item * cap * cap * 4 + 16 if shape.rederive else 0
        fragments = 2 * G * len(dot_fragments(shape.copies.read, 2)) * 32 * 16 + 16 if self.tensor_core_reads(shape) else 0
        return stages_smem_bytes(self.stages, self.stage_bytes(shape)) + scratch + weighted_dots + coupling + fragments

    def key(self):
        return ("pipe", self.stages, self.ctas, self.rows_per_item, self.rows_per_warp, self.prefetch,
                self.consumer_groups, self.min_ctas_per_sm, self.mma_dots, self.mma_flush, self.heads_per_item,
                self.row_lanes)

    def check(self, shape: GDNShape) -> Optional[str]:
        V, K = shape.head_v_dim, shape.head_k_dim
        if shape.checkpoint_format != "fp32":
            return "the pipelined decode takes an fp32 checkpoint (with or without a read copy)"
        if K % 16 or K > 256:
            return f"head_k_dim {K}: the kernel needs a multiple of 16 up to 256"
        if self.rows_per_warp not in ROWS_PER_WARP:
            return f"rows_per_warp {self.rows_per_warp}: expected one of {ROWS_PER_WARP}"
        if self.rows_per_item % self.rows_per_warp or V % self.rows_per_item or self.rows_per_item > 256:
            return (f"rows_per_item {self.rows_per_item}: expected a multiple of rows_per_warp "
                    f"{self.rows_per_warp} up to 256 dividing head_v_dim {V}")
        if self.consumer_warps() > 16:
            return f"{self.consumer_warps()} consumer warps (rows_per_item / rows_per_warp): at most 16"
        HI, rep = self.heads_per_item, shape.num_v_heads // shape.num_k_heads
        if HI < 1 or rep % HI:
            return f"heads_per_item {HI}: expected a divisor of the value heads per key head ({rep})"
        if HI > 1 and self.rows_per_item != V:
            return f"heads_per_item {HI}: items of several heads take whole heads (rows_per_item {V}, not {self.rows_per_item})"
        if HI * self.rows_per_item > MAX_BOX_ROWS:
            return f"heads_per_item {HI}: {HI} heads of {V} rows are more than one TMA box holds ({MAX_BOX_ROWS} rows)"
        if self.prefetch * HI > max(PREFETCH_CHOICES):
            # the producer holds a chunk's v of every head twice (this chunk's and the next's)
            return (f"prefetch {self.prefetch} x heads_per_item {HI}: the producer holds at most "
                    f"{max(PREFETCH_CHOICES)} heads' inputs a chunk")
        reason = residency_check(self.stages, self.consumer_groups, self.warps(), self.min_ctas_per_sm)
        if reason is not None:
            return reason
        if shape.capacity > MAX_CAPACITY:
            return f"ring capacity {shape.capacity} (window + drafts) above {MAX_CAPACITY} (one lane per record)"
        reason = self.row_lanes_check(shape)
        if reason is not None:
            return reason
        if shape.read_copy is not None:
            reason = shape.copies.check(shape.k_vec, self.rows_per_item, V)
            if reason is not None:
                return reason
        if shape.rederive:
            if not (shape.keep_v_beta and shape.window > 1):
                return "re-deriving corrections needs keep_v_beta and a window > 1"
            if 32 * shape.k_vec != K:
                return f"a re-deriving flush needs every lane to hold a slice of a key: K = 32 x {shape.k_vec}, not {K}"
        return (pipeline_check(self.stages, self.ctas, self.smem_bytes(shape), self.prefetch)
                or smem_fit(self.smem_bytes(shape), self.min_ctas_per_sm))


def item_chunk(arch: str, heads_per_item: int) -> int:
    """The producer's chunk of items of ``heads_per_item`` value heads: the target's chunk cut to
    the heads whose inputs the producer can hold (``GDNPipeConfig.check``)."""
    return max(1, producer_prefetch(arch) // heads_per_item)


def pipelined_space(shape: GDNShape, sm_count: int, arch: str) -> List[GDNPipeConfig]:
    """The configs the tuner times (replayssm_cute.tune) where ``pipelined_config`` serves
    ``shape``: one or two CTAs per SM, whole or half heads per item, 8- or 16-row consumer warps,
    one or two consumer groups (where an SM keeps at most 9 warps: more leave a consumer fewer
    than 168 registers, and the flush spills), the stage counts of PIPELINE_STAGE_CHOICES that fit
    (multiples of the groups), the target's producer chunk, a read copy's row dots on tensor or
    CUDA cores, and next to a read copy items of several value heads (``HEADS_PER_ITEM_CHOICES``:
    the copy's small rows, the key head's work shared); [] where it serves nothing."""
    default = pipelined_config(shape, sm_count, arch)
    if default is None:
        return []
    V = shape.head_v_dim
    configs = []
    for heads in HEADS_PER_ITEM_CHOICES if shape.read_copy is not None else (1,):
        for per_sm in (1, 2):
            for rows in sorted({V, V // 2}, reverse=True):
                for rows_per_warp in ROWS_PER_WARP:
                    for groups in (1, 2):
                        for stages in PIPELINE_STAGE_CHOICES:
                            config = GDNPipeConfig(stages, per_sm * sm_count, rows, rows_per_warp,
                                                   item_chunk(arch, heads), groups, heads_per_item=heads)
                            if groups > 1 and per_sm * config.warps() > MAX_GROUPED_WARPS:
                                continue
                            if config.check(shape) is None and smem_fit(config.smem_bytes(shape), per_sm) is None:
                                configs.append(config)
                                if rows_fit_tensor_cores(shape.copies.read, rows_per_warp, shape.k_vec):
                                    configs.append(dataclasses.replace(config, mma_dots=False))
    return configs


def pipelined_config(shape: GDNShape, sm_count: int, arch: str) -> Optional[GDNPipeConfig]:
    """Next to a read copy, items of ``READ_COPY_HEADS_PER_ITEM`` whole value heads of a key head
    in two stages where the shape takes them; else whole heads per item where they take at most 8
    consumer warps of 16 rows (the ring dots split over more warps, and more warps per SM to hide
    the per-item latency: on the H200, Qwen3.5-122B at batch 256, 303 us a layer against 353 for
    half heads), else half heads, as many stages as fit up to ``MAX_DEFAULT_STAGES`` of the read
    copy. One CTA per SM, the target's producer chunk (cut to the heads an item holds), a read
    copy's row dots on the unit measured faster for it (``CUDA_CORE_DOT_READS``); None if the
    kernel cannot take `shape`."""
    V = shape.head_v_dim
    mma_dots = shape.read_copy not in CUDA_CORE_DOT_READS
    if shape.read_copy is not None:
        heads = READ_COPY_HEADS_PER_ITEM
        config = GDNPipeConfig(stages=2, ctas=sm_count, rows_per_item=V, prefetch=item_chunk(arch, heads),
                               mma_dots=mma_dots, heads_per_item=heads)
        if config.check(shape) is None:
            return config
    most = MAX_DEFAULT_STAGES.get(shape.read_copy, 6)
    for rows in (V, V // 2):
        if rows % 16 or rows > 128:
            continue
        for stages in range(most, 1, -1):
            config = GDNPipeConfig(stages=stages, ctas=sm_count, rows_per_item=rows,
                                   prefetch=producer_prefetch(arch), mma_dots=mma_dots)
            if config.check(shape) is None:
                return config
    return None


class GDNPipelinedDecode:
    """One decode step of a Gated DeltaNet layer over a pool of slots (see module docstring)."""

    def __init__(self, shape: GDNShape, config: GDNPipeConfig):
        reason = config.check(shape)
        if reason is not None:
            raise ValueError(f"GDNPipeConfig {config} invalid for {shape}: {reason}")
        self.shape = shape
        self.config = config
        self.dims = pipe_dims(shape, config)

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
        mRingU: Optional[cute.Tensor],
        mRingK: Optional[cute.Tensor],
        mRingG: Optional[cute.Tensor],
        mRingV: Optional[cute.Tensor],
        mRingBeta: Optional[cute.Tensor],
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
        tma_state, mStateTma = entry_tma(s.copies, mCheckpoint, mRead, d.HV * d.V, d.RI)
        launch(self.kernel(
            tma_state, mStateTma, mCheckpoint, GDNToken(mQ, mK, mV, mA, mB, mALog, mDtBias), mSlot, mOut,
            GDNRing(mRingU, mRingK, mRingG, mRingV, mRingBeta, mPlan),
            CopyTensors(mCheckpointScale, mCheckpointStateScale, mRead, mReadScale, mReadStateScale, mSrSeed),
        ), [c.ctas, 1, 1], [32 * c.warps(), 1, 1], stream, c.smem_bytes(s), c.min_ctas_per_sm)

    @cute.kernel
    def kernel(
        self,
        tma_state: cute.CopyAtom,
        mStateTma: cute.Tensor,
        mCheckpoint: cute.Tensor,
        token: GDNToken,
        mSlot: cute.Tensor,
        mOut: cute.Tensor,
        records: GDNRing,
        copy: CopyTensors,
    ):
        s, d = self.shape, self.dims
        PF, R, HI, parts, HVI, box_bytes = d.PF, d.R, d.HI, d.parts, d.HVI, d.box_bytes
        copies = s.copies

        tidx, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        num_slots = mCheckpoint.shape[0]
        total = token.mV.shape[0] * HVI * parts
        sm = self.shared_storage()

        # While the previous kernel finishes: lane u of the producer asks L2 for the entry rows (the
        # read copy's, else the checkpoint's) of the CTA's item u (by a slot id that may still
        # change: only a prefetch depends on it).
        if cutlass.const_expr(programmatic_launch()):  # a plain launch has nothing to overlap
            if (warp == 0) & (lane < PF):
                item = bid + lane * grid
                if item < total:
                    slot = load_past_l1(mSlot, item // (HVI * parts))
                    if slot_is_live(slot, num_slots, s.pad_slot_id):
                        mEntry = copy.mRead if copies.separate else mCheckpoint
                        prefetch_l2(mEntry[Int64(slot), (item // parts) % HVI * HI, (item % parts) * R, None], box_bytes)
        after_previous_kernel()

        if warp == 0:
            self.produce(tma_state, mStateTma, mCheckpoint, token, mSlot, records, copy, sm, bid, grid, lane,
                         num_slots, total)
        else:
            self.consume(mCheckpoint, mOut, records, copy, sm, bid, grid, warp, lane, num_slots, total)

    @cute.jit
    def shared_storage(self) -> GDNPipeSmem:
        """The kernel's shared memory (``GDNPipeSmem``), its mbarriers initialised."""
        s, c, d = self.shape, self.config, self.dims
        K, cap, ST, CW, G, RW, HI, RI, act, ring = d.K, d.cap, d.ST, d.CW, d.G, d.RW, d.HI, d.RI, d.act, d.ring
        copies, read, entry, rederive, mma_reads, mma_flush = s.copies, d.read, d.entry, s.rederive, d.mma_reads, d.mma_flush

        # Shared memory, declared once: per stage the item's state rows (the fp32 checkpoint's, or
        # the read copy's with their scales; head i's from i R), the ring records it reads, this
        # token's q, k, v (fp32) and the item's scalars (per head where they are a value head's);
        # a full and an empty mbarrier per stage; with re-derived corrections the records' v and
        # beta per stage; per consumer group each head's coupling (written after the item's first
        # barrier, which every warp reaches only once done with the previous item) and, for a read
        # copy's rows on tensor cores, k and q as every lane's B fragments (written before it: two
        # buffers, live items taking turns); each consumer warp's (of every group) weighted ring
        # dots of its head, S_ckpt k_p and re-derived u (with a tensor-core flush, the u scratch
        # also without re-derivation: it hands the fold's coefficients to the A fragments).
        smem = SmemAllocator()
        sState = staged(smem, entry.storage, (RI, entry.cols), ST, byte_alignment=128)
        sReadScale, sAmax = None, None
        if cutlass.const_expr(read is not None and read.scale_dtype is not None):
            sReadScale = staged(smem, read.scale_dtype, (RI, read.scales_per_row), ST)
        if cutlass.const_expr(copies.whole_state):
            sAmax = staged(smem, Float32, (CW, HI), ST)
        sRingU, sRingK, sRingDot, sWeightedDots = None, None, None, None
        if cutlass.const_expr(ring):
            sRingU = staged(smem, cutlass.Float16, (cap, RI), ST)
            sRingK = staged(smem, act, (cap, K), ST, row_pad=c.ring_key_pad(s))
            sRingDot = staged(smem, Float32, (2, cap), ST)  # k_p . k, k_p . q of live positions (key head's)
            # a warp's w_j k_p . k, w_j k_p . q of its head (the weights are the value head's)
            sWeightedDots = smem.allocate_tensor(Float32, cute.make_layout((2, cap, G * CW), stride=(cap, 1, 2 * cap)),
                                                 byte_alignment=16)
        sRingV, sRingBeta, sSolve, sSk, sUre = None, None, None, None, None
        if cutlass.const_expr(rederive):
            sRingV = staged(smem, act, (cap, RI), ST)
            sRingBeta = staged(smem, Float32, (32, HI), ST)
            sSolve = smem.allocate_tensor(Float32, cute.make_layout((cap, cap, HI, G), stride=(cap, 1, cap * cap,
                                                                                            cap * cap * HI)),
                                          byte_alignment=16)
            sSk = smem.allocate_tensor(Float32, cute.make_layout((cap, RW, G * CW), stride=(RW, 1, cap * RW)),
                                       byte_alignment=16)
        if cutlass.const_expr(rederive or mma_flush):  # the re-derived u, then the tensor-core fold's coefficients
            sUre = smem.allocate_tensor(Float32, cute.make_layout((cap, RW, G * CW), stride=(RW, 1, cap * RW)),
                                        byte_alignment=16)
        sKQFragments = None
        if cutlass.const_expr(mma_reads):  # (fragments, lane, words, buffer 2 g + parity): share_b_fragments
            fragments = len(dot_fragments(read, 2))
            sKQFragments = smem.allocate_tensor(Int32, cute.make_layout((fragments, 32, 4, 2 * G),
                                                                        stride=(128, 4, 1, 128 * fragments)),
                                                byte_alignment=16)
        sQ = staged(smem, Float32, (K,), ST)
        sK = staged(smem, Float32, (K,), ST)
        sV = staged(smem, Float32, (RI,), ST)
        sRingG = staged(smem, Float32, (32, HI), ST)
        sMetaI = staged(smem, Int32, (META,), ST)
        sMetaF = staged(smem, Float32, (META, HI), ST)
        full, empty = stage_barriers(smem, ST, CW)
        return GDNPipeSmem(sState, sReadScale, sAmax, sRingU, sRingK, sRingDot, sWeightedDots, sRingV, sRingBeta,
                           sSolve, sSk, sUre, sKQFragments, sQ, sK, sV, sRingG, sMetaI, sMetaF, full, empty)

    @cute.jit
    def produce(self, tma_state: cute.CopyAtom, mStateTma: cute.Tensor, mCheckpoint: cute.Tensor, token: GDNToken,
                mSlot: cute.Tensor, records: GDNRing, copy: CopyTensors, sm: GDNPipeSmem, bid: Int32, grid: Int32,
                lane: Int32, num_slots: Int32, total: Int32):
        """Warp 0: fill the stages with the CTA's items bid, bid + grid, ... (module docstring)."""
        s, d = self.shape, self.dims
        mRingU, mRingK, mRingG, mRingV, mRingBeta, mPlan = records
        K, L, cap, ST, PF, R, HI, RI, parts, HVI = d.K, d.L, d.cap, d.ST, d.PF, d.R, d.HI, d.RI, d.parts, d.HVI
        rep, act, ring, read, entry, rederive, box_bytes = d.rep, d.act, d.ring, d.read, d.entry, s.rederive, d.box_bytes
        u_per16 = 8  # fp16 u values per 16-byte cp.async
        k_per16 = 128 // act.width
        sState, sReadScale, sRingU, sRingK, sRingV, sRingBeta = (sm.sState, sm.sReadScale, sm.sRingU, sm.sRingK,
                                                                 sm.sRingV, sm.sRingBeta)
        sQ, sK, sV, sRingG, sMetaI, sMetaF, empty, full = (sm.sQ, sm.sK, sm.sV, sm.sRingG, sm.sMetaI, sm.sMetaF,
                                                           sm.empty, sm.full)
        t_s, t_g = box_partition(tma_state, mStateTma, sState, (RI, entry.cols))
        copy_u = cute.make_copy_atom(cpasync.CopyG2SOp(), cutlass.Float16, num_bits_per_copy=128)
        copy_k = cute.make_copy_atom(cpasync.CopyG2SOp(), act, num_bits_per_copy=128)
        copy4 = cute.make_copy_atom(cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
        # The producer walks its items in chunks of PF: it holds the chunk's q, k, v (and
        # lane u the scalars of item u) and loads the next chunk's while this one is issued,
        # so a load's latency is paid once per chunk behind PF stage waits.
        kq_per_lane = (K + 31) // 32  # lane: q and k elements lane, lane + 32, ...
        v_per_lane = (RI + 31) // 32  # lane: v of rows lane, lane + 32, ... of the item
        rQ = cute.make_rmem_tensor((PF, kq_per_lane), Float32)
        rK = cute.make_rmem_tensor((PF, kq_per_lane), Float32)
        rV = cute.make_rmem_tensor((PF, v_per_lane), Float32)
        rInt = cute.make_rmem_tensor((3,), Int32)
        rFloat = cute.make_rmem_tensor((4, HI), Float32)
        rQn = cute.make_rmem_tensor((PF, kq_per_lane), Float32)
        rKn = cute.make_rmem_tensor((PF, kq_per_lane), Float32)
        rVn = cute.make_rmem_tensor((PF, v_per_lane), Float32)
        rIntNext = cute.make_rmem_tensor((3,), Int32)
        rFloatNext = cute.make_rmem_tensor((4, HI), Float32)
        self.chunk_inputs(bid, grid, total, mSlot, mPlan, token, rQ, rK, rV, rInt, rFloat)
        chunk = Int32(0)
        for first in cutlass.range(bid, total, grid * PF, unroll=1):
            self.chunk_inputs(first + grid * PF, grid, total, mSlot, mPlan, token, rQn, rKn, rVn, rIntNext,
                              rFloatNext)
            for u in cutlass.range_constexpr(PF):
                item = first + u * grid
                if item < total:
                    vhead0 = (item // parts) % HVI * HI  # the item's first value head
                    part = item % parts
                    khead = vhead0 // rep
                    stage, phase = stage_of(chunk * PF + u, ST)
                    slot = cute.arch.shuffle_sync(rInt[0], u)
                    h = cute.arch.shuffle_sync(rInt[1], u)
                    origin = cute.arch.shuffle_sync(rInt[2], u)
                    live = slot_is_live(slot, num_slots, s.pad_slot_id)
                    flush_item = h + 1 >= L
                    with_box = live
                    if cutlass.const_expr(read is not None):
                        with_box = live & (h + 1 < L)  # a flush reads the checkpoint, not the copy
                    # The item's scalars, once here for all its consumer warps: the key head's k
                    # and q L2-normalised (q scaled) with their dot, and each value head's gates.
                    kq = normalize_qk(rK[u, None], rQ[u, None], kq_per_lane, s.q_scale)
                    gates = [gdn_gates(*[cute.arch.shuffle_sync(rFloat[k, i], u) for k in range(4)])
                             for i in range(HI)]
                    acquire_stage(empty, stage, phase)
                    for e in cutlass.range_constexpr(kq_per_lane):
                        col = e * 32 + lane
                        if col < K:
                            sQ[col, stage] = rQ[u, e]
                            sK[col, stage] = rK[u, e]
                    for e in cutlass.range_constexpr(v_per_lane):
                        vr = e * 32 + lane
                        if vr < RI:
                            sV[vr, stage] = rV[u, e]
                    if live:
                        slot64 = Int64(slot)
                        if cutlass.const_expr(ring):
                            # the live records only; stale positions as zeros. The item's heads'
                            # rows are consecutive at each position.
                            copy_records_async(copy_u, item_rows(mRingU[slot64, None, vhead0, None], RI, part),
                                               sRingU[None, None, stage], u_per16, origin, h)
                            copy_records_async(copy_k, mRingK[slot64, None, khead, None], sRingK[None, None, stage],
                                               k_per16, origin, h)
                            for i in cutlass.range_constexpr(HI):
                                copy_records_async(copy4, as_column(mRingG[slot64, None, vhead0 + i]),
                                                   as_column(cute.local_tile(sRingG[None, i, stage], (cap,), (0,))),
                                                   1, origin, h)
                        if cutlass.const_expr(read is not None):
                            if with_box:
                                for i in cutlass.range_constexpr(HI):
                                    sHeadScale = None
                                    if cutlass.const_expr(read.scale_dtype is not None):
                                        sHeadScale = cute.local_tile(sReadScale, (R, read.scales_per_row, ST),
                                                                     (i, 0, 0))
                                    copy_read_scales_async(read, copy, slot64, vhead0 + i, part, R, sHeadScale,
                                                           sMetaF[None, i, None], stage)
                            elif lane == 0:  # a flush: its checkpoint rows into L2 for the consumers' loads
                                prefetch_l2(mCheckpoint[slot64, vhead0, part * R, None], RI * K * 4)
                        if cutlass.const_expr(rederive):
                            if flush_item:  # the records' v and beta
                                copy_records_async(copy_k, item_rows(mRingV[slot64, None, vhead0, None], RI, part),
                                                   sRingV[None, None, stage], k_per16, origin, h)
                                for i in cutlass.range_constexpr(HI):
                                    copy_records_async(copy4, as_column(mRingBeta[slot64, None, vhead0 + i]),
                                                       as_column(cute.local_tile(sRingBeta[None, i, stage], (cap,),
                                                                                 (0,))),
                                                       1, origin, h)
                    if lane == 0:
                        stage_item_plan(sMetaI, stage, slot, h, origin)
                        sMetaF[META_KQ, 0, stage] = kq
                        for i in cutlass.range_constexpr(HI):
                            sMetaF[META_G, i, stage] = gates[i][0]
                            sMetaF[META_BETA, i, stage] = gates[i][1]
                    publish_stage(full, stage, with_box, box_bytes, tma_state,
                                  t_g[None, (slot * HVI + vhead0 // HI) * parts + part], t_s[None, stage])
            rQ.store(rQn.load())
            rK.store(rKn.load())
            rV.store(rVn.load())
            rInt.store(rIntNext.load())
            rFloat.store(rFloatNext.load())
            chunk = chunk + 1

    @cute.jit
    def consume(self, mCheckpoint: cute.Tensor, mOut: cute.Tensor, records: GDNRing, copy: CopyTensors,
                sm: GDNPipeSmem, bid: Int32, grid: Int32, warp: Int32, lane: Int32, num_slots: Int32, total: Int32):
        """A consumer warp: its group's items of the CTA, each from its stage, head by head
        (``consume_head``), then the stage released."""
        s, d = self.shape, self.dims
        L, cap, ST, CW, G, RW, HI, parts, HVI, vec = d.L, d.cap, d.ST, d.CW, d.G, d.RW, d.HI, d.parts, d.HVI, d.vec
        ring, read, mma_reads, kq_ups = d.ring, d.read, d.mma_reads, d.kq_ups
        sRingK, sRingDot, sKQFragments, sQ, sK, sMetaI, sMetaF, full, empty = (
            sm.sRingK, sm.sRingDot, sm.sKQFragments, sm.sQ, sm.sK, sm.sMetaI, sm.sMetaF, sm.full, sm.empty)
        # consumer group cg computes the CTA's items cg, cg + G, ...; cw is the warp's place in it
        cg = (warp - 1) // CW
        cw = (warp - 1) % CW
        scratch = warp - 1  # the warp's slot of the per-warp scratch
        group_barrier = CONSUMER_BARRIER + cg
        lr = lane % RW
        r0 = cw * RW  # the warp's first row of a head's part
        i_row = r0 + lr  # this lane's state row within the part
        it = Int32(0)
        live_items = Int32(0)  # the group's live items so far: their B fragments' buffers alternate
        for item in cutlass.range(bid + cg * grid, total, grid * G, unroll=1):
            row = item // (HVI * parts)
            vhead0 = (item // parts) % HVI * HI
            part = item % parts
            stage, phase = stage_of(it * G + cg, ST)
            slot = wait_item(full, sMetaI, stage, phase)
            if slot_is_live(slot, num_slots, s.pad_slot_id):
                slot64 = Int64(slot)
                h, origin = item_plan(sMetaI, stage)
                kq = sMetaF[META_KQ, 0, stage]
                flush = h + 1 >= L  # h == L only after a speculative commit
                pos_h = (origin + h) % cap
                fragments_buffer = 2 * cg + live_items % 2
                # The key head's ring dots k_p . k and k_p . q (each head weights them for itself
                # below) and, for a read copy's rows on tensor cores, k and q as B fragments: once
                # for the item's heads, split over the warps.
                if cutlass.const_expr(ring):
                    rKeyK, rKeyQ = lane_vectors(sK[None, stage], sQ[None, stage], vec)
                    key_head_ring_dots(sRingK[None, None, stage], rKeyK, rKeyQ, sRingDot[None, None, stage],
                                       cw, CW, cap, vec)
                    if cutlass.const_expr(mma_reads):
                        if not flush:
                            share_b_fragments(read, (rKeyK, rKeyQ), kq_ups,
                                              sKQFragments[None, None, None, fragments_buffer], cw, CW)
                    cute.arch.barrier(barrier_id=group_barrier, number_of_threads=32 * CW)

                for hi in cutlass.range(HI, unroll=1):
                    # the stage, the plan and the key head's quantities (k, q, the ring keys) anew
                    # per head, as far as the compiler can tell: what it computes from them would
                    # otherwise be hoisted out of the loop and stay live across the heads
                    st = loop_variant(stage, hi)
                    origin = loop_variant(origin, hi)
                    h = loop_variant(h, hi)
                    self.consume_head(mCheckpoint, mOut, records, copy, sm,
                                      ConsumerWarp(cg, cw, scratch, group_barrier, lr, r0, i_row, lane),
                                      StagedItem(st, row, vhead0 + hi, part, slot64, h, origin, flush, pos_h, kq,
                                                 fragments_buffer), hi)
                    cute.arch.sync_warp()  # the warp's scratch read before the next head writes it
                live_items = live_items + 1
            release_stage(empty, stage)
            it = it + 1

    @cute.jit
    def consume_head(self, mCheckpoint: cute.Tensor, mOut: cute.Tensor, records: GDNRing, copy: CopyTensors,
                     sm: GDNPipeSmem, w: ConsumerWarp, item: StagedItem, hi: Int32):
        """The warp's rows of the item's head ``hi``: load (the head's gates and record weights, a
        flush's fp32 rows, the ring's u), compute (S k and S q of the rows, a re-deriving flush's
        corrections, the ring sums), store (the output, then the ring's record or the folded rows)."""
        s, d = self.shape, self.dims
        mRingU, mRingK, mRingG, mRingV, mRingBeta, _ = records
        cap, CW, RW, R, vec, KL, rep, act, ring, read, entry = (d.cap, d.CW, d.RW, d.R, d.vec, d.KL, d.rep, d.act, d.ring,
                                                                d.read, d.entry)
        rederive, mma_reads, mma_flush, piece, kq_ups = s.rederive, d.mma_reads, d.mma_flush, d.piece, d.kq_ups
        flush_rows = d.flush_rows  # a flush's rAcc
        cg, cw, scratch, group_barrier, lr, r0, i_row, lane = w
        st, row, vhead, part, slot64, h, origin, flush, pos_h, kq, fragments_buffer = item
        sState, sReadScale, sWeightedDots = sm.sState, sm.sReadScale, sm.sWeightedDots
        sRingU, sRingK, sRingDot, sRingG = sm.sRingU, sm.sRingK, sm.sRingDot, sm.sRingG
        sRingV, sRingBeta = sm.sRingV, sm.sRingBeta
        sSolve, sSk, sUre, sKQFragments = sm.sSolve, sm.sSk, sm.sUre, sm.sKQFragments
        sQ, sK, sV, sMetaF = sm.sQ, sm.sK, sm.sV, sm.sMetaF
        hr0 = hi * R + r0  # the warp's first row of this head in the stage
        g = sMetaF[META_G, hi, st]
        beta = sMetaF[META_BETA, hi, st]
        rK, rQ = lane_vectors(sK[None, st], sQ[None, st], vec)
        # a flush's fp32 rows: the lane's slice of each of the warp's rows, or on tensor
        # cores its quarter of two of them (fragment_rows), loaded first so that their
        # latency overlaps the head's work below (not live across heads: registers)
        rAcc = cute.make_rmem_tensor(cute.make_layout(flush_rows, stride=(flush_rows[1], 1)), Float32)
        if cutlass.const_expr(mma_flush):
            if flush:
                fragment_rows(rAcc, mCheckpoint[slot64, vhead, None, None], part * R + r0, piece)

        # Lane j: g_j of record j < h, this token's g at lane h; record j's weight is
        # exp(sum of the later g, this token's included).
        g_rec = Float32(0.0)
        if cutlass.const_expr(ring):
            p_lane = lane % cap
            g_phys = cutlass.select_((p_lane - origin + cap) % cap < h, sRingG[p_lane, hi, st],
                                     Float32(0.0))
            g_rec = cute.arch.shuffle_sync(g_phys, (origin + lane) % cap)
        g_j, tail = record_values(g, g_rec, h, ring)
        w_j = cute.math.exp(tail - g_j, fastmath=False)
        gamma = cute.math.exp(cute.arch.shuffle_sync(tail, 0), fastmath=False)

        # This lane's row's u at every ring position (cached; a re-deriving flush
        # replaces them) and the head's weighted ring dots (lane p: position p's, into
        # the warp's scratch); a re-deriving flush's warps also split the records'
        # coupling.
        rU = cute.make_rmem_tensor((cap,), Float32)
        beta_lane = Float32(0.0)  # lane j: beta of record j, read only where a flush re-derives
        if cutlass.const_expr(rederive):
            if flush and lane < h:
                beta_lane = sRingBeta[(origin + lane) % cap, hi, st]
        if cutlass.const_expr(ring):
            for p in cutlass.range_constexpr(cap):
                rU[p] = sRingU[p, hr0 + lr, st].to(Float32)
            j_l = (lane % cap - origin + cap) % cap
            w_l = cute.arch.shuffle_sync(w_j, j_l)
            if lane < cap:
                for dot in cutlass.range_constexpr(2):
                    sWeightedDots[dot, lane, scratch] = cutlass.select_(j_l < h, w_l * sRingDot[dot, lane, st],
                                                                      Float32(0.0))
            if cutlass.const_expr(rederive):
                if flush:
                    solve_matrix(sRingK[None, None, st], sSolve[None, None, hi, cg], g_j, beta_lane,
                                 origin, h, cw, CW, cap, act.width <= 16)
                    cute.arch.barrier(barrier_id=group_barrier, number_of_threads=32 * CW)
            cute.arch.sync_warp()  # the weighted dots

        # S k and S q of the warp's rows (the checkpoint before this token): a flush
        # holds its fp32 rows in registers (from the stage, or from global memory next
        # to a read copy) for the fold, and takes S_ckpt k_p for a re-derivation; a
        # read copy's rows meet k and q on tensor cores where they can.
        s_k = Float32(0.0)  # lane lr's row's totals
        s_q = Float32(0.0)
        rRows = cute.make_rmem_tensor((2 * RW,), Float32)
        rRows.fill(0.0)
        if flush:
            if cutlass.const_expr(mma_flush):
                s_k, s_q = fragment_row_dots(rAcc, sK[None, st], sQ[None, st], piece)
                if cutlass.const_expr(rederive):
                    fragment_key_dots(rAcc, sRingK[None, None, st], sSk[None, None, scratch], cap,
                                      act.width <= 16, piece)
            else:
                rAcc.fill(0.0)
                if lane < KL:  # lanes past K hold zeros (K < 32 vec)
                    for r in cutlass.range_constexpr(RW):
                        if cutlass.const_expr(read is None):
                            src = cute.local_tile(sState[hr0 + r, None, st], (vec,), (lane,))
                        else:
                            src = cute.local_tile(mCheckpoint[slot64, vhead, part * R + r0 + r, None],
                                                  (vec,), (lane,))
                        cute.autovec_copy(src, rAcc[r, None])
                for r in cutlass.range_constexpr(RW):
                    for e in cutlass.range_constexpr(vec):
                        rRows[2 * r] = rRows[2 * r] + rAcc[r, e] * rK[e]
                        rRows[2 * r + 1] = rRows[2 * r + 1] + rAcc[r, e] * rQ[e]
                if cutlass.const_expr(rederive):
                    checkpoint_key_dots(rAcc, sRingK[None, None, st], sSk[None, None, scratch], RW,
                                        cap, vec, act)
        else:
            state_scale = Float32(1.0)
            if cutlass.const_expr(read is not None and read.has_state_scale):
                state_scale = sMetaF[READ_STATE_SCALE, hi, st]
            if cutlass.const_expr(mma_reads):
                sScaleRows = None
                if cutlass.const_expr(read.scale_dtype is not None):
                    sScaleRows = cute.local_tile(sReadScale[None, None, st],
                                                 (RW, read.scales_per_row), (hi * CW + cw, 0))
                rB = shared_b_fragments(read, sKQFragments[None, None, None, fragments_buffer], 2)
                dots = mma_row_dots(read, cute.local_tile(sState[None, None, st], (RW, entry.cols),
                                                          (hi * CW + cw, 0)),
                                    sScaleRows, rB, 2, state_scale)
                s_k = cute.arch.shuffle_sync(dots[0], lr) * (1.0 / kq_ups[0])
                s_q = cute.arch.shuffle_sync(dots[1], lr) * (1.0 / kq_ups[1])
            elif cutlass.const_expr(d.row_lanes < 32):
                s_k, s_q = grouped_row_dots(read, sState[None, None, st], sReadScale, st, sK[None, st], sQ[None, st],
                                            hr0, RW, d.row_lanes, d.row_piece)
            elif lane < KL:
                for r in cutlass.range_constexpr(RW):
                    rS = cute.make_rmem_tensor((vec,), Float32)
                    if cutlass.const_expr(read is None):
                        cute.autovec_copy(cute.local_tile(sState[hr0 + r, None, st], (vec,), (lane,)),
                                          rS)
                    else:
                        scale = None  # a row's one scale is taken after its dots (row_totals below)
                        if cutlass.const_expr(not scale_per_row(read)):
                            scale = smem_scale(read, sReadScale, st, hr0 + r, lane * vec, state_scale)
                        decode_slice(read, cute.local_tile(sState[hr0 + r, None, st],
                                                           (read.per_lane(vec),), (lane,)), scale, rS)
                    for e in cutlass.range_constexpr(vec):
                        rRows[2 * r] = rRows[2 * r] + rS[e] * rK[e]
                        rRows[2 * r + 1] = rRows[2 * r + 1] + rS[e] * rQ[e]
        if cutlass.const_expr(rederive):
            if flush:
                cute.arch.sync_warp()  # the warp's S_ckpt k_p
                coupled_substitution(sSolve[None, None, hi, cg], sSk[None, None, scratch],
                                     cute.local_tile(sRingV[None, None, st], (cap, RW), (0, hi * CW + cw)),
                                     sUre[None, None, scratch], beta_lane, rU, g_j, origin, h, RW, cap)

        # Ring sums of this lane's row: sum over live positions of w_j (k_p . x) u_p[i].
        ring_k = Float32(0.0)
        ring_q = Float32(0.0)
        if cutlass.const_expr(ring):
            for p in cutlass.range_constexpr(cap):
                ring_k = ring_k + sWeightedDots[0, p, scratch] * rU[p]
                ring_q = ring_q + sWeightedDots[1, p, scratch] * rU[p]
        if flush:
            if cutlass.const_expr(not mma_flush):
                s_k, s_q = row_totals(rRows, lr, RW)
        elif cutlass.const_expr(not mma_reads and d.row_lanes == 32):
            s_k, s_q = row_totals(rRows, lr, RW)
            if cutlass.const_expr(read is not None and scale_per_row(read)):
                row_scale = smem_scale(read, sReadScale, st, hr0 + lr, Int32(0), Float32(1.0))
                s_k, s_q = s_k * row_scale, s_q * row_scale

        v_cur = sV[hr0 + lr, st]
        u = beta * (v_cur - (gamma * s_k + ring_k))
        if lane < RW:
            mOut[row, vhead, part * R + i_row] = (gamma * s_q + ring_q + u * kq).to(act)
        if flush:
            self.fold_and_store(rAcc, rU, rK, u, gamma, w_j, mCheckpoint, copy, sm, w, item, hi)
        else:
            if cutlass.const_expr(ring):
                if lane < RW:
                    mRingU[slot64, pos_h, vhead, part * R + i_row] = u.to(cutlass.Float16)
                    if cutlass.const_expr(s.keep_v_beta):
                        mRingV[slot64, pos_h, vhead, part * R + i_row] = v_cur.to(act)
                # this token's key once per key head, its g (and beta) once per value head
                if part == 0 and cw == 0:
                    if vhead % rep == 0 and lane < KL:
                        for e in cutlass.range_constexpr(vec):
                            mRingK[slot64, pos_h, vhead // rep, lane * vec + e] = rK[e].to(act)
                    if lane == 0:
                        mRingG[slot64, pos_h, vhead] = g
                        if cutlass.const_expr(s.keep_v_beta):
                            mRingBeta[slot64, pos_h, vhead] = beta

    @cute.jit
    def fold_and_store(self, rAcc: cute.Tensor, rU: cute.Tensor, rK: cute.Tensor, u: Float32, gamma: Float32,
                       w_j: Float32, mCheckpoint: cute.Tensor, copy: CopyTensors, sm: GDNPipeSmem, w: ConsumerWarp,
                       item: StagedItem, hi: Int32):
        """A flush of the warp's rows of the item's head ``hi`` (``rAcc``, fp32, in registers):
        S = gamma S + u k (this token) + sum over live positions of w_j u_j[i] k_j (a stale key is
        replaced by zero: NaN-safe), stored into the checkpoint and the read copy (RTN; nvfp4's
        state scale from the folded rows of every consumer warp of the group first, which meet at
        the group's named barrier through the head's ``sAmax`` slots). With a tensor-core flush ``rAcc`` is in
        ``fragment_rows``' layout and the fold runs on tensor cores (``fragment_fold``, through the warp's scratch
        of ``sUre``)."""
        s, d = self.shape, self.dims
        cap, K, RW, CW, vec, KL, act, ring, piece = d.cap, d.K, d.RW, d.CW, d.vec, d.KL, d.act, d.ring, d.piece
        copies = s.copies
        _, cw, scratch, group_barrier, _, r0, _, _ = w
        stage, _, vhead, part, slot64, h, origin, _, _, _, _ = item
        sRingK, sK, sUre, sAmax = sm.sRingK, sm.sK, sm.sUre, None
        if cutlass.const_expr(copies.whole_state):
            sAmax = sm.sAmax[None, hi, None]
        first_row = part * d.R + r0  # the warp's first row of the head
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(d.mma_flush):
            rCoefs = cute.make_rmem_tensor((cap,), Float32)
            sKeys, sCoef = None, None
            if cutlass.const_expr(ring):
                ring_coefficients(w_j, rU, origin, h, rCoefs)
                sKeys = sRingK[None, None, stage]
                sCoef = sUre[None, None, scratch]
            cute.arch.sync_warp()  # every lane's reads of the scratch (re-derived u) before it takes the coefficients
            fragment_fold(rAcc, sK[None, stage], u, gamma, rCoefs, sCoef, sKeys, cap, ring, act.width <= 16, piece)
        else:
            for r in cutlass.range_constexpr(RW):
                coef = cute.arch.shuffle_sync(u, r)
                for e in cutlass.range_constexpr(vec):
                    rAcc[r, e] = gamma * rAcc[r, e] + coef * rK[e]
            if cutlass.const_expr(ring):
                for p in cutlass.range_constexpr(cap):
                    j = (p - origin + cap) % cap
                    live_p = j < h
                    w = cute.arch.shuffle_sync(w_j, j)
                    coef_p = cutlass.select_(live_p, w * rU[p], Float32(0.0))
                    rKp = cute.make_rmem_tensor((vec,), Float32)
                    rKp.fill(0.0)
                    if lane < KL:
                        rKey = cute.make_rmem_tensor((vec,), act)
                        cute.autovec_copy(cute.local_tile(sRingK[p, None, stage], (vec,), (lane,)), rKey)
                        for e in cutlass.range_constexpr(vec):
                            rKp[e] = cutlass.select_(live_p, rKey[e].to(Float32), Float32(0.0))
                    for r in cutlass.range_constexpr(RW):
                        coef = cute.arch.shuffle_sync(coef_p, r)
                        for e in cutlass.range_constexpr(vec):
                            rAcc[r, e] = rAcc[r, e] + coef * rKp[e]
        if cutlass.const_expr(copies.read is None):
            if lane < KL:
                for r in cutlass.range_constexpr(RW):
                    cute.autovec_copy(rAcc[r, None], cute.local_tile(mCheckpoint[slot64, vhead, first_row + r, None],
                                                                     (vec,), (lane,)))
        else:
            state_scale = Float32(1.0)
            if cutlass.const_expr(copies.whole_state):  # whole heads per item (GDNPipeConfig.check)
                state_scale = warps_state_scale(lane_amax(rAcc), sAmax[None, stage], cw, group_barrier, 32 * CW)
                if cw == 0:
                    if lane == 0:
                        copy.mReadStateScale[slot64, vhead] = state_scale
            if cutlass.const_expr(d.mma_flush):
                # the lane's pieces of rows g and g + 8; an nvfp4 block is a lane's piece or two
                # (fragment_piece), an fp8 block a whole row (flush_fits_tensor_cores): its amax over the quad
                for half in cutlass.range_constexpr(2):
                    row_amax = None
                    if cutlass.const_expr(copies.read.name == "fp8"):
                        row_amax = lane_amax(rAcc[half, None])
                        for offset in (1, 2):
                            row_amax = max_nan(row_amax, cute.arch.shuffle_sync_bfly(row_amax, offset=offset))
                    for pc in cutlass.range_constexpr(K // 4 // piece):
                        store_copies_at(copies, cute.local_tile(rAcc[half, None], (piece,), (pc,)),
                                        mCheckpoint, copy, slot64, vhead,
                                        first_row + lane // 4 + 8 * half, fragment_col(lane % 4, pc * piece, piece),
                                        state_scale, Uint32(0), row_amax)
            else:
                for r in cutlass.range_constexpr(RW):
                    store_copies(copies, rAcc[r, None], mCheckpoint, copy, slot64, vhead, first_row + r,
                                 state_scale, Uint32(0))

    @cute.jit
    def chunk_inputs(self, first: Int32, stride: Int32, total: Int32, mSlot: cute.Tensor, mPlan: Optional[cute.Tensor],
                     token: GDNToken, rQ: cute.Tensor, rK: cute.Tensor, rV: cute.Tensor, rInt: cute.Tensor,
                     rFloat: cute.Tensor):
        """Of items ``first + u stride`` (u < prefetch, clamped to the last item): this lane's
        elements of their q, k (K / 32 each) and v (the item's rows / 32, its heads' one after the
        other) into ``rQ[u]``, ``rK[u]``, ``rV[u]`` (fp32); lane u: (slot, h, origin) of item u
        into ``rInt``, and each head i's (raw gates a and b, A_log, dt_bias) into ``rFloat[None, i]``."""
        d = self.dims
        K, R, HI, parts, HVI, rep, PF = d.K, d.R, d.HI, d.parts, d.HVI, d.rep, d.PF
        lane = cute.arch.lane_idx()
        mQ, mK, mV, mA, mB, mALog, mDtBias = token
        for u in cutlass.range_constexpr(PF):
            item = cutlass.min(first + u * stride, total - 1)
            row = item // (HVI * parts)
            vhead0 = (item // parts) % HVI * HI
            part = item % parts
            for e in cutlass.range_constexpr(cute.size(rQ, mode=[1])):
                rQ[u, e] = Float32(0.0)  # zeros past K: the norms take only the key's elements
                rK[u, e] = Float32(0.0)
                if e * 32 + lane < K:
                    rQ[u, e] = mQ[row, vhead0 // rep, e * 32 + lane].to(Float32)
                    rK[u, e] = mK[row, vhead0 // rep, e * 32 + lane].to(Float32)
            for e in cutlass.range_constexpr(cute.size(rV, mode=[1])):
                r = e * 32 + lane  # the item's row r: head r // R, row r % R of its part
                if r < HI * R:
                    rV[u, e] = mV[row, vhead0 + r // R, part * R + r % R].to(Float32)
        item = cutlass.min(first + (lane % PF) * stride, total - 1)
        row = item // (HVI * parts)
        vhead0 = (item // parts) % HVI * HI
        rInt[0] = mSlot[row]
        rInt[1] = Int32(0)
        rInt[2] = Int32(0)
        if cutlass.const_expr(d.ring):
            rInt[1] = mPlan[row, 1]
            rInt[2] = mPlan[row, 2]
        for i in cutlass.range_constexpr(HI):
            rFloat[0, i] = mA[row, vhead0 + i].to(Float32)
            rFloat[1, i] = mB[row, vhead0 + i].to(Float32)
            rFloat[2, i] = mALog[vhead0 + i].to(Float32)
            rFloat[3, i] = mDtBias[vhead0 + i].to(Float32)


def compile_pipelined_decode(shape: GDNShape, config: GDNPipeConfig, options: str):
    """Compile with `options` (TVM-FFI and the target arch) from the decode kernel's fake
    inputs; launches on the caller's current CUDA stream."""
    from .decode import fake_inputs

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = fake_inputs(shape)
    return cute.compile(GDNPipelinedDecode(shape, config), *args.values(), stream, options=options)
