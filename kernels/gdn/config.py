"""Gated DeltaNet kernel shapes and launch configs: ``GDNShape`` (everything static about one
layer's call), ``GDNConfig`` (the launch knobs, with the checks every GDN kernel shares and the
decode kernel's own). The analytical default configs are in ``defaults.py``.

The kernels take the layer's tensors as bundles: ``GDNToken`` (a step's inputs; verify's with a
draft dim) and ``GDNRing`` (the records and the plan).

The kernel modules (decode, verify, snapshot) and the host (replayssm_cute) import them from here.
"""

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Type

import cutlass
import cutlass.cute as cute

from ..common import pow2_at_least, smem_fit
from ..config_space import config_space, launch_check
from ..limits import MAX_CAPACITY
from ..state_io import CopyFormat, StateCopies, mma_dots_error


# The read copies whose rows the pipelined decode dots on CUDA cores by default, where they were
# faster than on tensor cores (fp16 / fp8: 241 / 264 against 299 / 297 us; nvfp4, whose sm_90a
# decode is software, 380 against 315 us). Qwen3.5-122B, batch 256, L = 16, non-flush steps on
# the H200 (sweeps/results/README.md, "GDN read-copy row dots on tensor cores").
CUDA_CORE_DOT_READS = ("fp16", "fp8")


def rows_fit_tensor_cores(fmt: Optional[CopyFormat], rows: int, vec: int) -> bool:
    """Whether a GDN decode can dot ``rows`` rows of the read copy ``fmt`` with k and q on tensor
    cores (state_io.mma_row_dots, k and q from lanes of ``vec`` values): any low-precision copy."""
    return fmt is not None and mma_dots_error(fmt, rows, vec) is None


class GDNToken(NamedTuple):
    """A step's inputs: this token's (decode), or the drafts' with a draft dim after the batch (verify)."""

    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mA: cute.Tensor
    mB: cute.Tensor
    mALog: cute.Tensor
    mDtBias: cute.Tensor


class GDNRing(NamedTuple):
    """The ring's records and the step's plan rows (all None at window 1; v and beta only with
    keep_v_beta)."""

    mRingU: Optional[cute.Tensor]
    mRingK: Optional[cute.Tensor]
    mRingG: Optional[cute.Tensor]
    mRingV: Optional[cute.Tensor]
    mRingBeta: Optional[cute.Tensor]
    mPlan: Optional[cute.Tensor]


