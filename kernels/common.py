"""Device helpers shared by the Mamba-2 and GDN kernels.

What lives here is the same in every layer type: the softplus of the engines, warp sums, the TMA
streaming of a checkpoint tile into shared memory (one mbarrier per stage, every stage issued up
front so a CTA keeps its whole tile in flight), and the tensor-core products of the verify
kernels: a warp's 16 state rows times a few columns (m16n8k8 TF32 MMAs on fp32 data split into a
high and a low TF32 part, so the products keep fp32 accuracy).

MMA fragments follow the PTX m16n8k8 TF32 layout, with g = lane / 4 and c = lane % 4:
A (16 x 8) value i at (g + 8 (i % 2), c + 4 (i // 2)); B (8 x 8, given as an n x k matrix) value
i at (n = g, k = c + 4 i); the accumulator value i at (g + 8 (i // 2), 2 c + i % 2).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, TFloat32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cutlass_dsl import dsl_user_op

from .limits import MAX_CAPACITY, MAX_DRAFT, programmatic_launch


SMEM_PER_CTA = 227 * 1024  # opt-in maximum per CTA on sm_90 / sm_100 / sm_103
MMA_ROWS = 16  # state rows per warp in the verify kernels: the M of an m16n8k8 MMA
SMEM_PER_SM = 228 * 1024


def smem_fit(smem_bytes: int, min_ctas_per_sm: int):
    """None if a CTA of `smem_bytes` fits, with `min_ctas_per_sm` of them per SM; else why not."""
    if smem_bytes > SMEM_PER_CTA:
        return f"needs {smem_bytes} bytes of shared memory per CTA (at most {SMEM_PER_CTA})"
    if min_ctas_per_sm * (smem_bytes + 1024) > SMEM_PER_SM:
        return f"{min_ctas_per_sm} CTAs of {smem_bytes} bytes of shared memory do not fit on an SM"
    return None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch(kernel_call, grid, block, stream, smem_bytes: int = 0, min_ctas_per_sm: int = 0):
    """Launch one of our kernels: all of the SM's unified memory as shared memory (where the
    state tiles in flight live), and programmatically where ``programmatic_launch()`` says so.
    Every kernel launched here starts with ``after_previous_kernel``."""
    kernel_call.launch(
        grid=grid,
        block=block,
        smem=smem_bytes,
        stream=stream,
        min_blocks_per_mp=min_ctas_per_sm,
        preferred_smem_carveout=100,
        use_pdl=programmatic_launch(),
    )


def launch_tiles(kernel_call, grid, config, smem_bytes: int, stream):
    """Launch a tile kernel: ``config.num_warps`` warps a CTA and its register cap (``min_ctas_per_sm``)."""
    launch(kernel_call, grid, [32 * config.num_warps, 1, 1], stream, smem_bytes, config.min_ctas_per_sm)


@cute.jit
def after_previous_kernel():
    """Wait until the kernels before this one in the stream have finished and their writes are
    visible, then let the next kernel launch (its CTAs only take SM room once every CTA of this
    grid runs). Under a plain launch both are no-ops. Nothing a previous kernel may write is read
    before this, but for an L2 prefetch (``prefetch_l2``) by an id read with ``load_past_l1``."""
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()


@dsl_user_op
def prefetch_l2(t: cute.Tensor, num_bytes: cutlass.Constexpr[int], *, loc=None, ip=None):
    """One thread asks for ``num_bytes`` (a multiple of 16) of global memory from ``t``'s first
    element into L2 (``cp.async.bulk.prefetch.L2``), so loads issued later find them there."""
    address = t.iterator.toint(loc=loc, ip=ip)
    llvm.inline_asm(None, [address.ir_value(loc=loc, ip=ip), Int32(num_bytes).ir_value(loc=loc, ip=ip)],
                    "cp.async.bulk.prefetch.L2.global [$0], $1;", "l,r", has_side_effects=True,
                    asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def load_past_l1(t: cute.Tensor, index, *, loc=None, ip=None) -> Int32:
    """``t[index]`` of an Int32 tensor, loaded from L2 without keeping the line in L1
    (``ld.global.cg``): read before ``after_previous_kernel`` (a previous kernel may still write
    it), so no stale copy may stay in L1 for the loads after the wait."""
    address = (t.iterator + index).toint(loc=loc, ip=ip)
    return Int32(llvm.inline_asm(Int32.mlir_type, [address.ir_value(loc=loc, ip=ip)],
                                 "ld.global.cg.b32 $0, [$1];", "=r,l", has_side_effects=True,
                                 is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def round_up(n: int, m: int) -> int:
    return cdiv(n, m) * m


class DraftStepKernel:
    """Host side shared by the kernels of a T-draft step (verify, snapshot baseline): the static
    shape, launch config and draft count, refused at construction with the class's ``check``."""

    def __init__(self, shape, config, num_drafts: int):
        reason = self.check(shape, config, num_drafts)
        if reason is not None:
            raise ValueError(f"{type(self).__name__}({config}, T={num_drafts}) invalid for {shape}: {reason}")
        self.shape, self.config, self.num_drafts = shape, config, num_drafts


