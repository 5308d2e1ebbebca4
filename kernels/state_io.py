"""Device side of the state copies: a lane's slice of a state row read from any format, and an
fp32 state row written into any format, bit for bit as ``replayssm_cute.quant`` (RTN into a read
copy, SR with the cache's counter-based bits into a low-precision recurrence checkpoint).

Both layer types hold a state as rows along its innermost dim K (Mamba-2: (P, N) per head, GDN:
(V, K) per value head); a warp owns whole rows and its lanes split a row's K elements into
``vec`` consecutive ones each. A copy is described by a static ``CopyFormat``; its tensors come
as torch passes them (replayssm_cute.cache's layout), low-precision codes as integers:

| format | data (slots, heads, rows, cols) | scale                              | state scale        |
|--------|---------------------------------|------------------------------------|--------------------|
| fp32   | fp32, cols = K                  | -                                  | -                  |
| fp16   | fp16, cols = K                  | -                                  | -                  |
| fp8    | uint8 E4M3 codes, cols = K      | fp32 (slots, heads, rows, K / bk)  | -                  |
| nvfp4  | uint8, two E2M1 codes, cols = K/2| uint8 E4M3 codes (.., rows, K / 16)| fp32 (slots, heads)|

Reading multiplies each decoded code by its scale (fp8: fl(code * scale); nvfp4: exact), so a
low-precision checkpoint decodes to the reference's fp32 values. Writing needs the block amax
(a shuffle reduction over the lanes of a block) and, for nvfp4, the amax of the whole state,
which the caller reduces over its CTA (``nvfp4_state_scale``): a kernel writing nvfp4 holds a
whole head's state in one CTA.

Conversions: RTN into fp16 and E4M3 and E4M3 decoding use the hardware conversions of every
target (``cvt.rn.f16.f32``, ``cvt.rn.satfinite.e4m3x2.f32``, ``cvt.rn.f16x2.e4m3x2``: quant's
RTN exactly, NaN mapped to its code); E2M1 decoding uses ``cvt.rn.f16x2.e2m1x2`` on sm_100a /
sm_103a and software on sm_90a (the same values either way: E2M1 is exact in fp16); E2M1 RTN
and every SR rounding are software on every target.
sm_90a has neither ``cvt.rs`` nor E2M1 conversions; on sm_100a / sm_103a ``cvt.rs`` takes 13
random bits per fp16 element and shares one 32-bit word between the elements of an E4M3 / E2M1
quad (PTX ISA, ``cvt``), so it cannot draw quant's independent 32 bits per element and no
definition of the bits makes it bit-exact with the reference: SR stays software there too.

Light copies (``StateCopies.light``): with a low-precision entry tile a decode kernel keeps no fp32
tile in shared memory (so more CTAs fit an SM, which a latency-bound step needs to use the smaller
reads) and a flush folds checkpoint rows in registers (``checkpoint_row``); an nvfp4 writer folds
the rows twice, first for the whole state's amax (``folded_state_scale``), then to store them.
"""

from dataclasses import dataclass
from typing import NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float16, Float32, Int32, Int64, Uint8, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from .common import (f32_asm, fold_into_checkpoint, load_past_l1, make_padded_row_tma, make_row_tma, mma_f16,
                     prefetch_l2, ptx_op, ptx_ops, slot_is_live, slot_rows, start_tile_loads)
from .limits import programmatic_launch
from .quant import E2M1, E4M3, F16, Minifloat, f32_bits, fmix32, round_to_code

FORMATS = ("fp32", "fp16", "fp8", "nvfp4")
_E4M3_MAX = 448.0
_E2M1_MAX = 6.0
_SR_KEY_SALT = 0x9E3779B9


@dataclass(frozen=True)
class CopyFormat:
    """One state copy's storage: its format name and the state's innermost dim K."""

    name: str
    K: int

    def __post_init__(self):
        if self.name not in FORMATS:
            raise ValueError(f"format {self.name!r}: expected one of {FORMATS}")

    @property
    def low_precision(self) -> bool:
        return self.name != "fp32"

    @property
    def storage(self):
        return {"fp32": Float32, "fp16": Float16}.get(self.name, Uint8)

    @property
    def cols(self) -> int:
        """Storage elements per state row."""
        return self.K // 2 if self.name == "nvfp4" else self.K

    @property
    def row_bytes(self) -> int:
        return self.cols * self.storage.width // 8

    @property
    def block_k(self) -> int:
        """Elements along K that share a scale (K when there is none)."""
        if self.name == "fp8":
            return 128 if self.K % 128 == 0 else self.K
        return 16 if self.name == "nvfp4" else self.K

    @property
    def scale_dtype(self):
        return {"fp8": Float32, "nvfp4": Uint8}.get(self.name)

    @property
    def has_state_scale(self) -> bool:
        return self.name == "nvfp4"

    @property
    def scales_per_row(self) -> int:
        return self.K // self.block_k if self.scale_dtype is not None else 0

    def scale_smem_bytes(self, rows: int) -> int:
        """The staged scales of ``rows`` rows (``stage_scales``), alignment slack included."""
        return rows * self.scales_per_row * self.scale_dtype.width // 8 + 16 if self.scale_dtype is not None else 0

    def per_lane(self, vec: int) -> int:
        """Storage elements holding a lane's ``vec`` consecutive values."""
        return vec // 2 if self.name == "nvfp4" else vec

    def check(self, vec: int) -> Optional[str]:
        """None if lanes holding ``vec`` consecutive elements of a row can read and write this format."""
        if self.name == "nvfp4" and (self.K % 32 or 16 % vec or vec % 2):
            return f"nvfp4 needs K a multiple of 32 with 2, 4 or 8 elements per lane (K = {self.K})"
        if self.row_bytes % 16:
            return f"a {self.name} state row of {self.row_bytes} bytes: TMA rows need a multiple of 16"
        return None


@dataclass(frozen=True)
class StateCopies:
    """The state copies of one cache configuration as a kernel sees them: the recurrence
    checkpoint (SR when low precision) and the optional read copy (RTN) of non-flush steps."""

    checkpoint_format: str
    read_copy: Optional[str]
    K: int
    window: int

    @property
    def checkpoint(self) -> CopyFormat:
        return CopyFormat(self.checkpoint_format, self.K)

    @property
    def read(self) -> Optional[CopyFormat]:
        return None if self.read_copy is None else CopyFormat(self.read_copy, self.K)

    @property
    def separate(self) -> bool:
        """A read copy apart from the checkpoint: a flush loads the checkpoint after the cursor."""
        return self.read_copy is not None

    @property
    def entry(self) -> CopyFormat:
        """What every step loads at entry, before the cursor says whether it flushes."""
        return self.read if self.separate else self.checkpoint

    @property
    def stochastic(self) -> bool:
        return self.checkpoint.low_precision

    @property
    def light(self) -> bool:
        """The entry is low precision: a decode kernel keeps no fp32 tile in shared memory (only
        the small entry tile, so more CTAs fit an SM) and a flush folds row by row in registers
        from the checkpoint (twice for an nvfp4 copy: the whole-state amax, then the stores)."""
        return self.entry.low_precision

    @property
    def whole_state(self) -> bool:
        """nvfp4 is written with one scale per state: its writer holds a whole head."""
        return "nvfp4" in (self.checkpoint_format, self.read_copy)

    def smem_bytes(self, rows: int, warps: int) -> int:
        """A decode kernel's shared memory beyond its fp32 work tile (none with a light entry):
        the low-precision entry tile, its scales, amax slots."""
        return (-4 * rows * self.K if self.light else 0) + self.work_tile_smem_bytes(rows, warps)

    def work_tile_smem_bytes(self, rows: int, warps: int) -> int:
        """Shared memory beyond the fp32 work tile of a kernel that decodes its entry into it
        (``fill_work_tile``): the low-precision entry tile, its scales and nvfp4's amax slots."""
        extra = 0
        if self.entry.low_precision:
            extra += rows * self.entry.row_bytes + 128 + self.entry.scale_smem_bytes(rows)
        if self.whole_state:
            extra += 4 * warps
        return extra

    def check(self, vec: int, rows_per_cta: int, rows_per_head: int) -> Optional[str]:
        if self.read_copy is not None and self.window == 1:
            return "a read copy needs a ring (window > 1)"
        if self.checkpoint_format == "nvfp4" and self.read_copy is not None:
            return "an nvfp4 checkpoint is a single copy (shared or window 1), never next to a read copy"
        for fmt in (self.checkpoint, self.read):
            reason = None if fmt is None else fmt.check(vec)
            if reason is not None:
                return reason
            if fmt is not None and fmt.low_precision and 32 * vec != self.K:
                return f"a {fmt.name} copy needs every lane to hold a slice of a row: K = 32 x {vec}, not {self.K}"
        if self.whole_state and rows_per_cta != rows_per_head:
            return f"nvfp4 copies are written by one CTA per head: rows_per_cta must be {rows_per_head}"
        return None


