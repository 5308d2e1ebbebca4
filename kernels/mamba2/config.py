"""Mamba-2 kernel shapes and launch configs: ``Mamba2Shape`` (everything static about one
layer's call), ``Mamba2Config`` (the launch knobs, with the checks every Mamba-2 kernel shares
and the decode kernel's own). The analytical default configs are in ``defaults.py``.

The kernels take the layer's tensors as bundles: ``Mamba2Token`` (a step's inputs; verify's with a
draft dim) and ``Mamba2Ring`` (the records and the plan).

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

# fp16 rows stay on CUDA cores: nothing to decode, and the copy is near the byte rate (measured on
# the H200, Nemotron-3-Super on the pipelined decode at batch 256, non-flush: 149 us, 157 on tensor cores)
TENSOR_CORE_READS = ("fp8", "nvfp4")


def rows_on_tensor_cores(fmt: Optional[CopyFormat], rows: int) -> bool:
    """Whether a Mamba-2 decode dots ``rows`` rows of ``fmt`` with C on tensor cores (state_io.mma_row_dots)."""
    return fmt is not None and fmt.name in TENSOR_CORE_READS and mma_dots_error(fmt, rows) is None


class Mamba2Token(NamedTuple):
    """A step's inputs: this token's (decode), or the drafts' with a draft dim after the batch (verify)."""

    mX: cute.Tensor
    mDt: cute.Tensor
    mA: cute.Tensor
    mB: cute.Tensor
    mC: cute.Tensor
    mD: Optional[cute.Tensor]
    mZ: Optional[cute.Tensor]
    mDtBias: Optional[cute.Tensor]


class Mamba2Ring(NamedTuple):
    """The ring's records and the step's plan rows (all None at window 1)."""

    mRingX: Optional[cute.Tensor]
    mRingB: Optional[cute.Tensor]
    mRingDt: Optional[cute.Tensor]
    mPlan: Optional[cute.Tensor]


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
    checkpoint_format: str = "fp32"  # the recurrence checkpoint; low precision is written with SR
    read_copy: Optional[str] = None  # the read copy of non-flush steps (RTN), None: the checkpoint

    def key(self):
        return (self.nheads, self.headdim, self.dstate, self.ngroups, self.window, self.capacity,
                self.act_dtype.__name__, self.dt_dtype.__name__, self.has_D, self.has_z,
                self.has_dt_bias, self.dt_softplus, self.pad_slot_id, self.checkpoint_format, self.read_copy)

    @property
    def copies(self) -> StateCopies:
        return StateCopies(self.checkpoint_format, self.read_copy, self.dstate, self.window)


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

    def records_per_warp(self, capacity: int) -> int:
        return -(-capacity // self.num_warps)

    def record_dot_values(self, capacity: int) -> int:
        """Values a warp reduces for its ring positions (B_p . C each), a power of two."""
        return pow2_at_least(self.records_per_warp(capacity))

    def smem_bytes(self, shape: Mamba2Shape) -> int:
        """The state tile, B at every ring position and its weights, mbarriers, alignment slack."""
        N, cap = shape.dstate, shape.capacity
        return ((self.rows_per_cta * N + cap) * 4 + cap * N * shape.act_dtype.width // 8 + 8 * self.num_warps + 512
                + shape.copies.smem_bytes(self.rows_per_cta, self.num_warps))

    def key(self):
        return (self.rows_per_cta, self.num_warps, self.min_ctas_per_sm)

    @classmethod
    def space(cls, headdim: int) -> List["Mamba2Config"]:
        """The launch configs the autotuner tries at this headdim, before a kernel's check
        (config_space): the decode kernel keeps those its ``check`` takes, verify and the
        snapshot baseline those theirs do."""
        return config_space(cls, headdim)

    def check(self, shape: Mamba2Shape) -> Optional[str]:
        """None if valid for the decode kernel on `shape`, else the reason."""
        reason = self.check_tiles(shape)
        if reason is not None:
            return reason
        if self.rows_per_warp > 32:
            return "more than 32 rows per warp (a lane per row in the fold)"
        reason = shape.copies.check(shape.dstate // 32, self.rows_per_cta, shape.headdim)
        if reason is not None:
            return reason
        return smem_fit(self.smem_bytes(shape), self.min_ctas_per_sm)

    def check_tiles(self, shape: Mamba2Shape) -> Optional[str]:
        """The checks every Mamba-2 kernel shares: launch fields, dims, tiling and ring capacity."""
        reason = launch_check(self.rows_per_cta, self.num_warps, self.min_ctas_per_sm)
        if reason is not None:
            return reason
        P, N = shape.headdim, shape.dstate
        if N % 32 or N > 256:
            return f"dstate {N}: the kernel needs a multiple of 32 up to 256"
        if P % self.rows_per_cta:
            return f"rows_per_cta {self.rows_per_cta} does not divide headdim {P}"
        if self.rows_per_cta % self.num_warps:
            return f"num_warps {self.num_warps} does not divide rows_per_cta {self.rows_per_cta}"
        if shape.capacity > MAX_CAPACITY:
            return f"ring capacity {shape.capacity} (window + drafts) above {MAX_CAPACITY} (one lane per record)"
        return None