def verify_check(shape, config, num_drafts: int):
    """None if a verify kernel's tiling takes (shape, config, T), else why not (both layer types);
    the kernel's own check then adds its state copies and shared memory, computed from fields
    this one has checked."""
    reason = config.check_tiles(shape)
    if reason is not None:
        return reason
    if config.rows_per_warp != MMA_ROWS:
        return f"verify tiles {MMA_ROWS} rows per warp (the MMA's M), not {config.rows_per_warp}"
    if shape.window < 2:
        return "verification needs a ring (window >= 2)"
    if not 1 <= num_drafts <= min(MAX_DRAFT, shape.capacity - shape.window, shape.window):
        return (f"num_drafts {num_drafts}: needs 1 <= T <= min({MAX_DRAFT}, max_draft "
                f"{shape.capacity - shape.window}, window {shape.window})")
    if shape.window + num_drafts > MAX_CAPACITY:
        return f"window + T = {shape.window + num_drafts} above {MAX_CAPACITY} (one lane per record)"
    return None


def snapshot_check(shape, config, num_drafts: int):
    """None if a snapshot-baseline kernel's tiling takes (shape, config, T), else why not; the
    kernel's own check then adds its shared memory."""
    if shape.window != 1:
        return "the snapshot baseline runs on a conventional cache (window 1)"
    reason = config.check(shape)
    if reason is not None:
        return reason
    rw = config.rows_per_warp
    if rw > 8 or rw & (rw - 1):
        return f"rows per warp {rw}: a power of two up to 8 (a warp keeps its rows in registers)"
    if not 1 <= num_drafts <= MAX_DRAFT:
        return f"num_drafts {num_drafts}: 1..{MAX_DRAFT}"
    return None


def pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@cute.jit
def slot_is_live(slot: Int32, num_slots: Int32, pad_slot_id: cutlass.Constexpr[int]):
    """A row decodes when its slot id names a slot of the pool and is not the pad sentinel:
    out-of-range ids act as pad rows (nothing is touched)."""
    live = (slot >= 0) & (slot < num_slots)
    if cutlass.const_expr(pad_slot_id == 0):
        live = live & (slot != 0)
    return live


@cute.jit
def planned_positions(mPlan, row: Int32, ring: cutlass.Constexpr[bool], stochastic: cutlass.Constexpr[bool]):
    """A batch row's (h, origin, SR write counter) from the step's plan (kernels/table.py),
    loaded by row so that they do not wait on the slot id; zero where the step has no ring
    (``ring`` False) or writes no SR checkpoint (``stochastic`` False)."""
    h = Int32(0)
    origin = Int32(0)
    sr_count = Int32(0)
    if cutlass.const_expr(ring):
        h = mPlan[row, 1]
        origin = mPlan[row, 2]
    if cutlass.const_expr(stochastic):
        sr_count = mPlan[row, 3]
    return h, origin, sr_count


