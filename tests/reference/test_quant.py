"""Tests of the low-precision formats and rounding reference (replayssm_cute.quant), CPU only.

RTN is checked bit for bit against torch's own casts (fp16, float8_e4m3fn) and, for E2M1,
against a brute-force nearest-even search of the value table; SR against the two neighbours
found by searching every representable value, against the fp32 pattern-add recipe the kernels
use, and for unbiasedness, both exactly (stratified bits) and statistically (sr_bits draws).
"""

import math

import pytest
import torch

from replayssm_cute import quant as Q

from tests.helpers.inputs import gen as _gen
from tests.helpers.numerics import fmix32 as _fmix32

MASK32 = (1 << 32) - 1
ELEMENTS = [Q.F16, Q.E4M3, Q.E2M1]
TORCH_DTYPE = {"fp16": torch.float16, "e4m3": torch.float8_e4m3fn}
STATE_FORMATS = [Q.FP16(), Q.FP8E4M3(), Q.NVFP4()]


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are small: on a busy machine, waking intra-op threads costs more than the work."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_patterns(n, seed=0):
    """Every fp32 class: normals of every exponent, subnormals, zeros, Inf, NaN."""
    return torch.randint(-(2**31), 2**31, (n,), generator=_gen(seed), dtype=torch.int64).to(torch.int32).view(
        torch.float32
    )


def _spread(n, lo_exp, hi_exp, seed=0):
    """Signed values with log-uniform magnitudes in [2^lo_exp, 2^hi_exp)."""
    g = _gen(seed)
    mag = torch.exp2(torch.rand(n, generator=g, dtype=torch.float64) * (hi_exp - lo_exp) + lo_exp)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
    return (mag * sign).to(torch.float32)


def _torch_codes(x, fmt):
    dtype = TORCH_DTYPE[fmt.name]
    int_dtype = torch.int16 if dtype == torch.float16 else torch.uint8
    return x.to(dtype).view(int_dtype).to(torch.int64) & (2 * fmt.sign_bit - 1)


def _finite_magnitudes(fmt):
    """Sorted float64 tensor of every finite non-negative value of fmt."""
    values = fmt.values(torch.arange(fmt.sign_bit)).to(torch.float64)
    return torch.unique(values[torch.isfinite(values)])


def _neighbours(x, fmt):
    """(lower, upper): the representable values around |x| (both max for |x| > max), signed like x."""
    table = _finite_magnitudes(fmt)
    a = x.abs().to(torch.float64).clamp(max=table[-1].item())
    lower = table[torch.searchsorted(table, a, right=True) - 1]
    upper = table[torch.searchsorted(table, a, right=False)]
    sign = torch.where(torch.signbit(x), -1.0, 1.0).to(torch.float64)
    return lower * sign, upper * sign


def _same_bits(a, b):
    """fp32 tensors equal bit for bit (so -0.0 != 0.0), NaN matching NaN whatever its payload."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))


def _midpoints(fmt):
    """Every exact tie between neighbouring finite values of fmt, both signs, plus the fp32 values
    one ulp either side of each."""
    table = _finite_magnitudes(fmt)
    mid = ((table[1:] + table[:-1]) / 2).to(torch.float32)  # 12 significant bits at most: exact
    around = torch.cat([mid, torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, mid * 2)])
    return torch.cat([around, -around])


def _sr_bits_python(seed, offset):
    """The generator written from its docstring with Python ints: the kernels' reference."""
    return _fmix32((offset & MASK32) ^ _fmix32(seed ^ 0x9E3779B9))


def _draws(n, seed=1):
    """n independent draws of 32 random bits, as int32."""
    return Q.sr_bits(seed, torch.arange(n))


# ----------------------------------------------------------------------------- random bits


def test_sr_bits_matches_python_reference():
    offsets = [0, 1, 2, 3, 127, 128, 2**31 - 1, 2**31, 2**32 - 1, 2**32 + 5, 12345678901]
    for seed in (0, 1, 0x9E3779B9, 2**32 - 1):
        got = Q.sr_bits(seed, torch.tensor(offsets)).to(torch.int64) & MASK32
        assert got.tolist() == [_sr_bits_python(seed, o) for o in offsets], seed
    assert Q.sr_bits(5, torch.arange(4)).dtype == torch.int32


