"""Device helpers shared by the Mamba-2 and GDN decode kernels.

What lives here is the same in every layer type: the softplus of the engines, warp sums, and
the TMA streaming of a checkpoint tile into shared memory (one mbarrier per stage, every stage
issued up front so a CTA keeps its whole tile in flight).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync


SMEM_PER_CTA = 227 * 1024  # opt-in maximum per CTA on sm_90 / sm_100 / sm_103
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
def warp_reduce_many(vals: cute.Tensor, n: cutlass.Constexpr[int]) -> Float32:
    """Sum each of n per-lane values (a power of two up to 32) over the warp in n - 1 + 5 - log2(n)
    shuffles instead of 5 n: every step halves the values a lane carries and trades the other
    half with its partner. Lane l returns the total of value ``l >> (5 - log2(n))``; ``vals`` is
    clobbered."""
    m = n.bit_length() - 1
    lane = cute.arch.lane_idx()
    for s in cutlass.range_constexpr(m):
        half = n >> (s + 1)
        offset = 16 >> s
        upper = (lane & offset) != 0
        for i in cutlass.range_constexpr(half):
            send = cutlass.select_(upper, vals[i], vals[i + half])
            keep = cutlass.select_(upper, vals[i + half], vals[i])
            vals[i] = keep + cute.arch.shuffle_sync_bfly(send, offset=offset)
    total = vals[0]
    for s in cutlass.range_constexpr(5 - m):
        total = total + cute.arch.shuffle_sync_bfly(total, offset=(16 >> m) >> s)
    return total


def make_row_tma(m_rows: cute.Tensor, box_rows: int, box_cols: int):
    """TMA atom loading (box_rows, box_cols) boxes of a row-major 2-D gmem view.

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
    g_boxes = cute.local_tile(m_tma, cute.select(s_tile.shape, mode=[0, 1]), (None, 0))
    t_s, t_g = cpasync.tma_partition(
        tma_atom, 0, cute.make_layout(1),
        cute.group_modes(s_tile, 0, 2), cute.group_modes(g_boxes, 0, 2),
    )
    for s in cutlass.range_constexpr(stages):
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar + s, stage_bytes)
        cute.copy(tma_atom, t_g[None, first_box + s], t_s[None, s], tma_bar_ptr=mbar + s)