@cute.jit
def clear_stale_record(tRecord: cute.Tensor, position: Int32, origin: Int32, h: Int32, cap: cutlass.Constexpr[int]):
    """Zero this lane's slice ``tRecord`` of a ring record staged in shared memory when its
    position holds no committed record. Every position is read (no load waits on the plan); the
    folds weigh a stale record zero, but zero times a stale NaN (a reused slot, a rejected draft)
    is still NaN. Written after the copy, so the staging registers are not held for it."""
    if (position - origin + cap) % cap >= h:
        rZero = cute.make_rmem_tensor((cute.size(tRecord),), tRecord.element_type)
        rZero.fill(0.0)
        cute.autovec_copy(rZero, tRecord)


@cute.jit
def start_tile_loads(
    tma_atom: cute.CopyAtom,
    m_tma: cute.Tensor,
    s_tile: cute.Tensor,
    mbar: cute.Pointer,
    first_box: Int32,
    stages: cutlass.Constexpr[int],
    stage_bytes: cutlass.Constexpr[int],
):
    """Initialise one mbarrier per stage, then warp 0 issues every stage's TMA load (the CTA's
    whole tile in flight at once); a warp waits on its own stage with ``mbarrier_wait``."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        for st in cutlass.range_constexpr(stages):
            cute.arch.mbarrier_init(mbar + st, 1)
        cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()
    if tidx // 32 == 0:
        issue_tile_loads(tma_atom, m_tma, s_tile, mbar, first_box, stages, stage_bytes)


@cute.jit
def softplus(x: Float32) -> Float32:
    """softplus(x) = x for x > 20 (engines' threshold), else log(1 + exp(x))."""
    out = x
    if x <= Float32(20.0):
        out = cute.math.log(Float32(1.0) + cute.math.exp(x, fastmath=False), fastmath=False)
    return out


@cute.jit
def warp_sum(val: Float32) -> Float32:
    """Butterfly sum over the 32 lanes of a warp; every lane gets the total."""
    for i in cutlass.range_constexpr(5):
        val = val + cute.arch.shuffle_sync_bfly(val, offset=1 << (4 - i))
    return val


@cute.jit
def lane_scan(value: Float32, reverse: cutlass.Constexpr[bool] = False) -> Float32:
    """Inclusive scan over the warp's lanes (5 shuffles): lane l returns the sum of lanes 0 .. l,
    or with ``reverse`` the sum of lanes l .. 31."""
    lane = cute.arch.lane_idx()
    total = value
    for t in cutlass.range_constexpr(5):
        step = 1 << t
        if cutlass.const_expr(reverse):
            other = cute.arch.shuffle_sync_down(total, step)
            live = lane + step < 32
        else:
            other = cute.arch.shuffle_sync_up(total, step)
            live = lane >= step
        if live:
            total = total + other
    return total


@cute.jit
def record_values(current: Float32, recorded: Float32, h: Int32, ring: cutlass.Constexpr[bool]):
    """(value, tail) of the records a step weighs, a lane each: lane j < h holds record j's value
    (``recorded``, read only with a ``ring``), lane h this token's ``current``, the lanes after it
    zero; tail is the sum over lanes j .. 31 (a reversed inclusive scan), so a record's decay
    since it was written is the tail past its lane."""
    lane = cute.arch.lane_idx()
    value = cutlass.select_(lane == h, current, Float32(0.0))
    if cutlass.const_expr(ring):
        if lane < h:
            value = recorded
    return value, lane_scan(value, reverse=True)


@cute.jit
def warp_reduce_many(vals: cute.Tensor, n: cutlass.Constexpr[int], lanes: cutlass.Constexpr[int] = 32) -> Float32:
    """Sum each of n per-lane values (a power of two up to ``lanes``) over each group of ``lanes``
    consecutive lanes (a power of two; the warp by default) in n - 1 + log2(lanes) - log2(n)
    shuffles instead of n log2(lanes): every step halves the values a lane carries and trades the
    other half with its partner. Lane l returns its group's total of value
    ``(l % lanes) >> (log2(lanes) - log2(n))``; ``vals`` is clobbered."""
    m = n.bit_length() - 1
    top = lanes >> 1  # the first partner's offset
    lane = cute.arch.lane_idx()
    for s in cutlass.range_constexpr(m):
        half = n >> (s + 1)
        offset = top >> s
        upper = (lane & offset) != 0
        for i in cutlass.range_constexpr(half):
            send = cutlass.select_(upper, vals[i], vals[i + half])
            keep = cutlass.select_(upper, vals[i + half], vals[i])
            vals[i] = keep + cute.arch.shuffle_sync_bfly(send, offset=offset)
    total = vals[0]
    for s in cutlass.range_constexpr(lanes.bit_length() - 1 - m):
        total = total + cute.arch.shuffle_sync_bfly(total, offset=(top >> m) >> s)
    return total


def slot_rows(m: cute.Tensor, rows_per_slot: int, cols: int) -> cute.Tensor:
    """A pool copy (slots, ..., cols) as rows ``((rows_per_slot, slots), cols)``, the view the TMA
    loads read: a flat box index ``slot * rows_per_slot / box_rows + box`` addresses it. The slot
    stays its own TMA coordinate: where a box spans whole rows (box_rows * cols <= 256), CuTe
    merges rows and columns into one int32 coordinate (row * cols), which overflows, and faults
    with an illegal instruction, once a pool holds over 2^31 elements."""
    return cute.make_tensor(m.iterator, cute.make_layout(
        ((rows_per_slot, m.shape[0]), cols), stride=((cols, rows_per_slot * cols), 1)))


def make_row_tma(m_rows: cute.Tensor, box_rows: int, box_cols: int):
    """TMA atom loading (box_rows, box_cols) boxes of a row-major gmem view (``slot_rows``).

    Returns the atom and the TMA coordinate tensor tiled by boxes:
    ``(box_rows, box_cols, num_box_rows, num_box_cols)``.
    """
    smem_layout = cute.make_layout((box_rows, box_cols), stride=(box_cols, 1))
    atom, m_tma = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), m_rows, smem_layout, (box_rows, box_cols)
    )
    return atom, m_tma