@dataclass(frozen=True)
class GDNShape:
    """Everything static about one GDN layer's decode: dims, window, dtypes, q scale, options."""

    num_v_heads: int
    head_v_dim: int
    head_k_dim: int
    num_k_heads: int
    window: int
    capacity: int
    act_dtype: Type[cutlass.Numeric] = cutlass.BFloat16
    gate_dtype: Type[cutlass.Numeric] = cutlass.BFloat16
    A_log_dtype: Type[cutlass.Numeric] = cutlass.Float32
    dt_bias_dtype: Type[cutlass.Numeric] = cutlass.Float32
    scale: float = 0.0  # q scale; 0 means head_k_dim ** -0.5
    keep_v_beta: bool = False
    pad_slot_id: int = -1
    checkpoint_format: str = "fp32"  # the recurrence checkpoint; low precision is written with SR
    read_copy: Optional[str] = None  # the read copy of non-flush steps (RTN), None: the checkpoint
    rederive: bool = False  # a flush re-derives the corrections from the checkpoint (Algorithm 6)

    @property
    def copies(self) -> StateCopies:
        return StateCopies(self.checkpoint_format, self.read_copy, self.head_k_dim, self.window)

    @property
    def q_scale(self) -> float:
        return self.scale if self.scale else self.head_k_dim ** -0.5

    @property
    def k_vec(self) -> int:
        """Elements of a K row per lane: the smallest power of two that fits K in 32 lanes."""
        return pow2_at_least(-(-self.head_k_dim // 32))

    def key(self):
        return (self.num_v_heads, self.head_v_dim, self.head_k_dim, self.num_k_heads, self.window,
                self.capacity, self.act_dtype.__name__, self.gate_dtype.__name__,
                self.A_log_dtype.__name__, self.dt_bias_dtype.__name__, float(self.scale),
                self.keep_v_beta, self.pad_slot_id, self.checkpoint_format, self.read_copy, self.rederive)


@dataclass(frozen=True)
class GDNConfig:
    """Launch configuration: rows_per_cta divides head_v_dim; num_warps divides rows_per_cta and
    each warp's rows (a power of two up to 16) arrive as one TMA stage with its own mbarrier."""

    rows_per_cta: int = 16
    num_warps: int = 4
    min_ctas_per_sm: int = 0  # > 0 caps registers so this many CTAs fit on an SM

    @property
    def rows_per_warp(self) -> int:
        return self.rows_per_cta // self.num_warps

    def records_per_warp(self, window: int) -> int:
        return -(-window // self.num_warps)

    def record_dot_values(self, window: int) -> int:
        """Values a warp reduces for its record keys (k_j . k and k_j . q each), a power of two."""
        return pow2_at_least(2 * self.records_per_warp(window))

    def smem_bytes(self, shape: GDNShape) -> int:
        """The state tile, the ring keys and per-position weights, mbarriers, alignment slack."""
        K, cap = shape.head_k_dim, shape.capacity
        rederive = 0
        if shape.rederive:  # the keys' Gram matrix; S_ckpt k_p and re-derived u per warp row
            rederive = 4 * cap * cap + 3 * 4 * cap * self.rows_per_cta + 48
        return (self.rows_per_cta * K * 4 + 8 * cap + cap * K * shape.act_dtype.width // 8 + 8 * self.num_warps + 512
                + shape.copies.smem_bytes(self.rows_per_cta, self.num_warps) + rederive)

    def key(self):
        return (self.rows_per_cta, self.num_warps, self.min_ctas_per_sm)

    @classmethod
    def space(cls, head_v_dim: int) -> List["GDNConfig"]:
        """The launch configs the autotuner tries at this head_v_dim, before a kernel's check
        (config_space): the decode kernel keeps those its ``check`` takes, verify and the
        snapshot baseline those theirs do."""
        return config_space(cls, head_v_dim)

    def check(self, shape: GDNShape) -> Optional[str]:
        """None if valid for the decode kernel on `shape`, else the reason."""
        reason = self.check_tiles(shape)
        if reason is not None:
            return reason
        rw = self.rows_per_warp
        if rw & (rw - 1) or rw > 16:
            return f"rows per warp {rw}: must be a power of two up to 16"
        if 2 * self.records_per_warp(shape.capacity) > 32:
            return f"{self.num_warps} warps are too few for a ring of {shape.capacity} (16 record keys per warp at most)"
        reason = shape.copies.check(shape.k_vec, self.rows_per_cta, shape.head_v_dim)
        if reason is not None:
            return reason
        if shape.rederive and not (shape.keep_v_beta and shape.window > 1):
            return "re-deriving corrections at a flush needs the records' v and beta (keep_v_beta, window > 1)"
        return smem_fit(self.smem_bytes(shape), self.min_ctas_per_sm)

    def check_tiles(self, shape: GDNShape) -> Optional[str]:
        """The checks every GDN kernel shares: launch fields, head dims, heads, tiling and ring capacity."""
        reason = launch_check(self.rows_per_cta, self.num_warps, self.min_ctas_per_sm)
        if reason is not None:
            return reason
        V, K = shape.head_v_dim, shape.head_k_dim
        if K % 16 or not 16 <= K <= 256 or V % 16 or not 16 <= V <= 256:
            return f"head dims (V {V}, K {K}): the kernel needs multiples of 16 up to 256"
        if shape.num_v_heads % shape.num_k_heads:
            return f"num_v_heads {shape.num_v_heads} is not a multiple of num_k_heads {shape.num_k_heads}"
        if self.rows_per_cta % self.num_warps:
            return f"num_warps {self.num_warps} does not divide rows_per_cta {self.rows_per_cta}"
        if V % self.rows_per_cta:
            return f"rows_per_cta {self.rows_per_cta} does not divide head_v_dim {V}"
        if shape.capacity > MAX_CAPACITY:
            return f"ring capacity {shape.capacity} (window + drafts) above {MAX_CAPACITY} (one lane per record)"
        return None
