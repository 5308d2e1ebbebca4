"""Mamba-2 kernel shapes and launch configs: ``Mamba2Shape`` (everything static about one
layer's call), ``Mamba2Config`` (the launch knobs, with the checks every Mamba-2 kernel shares
and the decode kernel's own), and the analytical default config of each kernel (decode, verify,
the snapshot baseline) for the shapes the autotuner has not tuned.

The kernel modules (decode, verify, snapshot) and the host (replayssm_cute) import them from here.
"""

from dataclasses import dataclass
from typing import List, Optional, Type

import cutlass

from ..common import pow2_at_least, smem_fit
from ..config_space import VERIFY_ROWS_PER_WARP, config_space, launch_check, verify_tile_rows
from ..limits import MAX_CAPACITY
from ..state_io import StateCopies


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


def default_mamba2_config(headdim: int, batch: int, window: int, whole_head: bool = False, shape=None):
    """What the autotuner finds on the H200 (tuned/h200.json, every batch bucket of four Mamba-2
    shapes), for shapes it has not tuned. ReplaySSM: the whole head in one CTA of 4 warps (16-20
    rows each, one ring walk per head) with registers capped for 4 CTAs per SM, half the head at
    batch 1 (1.3-1.5x over the 16-row tiles of the old default at batch 2-16). Conventional: 8-row
    tiles over 2 warps (1-3% over larger tiles at every batch). ``whole_head``: a CTA per head
    (the writer of an nvfp4 copy needs the whole state's amax). With `shape` of a read copy from
    batch 8: a head per CTA in 32-row warps, registers capped for 8 CTAs per SM (the tuner's pick
    for fp8 and nvfp4 at batch 8-1024 on Nemotron-3-Super, 1.21-1.31x over 4-warp heads at batch
    8-16; fp16 copies run the pipelined kernel). With `shape`, the first choice its check takes."""
    def takes(cfg):
        return headdim % cfg.rows_per_cta == 0 and cfg.rows_per_cta % cfg.num_warps == 0 and (
            shape is None or cfg.check(shape) is None)

    if shape is not None and shape.read_copy is not None and batch >= 8 and headdim % 32 == 0:
        light = Mamba2Config(rows_per_cta=headdim, num_warps=headdim // 32, min_ctas_per_sm=8)
        if light.check(shape) is None:
            return light
    if whole_head:
        return Mamba2Config(rows_per_cta=headdim, num_warps=4 if headdim % 4 == 0 else 1)
    if window > 1:
        rows = headdim // 2 if batch == 1 and headdim % 8 == 0 else headdim
        choices = [Mamba2Config(rows, 4, 4), Mamba2Config(64, 4), Mamba2Config(32, 2)]
    else:
        choices = [Mamba2Config(8, 2), Mamba2Config(16, 4)]
    for cfg in choices:
        if takes(cfg):
            return cfg
    return Mamba2Config(rows_per_cta=16, num_warps=4)


def default_mamba2_verify_config(headdim: int, batch: int, whole_head: bool = False):
    """Verify tiles 16 rows per warp (the MMA's M): one warp per CTA at batch <= 2, where more
    CTAs per row hide latency, else the whole head where it fits in 8 warps, so the per-CTA dot
    GEMM and staging are shared by more rows (tuned on the H200, T = 4 and 8: 1.1-1.25x over
    one-warp CTAs at batch 4-16 for headdim 64 and 80). ``whole_head``: a CTA per head at any
    batch (an nvfp4 copy's writer)."""
    if whole_head:
        return Mamba2Config(rows_per_cta=headdim, num_warps=headdim // 16)
    rows = verify_tile_rows(headdim) if batch > 2 else VERIFY_ROWS_PER_WARP
    return Mamba2Config(rows_per_cta=rows, num_warps=rows // VERIFY_ROWS_PER_WARP)


def default_mamba2_snapshot_config(headdim: int, batch: int):
    """At most 8 rows per warp (a warp keeps its rows in registers across the drafts): 16-row
    tiles at batch <= 16, where more CTAs per row hide latency, else 32-row tiles where they
    divide headdim."""
    return Mamba2Config(16, 4) if batch <= 16 or headdim % 32 else Mamba2Config(32, 4)
