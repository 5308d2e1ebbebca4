"""Device side of the low-precision formats: the rounding of ``replayssm_cute.quant``, bit for bit.

Integer arithmetic on fp32 bit patterns, the same steps as ``quant.Minifloat._round`` (its module
docstring derives them), so the kernels that write a read copy (round to nearest, RTN) or a
low-precision recurrence checkpoint (stochastic rounding, SR) store exactly the reference's codes:
for SR given the same random bits, which come from the same counter-based generator
(``sr_bits``: murmur3's finalizer of the element's offset keyed by a seed from a device tensor).

Software on every target: it runs on sm_90a, which has no ``cvt.rs``, and keeps sm_100a / sm_103a
bit-identical to the reference until their hardware conversion is checked against it.

Element formats: the reference's ``Minifloat`` constants fp16, E4M3 ("fn": no Inf, saturating), E2M1.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass.cutlass_dsl import dsl_user_op

from ..quant import E2M1, E4M3, F16, Minifloat  # noqa: F401 (re-exported: the formats the kernels take)
from .common import f32_asm


@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    """The bit pattern of fp32 ``x``."""
    return f32_asm(Int32, x, "mov.b32 $0, $1;", "=r,f", loc, ip)


@cute.jit
def fmix32(h: Uint32) -> Uint32:
    """murmur3's 32-bit finalizer."""
    h = h ^ (h >> 16)
    h = h * Uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * Uint32(0xC2B2AE35)
    return h ^ (h >> 16)


@cute.jit
def sr_bits(seed: Uint32, offset: Uint32) -> Uint32:
    """The element's 32 random bits: ``fmix32(offset ^ fmix32(seed ^ 0x9E3779B9))``."""
    return fmix32(offset ^ fmix32(seed ^ Uint32(0x9E3779B9)))


@cute.jit
def round_to_code(x: Float32, bits: Uint32, spec: cutlass.Constexpr[Minifloat],
                  stochastic: cutlass.Constexpr[bool]) -> Int32:
    """The code of fp32 ``x`` in ``spec``: RTN (ties to even, overflow to inf_code) or, with
    ``stochastic``, SR with the 32 random ``bits`` (overflow to max_code); ±Inf -> inf_code,
    NaN -> nan_code; the sign bit set on every code."""
    m = spec.man_bits
    emin = 1 - spec.bias
    pattern = f32_bits(x)
    sign = (pattern >> 31) & 1
    magnitude = pattern & 0x7FFFFFFF
    biased = magnitude >> 23
    e = cutlass.max(biased, 1) - 127
    sig = (magnitude & 0x7FFFFF) | cutlass.select_(biased > 0, Int32(1 << 23), Int32(0))
    g = cutlass.max(e, emin) - m
    d = cutlass.min(23 + g - e, 60)  # significand bits below the format's spacing at |x|
    sig64 = Int64(sig)
    n = sig64 >> Int64(d)
    rem = sig64 & ((Int64(1) << Int64(d)) - 1)
    up = Int64(0)
    if cutlass.const_expr(stochastic):
        frac32 = cutlass.select_(d <= 32, rem << Int64(cutlass.max(32 - d, 0)), rem >> Int64(cutlass.max(d - 32, 0)))
        up = cutlass.select_(frac32 + Int64(bits) > Int64(0xFFFFFFFF), Int64(1), Int64(0))
    else:
        half = Int64(1) << Int64(d - 1)
        up = cutlass.select_((rem > half) | ((rem == half) & ((n & 1) == 1)), Int64(1), Int64(0))
    code = Int32(Int64((g + m + spec.bias - 1) << m) + n + up)
    overflow_code = spec.max_code if stochastic else spec.inf_code
    code = cutlass.select_(code > spec.max_code, Int32(overflow_code), code)
    nonfinite = cutlass.select_(magnitude == 0x7F800000, Int32(spec.inf_code), Int32(spec.nan_code))
    code = cutlass.select_(biased == 255, nonfinite, code)
    return code | (sign * spec.sign_bit)
