"""Mamba-2 decode step: ReplaySSM standard decoding, with the conventional step as window 1.

One kernel class serves both. With window L > 1 it runs Algorithm 1 of the paper: each row reads
its cursor h on the device, appends its record, and either computes its output from checkpoint +
ring without writing any state (non-flush, output-only route) or folds the ring into the
checkpoint and stores it (flush, when h + 1 == L). With L == 1 every step is a flush of the
current token alone, which is exactly the conventional load-update-store step, so the baseline and
ReplaySSM share one code path and one set of launch parameters.

Grid: (headdim // rows_per_cta, nheads, batch). A CTA owns rows [p0, p0 + rows_per_cta) of one
head's (P, N) state for one batch row; warp w owns the consecutive rows_per_cta / num_warps rows
that arrive as its TMA stage (cp.async.bulk.tensor, all stages issued at entry); each lane holds
N / 32 consecutive elements of a state row. The last warp of a row to finish advances its cursor.

Tensor contract (b = batch, S = slots, cap = window + max_draft, act = bf16 | fp16 | fp32):

| name        | shape            | dtype   | access | meaning                                        |
|-------------|------------------|---------|--------|------------------------------------------------|
| checkpoint  | (S, H, P, N)     | fp32    | R / W on flush | S_ckpt (the conventional state when L = 1) |
| x           | (b, H, P)        | act     | R      | value input; batch stride free                 |
| dt          | (b, H)           | act/fp32| R      | raw dt                                         |
| A           | (H,)             | fp32    | R      | negative decay rate                            |
| B, C        | (b, G, N)        | act     | R      | key / query, head h uses group h // (H // G)   |
| D           | (H,)             | fp32    | R, optional | skip connection                           |
| z           | (b, H, P)        | act     | R, optional | gate: y *= z * sigmoid(z)                 |
| dt_bias     | (H,)             | fp32    | R, optional | added to dt before softplus               |
| slot_ids    | (b,)             | int32   | R      | pool slot per row; pad / out-of-range rows skip|
| out         | (b, H, P)        | act     | W      | y (pad rows left untouched)                    |
| ring_x      | (S, cap, H, P)   | act     | R / W  | record x (L > 1 only)                          |
| ring_B      | (S, cap, G, N)   | act     | R / W  | record B, once per group                       |
| ring_dt     | (S, cap, H)      | fp32    | R / W  | record dt after softplus                       |
| cursor      | (S,)             | int32   | R / W  | committed records h                            |
| origin      | (S,)             | int32   | R      | ring index of record 0                         |
| arrivals    | (S,)             | int32   | R / W  | zero between steps; the last CTA of a row advances the cursor |
"""

from dataclasses import dataclass
from typing import Optional, Type

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..common import issue_tile_loads, make_row_tma, softplus, warp_sum


@dataclass(frozen=True)
class Mamba2Shape:
    """Everything static about one layer's decode: dims, window, dtypes and optional inputs."""

    nheads: int
    headdim: int
    dstate: int
    ngroups: int
    window: int
    capacity: int
    act_dtype: Type[cutlass.Numeric] = cutlass.BFloat16
    dt_dtype: Type[cutlass.Numeric] = cutlass.BFloat16
    has_D: bool = True
    has_z: bool = False
    has_dt_bias: bool = True
    dt_softplus: bool = True
    pad_slot_id: int = -1

    def key(self):
        return (self.nheads, self.headdim, self.dstate, self.ngroups, self.window, self.capacity,
                self.act_dtype.__name__, self.dt_dtype.__name__, self.has_D, self.has_z,
                self.has_dt_bias, self.dt_softplus, self.pad_slot_id)


@dataclass(frozen=True)
class Mamba2Config:
    """Launch configuration: rows_per_cta divides headdim and num_warps divides rows_per_cta; each
    warp's rows arrive as one TMA stage with its own mbarrier."""

    rows_per_cta: int = 16
    num_warps: int = 4
    min_ctas_per_sm: int = 0  # > 0 caps registers so this many CTAs fit on an SM

    @property
    def rows_per_warp(self) -> int:
        return self.rows_per_cta // self.num_warps

    def key(self):
        return (self.rows_per_cta, self.num_warps, self.min_ctas_per_sm)

    def check(self, shape: Mamba2Shape) -> Optional[str]:
        """None if valid for `shape`, else the reason."""
        P, N = shape.headdim, shape.dstate
        if N % 32 or N > 256:
            return f"dstate {N}: the kernel needs a multiple of 32 up to 256"
        if P % self.rows_per_cta:
            return f"rows_per_cta {self.rows_per_cta} does not divide headdim {P}"
        if self.rows_per_cta % self.num_warps:
            return f"num_warps {self.num_warps} does not divide rows_per_cta {self.rows_per_cta}"
        if self.rows_per_warp > 32:
            return "more than 32 rows per warp (a lane per row in the fold)"
        if shape.window > 32:
            return "window above 32 (one lane per record)"
        return None


