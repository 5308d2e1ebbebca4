"""The analytical default launch config of each Mamba-2 tile kernel (decode, verify, the
snapshot baseline): what serves where no tuned config does (replayssm_cute.runtime.tuning). The
host (replayssm_cute.layers) imports them; no kernel module does, so these choices never change
generated code and the compile cache's source hash leaves this file out (a change here keeps
every compiled kernel; the chosen config is part of each kernel's key).
"""

from ..config_space import VERIFY_ROWS_PER_WARP, verify_tile_rows
from .config import Mamba2Config


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