@cute.jit
def issue_tile_loads(
    tma_atom: cute.CopyAtom,
    m_tma: cute.Tensor,
    s_tile: cute.Tensor,
    mbar: cute.Pointer,
    first_box: Int32,
    stages: cutlass.Constexpr[int],
    stage_bytes: cutlass.Constexpr[int],
):
    """Warp 0 issues `stages` TMA loads of consecutive row boxes, one mbarrier each.

    ``s_tile`` is ``(box_rows, box_cols, stages)``; box ``first_box + s`` lands in stage ``s``.
    """
    g_boxes = cute.local_tile(m_tma, cute.product_each(cute.select(s_tile.shape, mode=[0, 1])), (None, 0))
    t_s, t_g = cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1),
        cute.group_modes(s_tile, 0, 2), cute.group_modes(g_boxes, 0, 2),
    )
    for s in cutlass.range_constexpr(stages):
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, stage_bytes)
        cute.copy(tma_atom, t_g[None, first_box + s], t_s[None, s], tma_bar_ptr=mbar + s)


TILE_PAD = 4  # fp32 columns of padding per tile row: an MMA fragment read (8 rows x 4 columns) hits 32 banks


def padded_tile_layout(rows: int, cols: int, stages: int):
    """fp32 (rows, cols + TILE_PAD, stages) shared-memory tile with rows TILE_PAD columns apart."""
    width = cols + TILE_PAD
    return cute.make_layout((rows, width, stages), stride=(width, 1, rows * width))


def make_padded_row_tma(m_rows: cute.Tensor, box_rows: int, cols: int):
    """TMA atom loading (box_rows, cols) boxes of a row-major fp32 view (``slot_rows``) into the padded
    tile of ``padded_tile_layout``: the box is TILE_PAD columns wider than the tensor, so TMA fills
    the padding with zeros (out of bounds) and reads nothing extra. Returns (atom, coordinate
    tensor) as ``make_row_tma``; a stage then holds box_rows * (cols + TILE_PAD) * 4 bytes."""
    width = cols + TILE_PAD
    smem_layout = cute.make_layout((box_rows, width), stride=(width, 1))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_rows, smem_layout, (box_rows, width))