def test_sr_bits_tensor_seed_broadcasts_like_int_seed():
    offsets = torch.arange(6).view(2, 3)
    seeds = torch.tensor([[3], [4]])
    got = Q.sr_bits(seeds, offsets)
    assert torch.equal(got[0], Q.sr_bits(3, offsets[0]))
    assert torch.equal(got[1], Q.sr_bits(4, offsets[1]))


def test_sr_bits_are_balanced():
    # Each of the 32 bit positions is set about half the time over consecutive offsets.
    n = 1 << 16
    u = Q.sr_bits(11, torch.arange(n)).to(torch.int64) & MASK32
    ones = torch.stack([((u >> i) & 1).sum() for i in range(32)]).double()
    assert ((ones - n / 2).abs() <= 5 * math.sqrt(n / 4)).all(), ones


def test_sr_bits_argument_errors():
    with pytest.raises(ValueError, match="offsets"):
        Q.sr_bits(0, torch.zeros(3))
    with pytest.raises(ValueError, match="seed"):
        Q.sr_bits(-1, torch.arange(3))
    with pytest.raises(ValueError, match="seed"):
        Q.sr_bits(2**32, torch.arange(3))
    with pytest.raises(ValueError, match="seed"):
        Q.sr_bits(1.5, torch.arange(3))


# ----------------------------------------------------------------------------- element decode


@pytest.mark.parametrize("fmt", [Q.F16, Q.E4M3], ids=lambda f: f.name)
def test_values_match_torch_decode(fmt):
    codes = torch.arange(2 * fmt.sign_bit)
    if fmt is Q.F16:
        storage = (codes - ((codes >> 15) << 16)).to(torch.int16).view(torch.float16)
    else:
        storage = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    assert _same_bits(fmt.values(codes), storage.to(torch.float32))


def test_e2m1_values():
    expected = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert Q.E2M1.values(torch.arange(16)).tolist() == expected + [-v for v in expected]
    assert Q.E2M1.max_value == 6.0 and Q.E4M3.max_value == 448.0 and Q.F16.max_value == 65504.0


# ----------------------------------------------------------------------------- RTN


@pytest.mark.parametrize("fmt", [Q.F16, Q.E4M3], ids=lambda f: f.name)
def test_rtn_matches_torch_on_random_patterns(fmt):
    x = _random_patterns(1 << 18)
    codes, values = fmt.round_rtn(x)
    expected = _torch_codes(x, fmt)
    nan = x.isnan()
    # NaN payloads: torch keeps fp16 payload bits on some paths only; NaN-ness must agree.
    assert torch.equal(codes[~nan], expected[~nan])
    assert values[nan].isnan().all()


@pytest.mark.parametrize("fmt", [Q.F16, Q.E4M3], ids=lambda f: f.name)
def test_rtn_matches_torch_on_ties_subnormals_saturation_and_specials(fmt):
    max_value = fmt.max_value
    step_at_max = max_value - _finite_magnitudes(fmt)[-2].item()
    edges = torch.tensor(
        [
            0.0, -0.0, max_value, max_value + step_at_max / 2,  # the tie above max: even is max (fp16: Inf)
            max_value + step_at_max / 4, max_value + step_at_max, 1e30, 3.4e38,
            float("inf"), float("-inf"), float("nan"), -float("nan"),
            1e-40, -1e-45,  # fp32 subnormals
        ],
        dtype=torch.float32,
    )
    edges = torch.cat([edges, -edges[2:8]])
    x = torch.cat([_midpoints(fmt), edges, _spread(1 << 14, -30, 20)])
    codes, _ = fmt.round_rtn(x)
    assert torch.equal(codes, _torch_codes(x, fmt))


