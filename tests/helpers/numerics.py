"""Numerical checks shared by the tests: relative errors, rounding to a format, the SR bits' hash."""

import torch

F64 = torch.float64
M32 = (1 << 32) - 1


def rel_err(actual, expected, *, allow_zero=False):
    """||actual - expected|| / ||expected|| in float64 (a Python float).

    An all-zero (or empty) `expected` would make any check vacuous: it fails unless `allow_zero`,
    where the norm is clamped to 1e-30 (an all-zero or empty pair gives 0, a nonzero `actual` fails
    every tolerance)."""
    a, b = actual.to(F64), expected.to(F64)
    norm = b.norm()
    if allow_zero:
        norm = norm.clamp_min(1e-30)
    else:
        assert norm > 0, "the reference is all zeros: the check would be vacuous"
    return ((a - b).norm() / norm).item()


def assert_rel(actual, expected, rtol=1e-10, what=""):
    """Same shape, and max |actual - expected| <= rtol * max |expected| (expected not all zeros)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().item()
    err = (actual.to(F64) - expected.to(F64)).abs().max().item()
    assert scale > 0, f"{what}: expected is all zeros, the check would be vacuous"
    assert err <= rtol * scale, f"{what}: max abs err {err:.3e} > {rtol:.0e} * {scale:.3e}"


def assert_rounding_of(stored, exact, unit, tiny, what=""):
    """stored is exact rounded to a format with unit roundoff `unit` (relative), allowing a
    double rounding through fp32 and an absolute `tiny` for subnormals."""
    err = (stored.to(F64) - exact).abs()
    bound = exact.abs() * unit * (1 + 2.0**-10) + tiny
    assert bool((err <= bound).all()), f"{what}: not a rounding of the exact value (max err {err.max():.3e})"


def fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser on a Python int."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)