class Mamba2Decode:
    """One decode step of a Mamba-2 layer over a pool of slots (see module docstring)."""

    def __init__(self, shape: Mamba2Shape, config: Mamba2Config):
        reason = config.check(shape)
        if reason is not None:
            raise ValueError(f"Mamba2Config {config} invalid for {shape}: {reason}")
        self.shape = shape
        self.config = config

    def smem_bytes(self) -> int:
        c = self.config
        return (c.rows_per_cta * self.shape.dstate + self.shape.window) * 4 \
            + 8 * c.num_warps + 384

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
        mCursor: Optional[cute.Tensor],
        mOrigin: Optional[cute.Tensor],
        mArrivals: Optional[cute.Tensor],
        stream,
    ):
        s, c = self.shape, self.config
        H, P, N = s.nheads, s.headdim, s.dstate
        # The checkpoint as (slots * H * P, N) rows so a TMA box is one warp's state rows.
        mRows = cute.make_tensor(
            mCheckpoint.iterator,
            cute.make_layout((mCheckpoint.shape[0] * (H * P), N), stride=(N, 1)),
        )
        tma_atom, mRowsTma = make_row_tma(mRows, c.rows_per_warp, N)
        self.kernel(
            tma_atom, mRowsTma, mCheckpoint, mX, mDt, mA, mB, mC, mD, mZ, mDtBias, mSlot, mOut,
            mRingX, mRingB, mRingDt, mCursor, mOrigin, mArrivals,
        ).launch(
            grid=[P // c.rows_per_cta, H, mX.shape[0]],
            block=[32 * c.num_warps, 1, 1],
            smem=self.smem_bytes(),
            stream=stream,
            min_blocks_per_mp=c.min_ctas_per_sm,
            preferred_smem_carveout=100,  # the checkpoint tiles in flight live in shared memory
        )

    @cute.kernel
    def kernel(
        self,
        tma_atom: cute.CopyAtom,
        mRowsTma: cute.Tensor,
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
        mCursor: Optional[cute.Tensor],
        mOrigin: Optional[cute.Tensor],
        mArrivals: Optional[cute.Tensor],
    ):
        # Warp-centric: warp w owns rows [p0 + w*RW, p0 + (w+1)*RW) (one TMA stage each). Lane j
        # owns record j's scalars (dt_j, its decay weight w_j, w_j (B_j . C)); lane r owns row
        # p_warp + r's terms (x, the ring sum, the output); all lanes split each state row's N
        # columns for S . C. Records and rows meet through shuffles, never local memory.
        s, c = self.shape, self.config
        H, P, N, G, L, cap = s.nheads, s.headdim, s.dstate, s.ngroups, s.window, s.capacity
        R, W = c.rows_per_cta, c.num_warps
        RW = R // W
        JC = next(k for k in (8, 4, 2, 1) if L % k == 0)  # records folded per pass
        vec = N // 32
        heads_per_group = H // G
        act = s.act_dtype

        tidx, _, _ = cute.arch.thread_idx()
        ptile, head, row = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32

        slot = mSlot[row]
        valid = (slot >= 0) & (slot < mCheckpoint.shape[0])
        if cutlass.const_expr(s.pad_slot_id == 0):
            valid = valid & (slot != 0)

        if valid:
            slot64 = Int64(slot)
            group = head // heads_per_group
            p_warp = ptile * R + warp * RW

            smem = SmemAllocator()
            sState = smem.allocate_tensor(
                Float32, cute.make_layout((RW, N, W), stride=(N, 1, RW * N)), byte_alignment=128
            )
            mbar = smem.allocate_array(Int64, W, byte_alignment=8)
            sBC = smem.allocate_tensor(Float32, cute.make_layout(L), byte_alignment=16)  # B_j . C
            if tidx == 0:
                for st in cutlass.range_constexpr(W):
                    cute.arch.mbarrier_init(mbar + st, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            if warp == 0:
                first_box = Int32((slot64 * (H * P) + head * P + ptile * R) // RW)
                issue_tile_loads(tma_atom, mRowsTma, sState, mbar, first_box, W, RW * N * 4)

            h = Int32(0)
            origin = Int32(0)
            if cutlass.const_expr(L > 1):
                h = mCursor[slot]
                origin = mOrigin[slot]
            flush = h + 1 == L
            pos = (origin + lane) % cap  # ring index of this lane's record
            pos_h = (origin + h) % cap  # where this token's record goes

            # Lane r < RW owns state row p_warp + r for the per-row terms (loads coalesce).
            lr = lane % RW
            x_raw = mX[row, head, p_warp + lr]
            x_cur = x_raw.to(Float32)
            rCa = cute.make_rmem_tensor((vec,), act)
            cute.autovec_copy(cute.local_tile(mC[row, group, None], (vec,), (lane,)), rCa)

            A = mA[head].to(Float32)
            dt_j = Float32(0.0)
            if lane == h:
                dt_j = mDt[row, head].to(Float32)
                if cutlass.const_expr(s.has_dt_bias):
                    dt_j = dt_j + mDtBias[head].to(Float32)
                if cutlass.const_expr(s.dt_softplus):
                    dt_j = softplus(dt_j)
            if cutlass.const_expr(L > 1):
                if lane < h:
                    dt_j = mRingDt[slot64, pos, head]
            # Suffix sums over records (j, h] by a reversed inclusive scan across lanes.
            tail = dt_j
            for k in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_down(tail, 1 << k)
                if lane + (1 << k) < 32:
                    tail = tail + other
            w_j = dt_j * cute.math.exp(A * (tail - dt_j), fastmath=False)
            gamma = cute.math.exp(A * cute.arch.shuffle_sync(tail, 0), fastmath=False)

            rC = cute.make_rmem_tensor((vec,), Float32)
            rC.store(rCa.load().to(Float32))
            coef_j = Float32(0.0)  # non-flush: w_j (B_j . C), the weight of x_j[p] in y[p]
            ring_term = Float32(0.0)
            if cutlass.const_expr(L > 1):
                if not flush:
                    # B_j . C once per CTA: the warps split the records, then share through smem.
                    for jj in cutlass.range_constexpr((L + W - 1) // W):
                        j = jj * W + warp
                        if j <= h:
                            rBj = cute.make_rmem_tensor((vec,), act)
                            if j == h:
                                cute.autovec_copy(cute.local_tile(mB[row, group, None], (vec,), (lane,)), rBj)
                            else:
                                cute.autovec_copy(
                                    cute.local_tile(mRingB[slot64, (origin + j) % cap, group, None], (vec,), (lane,)),
                                    rBj)
                            part = Float32(0.0)
                            for v in cutlass.range_constexpr(vec):
                                part = part + rBj[v].to(Float32) * rC[v]
                            part = warp_sum(part)
                            if lane == 0:
                                sBC[j] = part
                    # Append this token's B and dt (its x goes in below, with the outputs).
                    if ptile == 0 and warp == 0:
                        if head % heads_per_group == 0:
                            for v in cutlass.range_constexpr(vec):
                                mRingB[slot64, pos_h, group, lane * vec + v] = mB[row, group, lane * vec + v]
                        if lane == h:
                            mRingDt[slot64, pos_h, head] = dt_j
                    cute.arch.sync_threads()
                    if lane <= h:
                        coef_j = w_j * sBC[lane]
                    # sum_j w_j (B_j . C) x_j[p] for this lane's row: coef_j by shuffle from lane j.
                    ring_term = cute.arch.shuffle_sync(coef_j, h) * x_cur
                    for j in cutlass.range_constexpr(L - 1):
                        coef = cute.arch.shuffle_sync(coef_j, j)
                        if j < h:
                            ring_term = ring_term + coef * mRingX[slot64, (origin + j) % cap, head, p_warp + lr].to(Float32)

            D = Float32(0.0)
            if cutlass.const_expr(s.has_D):
                D = mD[head].to(Float32)
            cute.arch.mbarrier_wait(mbar + warp, 0)
            if flush:
                # Fold in place in shared memory, a few records per pass, so that no more than a
                # chunk of B columns is ever live in registers: S = gamma S + sum_j (w_j x_j[p]) B_j.
                for jc in cutlass.range(L // JC):
                    # Lane r < RW forms w_j x_j[p_r] for this pass's records (a coalesced load per
                    # record), so the row loop below can stay a runtime loop: coef by shuffle.
                    rBc = cute.make_rmem_tensor(cute.make_layout((JC, vec), stride=(vec, 1)), act)
                    rCoef = cute.make_rmem_tensor((JC,), Float32)
                    for jj in cutlass.range_constexpr(JC):
                        j = jc * JC + jj
                        w = cute.arch.shuffle_sync(w_j, j)
                        if cutlass.const_expr(L == 1):
                            cute.autovec_copy(cute.local_tile(mB[row, group, None], (vec,), (lane,)), rBc[jj, None])
                            rCoef[jj] = w * x_cur
                        else:
                            if j == L - 1:
                                cute.autovec_copy(cute.local_tile(mB[row, group, None], (vec,), (lane,)), rBc[jj, None])
                                rCoef[jj] = w * x_cur
                            else:
                                cute.autovec_copy(
                                    cute.local_tile(mRingB[slot64, (origin + j) % cap, group, None], (vec,), (lane,)),
                                    rBc[jj, None])
                                rCoef[jj] = w * mRingX[slot64, (origin + j) % cap, head, p_warp + lr].to(Float32)
                    scale = cutlass.select_(jc == 0, gamma, Float32(1.0))
                    for r in cutlass.range(RW, unroll=2):
                        tS = cute.local_tile(sState[r, None, warp], (vec,), (lane,))
                        rS = cute.make_rmem_tensor((vec,), Float32)
                        cute.autovec_copy(tS, rS)
                        for v in cutlass.range_constexpr(vec):
                            rS[v] = scale * rS[v]
                        for jj in cutlass.range_constexpr(JC):
                            coef = cute.arch.shuffle_sync(rCoef[jj], r)
                            for v in cutlass.range_constexpr(vec):
                                rS[v] = rS[v] + coef * rBc[jj, v].to(Float32)
                        cute.autovec_copy(rS, tS)
                cute.arch.sync_warp()
            # Output: flush rows read the folded state; others gamma (S_ckpt . C) + sum_j coef_j x_j.
            gamma_out = cutlass.select_(flush, Float32(1.0), gamma)
            y_row = Float32(0.0)  # lane r: S[p_r] . C
            for r in cutlass.range(RW, unroll=2):
                rS = cute.make_rmem_tensor((vec,), Float32)
                cute.autovec_copy(cute.local_tile(sState[r, None, warp], (vec,), (lane,)), rS)
                if flush:
                    cute.autovec_copy(rS, cute.local_tile(mCheckpoint[slot64, head, p_warp + r, None], (vec,), (lane,)))
                part = Float32(0.0)
                for v in cutlass.range_constexpr(vec):
                    part = part + rS[v] * rC[v]
                y_row = cutlass.select_(lane == r, warp_sum(part), y_row)
            if lane < RW:
                y = gamma_out * y_row + ring_term
                if cutlass.const_expr(s.has_D):
                    y = y + D * x_cur
                if cutlass.const_expr(s.has_z):
                    z = mZ[row, head, p_warp + lane].to(Float32)
                    y = y * z / (Float32(1.0) + cute.math.exp(-z, fastmath=False))
                mOut[row, head, p_warp + lane] = y.to(act)
                if cutlass.const_expr(L > 1):
                    if not flush:
                        mRingX[slot64, pos_h, head, p_warp + lane] = x_raw

            if cutlass.const_expr(L > 1):
                # The last warp of this row to finish advances the cursor: every warp has used h by
                # then. Per-warp arrivals need no CTA barrier; acq_rel orders the reads before.
                if lane == 0:
                    done = cute.arch.atomic_add(mArrivals.iterator + slot64, Int32(1), sem="acq_rel", scope="gpu")
                    if done == H * (P // R) * W - 1:
                        next_h = h + 1
                        if flush:
                            next_h = Int32(0)
                        mCursor[slot] = next_h
                        mArrivals[slot] = Int32(0)


def _fake_inputs(shape: Mamba2Shape):
    """Fake tensors with symbolic batch and slot dims, matching what the API passes.

    Activation rows may be views into wider tensors (any batch stride), but their base and batch
    stride must be 16-byte aligned (checked by the API) so rows load as vectors.
    """
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    H, P, N, G, cap = shape.nheads, shape.headdim, shape.dstate, shape.ngroups, shape.capacity
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

    replay = shape.window > 1
    return dict(
        mCheckpoint=compact(Float32, (slots, H, P, N)),
        mX=rows(act, (H, P)),
        mDt=rows(shape.dt_dtype, (H,), align=None),
        mA=compact(Float32, (H,), align=4),
        mB=rows(act, (G, N)),
        mC=rows(act, (G, N)),
        mD=compact(Float32, (H,), align=4) if shape.has_D else None,
        mZ=rows(act, (H, P)) if shape.has_z else None,
        mDtBias=compact(Float32, (H,), align=4) if shape.has_dt_bias else None,
        mSlot=compact(Int32, (batch,), align=4),
        mOut=rows(act, (H, P)),
        mRingX=compact(act, (slots, cap, H, P)) if replay else None,
        mRingB=compact(act, (slots, cap, G, N)) if replay else None,
        mRingDt=compact(Float32, (slots, cap, H)) if replay else None,
        mCursor=compact(Int32, (slots,), align=4) if replay else None,
        mOrigin=compact(Int32, (slots,), align=4) if replay else None,
        mArrivals=compact(Int32, (slots,), align=4) if replay else None,
    )


def compile_decode(shape: Mamba2Shape, config: Mamba2Config, options: str):
    """Compile with `options` (TVM-FFI and the target arch); the entry point launches on the
    caller's current CUDA stream, so CUDA-graph capture records it."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = _fake_inputs(shape)
    return cute.compile(Mamba2Decode(shape, config), *args.values(), stream, options=options)