def test_rtn_documented_edge_cases():
    def rtn(fmt, v):
        return fmt.round_rtn(torch.tensor([v], dtype=torch.float32))[1].item()

    assert rtn(Q.F16, 65519.0) == 65504.0 and rtn(Q.F16, 65520.0) == float("inf")
    assert rtn(Q.E4M3, 464.0) == 448.0 and rtn(Q.E4M3, 470.0) == 448.0 and rtn(Q.E4M3, float("inf")) == 448.0
    # E4M3 subnormals are multiples of 2^-9; ties go to the even code.
    assert rtn(Q.E4M3, 2**-10) == 0.0 and rtn(Q.E4M3, 1.5 * 2**-9) == 2 * 2**-9
    assert rtn(Q.E4M3, 2.5 * 2**-9) == 2 * 2**-9 and rtn(Q.E4M3, 2**-10 * 1.0001) == 2**-9
    assert rtn(Q.F16, 2**-25) == 0.0 and rtn(Q.F16, 3 * 2**-25) == 2**-23
    assert rtn(Q.E2M1, 5.0) == 4.0 and rtn(Q.E2M1, 1e9) == 6.0 and rtn(Q.E2M1, float("-inf")) == -6.0


def test_e2m1_rtn_is_nearest_even_with_saturation():
    x = torch.cat([_midpoints(Q.E2M1), _spread(1 << 14, -6, 4), torch.tensor([0.0, -0.0, 6.0, 7.0, -100.0])])
    codes, values = Q.E2M1.round_rtn(x)
    table = Q.E2M1.values(torch.arange(8)).to(torch.float64)
    a = x.abs().to(torch.float64).clamp(max=6.0)
    distance = (a[:, None] - table[None, :]).abs()
    best = distance == distance.min(1, keepdim=True).values
    # Among the nearest (one, or two at a tie) take the even code.
    even_first = best.to(torch.int64) * (2 - torch.arange(8) % 2)
    expected = even_first.argmax(1) | torch.signbit(x).to(torch.int64) << 3
    assert torch.equal(codes, expected)
    assert values.abs().max() <= 6.0


# ----------------------------------------------------------------------------- SR


def _sr_inputs(fmt, n=1 << 15):
    """Values across the format's range (subnormals included), beyond it, and exact ones."""
    emin_sub = fmt.emin - fmt.man_bits
    exact = fmt.values(torch.arange(2 * fmt.sign_bit))
    exact = exact[torch.isfinite(exact)]
    return torch.cat(
        [
            _spread(n, emin_sub - 12, math.log2(fmt.max_value) + 2),
            exact,
            torch.tensor([fmt.max_value * 1.01, -3e38, 1e-45]),
        ]
    )


@pytest.mark.parametrize("fmt", ELEMENTS, ids=lambda f: f.name)
def test_sr_lands_on_a_neighbour(fmt):
    x = _sr_inputs(fmt)
    lower, upper = _neighbours(x, fmt)
    _, down = fmt.round_sr(x, torch.zeros_like(x, dtype=torch.int32))
    _, up = fmt.round_sr(x, torch.full_like(x, -1, dtype=torch.int32))  # all ones
    _, drawn = fmt.round_sr(x, _draws(x.numel()))
    assert torch.equal(down.to(torch.float64), lower)
    # Full bits reach the upper neighbour wherever the 32-bit fraction is exact (module docstring).
    exact_fraction = x.abs() >= 2.0 ** (fmt.emin - fmt.man_bits - 9)
    assert torch.equal(up[exact_fraction].to(torch.float64), upper[exact_fraction])
    assert ((drawn == lower) | (drawn == upper)).all()
    # Signs survive, zeros included.
    assert torch.equal(torch.signbit(drawn), torch.signbit(x))


@pytest.mark.parametrize("fmt", ELEMENTS, ids=lambda f: f.name)
def test_sr_saturates_and_keeps_nonfinite_like_rtn(fmt):
    big = torch.tensor([fmt.max_value * 1.5, -1e38, fmt.max_value], dtype=torch.float32)
    assert fmt.round_sr(big, torch.full_like(big, -1, dtype=torch.int32))[1].tolist() == [
        fmt.max_value, -fmt.max_value, fmt.max_value,
    ]
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), -float("nan")])
    assert torch.equal(fmt.round_sr(special, _draws(4))[0], fmt.round_rtn(special)[0])