class CopyTensors(NamedTuple):
    """A cache's state tensors besides the checkpoint's data, as a kernel and these helpers take
    them: the checkpoint's scales, the read copy with its scales, the SR seed (None where the cache
    has none). A kernel's trailing parameters, in this order (mCheckpoint comes first)."""

    mCheckpointScale: Optional[cute.Tensor]
    mCheckpointStateScale: Optional[cute.Tensor]
    mRead: Optional[cute.Tensor]
    mReadScale: Optional[cute.Tensor]
    mReadStateScale: Optional[cute.Tensor]
    mSrSeed: Optional[cute.Tensor]


COPY_ARGS = CopyTensors._fields


def fake_copy_tensors(copies: StateCopies, slots, heads: int, rows: int) -> dict:
    """Compile-time stand-ins of a kernel's state-copy arguments as the API passes them (symbolic
    ``slots``; (slots, heads, rows, cols) data): the checkpoint and its scales, the read copy and
    its scales, the SR seed, None where the configuration has none."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    def compact(dtype, dims, align=16):
        return make_fake_compact_tensor(dtype, dims, stride_order=tuple(reversed(range(len(dims)))),
                                        assumed_align=align)

    def copy_tensors(fmt):
        if fmt is None:
            return None, None, None
        return (compact(fmt.storage, (slots, heads, rows, fmt.cols)),
                compact(fmt.scale_dtype, (slots, heads, rows, fmt.scales_per_row), align=4) if fmt.scale_dtype else None,
                compact(Float32, (slots, heads), align=4) if fmt.has_state_scale else None)

    ckpt, ckpt_scale, ckpt_state_scale = copy_tensors(copies.checkpoint)
    read, read_scale, read_state_scale = copy_tensors(copies.read)
    stochastic = copies.stochastic
    return dict(mCheckpoint=ckpt, **dict(zip(COPY_ARGS, (
        ckpt_scale, ckpt_state_scale, read, read_scale, read_state_scale,
        compact(Int64, (1,), align=8) if stochastic else None))))


# ----------------------------------------------------------------------------- PTX steps


@dsl_user_op
def _f32_from_bits(bits: Int32, *, loc=None, ip=None) -> Float32:
    return ptx_op(Float32, [Int32(bits)], "mov.b32 $0, $1;", "=f,r", loc, ip)


@dsl_user_op
def max_nan(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """max(a, b), NaN if either is (an amax must not drop a NaN)."""
    return ptx_op(Float32, [Float32(a), Float32(b)], "max.NaN.f32 $0, $1, $2;", "=f,f,f", loc, ip)


@dsl_user_op
def _div(a: Float32, b: Float32, rounding: cutlass.Constexpr[str], *, loc=None, ip=None) -> Float32:
    """a / b correctly rounded in ``rounding`` ("rn" nearest, "rp" toward +inf)."""
    return ptx_op(Float32, [Float32(a), Float32(b)], f"div.{rounding}.f32 $0, $1, $2;", "=f,f,f", loc, ip)


@dsl_user_op
def _mul_rn(a: Float32, b: Float32, *, loc=None, ip=None) -> Float32:
    """fl(a * b), never contracted into an FMA."""
    return ptx_op(Float32, [Float32(a), Float32(b)], "mul.rn.f32 $0, $1, $2;", "=f,f,f", loc, ip)


@dsl_user_op
def _abs(x: Float32, *, loc=None, ip=None) -> Float32:
    return f32_asm(Float32, x, "abs.f32 $0, $1;", "=f,f", loc, ip)


@dsl_user_op
def _rcp_toward_zero(d: Float32, *, loc=None, ip=None) -> Float32:
    return f32_asm(Float32, d, "rcp.rz.f32 $0, $1;", "=f,f", loc, ip)


@dsl_user_op
def _f16_code_rn(x: Float32, *, loc=None, ip=None) -> Int32:
    """fp16 RTN code of x by the hardware conversion (ties to even, overflow to Inf, subnormals
    kept): quant's RTN for every non-NaN x."""
    return ptx_op(Int32, [Float32(x)], "{ .reg .b16 h; cvt.rn.f16.f32 h, $1; cvt.u32.u16 $0, h; }", "=r,f", loc, ip)


@dsl_user_op
def _e4m3_code_rn(x: Float32, *, loc=None, ip=None) -> Int32:
    """E4M3 RTN code of x by the hardware conversion (sm_89+; satfinite: overflow and Inf to
    ±448 as quant's E4M3 RTN): quant's RTN for every non-NaN x."""
    return ptx_op(Int32, [Float32(x)], "{ .reg .b16 h; cvt.rn.satfinite.e4m3x2.f32 h, $1, $1; cvt.u32.u16 $0, h; }",
                  "=r,f", loc, ip)


@cute.jit
def rtn_code(x: Float32, spec: cutlass.Constexpr[Minifloat]) -> Int32:
    """quant's RTN code of x in ``spec``: the hardware conversion for fp16 and E4M3 (NaN mapped to
    the reference's code, sign kept), software for E2M1 (sm_90a has no E2M1 conversion)."""
    code = Int32(0)
    if cutlass.const_expr(spec is F16):
        code = _f16_code_rn(x) & 0xFFFF
    elif cutlass.const_expr(spec is E4M3):
        code = _e4m3_code_rn(x) & 0xFF
    else:
        code = round_to_code(x, Uint32(0), spec, False)
    if cutlass.const_expr(spec is not E2M1):
        nan = spec.nan_code | ((f32_bits(x) >> 31) & 1) * spec.sign_bit
        code = cutlass.select_(x != x, Int32(nan), code)
    return code


@cute.jit
def _reciprocal_or_zero(d: Float32) -> Float32:
    """1 / d rounded toward zero, 0 where d == 0 (quant._reciprocal_toward_zero)."""
    return cutlass.select_(d == Float32(0.0), Float32(0.0), _rcp_toward_zero(d))


@cute.jit
def _group_max(x: Float32, lanes: cutlass.Constexpr[int]) -> Float32:
    """NaN-propagating max over aligned groups of ``lanes`` lanes (a power of two)."""
    offset = lanes // 2
    while cutlass.const_expr(offset >= 1):
        x = max_nan(x, cute.arch.shuffle_sync_bfly(x, offset=offset))
        offset = offset // 2
    return x


@cute.jit
def e4m3_value(code: Int32) -> Float32:
    """The value of an E4M3 code (sign bit included), exactly; NaN for 0x7F / 0xFF."""
    mag = Int32(code) & 0x7F
    sign = (Int32(code) & 0x80) << 24
    exponent = mag >> 3
    normal = _f32_from_bits((((exponent + 120) << 23) | ((mag & 7) << 20)) | sign)
    subnormal = _f32_from_bits(f32_bits(Float32(Int32(mag & 7)) * Float32(2.0 ** -9)) | sign)
    value = cutlass.select_(exponent == 0, subnormal, normal)
    return cutlass.select_(mag == 0x7F, Float32(float("nan")), value)


@dsl_user_op
def _e4m3_pair_values(pair: Int32, *, loc=None, ip=None):
    """The values of two E4M3 codes (low byte first) by the hardware conversion (sm_89+; exact,
    NaN for 0x7F / 0xFF, as ``e4m3_value``)."""
    halves = ptx_op(Int32, [Int32(pair)], "{ .reg .b16 p; cvt.u16.u32 p, $1; cvt.rn.f16x2.e4m3x2 $0, p; }",
                    "=r,r", loc, ip)
    lo = ptx_op(Float32, [halves], "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, l; }", "=f,r", loc, ip)
    hi = ptx_op(Float32, [halves], "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, h; }", "=f,r", loc, ip)
    return lo, hi


@dsl_user_op
def _e2m1_pair_values(byte: Int32, *, loc=None, ip=None):
    """The values of the two E2M1 codes of a byte (low nibble first) by the hardware conversion
    (sm_100a / sm_103a; exact, as ``_e2m1_value``)."""
    halves = ptx_op(Int32, [Int32(byte)], "{ .reg .b8 p; cvt.u8.u32 p, $1; cvt.rn.f16x2.e2m1x2 $0, p; }",
                    "=r,r", loc, ip)
    lo = ptx_op(Float32, [halves], "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, l; }", "=f,r", loc, ip)
    hi = ptx_op(Float32, [halves], "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.f32.f16 $0, h; }", "=f,r", loc, ip)
    return lo, hi


def has_e2m1_conversion() -> bool:
    """Whether the target compiled for (runtime.compile_cache.target_arch, as the compile
    options) has the E2M1 conversions: sm_100a / sm_103a do, sm_90a does not."""
    from ..runtime.compile_cache import target_arch

    return target_arch() in ("sm_100a", "sm_103a")