def ptx_op(result_type, operands, asm: str, constraints: str, loc, ip):
    """One side-effect-free PTX instruction on ``operands`` (DSL numerics, ``$1``, ``$2``, ...)
    with one result (``$0``)."""
    return result_type(llvm.inline_asm(
        result_type.mlir_type, [v.ir_value(loc=loc, ip=ip) for v in operands], asm, constraints,
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


def ptx_ops(result_type, count: int, operands, asm: str, constraints: str, loc, ip) -> list:
    """``count`` results (``$0`` .. ``$count-1``) of one side-effect-free PTX sequence on
    ``operands`` (DSL numerics, ``$count``, ...)."""
    ty = result_type.mlir_type
    result = llvm.inline_asm(llvm.StructType.get_literal([ty] * count), [v.ir_value(loc=loc, ip=ip) for v in operands],
                             asm, constraints, has_side_effects=False, is_align_stack=False,
                             asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return [result_type(llvm.extractvalue(ty, result, [i], loc=loc, ip=ip)) for i in range(count)]


@dsl_user_op
def loop_variant(value: Int32, index: Int32, *, loc=None, ip=None) -> Int32:
    """``value``, though to the compiler a function of the loop ``index``: what is loaded or
    computed from it stays in the loop. LLVM's code motion would hoist a loop's invariant shared
    memory loads out of it and keep them live across iterations, whatever the register pressure
    (GDN's items of two heads: the stage's k, q and keys, 6 KB of spills)."""
    return ptx_op(Int32, [Int32(value), Int32(index)], "{ .reg .b32 z; and.b32 z, $2, 0; add.s32 $0, $1, z; }",
                  "=r,r,r", loc, ip)


def f32_asm(result_type, x: Float32, asm: str, constraints: str, loc, ip):
    """One side-effect-free PTX instruction on fp32 ``x`` (``$1``) with one result (``$0``)."""
    return ptx_op(result_type, [Float32(x)], asm, constraints, loc, ip)


@dsl_user_op
def tf32_round(x: Float32, *, loc=None, ip=None) -> Float32:
    """x rounded to the nearest TF32 value (cvt.rna), returned as fp32."""
    return f32_asm(Float32, x, "cvt.rna.tf32.f32 $0, $1;", "=f,f", loc, ip)


@cute.jit
def mma_tf32(acc: cute.Tensor, rA: cute.Tensor, rB: cute.Tensor, split_a: cutlass.Constexpr[bool],
             split_b: cutlass.Constexpr[bool]):
    """acc (4, 1, NT) += A (4, 1, 1) B (2, NT, 1)^T for fp32 fragments. An operand that is not
    exact in TF32 (split_*) is split into hi + lo; lo x lo is below fp32 rounding and skipped."""
    atom = cute.make_mma_atom(warp.MmaTF32Op((16, 8, 8)))
    nt = cute.size(rB, mode=[1])
    aHi = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), TFloat32)
    aLo = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), TFloat32)
    bHi = cute.make_rmem_tensor(cute.make_layout((2, nt, 1)), TFloat32)
    bLo = cute.make_rmem_tensor(cute.make_layout((2, nt, 1)), TFloat32)
    for i in cutlass.range_constexpr(4):
        a = rA[i, 0, 0]
        if cutlass.const_expr(split_a):
            hi = tf32_round(a)
            aHi[i, 0, 0] = hi.to(TFloat32)
            aLo[i, 0, 0] = (a - hi).to(TFloat32)
        else:
            aHi[i, 0, 0] = a.to(TFloat32)
    for n in cutlass.range_constexpr(nt):
        for i in cutlass.range_constexpr(2):
            b = rB[i, n, 0]
            if cutlass.const_expr(split_b):
                hi = tf32_round(b)
                bHi[i, n, 0] = hi.to(TFloat32)
                bLo[i, n, 0] = (b - hi).to(TFloat32)
            else:
                bHi[i, n, 0] = b.to(TFloat32)
    cute.gemm(atom, acc, aHi, bHi, acc)
    if cutlass.const_expr(split_a):
        cute.gemm(atom, acc, aLo, bHi, acc)
    if cutlass.const_expr(split_b):
        cute.gemm(atom, acc, aHi, bLo, acc)


