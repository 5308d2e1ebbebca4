"""Low-precision state formats and their rounding: a plain-PyTorch reference.

docs/design.md section 5: a read copy in fp16, fp8 or nvfp4 and a recurrence checkpoint in
fp16 or fp8, each cast from the fp32 state a flush rebuilds.

The kernels that write the read copy (round-to-nearest, RTN) and a low-precision recurrence
checkpoint (stochastic rounding, SR) must match these functions bit for bit, so every step
below is integer arithmetic on fp32 bit patterns or one correctly rounded fp32 operation.

Formats of a state ``(..., V, K)``, K contiguous (rows along K)
---------------------------------------------------------------
* ``fp16``: float16 ``(..., V, K)``, unscaled; decoded = float(code).
* ``fp8``: float8_e4m3fn ``(..., V, K)`` and one fp32 scale per 128 elements along K (one per
  state row at K = 128; ``FP8E4M3(block_k=...)`` for other K), ``(..., V, K / 128)``;
  decoded = fl(float(code) * scale).
* ``nvfp4``: uint8 ``(..., V, K / 2)`` holding E2M1 codes, element 2i in the low nibble and
  2i + 1 in the high one; float8_e4m3fn block scales ``(..., V, K / 16)``, one per 16 elements
  along K; one fp32 state scale per (slot, head) state ``(...,)``, a power of two;
  decoded = e2m1(code) * block * state, exact in any order.

Element formats (sign-magnitude, m mantissa bits, bias b, emin = 1 - b): fp16 (m = 10, b = 15,
max 65504, Inf/NaN), E4M3 "fn" (m = 3, b = 7, max 448, no Inf, NaN 0x7F), E2M1 (m = 1, b = 1,
values 0, 0.5, 1, 1.5, 2, 3, 4, 6, no Inf/NaN).

Rounding an fp32 x into an element format (``Minifloat``)
---------------------------------------------------------
P = bits of x, s = P >> 31, M = P & 0x7FFFFFFF, E = M >> 23. For finite x (E < 255)::

    e    = max(E, 1) - 127                   fp32 subnormals share e = -126
    sig  = (M & 0x7FFFFF) | (E > 0) << 23    |x| = sig * 2^(e - 23)
    g    = max(e, emin) - m                  log2 of the format's spacing at |x|
    d    = min(23 + g - e, 60)               significand bits below that spacing (>= 23 - m)
    n    = sig >> d;  rem = sig & (2^d - 1)  |x| = (n + rem / 2^d) * 2^g
    RTN: up = rem > 2^(d-1) or (rem == 2^(d-1) and n odd)          ties to even
    SR:  f32 = rem << (32 - d) if d <= 32 else rem >> (d - 32)     discarded part, 32-bit fraction
         up  = f32 + r >= 2^32     r: the element's random bits as uint32 (carry of a 32-bit add)
    code = ((g + m + b - 1) << m) + n + up   a carry out of the mantissa field lands on the next
                                             binade's code; for subnormal results g + m + b - 1 = 0
    code > max_code: RTN -> inf_code (fp16 0x7C00 = Inf; E4M3 0x7E = 448; E2M1 0x7 = 6)
                     SR  -> max_code (the largest finite value: SR never overflows)

±Inf encodes as inf_code and NaN as nan_code (fp16 0x7E00, E4M3 0x7F, E2M1 0x0) under both
modes; the sign bit s is then set on every code, zeros and NaN included.

For |x| at or above the smallest subnormal (d <= 23) SR is the fp32 pattern add
``M' = (M + (r >> (32 - d))) & ~(2^d - 1)``, M' the result's fp32 magnitude (saturated as above;
d = 13 for fp16, 20 for E4M3, 22 for E2M1 in their normal ranges). For d <= 22 RTN is the
classic ``M' = (M + 2^(d-1) - 1 + ((M >> d) & 1)) & ~(2^d - 1)``; at d >= 23 (|x| below 2^-23
for fp16, 2^-8 for E4M3, 1 for E2M1) the tie goes by n's parity, which is not bit d of M.

SR rounds up with probability f32 / 2^32: exactly |x|'s position within its gap whenever
d <= 32 (|x| >= 2^(emin - m - 9)), so it is unbiased there; below, the fraction is truncated to
32 bits. RTN equals ``x.to(torch.float16)`` and ``x.to(torch.float8_e4m3fn)`` bit for bit
(torch saturates E4M3, Inf included, to ±448); NaN payloads are not kept (tests/reference/test_quant.py).

Random bits (``sr_bits``)
-------------------------
``r = fmix32(offset ^ fmix32(seed ^ 0x9E3779B9))``, fmix32 being murmur3's finalizer
``h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16`` in uint32
arithmetic, seed and offset taken mod 2^32. A kernel reads the seed from a device tensor (so a
CUDA-graph replay draws fresh bits) and uses the element's flat index as its offset; a
(seed, offset) pair must not repeat.

Scales
------
``fp8``, per 128 elements with amax = max |x| (NaN propagates)::

    scale = amax / 448 rounded up (div.rp.f32);  inv = 1 / scale rounded toward zero
    (rcp.rz.f32), 0 where scale == 0;  y = fl(x * inv);  code = E4M3 RTN or SR of y

``nvfp4``, per state with A = max |x| over (V, K), then per 16 elements with amax_b::

    G = 2^k, k the smallest integer with A <= 2688 * 2^k (2688 = 6 * 448), at least -126, and
        k = 0 for A == 0; from frexp(A) = (f, t), f in [0.5, 1): k = t - 12 + (f > 0.65625)
    a = amax_b / G (exact);  S = the smallest E4M3 value with 6 * S >= a: the E4M3 RTN of
        fl(a / 6) (div.rn.f32), one code higher if 6 * S < a (exact); S <= 448 by the choice of k
    R = 1 / (S * G) rounded toward zero, 0 where S == 0;  y = fl(x * R);  code = E2M1 RTN or SR of y

A state holding Inf or NaN stores G = NaN, block scales 0 and codes 0: it decodes to NaN.

Why the scales round up: SR reaches the mean only if both neighbours of y exist, and a y above
the format's max has one, so it would be clipped toward zero. A block scale rounded to nearest
lies below amax_b / 6 about half the time, putting the block's largest elements above 6. Rounded
up, |y| <= 6 (448 for fp8) for every element, at the cost of at most one E4M3 step (12.5%) of
resolution. The reciprocals round toward zero for the same guarantee; E[decoded] = x R S G is
then x (1 - delta) with 0 <= delta < 2^-23, one fp32 ulp, far below any format's step. A power
of two G makes S * G and the decode exact (it costs at most one binade of block-scale range).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Optional, Tuple, Union

import torch

__all__ = [
    "sr_bits",
    "Minifloat",
    "F16",
    "E4M3",
    "E2M1",
    "Encoded",
    "FP16",
    "FP8E4M3",
    "NVFP4",
    "FORMATS",
    "pack_e2m1",
    "unpack_e2m1",
    "bytes_per_state",
]

_MASK32 = (1 << 32) - 1


# ----------------------------------------------------------------------------- random bits


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for a in [0, 2^32) held in int64; split so no product overflows int64."""
    low = a * (c & 0xFFFF)
    high = (a * (c >> 16)) & 0xFFFF
    return (low + (high << 16)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on uint32 values held in int64."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _to_int32(u: torch.Tensor) -> torch.Tensor:
    """uint32 values held in int64 -> the int32 tensor with the same bit patterns."""
    return (u - ((u >> 31) << 32)).to(torch.int32)


def sr_bits(seed: Union[int, torch.Tensor], offsets: torch.Tensor) -> torch.Tensor:
    """32 random bits per offset, ``fmix32(offset ^ fmix32(seed ^ 0x9E3779B9))``, as int32.

    ``seed``: an int in [0, 2^32) or an integer tensor broadcastable to ``offsets`` (low 32
    bits used); ``offsets``: an integer tensor, typically each element's flat index (low 32 bits
    used). Counter-based, so a kernel computes the same bits from the same (seed, offset).
    """
    if not isinstance(offsets, torch.Tensor) or offsets.dtype.is_floating_point or offsets.dtype == torch.bool:
        raise ValueError(f"offsets: expected an integer tensor, got {_describe(offsets)}")
    if isinstance(seed, torch.Tensor):
        if seed.dtype.is_floating_point or seed.dtype == torch.bool:
            raise ValueError(f"seed: expected an int or an integer tensor, got {_describe(seed)}")
        seed = seed.to(device=offsets.device, dtype=torch.int64) & _MASK32
    elif isinstance(seed, int) and not isinstance(seed, bool):
        if not 0 <= seed <= _MASK32:
            raise ValueError(f"seed: expected an int in [0, 2^32), got {seed}")
        seed = torch.tensor(seed, dtype=torch.int64, device=offsets.device)
    else:
        raise ValueError(f"seed: expected an int or an integer tensor, got {_describe(seed)}")
    key = _fmix32(seed ^ 0x9E3779B9)
    return _to_int32(_fmix32((offsets.to(torch.int64) & _MASK32) ^ key))


# ----------------------------------------------------------------------------- element formats


@dataclass(frozen=True)
class Minifloat:
    """A sign-magnitude binary float format and what it does at its edges (module docstring)."""

    name: str
    exp_bits: int
    man_bits: int
    max_code: int  # magnitude code of the largest finite value
    inf_code: int  # magnitude code of ±Inf inputs and of RTN overflow
    nan_code: int  # magnitude code of NaN inputs

    @property
    def bias(self) -> int:
        return (1 << (self.exp_bits - 1)) - 1

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def sign_bit(self) -> int:
        return 1 << (self.exp_bits + self.man_bits)

    @property
    def max_value(self) -> float:
        return self.values(torch.tensor(self.max_code)).item()

    def round_rtn(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Round-to-nearest-even of fp32 ``x``: (int64 codes, fp32 values)."""
        codes = self._round(_check_fp32(x, "x"), "rtn")
        return codes, self.values(codes)

    def round_sr(self, x: torch.Tensor, bits: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Stochastic rounding of fp32 ``x`` with one 32-bit draw per element: (codes, values)."""
        _check_fp32(x, "x")
        codes = self._round(x, "sr", _check_bits(bits, x))
        return codes, self.values(codes)

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 value of each code (any integer dtype)."""
        codes = codes.to(torch.int64)
        m = self.man_bits
        magnitude = codes & (self.sign_bit - 1)
        exp_field = magnitude >> m
        mantissa = magnitude & ((1 << m) - 1)
        significand = torch.where(exp_field > 0, mantissa + (1 << m), mantissa)
        # Small integers times powers of two: exact in float64 and in the final fp32.
        value = torch.ldexp(significand.to(torch.float64), exp_field.clamp(min=1) - self.bias - m)
        special = torch.full_like(value, float("inf")).where(magnitude == self.inf_code, float("nan"))
        value = torch.where(magnitude > self.max_code, special, value)
        return torch.where((codes & self.sign_bit) != 0, -value, value).to(torch.float32)

    def _round(self, x: torch.Tensor, mode: str, r: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Codes of fp32 ``x`` rounded by ``mode``: "rtn" or "sr" with uint32 bits ``r`` held in
        int64 (module docstring)."""
        pattern = x.view(torch.int32).to(torch.int64) & _MASK32
        sign = pattern >> 31
        magnitude = pattern & 0x7FFFFFFF
        biased = magnitude >> 23
        m = self.man_bits
        e = biased.clamp(min=1) - 127
        sig = torch.where(biased > 0, (magnitude & 0x7FFFFF) | (1 << 23), magnitude & 0x7FFFFF)
        g = e.clamp(min=self.emin) - m
        # d > 60 changes nothing: n = 0 and no 32-bit fraction survives, and int64 shifts stay defined.
        d = (23 + g - e).clamp(max=60)
        n = sig >> d
        rem = sig & ((torch.ones_like(d) << d) - 1)
        if mode == "rtn":
            half = torch.ones_like(d) << (d - 1)
            up = (rem > half) | ((rem == half) & ((n & 1) == 1))
        else:
            frac32 = torch.where(d <= 32, rem << (32 - d).clamp(min=0), rem >> (d - 32).clamp(min=0))
            up = (frac32 + r) > _MASK32
        codes = ((g + m + self.bias - 1) << m) + n + up.to(torch.int64)
        codes = codes.where(codes <= self.max_code, self.max_code if mode == "sr" else self.inf_code)
        nonfinite = torch.full_like(codes, self.inf_code).where(magnitude == 0x7F800000, self.nan_code)
        codes = torch.where(biased == 255, nonfinite, codes)
        return codes | (sign * self.sign_bit)


F16 = Minifloat("fp16", exp_bits=5, man_bits=10, max_code=0x7BFF, inf_code=0x7C00, nan_code=0x7E00)
E4M3 = Minifloat("e4m3", exp_bits=4, man_bits=3, max_code=0x7E, inf_code=0x7E, nan_code=0x7F)
E2M1 = Minifloat("e2m1", exp_bits=2, man_bits=1, max_code=0x7, inf_code=0x7, nan_code=0x0)


# ----------------------------------------------------------------------------- state formats


class Encoded(NamedTuple):
    """A state cast into a format: what is stored, and its fp32 value (``decode(data, scales)``)."""

    data: torch.Tensor  # float16 / float8_e4m3fn (..., V, K), or packed E2M1 uint8 (..., V, K / 2)
    scales: Tuple[torch.Tensor, ...]  # fp16: (); fp8: (row scales,); nvfp4: (block, state)
    dequantized: torch.Tensor  # fp32 (..., V, K)


@dataclass(frozen=True)
class FP16:
    """Unscaled fp16 state."""

    name: ClassVar[str] = "fp16"

    def encode_rtn(self, x: torch.Tensor) -> Encoded:
        return self._encoded(F16._round(_check_fp32(x, "x"), "rtn"))

    def encode_sr(self, x: torch.Tensor, bits: torch.Tensor) -> Encoded:
        _check_fp32(x, "x")
        return self._encoded(F16._round(x, "sr", _check_bits(bits, x)))

    def decode(self, data: torch.Tensor, scales: Tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        _check_dtype(data, torch.float16, "data")
        _unpack_scales(scales, ())
        return data.to(torch.float32)

    def bytes_per_state(self, V: int, K: int) -> int:
        _check_dims(V, K, 1)
        return 2 * V * K

    def _encoded(self, codes: torch.Tensor) -> Encoded:
        data = _to_int16(codes).view(torch.float16)
        return Encoded(data, (), self.decode(data))


@dataclass(frozen=True)
class FP8E4M3:
    """E4M3 state with one fp32 scale per ``block_k`` elements along K (a state row at K = 128)."""

    name: ClassVar[str] = "fp8"
    block_k: int = 128

    def __post_init__(self):
        if not isinstance(self.block_k, int) or self.block_k <= 0:
            raise ValueError(f"block_k: expected a positive int, got {self.block_k!r}")

    def encode_rtn(self, x: torch.Tensor) -> Encoded:
        return self._encode(x, "rtn", None)

    def encode_sr(self, x: torch.Tensor, bits: torch.Tensor) -> Encoded:
        return self._encode(x, "sr", bits)

    def decode(self, data: torch.Tensor, scales: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        _check_dtype(data, torch.float8_e4m3fn, "data")
        _check_state_shape(data, "data", self.block_k)
        (scale,) = _unpack_scales(scales, ("row scale",))
        _check_dtype(scale, torch.float32, "scales[0]")
        _check_scale_shape(scale, data.shape[:-1] + (data.shape[-1] // self.block_k,), "scales[0]")
        return _per_block(data.to(torch.float32), scale, self.block_k)

    def bytes_per_state(self, V: int, K: int) -> int:
        _check_dims(V, K, self.block_k)
        return V * K + 4 * V * (K // self.block_k)

    def _encode(self, x: torch.Tensor, mode: str, bits) -> Encoded:
        _check_fp32(x, "x")
        _check_state_shape(x, "x", self.block_k)
        r = _check_bits(bits, x) if mode == "sr" else None
        amax = x.unflatten(-1, (-1, self.block_k)).abs().amax(-1)
        scale = _div_up(amax, 448.0)
        y = _per_block(x, _reciprocal_toward_zero(scale), self.block_k)
        data = E4M3._round(y, mode, r).to(torch.uint8).view(torch.float8_e4m3fn)
        return Encoded(data, (scale,), self.decode(data, (scale,)))


@dataclass(frozen=True)
class NVFP4:
    """E2M1 state, one E4M3 scale per 16 elements along K, one fp32 power-of-two scale per state."""

    name: ClassVar[str] = "nvfp4"
    block_k: ClassVar[int] = 16

    def encode_rtn(self, x: torch.Tensor) -> Encoded:
        return self._encode(x, "rtn", None)

    def encode_sr(self, x: torch.Tensor, bits: torch.Tensor) -> Encoded:
        return self._encode(x, "sr", bits)

    def decode(self, data: torch.Tensor, scales: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        _check_dtype(data, torch.uint8, "data")
        if data.dim() < 2:
            raise ValueError(f"data: expected packed codes (..., V, K / 2), got shape {tuple(data.shape)}")
        block_scale, state_scale = _unpack_scales(scales, ("block scale", "state scale"))
        _check_dtype(block_scale, torch.float8_e4m3fn, "scales[0]")
        _check_dtype(state_scale, torch.float32, "scales[1]")
        K = 2 * data.shape[-1]
        if K % self.block_k != 0:
            raise ValueError(
                f"data: expected K = 2 * data.shape[-1] to be a multiple of {self.block_k}, got {K}"
            )
        _check_scale_shape(block_scale, data.shape[:-1] + (K // self.block_k,), "scales[0]")
        _check_scale_shape(state_scale, data.shape[:-2], "scales[1]")
        values = E2M1.values(unpack_e2m1(data))
        # E2M1 (2 bits) x E4M3 (4 bits) x a power of two: every product is exact.
        block_dequant = block_scale.to(torch.float32) * state_scale[..., None, None]
        return _per_block(values, block_dequant, self.block_k)

    def bytes_per_state(self, V: int, K: int) -> int:
        _check_dims(V, K, self.block_k)
        return V * K // 2 + V * (K // self.block_k) + 4

    def _encode(self, x: torch.Tensor, mode: str, bits) -> Encoded:
        _check_fp32(x, "x")
        _check_state_shape(x, "x", self.block_k)
        r = _check_bits(bits, x) if mode == "sr" else None
        state_amax = x.abs().amax((-2, -1))
        finite = torch.isfinite(state_amax)
        fraction, exponent = torch.frexp(state_amax)
        # A <= 2688 * 2^k with 2688 = 6 * 448 = 0.65625 * 2^12 and A = fraction * 2^exponent.
        k = exponent.to(torch.int64) - 12 + (fraction > 0.65625).to(torch.int64)
        k = k.where(state_amax != 0, 0).clamp(min=-126)
        state_scale = torch.ldexp(torch.ones_like(state_amax), k).where(finite, float("nan"))

        # Smallest E4M3 S with 6 S >= a: round fl(a / 6) to nearest, one code more if that fell short.
        a = x.unflatten(-1, (-1, self.block_k)).abs().amax(-1) / state_scale[..., None, None]
        block_code = E4M3._round(_divide(a, 6.0), "rtn")
        block_code = block_code + (E4M3.values(block_code) * 6.0 < a).to(torch.int64)
        block_code = block_code.where(finite[..., None, None], 0)
        block_scale = block_code.to(torch.uint8).view(torch.float8_e4m3fn)

        block_dequant = block_scale.to(torch.float32) * state_scale[..., None, None]
        y = _per_block(x, _reciprocal_toward_zero(block_dequant), self.block_k)
        codes = E2M1._round(y, mode, r).where(finite[..., None, None], 0)
        data = pack_e2m1(codes)
        return Encoded(data, (block_scale, state_scale), self.decode(data, (block_scale, state_scale)))


FORMATS = {fmt.name: fmt for fmt in (FP16(), FP8E4M3(), NVFP4())}


def bytes_per_state(fmt: Union[str, FP16, FP8E4M3, NVFP4], V: int, K: int) -> int:
    """Bytes of one (V, K) state in ``fmt`` (a format or "fp32", "fp16", "fp8", "nvfp4"), scales included."""
    if fmt == "fp32":
        _check_dims(V, K, 1)
        return 4 * V * K
    if isinstance(fmt, str):
        if fmt not in FORMATS:
            raise ValueError(f"fmt: expected one of {['fp32', *FORMATS]} or a format object, got {fmt!r}")
        fmt = FORMATS[fmt]
    if not isinstance(fmt, (FP16, FP8E4M3, NVFP4)):
        raise ValueError(f"fmt: expected a format name or FP16 / FP8E4M3 / NVFP4, got {fmt!r}")
    return fmt.bytes_per_state(V, K)


# ----------------------------------------------------------------------------- E2M1 packing


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (..., K), values 0..15 -> uint8 (..., K / 2), element 2i in the low nibble."""
    if not isinstance(codes, torch.Tensor) or codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"codes: expected an integer tensor of 4-bit codes, got {_describe(codes)}")
    if codes.dim() < 1 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"codes: expected an even last dim, got shape {tuple(codes.shape)}")
    if codes.numel() and (codes.min() < 0 or codes.max() > 15):
        raise ValueError("codes: expected values in 0..15")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(data: torch.Tensor) -> torch.Tensor:
    """uint8 (..., K / 2) -> E2M1 codes uint8 (..., K), the inverse of ``pack_e2m1``."""
    _check_dtype(data, torch.uint8, "data")
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- helpers


def _div_up(a: torch.Tensor, c: float) -> torch.Tensor:
    """fp32 a / c rounded toward +inf (c with <= 29 significant bits, so q * c is exact in float64)."""
    q = _divide(a, c)
    short = q.to(torch.float64) * c < a.to(torch.float64)
    return torch.where(short, torch.nextafter(q, torch.full_like(q, float("inf"))), q)


def _divide(a: torch.Tensor, c: float) -> torch.Tensor:
    """Correctly rounded fp32 a / c. A Python-scalar divisor would let CUDA multiply by 1 / c."""
    return a / torch.full_like(a, c)


def _reciprocal_toward_zero(d: torch.Tensor) -> torch.Tensor:
    """fp32 1 / d rounded toward zero for d >= 0 (never Inf), 0 where d == 0."""
    r = torch.ones_like(d) / d
    # r and d have 24 significant bits each, so their float64 product is exact.
    over = r.to(torch.float64) * d.to(torch.float64) > 1.0
    r = torch.where(over, torch.nextafter(r, torch.zeros_like(r)), r)
    return r.where(d != 0, 0.0)


def _per_block(x: torch.Tensor, per_block: torch.Tensor, block_k: int) -> torch.Tensor:
    """x (..., K) times per_block (..., K / block_k), each factor over its block_k elements."""
    return (x.unflatten(-1, (-1, block_k)) * per_block[..., None]).flatten(-2)


def _to_int16(codes: torch.Tensor) -> torch.Tensor:
    return (codes - ((codes >> 15) << 16)).to(torch.int16)


def _describe(obj) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a {obj.dtype} tensor of shape {tuple(obj.shape)}"
    return repr(obj)


def _check_fp32(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise ValueError(f"{name}: expected a float32 tensor, got {_describe(x)}")
    return x


def _check_dtype(t, dtype: torch.dtype, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        raise ValueError(f"{name}: expected a {dtype} tensor, got {_describe(t)}")


def _check_state_shape(x: torch.Tensor, name: str, block_k: int) -> None:
    if x.dim() < 2 or x.shape[-1] % block_k != 0:
        raise ValueError(
            f"{name}: expected a state (..., V, K) with K a multiple of {block_k}, got shape {tuple(x.shape)}"
        )


def _check_scale_shape(scale: torch.Tensor, expected, name: str) -> None:
    if tuple(scale.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(scale.shape)}")


def _check_dims(V: int, K: int, block_k: int) -> None:
    if not isinstance(V, int) or V <= 0:
        raise ValueError(f"V: expected a positive int, got {V!r}")
    if not isinstance(K, int) or K <= 0 or K % block_k != 0:
        raise ValueError(f"K: expected a positive multiple of {block_k}, got {K!r}")


def _unpack_scales(scales, names: Tuple[str, ...]) -> Tuple[torch.Tensor, ...]:
    if not isinstance(scales, (tuple, list)) or len(scales) != len(names):
        raise ValueError(f"scales: expected ({', '.join(names)}), got {scales!r}")
    return tuple(scales)


def _check_bits(bits, x: torch.Tensor) -> torch.Tensor:
    """Random bits as uint32 values in int64; int32 bits are read as uint32, int64 by their low 32 bits."""
    if not isinstance(bits, torch.Tensor) or bits.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"bits: expected an int32 or int64 tensor of random bits, got {_describe(bits)}")
    if bits.shape != x.shape:
        raise ValueError(
            f"bits: expected shape {tuple(x.shape)} (one draw per element of x), got {tuple(bits.shape)}"
        )
    if bits.device != x.device:
        raise ValueError(f"bits: expected device {x.device} like x, got {bits.device}")
    return bits.to(torch.int64) & _MASK32