@pytest.mark.parametrize("fmt", ELEMENTS, ids=lambda f: f.name)
def test_sr_is_the_fp32_pattern_add(fmt):
    """The kernel recipe for |x| >= the smallest subnormal: add the top d random bits to the d
    discarded bits of the fp32 pattern, truncate, then saturate."""
    x = _sr_inputs(fmt)
    x = x[(x.abs() >= 2.0 ** (fmt.emin - fmt.man_bits)) & torch.isfinite(x)]
    r = _draws(x.numel(), seed=3).to(torch.int64) & MASK32
    magnitude = x.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    e = (magnitude >> 23) - 127
    d = 23 - fmt.man_bits + (fmt.emin - e).clamp(min=0)
    rounded = (magnitude + (r >> (32 - d))) & ~((1 << d) - 1)
    value = rounded.to(torch.int32).view(torch.float32).clamp(max=fmt.max_value)
    value = torch.where(torch.signbit(x), -value, value)
    assert torch.equal(fmt.round_sr(x, r.to(torch.int32))[1], value)


@pytest.mark.parametrize("fmt", ELEMENTS, ids=lambda f: f.name)
def test_rtn_is_the_fp32_pattern_trick_where_documented(fmt):
    """The classic recipe, valid for d <= 22 (the tie parity is then bit d of the pattern)."""
    x = torch.cat([_sr_inputs(fmt), _midpoints(fmt)])
    magnitude = x.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    e = (magnitude >> 23) - 127
    d = 23 - fmt.man_bits + (fmt.emin - e).clamp(min=0)
    keep = (d <= 22) & torch.isfinite(x) & (x.abs() <= fmt.max_value)
    x, magnitude, d = x[keep], magnitude[keep], d[keep]
    rounded = (magnitude + (1 << (d - 1)) - 1 + ((magnitude >> d) & 1)) & ~((1 << d) - 1)
    value = rounded.to(torch.int32).view(torch.float32)
    value = torch.where(torch.signbit(x), -value, value)
    assert torch.equal(fmt.round_rtn(x)[1], value)


def _sr_test_values(fmt):
    """Values at awkward places: subnormal gaps, normal gaps, the gap below max, exact values."""
    sub = 2.0 ** (fmt.emin - fmt.man_bits)
    step_at_max = fmt.max_value - _finite_magnitudes(fmt)[-2].item()
    return torch.tensor(
        [
            0.3 * sub, 1.7 * sub, 2.5 * sub, 0.01 * sub, 1.3 * 2.0**-11 * sub,  # the last: d > 32
            1.1, -1.37, 3.3 * 2.0**fmt.emin, -2.9,
            fmt.max_value - 0.3 * step_at_max, -(fmt.max_value - 0.9 * step_at_max),
            fmt.max_value, 1.0, -0.0,
        ],
        dtype=torch.float32,
    )


@pytest.mark.parametrize("fmt", ELEMENTS, ids=lambda f: f.name)
def test_sr_mean_is_exact_over_stratified_bits(fmt):
    # Bits i << 20 for i < 4096 sweep the top 12 bits evenly: the up-rounding frequency is the
    # position within the gap to 1 / 4096 (and 2^-32 more where the fraction is truncated, d > 32).
    x = _sr_test_values(fmt)
    lower, upper = _neighbours(x, fmt)
    strata = 4096
    bits = (torch.arange(strata, dtype=torch.int64) << 20).to(torch.int32)
    repeated = x[:, None].expand(-1, strata).contiguous()
    _, values = fmt.round_sr(repeated, bits.expand(x.numel(), -1).contiguous())
    mean = values.to(torch.float64).mean(1)
    gap = (upper - lower).abs()
    assert ((mean - x.to(torch.float64)).abs() <= gap * (1 / strata + 2.0**-32)).all(), (mean, x)


@pytest.mark.parametrize("fmt", ELEMENTS, ids=lambda f: f.name)
def test_sr_is_unbiased_with_sr_bits(fmt):
    x = _sr_test_values(fmt)
    draws = 4096
    bits = Q.sr_bits(99, torch.arange(x.numel() * draws)).view(x.numel(), draws)
    _, values = fmt.round_sr(x[:, None].expand(-1, draws).contiguous(), bits)
    lower, upper = _neighbours(x, fmt)
    gap = (upper - lower).abs()
    x64 = x.to(torch.float64)
    p = torch.where(gap > 0, (x64 - lower).abs() / gap, 0.0)
    standard_error = gap * torch.sqrt(p * (1 - p) / draws)
    mean = values.to(torch.float64).mean(1)
    assert ((mean - x64).abs() <= 5 * standard_error).all(), (mean - x64, standard_error)