@dsl_user_op
def mma_f16(acc, a, b, *, loc=None, ip=None):
    """One m16n8k16 MMA with fp16 operands and fp32 accumulation: ``acc`` (4 fp32: D rows g, g,
    g + 8, g + 8 and columns 2t, 2t + 1 of lane 4 g + t) + A B, ``a`` the 4 packed fp16 pairs of
    the A fragment (rows g, g + 8 at k 2t, 2t + 1, then at k 2t + 8, 2t + 9), ``b`` the 2 of the
    B fragment (column g at k 2t, 2t + 1 and 2t + 8, 2t + 9). Returns the 4 sums."""
    return ptx_ops(Float32, 4, [Int32(v) for v in list(a) + list(b)] + [Float32(v) for v in acc],
                   "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
                   "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", loc, ip)


@cute.jit
def load_b_fragment(rB: cute.Tensor, sCols: cute.Tensor, k0, n_tiles: cutlass.Constexpr[int]):
    """rB (2, n_tiles, 1) <- the B fragments of columns k0..k0+7 of the (n, k) matrix ``sCols``
    (rows 8 n .. 8 n + 7 of n-tile n)."""
    lane = cute.arch.lane_idx()
    for n in cutlass.range_constexpr(n_tiles):
        for i in cutlass.range_constexpr(2):
            rB[i, n, 0] = sCols[8 * n + lane // 4, k0 + lane % 4 + 4 * i].to(Float32)


@cute.jit
def rows_times_columns(acc: cute.Tensor, sTile: cute.Tensor, stage, sCols: cute.Tensor,
                       k_steps: cutlass.Constexpr[int], cols_exact: cutlass.Constexpr[bool]):
    """acc (4, 1, NT) += tile (16, 8 k_steps) @ cols^T: a warp's 16 fp32 state rows (stage
    ``stage`` of a padded tile) against the NT * 8 rows of the (n, k) matrix ``sCols``."""
    lane = cute.arch.lane_idx()
    nt = cute.size(acc, mode=[2])
    for kb in cutlass.range_constexpr(k_steps):
        rA = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
        for i in cutlass.range_constexpr(4):
            rA[i, 0, 0] = sTile[lane // 4 + 8 * (i % 2), 8 * kb + lane % 4 + 4 * (i // 2), stage]
        rB = cute.make_rmem_tensor(cute.make_layout((2, nt, 1)), Float32)
        load_b_fragment(rB, sCols, 8 * kb, nt)
        mma_tf32(acc, rA, rB, True, not cols_exact)


def fold_cols(cols: int) -> int:
    """Checkpoint columns folded per pass: the largest of 64, 32, 16, 8 dividing `cols`."""
    return next(c for c in (64, 32, 16, 8) if cols % c == 0)


@cute.jit
def add_coef_keys(acc: cute.Tensor, rCoef: cute.Tensor, sKeys: cute.Tensor, key_cols: cutlass.Constexpr,
                  live_rows: cutlass.Constexpr, keys_exact: cutlass.Constexpr[bool]):
    """acc (4, 1, NT) += Coef Keys on tensor cores (TF32, the coefficients split into hi + lo, the
    keys too unless ``keys_exact``): Coef (16, 8 KF) the A fragments ``rCoef`` (4, KF), Keys rows
    8 kf .. 8 kf + 7 of ``sKeys``, the lane's B column of n-tile n ``key_cols[n]`` (the caller's
    column order). With ``live_rows`` (not None) rows from it on read as zero (the ring's stale
    positions, past the staged keys)."""
    lane = cute.arch.lane_idx()
    nt = cute.size(acc, mode=[2])
    for kf in cutlass.range_constexpr(cute.size(rCoef, mode=[1])):
        rA = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
        for i in cutlass.range_constexpr(4):
            rA[i, 0, 0] = rCoef[i, kf]
        rB = cute.make_rmem_tensor(cute.make_layout((2, nt, 1)), Float32)
        for n in cutlass.range_constexpr(nt):
            for i in cutlass.range_constexpr(2):
                p = 8 * kf + lane % 4 + 4 * i
                if cutlass.const_expr(live_rows is None):
                    rB[i, n, 0] = sKeys[p, key_cols[n]].to(Float32)
                else:
                    key = sKeys[cutlass.min(p, live_rows - 1), key_cols[n]].to(Float32)
                    rB[i, n, 0] = cutlass.select_(p < live_rows, key, Float32(0.0))
        mma_tf32(acc, rA, rB, True, not keys_exact)


@cute.jit
def rows_times_dots(rAcc: cute.Tensor, rRows: cute.Tensor, sDot: cute.Tensor, split_rows: cutlass.Constexpr[bool]):
    """rAcc (4, 1, NT) <- R Dots^T on tensor cores (zeroed first): a warp's rows as A fragments
    ``rRows`` (4, KF) against the weighted dots ``sDot`` (k-major B operand). The verifies' ring
    and draft terms: Mamba-2's X Dots^T, GDN's U Dots^T. fp32 rows are split hi / lo (``split_rows``)."""
    rAcc.fill(0.0)
    for kf in cutlass.range_constexpr(cute.size(rRows, mode=[1])):
        rA = cute.make_rmem_tensor(cute.make_layout((4, 1, 1)), Float32)
        for i in cutlass.range_constexpr(4):
            rA[i, 0, 0] = rRows[i, kf]
        rW = cute.make_rmem_tensor(cute.make_layout((2, cute.size(rAcc, mode=[2]), 1)), Float32)
        load_b_fragment(rW, sDot, 8 * kf, cute.size(rAcc, mode=[2]))
        mma_tf32(rAcc, rA, rW, split_rows, True)


@cute.jit
def ring_fold_fragments(rCoef: cute.Tensor, rRows: cute.Tensor, w_fold: Float32, origin: Int32, c4: Int32,
                        cap: cutlass.Constexpr[int]):
    """A flush's fold over ring positions (drafts not folded): ``rCoef`` (4, KF) <- w_j r_j, the
    A fragments of the warp's rows' records ``rRows`` weighted by lane j's ``w_fold`` for the
    record at ring position q (zero past the ring)."""
    for kf in cutlass.range_constexpr(cute.size(rCoef, mode=[1])):
        for i in cutlass.range_constexpr(4):
            q = 8 * kf + c4 + 4 * (i // 2)
            w = cute.arch.shuffle_sync(w_fold, (q - origin + cap) % cap)
            rCoef[i, kf] = cutlass.select_(q < cap, w * rRows[i, kf], Float32(0.0))


@cute.jit
def fold_into_checkpoint(mRow: cute.Tensor, sTile: cute.Tensor, stage, rCoef: cute.Tensor, sKeys: cute.Tensor,
                         gamma: Float32, fold_cols: cutlass.Constexpr[int], keys_exact: cutlass.Constexpr[bool]):
    """Store ``gamma S + Coef Keys`` for a warp's 16 rows: S the fp32 tile (stage ``stage``),
    Coef (16, 8 KF) the records' coefficients as A fragments ``rCoef`` (4, KF), Keys the (8 KF, cols)
    rows of ``sKeys``; ``mRow(r, c)`` is the checkpoint row r of the warp. ``fold_cols`` columns of
    accumulators at a time keep the registers bounded."""
    lane = cute.arch.lane_idx()
    g4 = lane // 4
    c4 = lane % 4
    cols = cute.size(mRow, mode=[1])
    nt = fold_cols // 8
    for nc in cutlass.range_constexpr(cols // fold_cols):
        rNew = cute.make_rmem_tensor(cute.make_layout((4, 1, nt)), Float32)
        for n in cutlass.range_constexpr(nt):
            for i in cutlass.range_constexpr(4):
                rNew[i, 0, n] = gamma * sTile[g4 + 8 * (i // 2), nc * fold_cols + 8 * n + 2 * c4 + i % 2, stage]
        add_coef_keys(rNew, rCoef, sKeys, [nc * fold_cols + 8 * n + g4 for n in range(nt)], None, keys_exact)
        for n in cutlass.range_constexpr(nt):
            for half in cutlass.range_constexpr(2):
                rPair = cute.make_rmem_tensor((2,), Float32)
                rPair[0] = rNew[2 * half, 0, n]
                rPair[1] = rNew[2 * half + 1, 0, n]
                cute.autovec_copy(rPair, cute.local_tile(mRow[g4 + 8 * half, None], (2,), (nc * fold_cols // 2 + 4 * n + c4,)))
