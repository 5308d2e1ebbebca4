"""Device helpers shared by the GDN decode and verify kernels: gates and q/k normalisation."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..common import softplus, warp_reduce_many


@cute.jit
def gdn_gates(a_raw: Float32, b_raw: Float32, A_log: Float32, dt_bias: Float32):
    """(g, beta): g = -exp(A_log) softplus(a + dt_bias) (log decay), beta = sigmoid(b)."""
    g = -cute.math.exp(A_log, fastmath=False) * softplus(a_raw + dt_bias)
    beta = Float32(1.0) / (Float32(1.0) + cute.math.exp(-b_raw, fastmath=False))
    return g, beta


@cute.jit
def normalize_qk(rK: cute.Tensor, rQ: cute.Tensor, vec: cutlass.Constexpr[int], q_scale: cutlass.Constexpr[float]):
    """L2-normalise the warp's k and q (each lane holds `vec` elements; idle lanes hold zeros)
    in place, q times q_scale; returns k . q of the normalised pair."""
    rNorm = cute.make_rmem_tensor((4,), Float32)
    rNorm.fill(0.0)
    for e in cutlass.range_constexpr(vec):
        rNorm[0] = rNorm[0] + rK[e] * rK[e]
        rNorm[1] = rNorm[1] + rQ[e] * rQ[e]
        rNorm[2] = rNorm[2] + rK[e] * rQ[e]
    part = warp_reduce_many(rNorm, 4)  # lane 8 t holds total t
    inv_k = cute.math.rsqrt(cute.arch.shuffle_sync(part, 0) + Float32(1e-6))
    inv_q = cute.math.rsqrt(cute.arch.shuffle_sync(part, 8) + Float32(1e-6)) * Float32(q_scale)
    for e in cutlass.range_constexpr(vec):
        rK[e] = rK[e] * inv_k
        rQ[e] = rQ[e] * inv_q
    return cute.arch.shuffle_sync(part, 16) * inv_k * inv_q