@cute.jit
def _e2m1_value(nibble: Int32) -> Float32:
    """The value of an E2M1 code (bit 3 the sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    mag = nibble & 7
    normal = (mag << 22) + 0x3F000000  # exponent field (mag >> 1) + 126, mantissa bit mag & 1
    bits = cutlass.select_(mag < 2, mag * 0x3F000000, normal)
    return _f32_from_bits(bits | ((nibble & 8) << 28))


# ----------------------------------------------------------------------------- stochastic-rounding bits


@cute.jit
def sr_write_key(seed: Uint32, slot: Int32, counter: Int32) -> Uint32:
    """The per-write key of cache.py's SR bits, pre-mixed: r[e] = fmix32(e ^ key)."""
    salt = Uint32(_SR_KEY_SALT)
    key_slot = fmix32(Uint32(slot) ^ fmix32(seed ^ salt))
    key_write = fmix32(Uint32(counter) ^ fmix32(key_slot ^ salt))
    return fmix32(key_write ^ salt)


# ----------------------------------------------------------------------------- reading


@cute.jit
def load_scale(fmt: cutlass.Constexpr[CopyFormat], mScale, mStateScale, slot: Int64, head: Int32, row: Int32,
               col: Int32) -> Float32:
    """The factor of the element at column ``col`` of state row ``row``: 1, the fp8 block scale,
    or the nvfp4 block scale times the state scale (exact)."""
    scale = Float32(1.0)
    if cutlass.const_expr(fmt.name == "fp8"):
        scale = mScale[slot, head, row, col // fmt.block_k]
    if cutlass.const_expr(fmt.name == "nvfp4"):
        scale = e4m3_value(Int32(mScale[slot, head, row, col // fmt.block_k])) * mStateScale[slot, head]
    return scale


@cute.jit
def stage_scales(fmt: cutlass.Constexpr[CopyFormat], mScale, sScale: cute.Tensor, warp: Int32, slot: Int64,
                 head: Int32, first_row: Int32):
    """Warp ``warp`` copies the scales of its rows [first_row, first_row + rows) into its stage of
    ``sScale`` (rows, scales_per_row, warps): one coalesced read at entry instead of a dependent
    one per row. The warp syncs before reading them (``smem_scale``)."""
    rows, nb = cute.size(sScale, mode=[0]), fmt.scales_per_row
    lane = cute.arch.lane_idx()
    for i in cutlass.range_constexpr((rows * nb + 31) // 32):
        idx = i * 32 + lane
        if idx < rows * nb:
            sScale[idx // nb, idx % nb, warp] = mScale[slot, head, first_row + idx // nb, idx % nb]


@cute.jit
def smem_scale(fmt: cutlass.Constexpr[CopyFormat], sScale, warp: Int32, row: Int32, col: Int32,
               state_scale: Float32) -> Float32:
    """The factor of the element at column ``col`` of warp ``warp``'s staged row ``row`` (as
    ``load_scale``; ``sScale`` None for a format without scales)."""
    scale = Float32(1.0)
    if cutlass.const_expr(fmt.name == "fp8"):
        scale = sScale[row, col // fmt.block_k, warp]
    if cutlass.const_expr(fmt.name == "nvfp4"):
        scale = e4m3_value(Int32(sScale[row, col // fmt.block_k, warp])) * state_scale
    return scale


def scale_per_row(fmt: CopyFormat) -> bool:
    """Whether a row of ``fmt`` has one scale (fp8 with K up to a scale block): its decoded
    codes' dot with a vector then takes the scale once, after the dot (``decode_slice`` with
    ``scale`` None), rather than once per element."""
    return fmt.name == "fp8" and fmt.block_k == fmt.K


@cute.jit
def decode_slice(fmt: cutlass.Constexpr[CopyFormat], src: cute.Tensor, scale, out: cute.Tensor):
    """``out`` (vec,) fp32 <- the lane's stored slice ``src`` (vec storage elements; vec / 2 bytes
    for nvfp4) times ``scale``; with ``scale`` None (fp8) the codes' values alone."""
    vec = cute.size(out)
    if cutlass.const_expr(fmt.name == "fp32"):
        cute.autovec_copy(src, out)
    elif cutlass.const_expr(fmt.name == "fp16"):
        rH = cute.make_rmem_tensor((vec,), Float16)
        cute.autovec_copy(src, rH)
        for v in cutlass.range_constexpr(vec):
            out[v] = rH[v].to(Float32)
    elif cutlass.const_expr(fmt.name == "fp8"):
        rB = cute.make_rmem_tensor((vec,), Uint8)
        cute.autovec_copy(src, rB)
        for v in cutlass.range_constexpr(vec // 2):
            lo, hi = _e4m3_pair_values(Int32(rB[2 * v]) | (Int32(rB[2 * v + 1]) << 8))
            if cutlass.const_expr(scale is None):
                out[2 * v] = lo
                out[2 * v + 1] = hi
            else:
                out[2 * v] = _mul_rn(lo, scale)
                out[2 * v + 1] = _mul_rn(hi, scale)
    else:
        rB = cute.make_rmem_tensor((vec // 2,), Uint8)
        cute.autovec_copy(src, rB)
        for v in cutlass.range_constexpr(vec // 2):
            byte = Int32(rB[v])
            if cutlass.const_expr(has_e2m1_conversion()):
                lo, hi = _e2m1_pair_values(byte)
                out[2 * v] = lo * scale
                out[2 * v + 1] = hi * scale
            else:
                out[2 * v] = _e2m1_value(byte & 0xF) * scale
                out[2 * v + 1] = _e2m1_value(byte >> 4) * scale


# ----------------------------------------------------------------------------- reading on tensor cores


def _piece_bytes(fmt: CopyFormat) -> int:
    """Bytes of 4 consecutive values (a lane's piece of one MMA k-step)."""
    return 4 * fmt.storage.width // 8 // (2 if fmt.name == "nvfp4" else 1)


def _piece_col(fmt: CopyFormat, t: int, step: int) -> int:
    """The first column of the 4 values lane 4 g + t gives k-step ``step`` of a row (every lane
    reads 16-byte chunks t, t + 4, ...: chunk c holds the pieces of steps c // 4 * ppc ..)."""
    ppc = 16 // _piece_bytes(fmt)
    return 4 * (ppc * (t + 4 * (step // ppc)) + step % ppc)


def _step_tile(fmt: CopyFormat, step: int, t: int = 0) -> int:
    """The group of 8 scale blocks that lane 4 g + t's piece of k-step ``step`` reads."""
    return _piece_col(fmt, t, step) // fmt.block_k // 8


def dot_columns(fmt: CopyFormat, vectors: int) -> int:
    """MMA columns per vector in ``mma_row_dots``: vector v's scale block b is column v x this + b
    (one n-tile for every vector where their blocks fit in 8 columns, else whole n-tiles each)."""
    blocks = fmt.K // fmt.block_k
    return blocks if blocks * vectors <= 8 else 8 * ((blocks + 7) // 8)


def dot_fragments(fmt: CopyFormat, vectors: int) -> list:
    """The (k-step, n-tile) MMAs of ``mma_row_dots`` in order: each k-step meets the n-tile of its
    group of scale blocks in every vector's columns (the index of a pair in this list is its B
    fragment's)."""
    columns = dot_columns(fmt, vectors)
    return [(step, tile) for step in range(fmt.K // 16)
            for tile in sorted({(v * columns + 8 * _step_tile(fmt, step)) // 8 for v in range(vectors)})]


def _tile_vectors(columns: int, vectors: int, tile: int) -> list:
    """The vectors with columns in n-tile ``tile`` (``columns`` each, ``dot_columns``)."""
    return [v for v in range(vectors) if v * columns < 8 * tile + 8 and 8 * tile < (v + 1) * columns]


def mma_dots_error(fmt: CopyFormat, rows: int, lane_vec: int = 0) -> Optional[str]:
    """None if ``mma_row_dots`` takes ``rows`` rows of ``fmt``: whole 16-row MMA tiles, rows of
    whole 16-byte chunks per k-step lane, and each k-step inside one group of 8 scale blocks; with
    ``lane_vec`` > 0, B fragments from lanes of that many values each (``share_b_fragments``: whole
    fp16 pairs, a k-step lane's 16-byte chunk of whole lanes' values)."""
    if fmt.name == "fp32":
        return "fp32 rows are read on CUDA cores"
    if lane_vec and (lane_vec % 2 or 64 // _piece_bytes(fmt) % lane_vec):
        return f"{lane_vec} values per lane: B fragments from lanes take 2, 4 or 8"
    if rows % 16 or rows > 32:
        return f"{rows} rows: the MMA takes 16-row tiles, a lane per row (16 or 32)"
    steps, ppc = fmt.K // 16, 16 // _piece_bytes(fmt)
    if fmt.K % 16 or steps % ppc:
        return f"K {fmt.K}: {fmt.name} rows on tensor cores need a multiple of {16 * ppc}"
    if any(len({_step_tile(fmt, k, t) for t in range(4)}) > 1 for k in range(steps)):
        return f"K {fmt.K}: a k-step of {fmt.name} spans two groups of 8 scale blocks"
    return None


@dsl_user_op
def _f16x2_from_f32(hi: Float32, lo: Float32, *, loc=None, ip=None) -> Int32:
    return ptx_op(Int32, [Float32(hi), Float32(lo)], "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", loc, ip)


@dsl_user_op
def _two_results(asm: str, constraints: str, operand: Int32, result_type=Int32, *, loc=None, ip=None):
    """Two results (``$0``, ``$1``) of one PTX sequence on an int32 ``operand`` (``$2``)."""
    return tuple(ptx_ops(result_type, 2, [Int32(operand)], asm, constraints, loc, ip))


@cute.jit
def _f16_pair_values(packed: Int32):
    """The fp32 values of a packed fp16 pair (low half first)."""
    return _two_results("{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }", "=f,=f,r",
                        packed, Float32)


@cute.jit
def _f16x2_parts(lo: Float32, hi: Float32, parts: cutlass.Constexpr[int]):
    """(lo, hi) as packed fp16: one pair (RN), or with ``parts`` 2 also the pair of what it leaves
    (22 bits together)."""
    packed = _f16x2_from_f32(hi, lo)
    rest = Int32(0)
    if cutlass.const_expr(parts == 2):
        lo_back, hi_back = _f16_pair_values(packed)
        rest = _f16x2_from_f32(hi - hi_back, lo - lo_back)
    return packed, rest


# E2M1 magnitudes 0, 0.5, 1, 1.5 and 2, 3, 4, 6 as the high bytes of their fp16 codes (low bytes 0)
_E2M1_F16_HIGH = (0x3E3C3800, 0x46444240)


@cute.jit
def _piece_f16x2(fmt: cutlass.Constexpr[CopyFormat], rWords: cute.Tensor, i: cutlass.Constexpr[int]):
    """(lo, hi): the 4 values of piece ``i`` of a lane's 16-byte chunk ``rWords`` (4 words) as
    packed fp16 pairs (values 0, 1 and 2, 3), exactly: fp16 as stored, E4M3 by the hardware
    conversion, E2M1 by it on sm_100a / sm_103a and on sm_90a by a byte-permute table lookup of
    the magnitudes with the sign bits moved in."""
    lo, hi = Int32(0), Int32(0)
    if cutlass.const_expr(fmt.name == "fp16"):
        lo, hi = Int32(rWords[2 * i]), Int32(rWords[2 * i + 1])
    elif cutlass.const_expr(fmt.name == "fp8"):
        lo, hi = _two_results("{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.rn.f16x2.e4m3x2 $0, l; "
                              "cvt.rn.f16x2.e4m3x2 $1, h; }", "=r,=r,r", Int32(rWords[i]))
    else:
        piece = Int32(rWords[i // 2]) >> (16 * (i % 2))
        if cutlass.const_expr(has_e2m1_conversion()):
            lo, hi = _two_results("{ .reg .b8 b0, b1, b2, b3; mov.b32 {b0, b1, b2, b3}, $2; "
                                  "cvt.rn.f16x2.e2m1x2 $0, b0; cvt.rn.f16x2.e2m1x2 $1, b1; }", "=r,=r,r", piece)
        else:
            lo, hi = _two_results(
                "{ .reg .b32 u, m, q, s, t0, t1, z; "
                f"mov.b32 t0, {_E2M1_F16_HIGH[0]}; mov.b32 t1, {_E2M1_F16_HIGH[1]}; mov.b32 z, 0; "
                "and.b32 u, $2, 0x7777; prmt.b32 m, t0, t1, u; "  # the 4 magnitudes' high bytes
                "prmt.b32 $0, m, z, 0x1404; prmt.b32 $1, m, z, 0x3424; "  # into bytes 1 and 3 of each pair
                "and.b32 q, $2, 0x8888; "  # sign bits 3, 7, 11, 15 to bits 15 and 31 of their pair
                "mul.lo.u32 s, q, 0x1001000; and.b32 s, s, 0x80008000; or.b32 $0, $0, s; "
                "mul.lo.u32 s, q, 0x10010; and.b32 s, s, 0x80008000; or.b32 $1, $1, s; }",
                "=&r,=&r,r", piece)
    return lo, hi


@cute.jit
def _b_column(fmt: cutlass.Constexpr[CopyFormat], vectors: cutlass.Constexpr[int], step: cutlass.Constexpr[int],
              tile: cutlass.Constexpr[int]):
    """Lane 4 g + t's B column of n-tile ``tile`` at k-step ``step``: (its vector, whether its
    scale block is the one the lane's piece of the k-step reads; ``dot_columns``)."""
    lane = cute.arch.lane_idx()
    columns = dot_columns(fmt, vectors)
    column = 8 * tile + lane // 4
    col = 4 * (16 // _piece_bytes(fmt)) * (lane % 4) + _piece_col(fmt, 0, step)
    return column // columns, column % columns == col // fmt.block_k


@cute.jit
def vector_b_fragments(fmt: cutlass.Constexpr[CopyFormat], sC: cute.Tensor, rC: cute.Tensor):
    """(B fragments, factor) of one vector for ``mma_row_dots`` from ``sC`` (K,) in shared or
    global memory (activations; ``rC`` the lane's vec consecutive values of it as fp32): C scaled by a
    power of two that puts its largest magnitude just under 2^15, rounded to fp16 (exact down to
    2^-29 of the largest for bf16; an fp16 C taken as is; fp32 as an fp16 hi + lo, 22 bits: two
    parts), and the factor that undoes the scaling."""
    lane = cute.arch.lane_idx()
    t = lane % 4
    ppc = 16 // _piece_bytes(fmt)
    act = sC.element_type
    shift = Int32(0)
    if cutlass.const_expr(act is not Float16):
        biased = (f32_bits(_group_max(lane_amax(rC), 32)) >> 23) & 0xFF
        shift = cutlass.select_(biased == 0xFF, Int32(0), cutlass.min(cutlass.max(141 - biased, -113), 100))
    up = _f32_from_bits((shift + 127) << 23)
    parts = 2 if act is Float32 else 1
    fragments = dot_fragments(fmt, 1)
    sCWords = cute.make_tensor(cute.recast_ptr(sC.iterator, dtype=Uint32), cute.make_layout((fmt.K * act.width // 32,)))
    rB = cute.make_rmem_tensor((2, len(fragments), parts), Int32)
    for f in cutlass.range_constexpr(len(fragments)):
        step, tile = fragments[f]
        col = 4 * ppc * t + _piece_col(fmt, 0, step)
        vector, same_block = _b_column(fmt, 1, step, tile)
        mine = (vector == 0) & same_block
        for half in cutlass.range_constexpr(2):
            if cutlass.const_expr(act is Float16):
                rB[half, f, 0] = cutlass.select_(mine, Int32(sCWords[col // 2 + half]), Int32(0))
            else:
                if cutlass.const_expr(act is Float32):
                    lo = _f32_from_bits(Int32(sCWords[col + 2 * half])) * up
                    hi = _f32_from_bits(Int32(sCWords[col + 2 * half + 1])) * up
                else:  # a bf16 pair
                    word = Int32(sCWords[col // 2 + half])
                    lo = _f32_from_bits(word << 16) * up
                    hi = _f32_from_bits(word & Int32(-65536)) * up
                packed, rest = _f16x2_parts(lo, hi, parts)
                rB[half, f, 0] = cutlass.select_(mine, packed, Int32(0))
                if cutlass.const_expr(parts == 2):
                    rB[half, f, 1] = cutlass.select_(mine, rest, Int32(0))
    return rB, _f32_from_bits((127 - shift) << 23)


def _b_source(fmt: CopyFormat, vec: int, step: int, half: int):
    """Where lane 4 g + t's B values of k-step ``step`` (values 2 half, 2 half + 1 of its piece)
    sit when each lane holds ``vec`` consecutive values: (a, b, pair): lane a t + b, its fp16 pair
    ``pair`` (``mma_dots_error`` with ``lane_vec`` says which vec take whole pairs)."""
    ppc = 16 // _piece_bytes(fmt)
    first = _piece_col(fmt, 0, step) + 2 * half  # lane t's piece starts 4 ppc t further
    return 4 * ppc // vec, first // vec, first % vec // 2


@cute.jit
def _lane_pairs(rVectors, ups: cutlass.Constexpr):
    """Each lane's own values of the vectors ``rVectors`` (vec consecutive fp32 values of each),
    scaled by ``ups[v]``, as packed fp16 pairs in two parts (hi + lo, 22 bits): (vectors, 2, vec / 2)."""
    vectors = len(rVectors)
    vec = cute.size(rVectors[0])
    rPairs = cute.make_rmem_tensor((vectors, 2, vec // 2), Int32)
    for v in cutlass.range_constexpr(vectors):
        for i in cutlass.range_constexpr(vec // 2):
            packed, rest = _f16x2_parts(rVectors[v][2 * i] * ups[v], rVectors[v][2 * i + 1] * ups[v], 2)
            rPairs[v, 0, i] = packed
            rPairs[v, 1, i] = rest
    return rPairs


@cute.jit
def _gather_fragment(fmt: cutlass.Constexpr[CopyFormat], rPairs: cute.Tensor, f: cutlass.Constexpr[int],
                     rWords: cute.Tensor):
    """B fragment ``f`` of ``dot_fragments`` for this lane (lane 4 g + t: its column's vector at its
    piece of the k-step where the column's scale block is the piece's, zero elsewhere), gathered
    by shuffles from the lanes whose ``_lane_pairs`` hold it: ``rWords[2 half + p]`` the fp16 pair
    of half ``half`` (values 2 half, 2 half + 1 of the piece), part ``p``. Every lane of the warp
    takes part."""
    t = cute.arch.lane_idx() % 4
    vectors = cute.size(rPairs, mode=[0])
    vec = 2 * cute.size(rPairs, mode=[2])
    columns = dot_columns(fmt, vectors)
    step, tile = dot_fragments(fmt, vectors)[f]
    vector, same_block = _b_column(fmt, vectors, step, tile)
    in_tile = _tile_vectors(columns, vectors, tile)
    for half in cutlass.range_constexpr(2):
        lanes_per_t, first_lane, pair = _b_source(fmt, vec, step, half)
        for p in cutlass.range_constexpr(2):
            value = Int32(0)
            for i in cutlass.range_constexpr(len(in_tile)):
                got = cute.arch.shuffle_sync(rPairs[in_tile[i], p, pair], lanes_per_t * t + first_lane)
                value = cutlass.select_(same_block & (vector == in_tile[i]), got, value)
            rWords[2 * half + p] = value


@cute.jit
def share_b_fragments(fmt: cutlass.Constexpr[CopyFormat], rVectors, ups: cutlass.Constexpr, sFragments: cute.Tensor,
                      worker: Int32, workers: cutlass.Constexpr[int]):
    """The B fragments (two parts: fp16 hi + lo, 22 bits) for ``mma_row_dots`` of the vectors
    ``rVectors`` (each lane's vec consecutive fp32 values of each; lanes past the vector hold
    zeros), each scaled by its power of two ``ups[v]`` (the caller's bound: |value| x up < 2^15),
    gathered once for every warp that dots rows with them: ``workers`` warps split the fragments
    (fragment f by warp f mod workers, this one ``worker``) and store each lane's four words of
    fragment f at ``sFragments[f, lane]`` ((fragments, 32, 4) int32: one 16-byte store and load a
    lane); every warp loads them (``shared_b_fragments``) after they meet at a barrier. A warp
    gathering all of them before its MMAs paid about 150 instructions and the shuffles' latency
    per 16 rows (GDN's fp16 / fp8 row dots were 13-24% slower on tensor cores than on CUDA cores
    that way)."""
    lane = cute.arch.lane_idx()
    rPairs = _lane_pairs(rVectors, ups)
    for f in cutlass.range_constexpr(len(dot_fragments(fmt, len(rVectors)))):
        if f % workers == worker:
            rWords = cute.make_rmem_tensor((4,), Int32)
            _gather_fragment(fmt, rPairs, f, rWords)
            cute.autovec_copy(rWords, sFragments[f, lane, None])


@cute.jit
def shared_b_fragments(fmt: cutlass.Constexpr[CopyFormat], sFragments: cute.Tensor, vectors: cutlass.Constexpr[int]):
    """This lane's B fragments of ``vectors`` vectors as ``share_b_fragments`` stored them, in
    ``mma_row_dots``' (2 halves, fragments, 2 parts) order."""
    lane = cute.arch.lane_idx()
    fragments = len(dot_fragments(fmt, vectors))
    rB = cute.make_rmem_tensor((2, fragments, 2), Int32)
    for f in cutlass.range_constexpr(fragments):
        rWords = cute.make_rmem_tensor((4,), Int32)
        cute.autovec_copy(sFragments[f, lane, None], rWords)
        for half in cutlass.range_constexpr(2):
            for p in cutlass.range_constexpr(2):
                rB[half, f, p] = rWords[2 * half + p]
    return rB


@cute.jit
def mma_row_dots(fmt: cutlass.Constexpr[CopyFormat], sRows: cute.Tensor, sScale, rB: cute.Tensor,
                 vectors: cutlass.Constexpr[int], state_scale: Float32):
    """Lane r < rows: per vector, the sum over k of row r of the fp16 / fp8 / nvfp4 copy ``sRows``
    (rows, cols) decoded (block scales ``sScale`` (rows, scales_per_row); nvfp4's ``state_scale``)
    times the vector as its B fragments ``rB`` give it (``vector_b_fragments``,
    ``shared_b_fragments``: scaled, the caller undoes it), on tensor cores (``mma_dots_error`` says
    which shapes). The codes are exact in fp16 and the products are summed in fp32 (a B fragment's
    parts in accumulators of their own: two chains of dependent MMAs, not one). MMA column
    v x ``dot_columns`` + b holds vector v restricted to scale block b (zero elsewhere), so each
    row's block sums come out apart and take their scales after the product. A lane reads 16-byte
    chunks of its rows and gives their pieces to successive k-steps; B permutes k alike, so the
    sums are the row dots. Returns a tuple of ``vectors`` values."""
    lane = cute.arch.lane_idx()
    g = lane // 4
    t = lane % 4
    rows = cute.size(sRows, mode=[0])
    steps = fmt.K // 16
    ppc = 16 // _piece_bytes(fmt)
    blocks = fmt.K // fmt.block_k
    columns = dot_columns(fmt, vectors)
    tiles = (vectors * columns + 7) // 8
    fragments = dot_fragments(fmt, vectors)
    parts = cute.size(rB, mode=[2])
    row_words = fmt.row_bytes // 4
    sWords = cute.make_tensor(cute.recast_ptr(sRows.iterator, dtype=Uint32),
                              cute.make_layout((rows, row_words // 4, 4), stride=(row_words, 4, 1)))
    results = [Float32(0.0) for _ in range(vectors)]
    for mt in cutlass.range_constexpr(rows // 16):
        rAcc = cute.make_rmem_tensor((4, tiles, parts), Float32)
        rAcc.fill(0.0)
        for j in cutlass.range_constexpr(steps // ppc):
            rWords0 = cute.make_rmem_tensor((4,), Uint32)
            rWords1 = cute.make_rmem_tensor((4,), Uint32)
            cute.autovec_copy(sWords[16 * mt + g, t + 4 * j, None], rWords0)
            cute.autovec_copy(sWords[16 * mt + g + 8, t + 4 * j, None], rWords1)
            for i in cutlass.range_constexpr(ppc):
                lo0, hi0 = _piece_f16x2(fmt, rWords0, i)
                lo1, hi1 = _piece_f16x2(fmt, rWords1, i)
                for f in cutlass.range_constexpr(len(fragments)):
                    if cutlass.const_expr(fragments[f][0] == j * ppc + i):
                        nt = fragments[f][1]
                        for p in cutlass.range_constexpr(parts):
                            d = mma_f16([rAcc[q, nt, p] for q in range(4)], [lo0, lo1, hi0, hi1],
                                        [rB[0, f, p], rB[1, f, p]])
                            for q in cutlass.range_constexpr(4):
                                rAcc[q, nt, p] = d[q]
        for half in cutlass.range_constexpr(2):
            row = 16 * mt + 8 * half + g
            sums = [Float32(0.0) for _ in range(vectors)]
            for nt in cutlass.range_constexpr(tiles):
                first = 8 * nt + 2 * t  # the lane's columns first, first + 1
                block = first % columns
                scales = (Float32(1.0), Float32(1.0))
                if cutlass.const_expr(fmt.name == "fp8"):
                    scales = (sScale[row, cutlass.min(block, blocks - 1)], sScale[row, cutlass.min(block + 1, blocks - 1)])
                if cutlass.const_expr(fmt.name == "nvfp4"):
                    pair = cutlass.min(block, blocks - 2)  # blocks and columns are even
                    scales = _e4m3_pair_values(Int32(sScale[row, pair]) | (Int32(sScale[row, pair + 1]) << 8))
                for q in cutlass.range_constexpr(2):
                    column = first + q
                    term = rAcc[2 * half + q, nt, 0]
                    for p in cutlass.range_constexpr(1, parts):
                        term = term + rAcc[2 * half + q, nt, p]
                    term = scales[q] * term
                    in_tile = _tile_vectors(columns, vectors, nt)
                    for i in cutlass.range_constexpr(len(in_tile)):
                        v = in_tile[i]
                        sums[v] = sums[v] + cutlass.select_((column // columns == v) & (column % columns < blocks),
                                                            term, Float32(0.0))
            for v in cutlass.range_constexpr(vectors):
                total = sums[v] + cute.arch.shuffle_sync_bfly(sums[v], offset=1)
                total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
                results[v] = cutlass.select_(lane // 8 == 2 * mt + half, cute.arch.shuffle_sync(total, 4 * (lane % 8)),
                                             results[v])
    return tuple(results[v] * state_scale for v in range(vectors))


@cute.jit
def checkpoint_row(copies: cutlass.Constexpr[StateCopies], mCheckpoint, tensors: CopyTensors, sEntry, sEntryScale,
                   entry_state_scale: Float32, slot: Int64, head: Int32, first_row: Int32, r: Int32, out: cute.Tensor):
    """``out`` (vec,) fp32 <- the lane's slice of checkpoint row ``first_row + r`` (warp row r) for a
    kernel without an fp32 tile (``StateCopies.light``): from global memory next to a read copy,
    else from the entry tile, which holds the checkpoint."""
    ckpt = copies.checkpoint
    vec = cute.size(out)
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = cute.arch.lane_idx()
    if cutlass.const_expr(copies.separate):
        scale = load_scale(ckpt, tensors.mCheckpointScale, tensors.mCheckpointStateScale, slot, head, first_row + r,
                           lane * vec)
        decode_slice(ckpt, cute.local_tile(mCheckpoint[slot, head, first_row + r, None], (ckpt.per_lane(vec),),
                                           (lane,)), scale, out)
    else:
        scale = smem_scale(ckpt, sEntryScale, warp, r, lane * vec, entry_state_scale)
        decode_slice(ckpt, cute.local_tile(sEntry[r, None, warp], (ckpt.per_lane(vec),), (lane,)), scale, out)


def copy_rows_tma(m: cute.Tensor, cols: int, rows_per_slot: int, box_rows: int):
    """TMA atom and coordinates over a copy (slots, heads, rows, cols) viewed as (slots *
    rows_per_slot, cols) rows, so a box is ``box_rows`` consecutive state rows (one warp's)."""
    return make_row_tma(slot_rows(m, rows_per_slot, cols), box_rows, cols)


@cute.jit
def prefetch_entry_rows(copies: cutlass.Constexpr[StateCopies], mCheckpoint: cute.Tensor, mRead, mSlot: cute.Tensor,
                        row: Int32, head: Int32, first_row: Int32, rows: cutlass.Constexpr[int],
                        pad_slot_id: cutlass.Constexpr[int]):
    """Before ``after_previous_kernel`` of a programmatic launch: thread 0 asks L2 for a tile
    kernel's entry rows (the read copy, else the checkpoint; ``rows`` of them from ``first_row`` of
    the head), by a slot id that a previous kernel may still change (only this prefetch depends on
    it). A plain launch has nothing to overlap, and the prefetch would only delay the loads."""
    if cutlass.const_expr(programmatic_launch()):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            entry = mRead if copies.separate else mCheckpoint
            slot = load_past_l1(mSlot, row)
            if slot_is_live(slot, entry.shape[0], pad_slot_id):
                prefetch_l2(entry[Int64(slot), head, first_row, None], rows * copies.entry.row_bytes)


def entry_tma(copies: StateCopies, mCheckpoint: cute.Tensor, mRead, rows_per_slot: int, box_rows: int):
    """Host side of a kernel's entry load (``copy_rows_tma``): the read copy, else the checkpoint."""
    entry = mRead if copies.separate else mCheckpoint
    return copy_rows_tma(entry, copies.entry.cols, rows_per_slot, box_rows)


def work_tile_tma(copies: StateCopies, mCheckpoint: cute.Tensor, mRead, rows_per_slot: int, box_rows: int):
    """Host side of a kernel with a padded fp32 work tile (the verify kernels): a low-precision
    entry lands in a tile of its own (``entry_tma``; ``fill_work_tile`` decodes it), an fp32
    checkpoint in the work tile itself (``make_padded_row_tma``)."""
    if copies.entry.low_precision:
        return entry_tma(copies, mCheckpoint, mRead, rows_per_slot, box_rows)
    K = copies.K
    return make_padded_row_tma(slot_rows(mCheckpoint, rows_per_slot, K), box_rows, K)


@cute.jit
def start_work_tile_loads(copies: cutlass.Constexpr[StateCopies], smem, sState, mbar, tma_atom, mTma,
                          first_box: Int32, first_row: Int32, slot: Int32, slot64: Int64, head: Int32,
                          tensors: CopyTensors, sr_count: Int32):
    """A work-tile kernel's loads at entry (``work_tile_tma``; a warp per stage of ``sState``):
    ``start_state_loads`` for a low-precision entry, else the fp32 rows straight into the padded
    tile. Returns (sEntry, sAmax, sEntryScale, entry_state_scale, sr_key), None where unused."""
    rows, width, warps = cute.size(sState, mode=[0]), cute.size(sState, mode=[1]), cute.size(sState, mode=[2])
    sEntry, sAmax, sEntryScale, entry_state_scale, sr_key = None, None, None, Float32(1.0), None
    if cutlass.const_expr(copies.entry.low_precision):
        sEntry, sAmax, sEntryScale, entry_state_scale, sr_key = start_state_loads(
            copies, smem, sState, mbar, tma_atom, mTma, first_box, first_row, slot, slot64, head, tensors, sr_count,
            rows, warps)
    else:
        start_tile_loads(tma_atom, mTma, sState, mbar, first_box, warps, rows * width * 4)
    return sEntry, sAmax, sEntryScale, entry_state_scale, sr_key


@cute.jit
def fold_work_tile(copies: cutlass.Constexpr[StateCopies], sState: cute.Tensor, rCoef: cute.Tensor,
                   sKeys: cute.Tensor, gamma: Float32, fold_cols: cutlass.Constexpr[int],
                   keys_exact: cutlass.Constexpr[bool], mCheckpoint, tensors: CopyTensors, slot: Int64, head: Int32,
                   first_row: Int32, sAmax, key: Uint32):
    """A flushing row's fold of the warp's rows of the work tile (``fold_into_checkpoint``) into
    every copy: straight into an fp32 checkpoint, else in place in the tile and then cast into each
    copy (``store_work_tile``: every thread of the CTA calls it)."""
    rows = cute.size(sState, mode=[0])
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if cutlass.const_expr(copies.entry.low_precision):
        fold_into_checkpoint(cute.local_tile(sState[None, None, warp], (rows, copies.K), (0, 0)),
                             sState, warp, rCoef, sKeys, gamma, fold_cols, keys_exact)
        cute.arch.sync_warp()
        store_work_tile(copies, sState, sAmax, mCheckpoint, tensors, slot, head, first_row, key)
    else:
        fold_into_checkpoint(cute.local_tile(mCheckpoint[slot, head, None, None], (rows, copies.K),
                                             (first_row // rows, 0)),
                             sState, warp, rCoef, sKeys, gamma, fold_cols, keys_exact)


@cute.jit
def start_state_loads(copies: cutlass.Constexpr[StateCopies], smem, sState, mbar, tma_entry, mEntryTma,
                      first_box: Int32, first_row: Int32, slot: Int32, slot64: Int64, head: Int32,
                      tensors: CopyTensors, sr_count: Int32, rows: cutlass.Constexpr[int],
                      warps: cutlass.Constexpr[int]):
    """A kernel's state copies at entry: allocates the low-precision entry tile (an fp32
    checkpoint lands in the work tile ``sState`` itself), issues its TMA loads (the read copy,
    else the checkpoint; ``rows`` per warp, one mbarrier each), stages the entry rows' scales per
    warp and reads the SR write key. A flush next to a read copy reads checkpoint rows from global
    memory (``checkpoint_row``). ``sr_count`` is the slot's SR write counter before this write (the
    step's plan). Returns (sEntry, sAmax, sEntryScale, entry_state_scale, sr_key): sAmax the CTA's
    amax slots (nvfp4)."""
    entry_fmt = copies.entry
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    sEntry = sState
    if cutlass.const_expr(entry_fmt.low_precision):
        sEntry = smem.allocate_tensor(entry_fmt.storage, cute.make_layout(
            (rows, entry_fmt.cols, warps), stride=(entry_fmt.cols, 1, rows * entry_fmt.cols)), byte_alignment=128)
    sAmax = None
    if cutlass.const_expr(copies.whole_state):
        sAmax = smem.allocate_tensor(Float32, cute.make_layout(warps), byte_alignment=16)
    start_tile_loads(tma_entry, mEntryTma, sEntry, mbar, first_box, warps, rows * entry_fmt.row_bytes)
    sEntryScale = None
    entry_state_scale = Float32(1.0)
    if cutlass.const_expr(entry_fmt.scale_dtype is not None):
        sEntryScale = smem.allocate_tensor(entry_fmt.scale_dtype, cute.make_layout(
            (rows, entry_fmt.scales_per_row, warps), stride=(entry_fmt.scales_per_row, 1, rows * entry_fmt.scales_per_row)),
            byte_alignment=16)
        mEntryScale = tensors.mReadScale if cutlass.const_expr(copies.separate) else tensors.mCheckpointScale
        stage_scales(entry_fmt, mEntryScale, sEntryScale, warp, slot64, head, first_row)
        if cutlass.const_expr(entry_fmt.has_state_scale):
            mEntryState = (tensors.mReadStateScale if cutlass.const_expr(copies.separate)
                           else tensors.mCheckpointStateScale)
            entry_state_scale = mEntryState[slot64, head]
    sr_key = Uint32(0)
    if cutlass.const_expr(copies.stochastic):
        sr_key = sr_write_key(Uint32(tensors.mSrSeed[0]), slot, sr_count)
    return sEntry, sAmax, sEntryScale, entry_state_scale, sr_key


@cute.jit
def fold_row(rS: cute.Tensor, gamma: Float32, own: Float32, rOwnKey: cute.Tensor, rCoefs: cute.Tensor,
             sKeys: cute.Tensor, r: Int32, ring: cutlass.Constexpr[bool]):
    """A flush's fold of warp row ``r`` in registers (lane r holds its coefficients):
    ``S = gamma S + own_r k + sum_p coef_p[r] k_p`` over this token (key ``rOwnKey``) and the ring
    positions (keys ``sKeys`` (cap, K), coefficient ``rCoefs[p]``, zero where p holds no record)."""
    vec = cute.size(rS)
    lane = cute.arch.lane_idx()
    coef = cute.arch.shuffle_sync(own, r)
    for v in cutlass.range_constexpr(vec):
        rS[v] = gamma * rS[v] + coef * rOwnKey[v].to(Float32)
    if cutlass.const_expr(ring):
        for p in cutlass.range_constexpr(cute.size(rCoefs)):
            coef_p = cute.arch.shuffle_sync(rCoefs[p], r)
            rKey = cute.make_rmem_tensor((vec,), sKeys.element_type)
            cute.autovec_copy(cute.local_tile(sKeys[p, None], (vec,), (lane,)), rKey)
            for v in cutlass.range_constexpr(vec):
                rS[v] = rS[v] + coef_p * rKey[v].to(Float32)


@cute.jit
def ring_coefficients(w_j: Float32, rValues: cute.Tensor, origin: Int32, h: Int32, out: cute.Tensor):
    """``out[p]`` = w_j (p's record j) x ``rValues[p]`` for each ring position p holding a committed
    record (j < h), else 0: this lane's row's fold coefficients (``fold_row``)."""
    cap = cute.size(out)
    for p in cutlass.range_constexpr(cap):
        j_p = (p - origin + cap) % cap
        w_p = cute.arch.shuffle_sync(w_j, j_p)
        out[p] = cutlass.select_(j_p < h, w_p * rValues[p], Float32(0.0))


@cute.jit
def store_copies(copies: cutlass.Constexpr[StateCopies], values: cute.Tensor, mCheckpoint, tensors: CopyTensors,
                 slot: Int64, head: Int32, row: Int32, state_scale: Float32, key: Uint32):
    """One fp32 state row (the lane's ``values``), cast independently into each copy: SR into a
    low-precision checkpoint, RTN into the read copy (``encode_store``)."""
    store_copies_at(copies, values, mCheckpoint, tensors, slot, head, row, cute.arch.lane_idx() * cute.size(values),
                    state_scale, key)


@cute.jit
def store_copies_at(copies: cutlass.Constexpr[StateCopies], values: cute.Tensor, mCheckpoint, tensors: CopyTensors,
                    slot: Int64, head: Int32, row: Int32, col: Int32, state_scale: Float32, key: Uint32,
                    read_block_amax=None):
    """``store_copies`` of the lane's ``values`` at columns ``col ..`` of the row (a multiple of
    their count), for lanes that do not split a row in lane order: a scale block's lanes are
    aligned groups of consecutive lanes (``encode_store``), or the caller gives the read copy's
    block amax (``read_block_amax``: a block wider than the lanes' pieces)."""
    vec = cute.size(values)
    rows_per_head = mCheckpoint.shape[2]
    first = (head * rows_per_head + row) * copies.K + col  # the flat index of the SR bits
    ckpt = copies.checkpoint
    encode_store(ckpt, copies.stochastic, values, cute.local_tile(
        mCheckpoint[slot, head, row, None], (ckpt.per_lane(vec),), (col // vec,)), tensors.mCheckpointScale, slot, head,
        row, col, state_scale, key, first)
    if cutlass.const_expr(copies.separate):
        encode_store(copies.read, False, values, cute.local_tile(
            tensors.mRead[slot, head, row, None], (copies.read.per_lane(vec),), (col // vec,)), tensors.mReadScale,
            slot, head, row, col, state_scale, key, first, read_block_amax)


@cute.jit
def folded_row(copies: cutlass.Constexpr[StateCopies], mCheckpoint, tensors: CopyTensors, sEntry, sEntryScale,
               entry_state_scale: Float32, slot: Int64, head: Int32, first_row: Int32, r: Int32,
               gamma: Float32, own: Float32, rOwnKey: cute.Tensor, rCoefs: cute.Tensor, sKeys: cute.Tensor,
               ring: cutlass.Constexpr[bool], out: cute.Tensor):
    """``out`` (vec,) fp32 <- the lane's slice of warp row ``r`` of the state a light flush folds:
    the checkpoint row (``checkpoint_row``) folded in registers (``fold_row``)."""
    checkpoint_row(copies, mCheckpoint, tensors, sEntry, sEntryScale, entry_state_scale, slot, head, first_row, r, out)
    fold_row(out, gamma, own, rOwnKey, rCoefs, sKeys, r, ring)


@cute.jit
def folded_state_scale(copies: cutlass.Constexpr[StateCopies], mCheckpoint, tensors: CopyTensors, sEntry, sEntryScale,
                       entry_state_scale: Float32, slot: Int64, head: Int32, first_row: Int32,
                       gamma: Float32, own: Float32, rOwnKey: cute.Tensor, rCoefs: cute.Tensor, sKeys: cute.Tensor,
                       ring: cutlass.Constexpr[bool], sAmax: cute.Tensor) -> Float32:
    """nvfp4's G of the state a light flush folds (``folded_row`` of the warp's rows, as the pass
    that stores them will), reduced over the CTA: the first of a light nvfp4 flush's two passes.
    Every thread of the CTA calls it."""
    rows = cute.size(sEntry, mode=[0])
    vec = copies.K // 32
    amax = Float32(0.0)
    for r in cutlass.range(rows, unroll=4):
        rS = cute.make_rmem_tensor((vec,), Float32)
        folded_row(copies, mCheckpoint, tensors, sEntry, sEntryScale, entry_state_scale, slot, head, first_row, r,
                   gamma, own, rOwnKey, rCoefs, sKeys, ring, rS)
        amax = max_nan(amax, lane_amax(rS))
    return cta_state_scale(amax, sAmax)


@cute.jit
def write_state_scales(copies: cutlass.Constexpr[StateCopies], state_scale: Float32, tensors: CopyTensors,
                       slot: Int64, head: Int32):
    """Thread 0 stores nvfp4's G into the copies that have a state scale."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        if cutlass.const_expr(copies.checkpoint.has_state_scale):
            tensors.mCheckpointStateScale[slot, head] = state_scale
        if cutlass.const_expr(copies.separate and copies.read.has_state_scale):
            tensors.mReadStateScale[slot, head] = state_scale


@cute.jit
def fill_work_tile(copies: cutlass.Constexpr[StateCopies], sState: cute.Tensor, sEntry, sEntryScale,
                   entry_state_scale: Float32, flush, mCheckpoint, tensors: CopyTensors, slot: Int64, head: Int32,
                   first_row: Int32):
    """The warp's rows of the fp32 work tile ``sState`` (rows, >= K, warps) decoded from its
    low-precision entry tile (landed: the caller waited on its mbarrier), or on a flush from the
    checkpoint (``checkpoint_row``: the entry tile itself, or global memory next to a read copy),
    so that the fp32 tile code of a kernel runs unchanged on any cache; nothing for an fp32 entry,
    which lands in the work tile itself."""
    entry = copies.entry
    if cutlass.const_expr(entry.low_precision):
        rows = cute.size(sEntry, mode=[0])
        vec = copies.K // 32
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(entry.scale_dtype is not None):
            cute.arch.sync_warp()  # the staged scales
        for r in cutlass.range(rows, unroll=4):
            rS = cute.make_rmem_tensor((vec,), Float32)
            if flush:
                checkpoint_row(copies, mCheckpoint, tensors, sEntry, sEntryScale, entry_state_scale, slot, head,
                               first_row, r, rS)
            else:
                scale = smem_scale(entry, sEntryScale, warp, r, lane * vec, entry_state_scale)
                decode_slice(entry, cute.local_tile(sEntry[r, None, warp], (entry.per_lane(vec),), (lane,)), scale,
                             rS)
            cute.autovec_copy(rS, cute.local_tile(sState[r, None, warp], (vec,), (lane,)))
        cute.arch.sync_warp()


@cute.jit
def store_work_tile(copies: cutlass.Constexpr[StateCopies], sState: cute.Tensor, sAmax, mCheckpoint,
                    tensors: CopyTensors, slot: Int64, head: Int32, first_row: Int32, key: Uint32):
    """A flush's fp32 state in the work tile ``sState`` (rows, >= K, warps; each warp its rows,
    the CTA rows first_row - warp * rows ..) written into every copy (``store_copies``), with
    nvfp4's state scale reduced over the CTA (``sAmax``). Every thread of the CTA calls it."""
    rows = cute.size(sState, mode=[0])
    vec = copies.K // 32
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = cute.arch.lane_idx()
    state_scale = Float32(1.0)
    if cutlass.const_expr(copies.whole_state):
        state_scale = tile_state_scale(sState, vec, sAmax)
        write_state_scales(copies, state_scale, tensors, slot, head)
    for r in cutlass.range(rows, unroll=2):
        rS = cute.make_rmem_tensor((vec,), Float32)
        cute.autovec_copy(cute.local_tile(sState[r, None, warp], (vec,), (lane,)), rS)
        store_copies(copies, rS, mCheckpoint, tensors, slot, head, first_row + r, state_scale, key)


# ----------------------------------------------------------------------------- writing


@cute.jit
def nvfp4_state_scale(amax: Float32) -> Float32:
    """G = 2^k, the smallest k >= -126 with amax <= 2688 2^k (k = 0 at amax == 0); NaN when the
    state is not finite (quant.NVFP4)."""
    bits = f32_bits(amax)
    biased = bits >> 23  # amax >= 0
    # frexp(amax) = (f, t): t = biased - 126 and f > 0.65625 iff the mantissa exceeds 0x280000.
    k = biased - 138 + cutlass.select_((bits & 0x7FFFFF) > 0x280000, Int32(1), Int32(0))
    k = cutlass.select_(biased == 0, Int32(-126), cutlass.max(k, -126))
    k = cutlass.select_(bits == 0, Int32(0), k)
    return cutlass.select_(biased == 255, Float32(float("nan")), _f32_from_bits((k + 127) << 23))


@cute.jit
def tile_state_scale(sState: cute.Tensor, vec: cutlass.Constexpr[int], sAmax: cute.Tensor) -> Float32:
    """nvfp4's G of the state whose rows the CTA holds in ``sState`` (rows, >= 32 vec, warps) fp32,
    a warp per stage, lanes splitting K. Every thread calls it."""
    rows = cute.size(sState, mode=[0])
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    lane = cute.arch.lane_idx()
    amax = Float32(0.0)
    for r in cutlass.range(rows, unroll=2):
        rS = cute.make_rmem_tensor((vec,), Float32)
        cute.autovec_copy(cute.local_tile(sState[r, None, warp], (vec,), (lane,)), rS)
        amax = max_nan(amax, lane_amax(rS))
    return cta_state_scale(amax, sAmax)


@cute.jit
def cta_state_scale(amax: Float32, sAmax: cute.Tensor) -> Float32:
    """nvfp4's G of a state whose |values| the CTA's lanes each bound by ``amax`` (NaN-propagating
    max over the CTA through ``sAmax``, a slot per warp). Every thread calls it."""
    return warps_state_scale(amax, sAmax, cute.arch.make_warp_uniform(cute.arch.warp_idx()), Int32(0), 0)


@cute.jit
def warps_state_scale(amax: Float32, sAmax: cute.Tensor, slot: Int32, barrier_id: Int32,
                      threads: cutlass.Constexpr[int]) -> Float32:
    """``cta_state_scale`` over the ``threads`` threads that meet at named barrier ``barrier_id``
    (``threads`` 0: the whole CTA at __syncthreads), warp ``slot`` of ``sAmax`` (a slot per warp
    taking part)."""
    lane = cute.arch.lane_idx()
    amax = _group_max(amax, 32)
    if lane == 0:
        sAmax[slot] = amax
    if cutlass.const_expr(threads == 0):
        cute.arch.sync_threads()
    else:
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
    total = sAmax[0]
    for w in cutlass.range_constexpr(1, cute.size(sAmax)):
        total = max_nan(total, sAmax[w])
    return nvfp4_state_scale(total)


@cute.jit
def lane_amax(values: cute.Tensor) -> Float32:
    """max |v| over the lane's values, NaN-propagating."""
    amax = Float32(0.0)
    for v in cutlass.range_constexpr(cute.size(values)):
        amax = max_nan(amax, _abs(values[v]))
    return amax


@cute.jit
def encode_store(fmt: cutlass.Constexpr[CopyFormat], stochastic: cutlass.Constexpr[bool], values: cute.Tensor,
                 dst: cute.Tensor, mScale, slot: Int64, head: Int32, row: Int32, col: Int32,
                 state_scale: Float32, key: Uint32, first_element: Int32, block_amax=None):
    """Write the lane's ``values`` (vec fp32, columns col .. col + vec - 1 of state row ``row``)
    into ``dst`` (the lane's storage slice) in ``fmt``, RTN or SR; the first lane of each scale
    block also writes the block's scale. Every lane of the warp calls it for the same row (block
    amax by shuffles), unless ``block_amax`` gives it. ``state_scale``: nvfp4's G from ``nvfp4_state_scale``; ``key`` and
    ``first_element`` (the flat index of the lane's first value): the SR bits
    ``fmix32(e ^ key)``."""
    vec = cute.size(values)
    if cutlass.const_expr(fmt.name == "fp32"):
        cute.autovec_copy(values, dst)
    else:
        factor = Float32(1.0)  # fp32 values are multiplied by this before rounding
        amax = block_amax
        if cutlass.const_expr(block_amax is None and fmt.scale_dtype is not None):  # only a scale needs it
            amax = _group_max(lane_amax(values), fmt.block_k // vec)
        if cutlass.const_expr(fmt.name == "fp8"):
            scale = _div(amax, Float32(_E4M3_MAX), "rp")
            factor = _reciprocal_or_zero(scale)
            if col % fmt.block_k == 0:
                mScale[slot, head, row, col // fmt.block_k] = scale
        if cutlass.const_expr(fmt.name == "nvfp4"):
            finite = state_scale == state_scale
            a = _div(amax, state_scale, "rn")
            block = rtn_code(_div(a, Float32(_E2M1_MAX), "rn"), E4M3)
            block = block + cutlass.select_(e4m3_value(block) * Float32(_E2M1_MAX) < a, Int32(1), Int32(0))
            block = cutlass.select_(finite, block, Int32(0))
            factor = _reciprocal_or_zero(e4m3_value(block) * state_scale)
            if col % fmt.block_k == 0:
                mScale[slot, head, row, col // fmt.block_k] = Uint8(block)
        codes = cute.make_rmem_tensor((vec,), Int32)
        for v in cutlass.range_constexpr(vec):
            bits = Uint32(0)
            if cutlass.const_expr(stochastic):
                bits = fmix32(Uint32(first_element + v) ^ key)
            x = values[v]
            if cutlass.const_expr(fmt.name != "fp16"):
                x = _mul_rn(x, factor)
            spec = {"fp16": F16, "fp8": E4M3, "nvfp4": E2M1}[fmt.name]
            if cutlass.const_expr(stochastic):
                codes[v] = round_to_code(x, bits, spec, True)
            else:
                codes[v] = rtn_code(x, spec)
        if cutlass.const_expr(fmt.name == "fp16"):
            rH = cute.make_rmem_tensor((vec,), cutlass.Int16)
            for v in cutlass.range_constexpr(vec):
                rH[v] = cutlass.Int16(codes[v])
            cute.autovec_copy(cute.recast_tensor(rH, Float16), dst)
        elif cutlass.const_expr(fmt.name == "fp8"):
            rB = cute.make_rmem_tensor((vec,), Uint8)
            for v in cutlass.range_constexpr(vec):
                rB[v] = Uint8(codes[v])
            cute.autovec_copy(rB, dst)
        else:
            rB = cute.make_rmem_tensor((vec // 2,), Uint8)
            for v in cutlass.range_constexpr(vec // 2):
                pair = (codes[2 * v] & 0xF) | ((codes[2 * v + 1] & 0xF) << 4)
                rB[v] = Uint8(cutlass.select_(state_scale == state_scale, pair, Int32(0)))
            cute.autovec_copy(rB, dst)