def test_sr_with_fixed_bits_is_deterministic_and_seed_matters():
    x = torch.randn(2, 8, 128, generator=_gen(5))
    offsets = torch.arange(x.numel()).view(x.shape)
    for fmt in STATE_FORMATS:
        a = fmt.encode_sr(x, Q.sr_bits(7, offsets))
        b = fmt.encode_sr(x, Q.sr_bits(7, offsets))
        c = fmt.encode_sr(x, Q.sr_bits(8, offsets))
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), fmt.name
        assert _same_bits(a.dequantized, b.dequantized), fmt.name
        assert not torch.equal(a.data.view(torch.uint8), c.data.view(torch.uint8)), fmt.name


# ----------------------------------------------------------------------------- state formats


def _state(shape, seed=0, lo_exp=-12, hi_exp=6):
    """A state with a wide spread of magnitudes, varying per 16-element block."""
    g = _gen(seed)
    x = torch.randn(shape, generator=g)
    block_exp = torch.randint(lo_exp, hi_exp, shape[:-1] + (shape[-1] // 16, 1), generator=g).float()
    return (x.unflatten(-1, (-1, 16)) * torch.exp2(block_exp)).flatten(-2)


@pytest.mark.parametrize("fmt", STATE_FORMATS, ids=lambda f: f.name)
def test_decode_reproduces_dequantized(fmt):
    x = _state((3, 2, 16, 128))
    for encoded in (fmt.encode_rtn(x), fmt.encode_sr(x, _draws(x.numel()).view(x.shape))):
        assert _same_bits(fmt.decode(encoded.data, encoded.scales), encoded.dequantized)
        assert encoded.dequantized.dtype == torch.float32 and encoded.dequantized.shape == x.shape


def test_fp16_state_is_torch_half():
    x = _state((2, 8, 32))
    encoded = Q.FP16().encode_rtn(x)
    assert encoded.data.dtype == torch.float16 and encoded.scales == ()
    assert torch.equal(encoded.data.view(torch.int16), x.half().view(torch.int16))


def test_fp8_scales_and_codes():
    x = _state((4, 16, 256))
    fmt = Q.FP8E4M3()
    encoded = fmt.encode_rtn(x)
    (scale,) = encoded.scales
    assert scale.shape == (4, 16, 2) and scale.dtype == torch.float32
    amax = x.unflatten(-1, (-1, 128)).abs().amax(-1).to(torch.float64)
    # scale is amax / 448 rounded up: the smallest fp32 at or above it.
    assert (scale.to(torch.float64) * 448 >= amax).all()
    below = torch.nextafter(scale, torch.zeros_like(scale)).to(torch.float64)
    assert (below * 448 < amax).all()
    # The codes are torch's own cast of y = x * inv, and no |y| exceeds 448.
    inv = 1.0 / scale.to(torch.float64)
    y = (x.unflatten(-1, (-1, 128)) * Q._reciprocal_toward_zero(scale)[..., None]).flatten(-2)
    assert y.abs().max() <= 448.0
    assert torch.equal(encoded.data.view(torch.uint8), y.to(torch.float8_e4m3fn).view(torch.uint8))
    # Reciprocal rounded toward zero: within one fp32 ulp below the exact one.
    r = Q._reciprocal_toward_zero(scale).to(torch.float64)
    assert (r <= inv).all() and (r > inv * (1 - 2.0**-23)).all()
    # The largest element of each row decodes near its value, not clipped.
    largest = (encoded.dequantized.abs().unflatten(-1, (-1, 128)).amax(-1)).to(torch.float64)
    assert ((largest - amax).abs() <= amax / 16).all()


def test_fp8_block_k_and_special_rows():
    x = _state((2, 4, 64))
    x[0, 0] = 0.0
    x[0, 1, 3] = float("nan")
    x[0, 2, 5] = float("inf")
    fmt = Q.FP8E4M3(block_k=64)
    for encoded in (fmt.encode_rtn(x), fmt.encode_sr(x, _draws(x.numel()).view(x.shape))):
        out = encoded.dequantized
        assert encoded.scales[0][0, 0].item() == 0.0 and (out[0, 0] == 0).all()
        assert out[0, 1].isnan().all() and out[0, 2].isnan().all()
        assert torch.isfinite(out[0, 3]).all() and torch.isfinite(out[1]).all()


def test_nvfp4_scales():
    x = _state((3, 8, 128), lo_exp=-20, hi_exp=12)
    x[1] *= 1e-30  # a state far from 1 in scale
    encoded = Q.NVFP4().encode_rtn(x)
    block_scale, state_scale = encoded.scales
    assert block_scale.dtype == torch.float8_e4m3fn and block_scale.shape == (3, 8, 8)
    assert state_scale.dtype == torch.float32 and state_scale.shape == (3,)
    # The state scale is the smallest power of two G with amax <= 2688 G.
    amax = x.abs().amax((-2, -1)).to(torch.float64)
    mantissa, _ = torch.frexp(state_scale)
    assert (mantissa == 0.5).all()
    G = state_scale.to(torch.float64)
    assert (amax <= 2688 * G).all() and (amax > 2688 * G / 2).all()
    # Each block scale S is the smallest E4M3 value with 6 S G >= the block's amax.
    block_amax = x.unflatten(-1, (-1, 16)).abs().amax(-1).to(torch.float64)
    S = block_scale.to(torch.float64)
    assert (6 * S * G[:, None, None] >= block_amax).all()
    smaller = (block_scale.view(torch.uint8).to(torch.int64) - 1).clamp(min=0)
    S_below = Q.E4M3.values(smaller).to(torch.float64).where(S > 0, -1.0)
    assert (6 * S_below * G[:, None, None] < block_amax).all()
    # So no scaled element exceeds 6 and every decode is exact.
    D = (block_scale.to(torch.float32) * state_scale[:, None, None])
    y = (x.unflatten(-1, (-1, 16)) * Q._reciprocal_toward_zero(D)[..., None]).flatten(-2)
    assert y.abs().max() <= 6.0
    codes = Q.unpack_e2m1(encoded.data)
    exact = Q.E2M1.values(codes).to(torch.float64).unflatten(-1, (-1, 16)) * (S * G[:, None, None])[..., None]
    assert torch.equal(encoded.dequantized.to(torch.float64), exact.flatten(-2))


def test_nvfp4_sr_is_unbiased_at_the_block_amax():
    """A block whose amax / 6 lies just above an E4M3 value: a block scale rounded to nearest
    would fall below it and clip the block's largest element to 6, biasing SR."""
    V, K, draws = 2, 32, 4096
    x = _state((V, K), seed=9) * 0.01
    amax = 6 * 1.75 * 1.03  # amax / 6 = 1.8025, between the E4M3 values 1.75 and 1.875
    x[0, :16] = x[0, :16].clamp(-amax / 2, amax / 2)
    x[0, 5] = -amax
    x[1, 20] = 2000.0  # the state amax: 1344 < 2000 <= 2688, so the state scale is 1
    nearest = Q.E4M3.round_rtn(torch.tensor([amax / 6], dtype=torch.float32))[1].item()
    assert nearest == 1.75 and amax / nearest > 6.0  # the nearest scale would clip

    batch = x.expand(draws, V, K).contiguous()
    encoded = Q.NVFP4().encode_sr(batch, _draws(batch.numel(), seed=21).view(batch.shape))
    block_scale, state_scale = encoded.scales
    assert state_scale[0].item() == 1.0 and block_scale[0, 0, 0].to(torch.float32).item() == 1.875
    for row, col in ((0, 5), (1, 20), (0, 0), (0, 9)):
        D = block_scale[0, row, col // 16].to(torch.float32) * state_scale[0]
        y = x[row, col] * Q._reciprocal_toward_zero(D)
        lower, upper = (v.item() * D.item() for v in _neighbours(y.reshape(1), Q.E2M1))
        target = x[row, col].item()
        p = (target - lower) / (upper - lower)
        standard_error = abs(upper - lower) * math.sqrt(p * (1 - p) / draws)
        samples = encoded.dequantized[:, row, col].to(torch.float64)
        assert set(samples.unique().tolist()) <= {lower, upper}
        mean = samples.mean().item()
        assert abs(mean - target) <= 5 * standard_error, (row, col, mean, target)


def test_nvfp4_zero_and_nonfinite_states():
    x = _state((3, 4, 32))
    x[0] = 0.0
    x[1, 2, 7] = float("nan")
    x[2, 0, 0] = float("-inf")
    clean = _state((1, 4, 32))
    x = torch.cat([x, clean])
    fmt = Q.NVFP4()
    for encoded in (fmt.encode_rtn(x), fmt.encode_sr(x, _draws(x.numel()).view(x.shape))):
        block_scale, state_scale = encoded.scales
        assert state_scale[0].item() == 1.0 and (encoded.dequantized[0] == 0).all()
        for bad in (1, 2):
            assert math.isnan(state_scale[bad].item()) and encoded.dequantized[bad].isnan().all()
            assert (block_scale[bad].view(torch.uint8) == 0).all() and (encoded.data[bad] == 0).all()
        assert torch.isfinite(encoded.dequantized[3]).all()


def test_e2m1_packing():
    assert Q.pack_e2m1(torch.tensor([1, 2, 3, 4, 0xF, 0])).tolist() == [0x21, 0x43, 0x0F]
    codes = torch.randint(0, 16, (3, 5, 64), generator=_gen(2))
    packed = Q.pack_e2m1(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32)
    assert torch.equal(Q.unpack_e2m1(packed).to(torch.int64), codes)
    with pytest.raises(ValueError, match="codes"):
        Q.pack_e2m1(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="codes"):
        Q.pack_e2m1(torch.tensor([1, 16]))


def test_bytes_per_state():
    assert Q.bytes_per_state("fp32", 128, 128) == 65536
    assert Q.bytes_per_state("fp16", 128, 128) == 32768
    assert Q.bytes_per_state("fp8", 128, 128) == 128 * 128 + 4 * 128
    assert Q.bytes_per_state("nvfp4", 128, 128) == 128 * 64 + 128 * 8 + 4
    assert Q.bytes_per_state(Q.FP8E4M3(block_k=64), 64, 128) == 64 * 128 + 4 * 64 * 2
    x = _state((64, 128))
    for fmt in STATE_FORMATS:
        encoded = fmt.encode_rtn(x)
        stored = sum(t.numel() * t.element_size() for t in (encoded.data, *encoded.scales))
        assert stored == Q.bytes_per_state(fmt, 64, 128), fmt.name
    with pytest.raises(ValueError, match="fmt"):
        Q.bytes_per_state("fp4", 128, 128)
    with pytest.raises(ValueError, match="K"):
        Q.bytes_per_state("nvfp4", 128, 24)


def test_argument_errors():
    x = _state((4, 128))
    with pytest.raises(ValueError, match="x: expected a float32"):
        Q.FP16().encode_rtn(x.double())
    with pytest.raises(ValueError, match="x: expected a float32"):
        Q.E4M3.round_rtn(x.half())
    with pytest.raises(ValueError, match="bits: expected shape"):
        Q.FP8E4M3().encode_sr(x, _draws(7))
    with pytest.raises(ValueError, match="bits: expected an int32 or int64"):
        Q.NVFP4().encode_sr(x, torch.zeros_like(x))
    with pytest.raises(ValueError, match="x: expected a state"):
        Q.FP8E4M3().encode_rtn(_state((4, 64)))
    with pytest.raises(ValueError, match="x: expected a state"):
        Q.NVFP4().encode_rtn(torch.zeros(8, 24))
    with pytest.raises(ValueError, match="block_k"):
        Q.FP8E4M3(block_k=0)
    encoded = Q.NVFP4().encode_rtn(x)
    with pytest.raises(ValueError, match="scales"):
        Q.NVFP4().decode(encoded.data, encoded.scales[:1])
    with pytest.raises(ValueError, match=r"scales\[1\]"):
        Q.NVFP4().decode(encoded.data, (encoded.scales[0], encoded.scales[1][None]))
    with pytest.raises(ValueError, match="data"):
        Q.FP8E4M3().decode(encoded.data, (torch.ones(4, 1),))
