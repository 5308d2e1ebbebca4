"""Gated DeltaNet decode step: ReplaySSM standard decoding, with the conventional step as window 1.

One kernel class serves both, as for Mamba-2. With window L > 1 it runs Algorithm 4 of the paper
(docs/design.md section 3): each row reads its committed record count h from the step's plan
(kernels/table.py, which advanced the sequence table before the step's layers ran; this kernel
writes no cursor, counter or flag); S k and S q of the state
before the token are taken from the checkpoint in one pass plus the ring's records
(``alpha S_h x = gamma (S_ckpt x) + sum_j w_j (k_j . x) u_j`` with every decay after record j in
w_j), never forming the state; then ``u = beta (v - alpha S_h k)``, ``o = alpha S_h q + u (k . q)``.
A non-flush row appends (u, k, g) and writes no state; a flushing row (h + 1 == L) folds its
records and this token into the checkpoint tile it already holds in shared memory and stores it.
With L == 1 every step is that flush of the current token alone: exactly the conventional fused
step (L2 norm, gates, load, update, store), so the baseline shares the code and launch parameters.

Grid: (head_v_dim // rows_per_cta, num_v_heads, batch). A CTA owns rows [i0, i0 + rows_per_cta)
of one value head's (V, K) state for one batch row; warp w owns the rows_per_cta / num_warps rows
that arrive as its TMA stage (cp.async.bulk.tensor, all stages issued at entry); a lane holds
`vec` consecutive elements of a state row along K. The dot products of a row (with k and with q)
and of a record key (with k and q) are reduced several at a time (``warp_reduce_many``). The plan
row is loaded with the slot id (both indexed by the batch row), then the ring (u and keys at every
position, as in the Mamba-2 kernel; g of the live records), put in record order with shuffles;
stale positions weigh zero where used (``clear_stale_record`` for the staged keys).

Tensor contract (b = batch, S = slots, cap = window + max_draft, act = bf16 | fp16 | fp32):

| name        | shape             | dtype    | access | meaning                                     |
|-------------|-------------------|----------|--------|---------------------------------------------|
| checkpoint  | (S, HV, V, K)     | fmt      | R / W on flush | S_ckpt (the state when L = 1); format below |
| q, k        | (b, H, K)         | act      | R      | raw query / key; any batch stride (views into mixed_qkv) |
| v           | (b, HV, V)        | act      | R      | value, any batch stride                     |
| a, b        | (b, HV)           | gate     | R      | raw gates: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) |
| A_log       | (HV,)             | param    | R      |                                             |
| dt_bias     | (HV,)             | param    | R      |                                             |
| slot_ids    | (b,)              | int32    | R      | pool slot per row; pad / out-of-range rows skip |
| out         | (b, HV, V)        | act      | W      | o (pad rows left untouched)                 |
| ring_u      | (S, cap, HV, V)   | fp16     | R / W  | record u (L > 1 only)                       |
| ring_k      | (S, cap, H, K)    | act      | R / W  | record key, L2-normalised, once per key head|
| ring_g      | (S, cap, HV)      | fp32     | R / W  | record log decay g                          |
| ring_v      | (S, cap, HV, V)   | act      | W; R at a re-deriving flush | record v (two-precision caches) |
| ring_beta   | (S, cap, HV)      | fp32     | W; R at a re-deriving flush | record beta             |
| plan        | (b, 4)            | int32    | R      | (slot, h, origin, sr_writes) before the step (L > 1 or SR) |
| checkpoint_scale, _state_scale | per format | fp32 / E4M3 | R / W on flush | fp8: (S, HV, V, K / bk); nvfp4: (S, HV, V, K / 16), (S, HV) |
| read        | (S, HV, V, cols) | fmt | R; W on flush | read copy (optional), RTN; scales as the checkpoint's |
| sr_seed     | (1,)             | int64   | R      | SR seed (low-precision checkpoint)              |

The kernel takes this token's tensors as a ``GDNToken``, the records with the plan as a ``GDNRing``
and the copies' other tensors (scales, read copy, SR seed) as a ``state_io.CopyTensors``.

State formats (kernels/state_io.py): fp32, fp16, fp8 (uint8 E4M3 codes + fp32 scale per bk = 128
elements, or per row) or nvfp4 (uint8 pairs of E2M1 codes + E4M3 block scales + fp32 state scale),
cols = K or K / 2. Non-flush steps read the read copy when there is one, else the checkpoint; a
flush reads the checkpoint, rebuilds the state in fp32 and writes it into every copy: SR into a
low-precision checkpoint (bits keyed by sr_seed, slot and the plan's sr_writes), RTN into the read copy.
With a low-precision entry (``StateCopies.light``) the kernel keeps no fp32 tile: a flush reads the
checkpoint rows (from the entry tile, or from global memory next to a read copy) and folds them in
registers, twice for an nvfp4 writer (the whole-state amax, then the stores).
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..common import (after_previous_kernel, clear_stale_record, lane_scan, launch_tiles, planned_positions,
                      pow2_at_least, record_values, slot_is_live, warp_reduce_many)
from ..state_io import (CopyTensors, checkpoint_row, decode_slice, entry_tma, fake_copy_tensors, folded_row,
                        folded_state_scale, prefetch_entry_rows, ring_coefficients, smem_scale, start_state_loads,
                        store_copies, write_state_scales)
from .common import gdn_gates, normalize_qk
from .config import GDNConfig, GDNRing, GDNShape, GDNToken


@cute.jit
def ring_sums(sCoef: cute.Tensor, rU: cute.Tensor, origin: Int32, h: Int32, cap: cutlass.Constexpr[int]):
    """This lane's row's ring terms sum_j w_j (k_j . x) u_j[i], x = k and q, over the h committed
    records (``sCoef`` per position, ``rU`` the row's u per position)."""
    ring_k = Float32(0.0)
    ring_q = Float32(0.0)
    for p in cutlass.range_constexpr(cap):
        # select, not a zero weight: a stale position may hold any value.
        live_p = (p - origin + cap) % cap < h
        ring_k = ring_k + cutlass.select_(live_p, sCoef[0, p] * rU[p], Float32(0.0))
        ring_q = ring_q + cutlass.select_(live_p, sCoef[1, p] * rU[p], Float32(0.0))
    return ring_k, ring_q


@cute.jit
def key_pair_dots(sKeys: cute.Tensor, b: Int32, cap: cutlass.Constexpr[int], vec: cutlass.Constexpr[int],
                  act: cutlass.Constexpr) -> Float32:
    """k_p . k_q of the 32 position pairs b * 32 .. b * 32 + 31 (pair = p * cap + q; past cap^2 the
    last pair again): lane l returns pair b * 32 + l."""
    lane = cute.arch.lane_idx()
    n_pairs = cap * cap
    rPart = cute.make_rmem_tensor((32,), Float32)
    for t in cutlass.range_constexpr(32):
        pair = cutlass.min(b * 32 + t, n_pairs - 1)
        rKp = cute.make_rmem_tensor((vec,), act)
        rKq = cute.make_rmem_tensor((vec,), act)
        cute.autovec_copy(cute.local_tile(sKeys[pair // cap, None], (vec,), (lane,)), rKp)
        cute.autovec_copy(cute.local_tile(sKeys[pair % cap, None], (vec,), (lane,)), rKq)
        acc = Float32(0.0)
        for e in cutlass.range_constexpr(vec):
            acc = acc + rKp[e].to(Float32) * rKq[e].to(Float32)
        rPart[t] = acc
    return warp_reduce_many(rPart, 32)


@cute.jit
def key_gram(sKeys: cute.Tensor, sGram: cute.Tensor, worker: Int32, workers: cutlass.Constexpr[int],
             cap: cutlass.Constexpr[int], vec: cutlass.Constexpr[int], act: cutlass.Constexpr):
    """sGram[p, q] = k_p . k_q for every pair of ring positions, 32 pairs per warp pass, split
    over ``workers`` warps (this one is number ``worker``)."""
    lane = cute.arch.lane_idx()
    n_pairs = cap * cap
    n_batch = (n_pairs + 31) // 32
    for bb in cutlass.range_constexpr((n_batch + workers - 1) // workers):
        b = bb * workers + worker
        if b < n_batch:
            total = key_pair_dots(sKeys, b, cap, vec, act)
            if b * 32 + lane < n_pairs:
                sGram[(b * 32 + lane) // cap, (b * 32 + lane) % cap] = total


@cute.jit
def row_key_dots(rS: cute.Tensor, sKeys: cute.Tensor, sSk: cute.Tensor, r: Int32, cap: cutlass.Constexpr[int],
                 vec: cutlass.Constexpr[int], act: cutlass.Constexpr):
    """sSk[p, r] = S_ckpt[row r] . k_p for every position p (``rS``: the lane's slice of the
    checkpoint row; ``sSk`` the calling warp's (cap, rows))."""
    lane = cute.arch.lane_idx()
    n_pos = pow2_at_least(cap)
    rDots = cute.make_rmem_tensor((n_pos,), Float32)
    rDots.fill(0.0)
    for p in cutlass.range_constexpr(cap):
        rKey = cute.make_rmem_tensor((vec,), act)
        cute.autovec_copy(cute.local_tile(sKeys[p, None], (vec,), (lane,)), rKey)
        for e in cutlass.range_constexpr(vec):
            rDots[p] = rDots[p] + rS[e] * rKey[e].to(Float32)
    s_k = warp_reduce_many(rDots, n_pos)  # lane l: position l >> (5 - log2 n_pos)
    p_lane = lane >> (5 - (n_pos.bit_length() - 1))
    if lane % (32 // n_pos) == 0 and p_lane < cap:
        sSk[p_lane, r] = s_k


@cute.jit
def rederive_corrections(sKeys: cute.Tensor, sGram: cute.Tensor, sSk: cute.Tensor,
                         sUre: cute.Tensor, sV: cute.Tensor, mRingV: cute.Tensor, mRingBeta: cute.Tensor, rU: cute.Tensor, g_j: Float32,
                         slot64: Int64, vhead: Int32, i_row: Int32, origin: Int32, h: Int32,
                         rows: cutlass.Constexpr[int], warps: cutlass.Constexpr[int], cap: cutlass.Constexpr[int],
                         vec: cutlass.Constexpr[int], act: cutlass.Constexpr):
    """A flush's corrections from the recurrence checkpoint (``forward_substitution``) in a kernel
    whose CTA holds one item: the records' v and beta from global memory, the keys' Gram matrix
    split over the CTA's warps. ``sSk`` holds S_ckpt k_p of every warp's rows (``row_key_dots``);
    every thread of the CTA calls it."""
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = cute.arch.lane_idx()
    lr = lane % rows
    # v of this lane's row at every position, all loads in flight at once, staged by position.
    for p in cutlass.range_constexpr(cap):
        sV[p, lr, warp] = mRingV[slot64, p, vhead, i_row].to(Float32)
    key_gram(sKeys, sGram, warp, warps, cap, vec, act)
    cute.arch.sync_threads()  # the Gram matrix of every warp, this warp's S_ckpt k_p
    beta_lane = Float32(0.0)
    if lane < h:
        beta_lane = mRingBeta[slot64, (origin + lane) % cap, vhead]
    forward_substitution(sGram, sSk[None, None, warp], sV[None, None, warp], sUre[None, None, warp], beta_lane, rU,
                         g_j, origin, h, rows, cap)


@cute.jit
def rederived_by_position(sUre: cute.Tensor, rU: cute.Tensor, origin: Int32, h: Int32, lr: Int32,
                          cap: cutlass.Constexpr[int]):
    """``rU``: the re-derived u of this lane's row (``sUre``, by record, written by this warp) by
    ring position, zero at stale positions (never a NaN's product)."""
    cute.arch.sync_warp()
    for p in cutlass.range_constexpr(cap):
        j = (p - origin + cap) % cap
        rU[p] = cutlass.select_(j < h, sUre[j, lr], Float32(0.0))


@cute.jit
def forward_substitution(sGram: cute.Tensor, sSk: cute.Tensor, sV: cute.Tensor, sUre: cute.Tensor, beta_lane: Float32,
                         rU: cute.Tensor, g_j: Float32, origin: Int32, h: Int32, rows: cutlass.Constexpr[int],
                         cap: cutlass.Constexpr[int]):
    """Paper Algorithm 6 for this lane's row (lane mod ``rows`` of the warp's): for the records
    j = 0 .. h-1 in order, ``u_j = beta_j (v_j - alpha_j S_{j-1} k_j)`` with
    ``alpha_j S_{j-1} k_j = e^{P_j} (S_ckpt k_j) + sum_{i<j} e^{P_j - P_i} (k_i . k_j) u_i`` (P the
    prefix sums of g), replacing the cached ones in ``rU`` (by ring position; zero at stale
    positions), so that read-copy rounding never enters the recurrence. The warp's (cap, rows) tensors by ring position:
    ``sSk`` S_ckpt k_p, ``sV`` the records' v (any dtype; zero where stale), ``sUre`` scratch;
    ``sGram`` the keys' Gram matrix; lane j: ``g_j`` and ``beta_lane`` of record j."""
    lane = cute.arch.lane_idx()
    lr = lane % rows
    # Record scalars by record index, in every lane's registers: P_j (inclusive prefix of g), beta_j.
    prefix = lane_scan(g_j)
    alpha_lane = cute.math.exp(g_j, fastmath=False)
    rPre = cute.make_rmem_tensor((cap,), Float32)
    rBeta = cute.make_rmem_tensor((cap,), Float32)
    rPos = cute.make_rmem_tensor((cap,), Int32)  # ring position of record j
    for j in cutlass.range_constexpr(cap):
        rPre[j] = cute.arch.shuffle_sync(prefix, j)
        rBeta[j] = cute.arch.shuffle_sync(beta_lane, j)
        rPos[j] = cutlass.select_(origin + j >= cap, origin + j - cap, origin + j)

    # Forward substitution along the records for this lane's row; e^{P_j - P_i} as the product of
    # the decays alpha_{i+1} .. alpha_j, accumulated from i = j - 1 down (no exp per pair). The
    # inner loop stays rolled (u_i from sUre, which this lane wrote): unrolled, its cap^2 / 2
    # bodies overflowed the instruction cache (Nsight Compute: half the flush's stall cycles
    # were instruction fetch).
    for j in cutlass.range_constexpr(cap):
        if j < h:
            p = rPos[j]
            acc = cute.math.exp(rPre[j], fastmath=False) * sSk[p, lr]
            if cutlass.const_expr(j > 0):
                decay = Float32(1.0)
                for ii in cutlass.range(j, unroll=1):
                    i = j - 1 - ii
                    decay = decay * cute.arch.shuffle_sync(alpha_lane, i + 1)
                    p_i = cutlass.select_(origin + i >= cap, origin + i - cap, origin + i)
                    acc = acc + decay * sGram[p_i, p] * sUre[i, lr]
            sUre[j, lr] = rBeta[j] * (sV[p, lr].to(Float32) - acc)
    rederived_by_position(sUre, rU, origin, h, lr, cap)


class GDNDecode:
    """One decode step of a Gated DeltaNet layer over a pool of slots (see module docstring)."""

    def __init__(self, shape: GDNShape, config: GDNConfig):
        reason = config.check(shape)
        if reason is not None:
            raise ValueError(f"GDNConfig {config} invalid for {shape}: {reason}")
        self.shape = shape
        self.config = config

    def smem_bytes(self) -> int:
        return self.config.smem_bytes(self.shape)

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
        s, c = self.shape, self.config
        HV, V = s.num_v_heads, s.head_v_dim
        tma_entry, mEntryTma = entry_tma(s.copies, mCheckpoint, mRead, HV * V, c.rows_per_warp)
        launch_tiles(self.kernel(
            tma_entry, mEntryTma, mCheckpoint, GDNToken(mQ, mK, mV, mA, mB, mALog, mDtBias), mSlot, mOut,
            GDNRing(mRingU, mRingK, mRingG, mRingV, mRingBeta, mPlan),
            CopyTensors(mCheckpointScale, mCheckpointStateScale, mRead, mReadScale, mReadStateScale, mSrSeed),
        ), [V // c.rows_per_cta, HV, mV.shape[0]], c, self.smem_bytes(), stream)

    @cute.kernel
    def kernel(
        self,
        tma_entry: cute.CopyAtom,
        mEntryTma: cute.Tensor,
        mCheckpoint: cute.Tensor,
        token: GDNToken,
        mSlot: cute.Tensor,
        mOut: cute.Tensor,
        records: GDNRing,
        tensors: CopyTensors,
    ):
        # Warp-centric, as the Mamba-2 kernel: lane j owns record j's scalars (g_j, its weight
        # w_j); lane r owns state row i_warp + r's scalars (v, u, the ring sums, the output);
        # all lanes split each K-long row. Records and rows meet through shuffles and a small
        # shared table of w_j (k_j . k), w_j (k_j . q); nothing goes to local memory.
        mQ, mK, mV, mA, mB, mALog, mDtBias = token
        mRingU, mRingK, mRingG, mRingV, mRingBeta, mPlan = records
        s, c = self.shape, self.config
        HV, V, K, H, L, cap = s.num_v_heads, s.head_v_dim, s.head_k_dim, s.num_k_heads, s.window, s.capacity
        R, W = c.rows_per_cta, c.num_warps
        RW = R // W
        vec = s.k_vec
        KL = K // vec  # lanes that hold part of a K row
        JC = 4  # records folded per pass
        RPW = c.records_per_warp(cap)  # ring positions whose keys a warp loads
        rep = HV // H
        act = s.act_dtype
        copies = s.copies
        entry_fmt = copies.entry
        rederive = s.rederive and L > 1
        # A low-precision entry: no fp32 tile, a flush reads checkpoint rows and folds them in
        # registers; else one fp32 checkpoint, folded in the tile and stored as folded.
        light = copies.light

        tidx, _, _ = cute.arch.thread_idx()
        ptile, vhead, row = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()

        prefetch_entry_rows(copies, mCheckpoint, tensors.mRead, mSlot, row, vhead, ptile * R, R, s.pad_slot_id)
        after_previous_kernel()
        slot = mSlot[row]
        h, origin, sr_count = planned_positions(mPlan, row, L > 1, copies.stochastic)
        valid = slot_is_live(slot, mCheckpoint.shape[0], s.pad_slot_id)

        if valid:
            slot64 = Int64(slot)
            khead = vhead // rep
            i_warp = ptile * R + warp * RW  # first state row of this warp

            smem = SmemAllocator()
            sState = None
            if cutlass.const_expr(not light):
                sState = smem.allocate_tensor(
                    Float32, cute.make_layout((RW, K, W), stride=(K, 1, RW * K)), byte_alignment=128
                )
            mbar = smem.allocate_array(Int64, W, byte_alignment=8)
            # Per record j: w_j (k_j . k) and w_j (k_j . q), shared by the CTA's warps.
            sCoef = smem.allocate_tensor(Float32, cute.make_layout((2, cap), stride=(1, 2)), byte_alignment=16)
            # The keys at every ring position, staged once so a flush folds without another load.
            sKeys = smem.allocate_tensor(act, cute.make_layout((cap, K), stride=(K, 1)), byte_alignment=16)
            # Low-precision copies land in their own tiles (storage dtype) and are decoded per
            # row; the entry rows' scales are staged per warp at entry.
            first_box = Int32((slot64 * (HV * V) + vhead * V + ptile * R) // RW)
            sEntry, sAmax, sEntryScale, entry_state_scale, sr_key = start_state_loads(
                copies, smem, sState, mbar, tma_entry, mEntryTma, first_box, i_warp, slot, slot64, vhead,
                tensors, sr_count, RW, W)
            sGram, sSk, sUre, sV = None, None, None, None
            if cutlass.const_expr(rederive):
                sGram = smem.allocate_tensor(Float32, cute.make_layout((cap, cap), stride=(cap, 1)), byte_alignment=16)
                sSk = smem.allocate_tensor(Float32, cute.make_layout((cap, RW, W), stride=(RW, 1, cap * RW)),
                                           byte_alignment=16)
                sUre = smem.allocate_tensor(Float32, cute.make_layout((cap, RW, W), stride=(RW, 1, cap * RW)),
                                            byte_alignment=16)
                sV = smem.allocate_tensor(Float32, cute.make_layout((cap, RW, W), stride=(RW, 1, cap * RW)),
                                          byte_alignment=16)

            # The ring is read by physical position p (record (p - origin) mod cap); a stale
            # position's u and key are read but weigh zero; record order is restored with shuffles.
            g_phys = Float32(0.0)  # lane p: g at position p
            if cutlass.const_expr(L > 1):
                if (lane % cap - origin + cap) % cap < h:
                    g_phys = mRingG[slot64, lane % cap, vhead]
            flush = h + 1 >= L  # h == L only after a speculative commit: fold all, then this token
            pos_h = (origin + h) % cap  # where this token's record goes

            # Lane r (mod RW) owns row i = i_warp + r: its v and u_p[i] at every position p.
            lr = lane % RW
            i_row = i_warp + lr
            v_raw = mV[row, vhead, i_row]
            rU = cute.make_rmem_tensor((cap,), Float32)
            if cutlass.const_expr(L > 1):
                for p in cutlass.range_constexpr(cap):  # every position: predicated loads spill here
                    rU[p] = mRingU[slot64, p, vhead, i_row].to(Float32)

            # Keys at every position, staged in shared memory for the fold: warp w takes p = w,
            # w + W, ...; its lanes split K.
            if cutlass.const_expr(L > 1):
                rKring = cute.make_rmem_tensor(cute.make_layout((RPW, vec), stride=(vec, 1)), act)
                if lane < KL:
                    for pp in cutlass.range_constexpr(RPW):
                        if cutlass.const_expr(pp * W < cap):
                            p_key = pp * W + warp
                            if p_key < cap:
                                for e in cutlass.range_constexpr(vec):
                                    rKring[pp, e] = mRingK[slot64, p_key, khead, lane * vec + e]

            # q and k of the key head, L2-normalised in fp32; q scaled. Scalar loads: any stride.
            rK = cute.make_rmem_tensor((vec,), Float32)
            rQ = cute.make_rmem_tensor((vec,), Float32)
            rK.fill(0.0)
            rQ.fill(0.0)
            if lane < KL:
                for e in cutlass.range_constexpr(vec):
                    rK[e] = mK[row, khead, lane * vec + e].to(Float32)
                    rQ[e] = mQ[row, khead, lane * vec + e].to(Float32)
            kq = normalize_qk(rK, rQ, vec, s.q_scale)
            g, beta = gdn_gates(mA[row, vhead].to(Float32), mB[row, vhead].to(Float32),
                                mALog[vhead].to(Float32), mDtBias[vhead].to(Float32))

            # Lane j: g_j of record j < h, this token's g at lane h. The weight of record j in
            # alpha S_h (and in the folded state) is exp(sum of the g after it, this token's
            # included): a reversed inclusive scan across lanes.
            g_rec = Float32(0.0)
            if cutlass.const_expr(L > 1):
                g_rec = cute.arch.shuffle_sync(g_phys, (origin + lane) % cap)
            g_j, tail = record_values(g, g_rec, h, L > 1)
            w_j = cute.math.exp(tail - g_j, fastmath=False)
            gamma = cute.math.exp(cute.arch.shuffle_sync(tail, 0), fastmath=False)

            if cutlass.const_expr(L > 1):
                # k_p . k and k_p . q once per CTA for the warp's positions; the CTA shares
                # w_j (k_p . x) per position p (zero where p holds no committed record).
                n_rec = c.record_dot_values(cap)
                rDot = cute.make_rmem_tensor((n_rec,), Float32)
                rDot.fill(0.0)
                if lane < KL:
                    for pp in cutlass.range_constexpr(RPW):
                        if cutlass.const_expr(pp * W < cap):
                            p_key = pp * W + warp
                            if p_key < cap:
                                tKey = cute.local_tile(sKeys[p_key, None], (vec,), (lane,))
                                cute.autovec_copy(rKring[pp, None], tKey)
                                clear_stale_record(tKey, p_key, origin, h, cap)
                                for e in cutlass.range_constexpr(vec):
                                    rDot[2 * pp] = rDot[2 * pp] + rKring[pp, e].to(Float32) * rK[e]
                                    rDot[2 * pp + 1] = rDot[2 * pp + 1] + rKring[pp, e].to(Float32) * rQ[e]
                dot = warp_reduce_many(rDot, n_rec)
                idx = lane >> (5 - (n_rec.bit_length() - 1))
                p_dot = (idx // 2) * W + warp
                j_dot = (p_dot - origin + cap) % cap  # the record at position p_dot
                w_dot = cute.arch.shuffle_sync(w_j, j_dot)
                if lane % (32 // n_rec) == 0 and idx < 2 * RPW and p_dot < cap:
                    sCoef[idx % 2, p_dot] = cutlass.select_(j_dot < h, w_dot * dot, Float32(0.0))
                if not flush:
                    # Append this token's key (once per key head) and decay (once per value head).
                    if ptile == 0 and warp == 0:
                        if vhead % rep == 0 and lane < KL:
                            for e in cutlass.range_constexpr(vec):
                                mRingK[slot64, pos_h, khead, lane * vec + e] = rK[e].to(act)
                        if lane == 0:
                            mRingG[slot64, pos_h, vhead] = g
                            if cutlass.const_expr(s.keep_v_beta):
                                mRingBeta[slot64, pos_h, vhead] = beta
                cute.arch.sync_threads()

            # The ring sums of this lane's row: sum_j w_j (k_j . x) u_j[i] for x = k, q (after the
            # corrections are re-derived when a flush does that).
            ring_k = Float32(0.0)
            ring_q = Float32(0.0)
            if cutlass.const_expr(L > 1 and not rederive):
                ring_k, ring_q = ring_sums(sCoef, rU, origin, h, cap)

            cute.arch.mbarrier_wait(mbar + warp, 0)
            if cutlass.const_expr(entry_fmt.scale_dtype is not None):
                cute.arch.sync_warp()  # the staged scales
            if flush:
                if cutlass.const_expr(rederive and not light):
                    for r in cutlass.range(RW, unroll=1):
                        rS = cute.make_rmem_tensor((vec,), Float32)
                        cute.autovec_copy(cute.local_tile(sState[r, None, warp], (vec,), (lane,)), rS)
                        row_key_dots(rS, sKeys, sSk[None, None, warp], r, cap, vec, act)

            # One pass over the state tile: S k and S q for each of the warp's rows (the read copy
            # on a non-flush step, the checkpoint on a flush; with a light tile a flush takes the
            # checkpoint rows here, and S_ckpt k_p for a re-derivation).
            rRows = cute.make_rmem_tensor((2 * RW,), Float32)
            rRows.fill(0.0)
            if lane < KL:
                for r in cutlass.range_constexpr(RW):
                    rS = cute.make_rmem_tensor((vec,), Float32)
                    if cutlass.const_expr(light):
                        if flush:
                            checkpoint_row(copies, mCheckpoint, tensors, sEntry, sEntryScale, entry_state_scale, slot64,
                                           vhead, i_warp, r, rS)
                            if cutlass.const_expr(rederive):
                                row_key_dots(rS, sKeys, sSk[None, None, warp], r, cap, vec, act)
                        else:
                            scale = smem_scale(entry_fmt, sEntryScale, warp, r, lane * vec, entry_state_scale)
                            decode_slice(entry_fmt, cute.local_tile(sEntry[r, None, warp], (entry_fmt.per_lane(vec),),
                                                                    (lane,)), scale, rS)
                    else:
                        cute.autovec_copy(cute.local_tile(sState[r, None, warp], (vec,), (lane,)), rS)
                    for e in cutlass.range_constexpr(vec):
                        rRows[2 * r] = rRows[2 * r] + rS[e] * rK[e]
                        rRows[2 * r + 1] = rRows[2 * r + 1] + rS[e] * rQ[e]
            if cutlass.const_expr(rederive):
                if flush:
                    rederive_corrections(sKeys, sGram, sSk, sUre, sV, mRingV, mRingBeta, rU, g_j, slot64, vhead,
                                         i_row, origin, h, RW, W, cap, vec, act)
                ring_k, ring_q = ring_sums(sCoef, rU, origin, h, cap)
            rows = warp_reduce_many(rRows, 2 * RW)
            shift = 5 - (2 * RW).bit_length() + 1
            s_k = cute.arch.shuffle_sync(rows, (2 * lr) << shift)
            s_q = cute.arch.shuffle_sync(rows, (2 * lr + 1) << shift)

            u = beta * (v_raw.to(Float32) - (gamma * s_k + ring_k))
            if lane < RW:
                mOut[row, vhead, i_row] = (gamma * s_q + ring_q + u * kq).to(act)
                if cutlass.const_expr(L > 1):
                    if not flush:
                        mRingU[slot64, pos_h, vhead, i_row] = u.to(cutlass.Float16)
                        if cutlass.const_expr(s.keep_v_beta):
                            mRingV[slot64, pos_h, vhead, i_row] = v_raw

            if cutlass.const_expr(light):
                if flush:
                    # Row by row in registers from the checkpoint: S = gamma S + u k + sum_j
                    # (w_j u_j[i]) k_j, then every copy of the row.
                    rCoefs = cute.make_rmem_tensor((cap,), Float32)  # this lane's row, per position
                    ring_coefficients(w_j, rU, origin, h, rCoefs)
                    state_scale = Float32(1.0)
                    if cutlass.const_expr(copies.whole_state):  # nvfp4: the folded state's amax first
                        state_scale = folded_state_scale(
                            copies, mCheckpoint, tensors, sEntry, sEntryScale, entry_state_scale, slot64, vhead, i_warp,
                            gamma, u, rK, rCoefs, sKeys, L > 1, sAmax)
                    for r in cutlass.range(RW, unroll=4):  # rows' checkpoint loads in flight together
                        rS = cute.make_rmem_tensor((vec,), Float32)
                        folded_row(copies, mCheckpoint, tensors, sEntry, sEntryScale, entry_state_scale, slot64, vhead,
                                   i_warp, r, gamma, u, rK, rCoefs, sKeys, L > 1, rS)
                        store_copies(copies, rS, mCheckpoint, tensors, slot64, vhead, i_warp + r, state_scale, sr_key)
                    if cutlass.const_expr(copies.whole_state):
                        write_state_scales(copies, state_scale, tensors, slot64, vhead)
            else:
                if flush:
                    # Fold in place in shared memory, JC items per pass (their keys in registers),
                    # storing to the checkpoint on the last pass: S = gamma S + sum_j (w_j u_j[i]) k_j
                    # over this token (item 0) and the ring positions (items 1..cap; zero weight where
                    # a position holds no committed record). Keys come from sKeys and u from
                    # registers: no load waits once the tile is in.
                    n_items = 1 if cutlass.const_expr(L == 1) else cap + 1
                    n_pass = (n_items + JC - 1) // JC
                    for jc in cutlass.range_constexpr(n_pass):
                        items = min(JC, n_items - jc * JC)
                        rKc = cute.make_rmem_tensor(cute.make_layout((JC, vec), stride=(vec, 1)), Float32)
                        rCoef = cute.make_rmem_tensor((JC,), Float32)
                        for jj in cutlass.range_constexpr(items):
                            item = jc * JC + jj
                            if cutlass.const_expr(item == 0):
                                for e in cutlass.range_constexpr(vec):
                                    rKc[jj, e] = rK[e]
                                rCoef[jj] = u  # the token's own weight is exp(0)
                            else:
                                p_item = item - 1
                                j_item = (p_item - origin + cap) % cap
                                w = cute.arch.shuffle_sync(w_j, j_item)
                                if lane < KL:
                                    rKs = cute.make_rmem_tensor((vec,), act)
                                    cute.autovec_copy(cute.local_tile(sKeys[p_item, None], (vec,), (lane,)), rKs)
                                    for e in cutlass.range_constexpr(vec):
                                        rKc[jj, e] = rKs[e].to(Float32)
                                rCoef[jj] = cutlass.select_(j_item < h, w * rU[p_item], Float32(0.0))
                        for r in cutlass.range(RW, unroll=2):
                            rS = cute.make_rmem_tensor((vec,), Float32)
                            tS = cute.local_tile(sState[r, None, warp], (vec,), (lane,))
                            if lane < KL:
                                cute.autovec_copy(tS, rS)
                            if cutlass.const_expr(jc == 0):
                                for e in cutlass.range_constexpr(vec):
                                    rS[e] = gamma * rS[e]
                            for jj in cutlass.range_constexpr(items):
                                coef = cute.arch.shuffle_sync(rCoef[jj], r)
                                for e in cutlass.range_constexpr(vec):
                                    rS[e] = rS[e] + coef * rKc[jj, e]
                            if lane < KL:
                                if cutlass.const_expr(jc == n_pass - 1):
                                    cute.autovec_copy(rS, cute.local_tile(
                                        mCheckpoint[slot64, vhead, i_warp + r, None], (vec,), (lane,)))
                                else:
                                    cute.autovec_copy(rS, tS)


def fake_inputs(shape: GDNShape):
    """Fake tensors with symbolic batch and slot dims, matching what the API passes: activation
    rows take any batch stride (q, k, v may be views into vLLM's packed mixed_qkv)."""
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

    HV, V, K, H, cap = shape.num_v_heads, shape.head_v_dim, shape.head_k_dim, shape.num_k_heads, shape.capacity
    act = shape.act_dtype
    batch, slots = cute.sym_int(), cute.sym_int()

    def compact(dtype, dims, align=16):
        return make_fake_compact_tensor(dtype, dims, stride_order=tuple(reversed(range(len(dims)))),
                                        assumed_align=align)

    def rows(dtype, inner):
        strides, step = [], 1
        for d in reversed(inner):
            strides.insert(0, step)
            step *= d
        return make_fake_tensor(dtype, (batch,) + tuple(inner), (cute.sym_int64(),) + tuple(strides),
                                assumed_align=dtype.width // 8)

    replay = shape.window > 1
    keep = replay and shape.keep_v_beta
    copies = shape.copies

    state = fake_copy_tensors(copies, slots, HV, V)
    return dict(
        mCheckpoint=state.pop("mCheckpoint"),
        mQ=rows(act, (H, K)),
        mK=rows(act, (H, K)),
        mV=rows(act, (HV, V)),
        mA=rows(shape.gate_dtype, (HV,)),
        mB=rows(shape.gate_dtype, (HV,)),
        mALog=compact(shape.A_log_dtype, (HV,), align=4),
        mDtBias=compact(shape.dt_bias_dtype, (HV,), align=4),
        mSlot=compact(Int32, (batch,), align=4),
        mOut=rows(act, (HV, V)),
        mRingU=compact(cutlass.Float16, (slots, cap, HV, V)) if replay else None,
        mRingK=compact(act, (slots, cap, H, K)) if replay else None,
        mRingG=compact(Float32, (slots, cap, HV)) if replay else None,
        mRingV=compact(act, (slots, cap, HV, V)) if keep else None,
        mRingBeta=compact(Float32, (slots, cap, HV)) if keep else None,
        mPlan=compact(Int32, (batch, 4)) if replay or copies.stochastic else None,
        **state,
    )


def compile_decode(shape: GDNShape, config: GDNConfig, options: str):
    """Compile with `options` (TVM-FFI and the target arch); the entry point launches on the
    caller's current CUDA stream, so CUDA-graph capture records it."""
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    args = fake_inputs(shape)
    return cute.compile(GDNDecode(shape, config), *args.values(), stream, options=options)
