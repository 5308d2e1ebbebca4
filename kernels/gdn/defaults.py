"""The analytical default launch config of each Gated DeltaNet tile kernel (decode, verify, the
snapshot baseline): what serves where no tuned config does (replayssm_cute.runtime.tuning). The
host (replayssm_cute.layers) imports them; no kernel module does, so these choices never change
generated code and the compile cache's source hash leaves this file out (a change here keeps
every compiled kernel; the chosen config is part of each kernel's key).
"""

from ..config_space import VERIFY_ROWS_PER_WARP, verify_tile_rows
from .config import GDNConfig


def default_gdn_config(head_v_dim: int, batch: int, window: int, shape=None, whole_head: bool = False):
    """What the autotuner finds on the H200 (tuned/h200.json, every batch bucket of two GDN
    shapes), for shapes it has not tuned. ReplaySSM: 64-row tiles over 4 warps at batch <= 16
    (1.5-1.7x over the 16-row tiles of the old default), the whole head over 8 warps above (one
    ring walk per head). Conventional: 8-row tiles over 2 warps (1-2% over larger tiles). With
    `shape`, the first choice that fits it (shared memory for large K). ``whole_head``: a CTA per
    head (the writer of an nvfp4 copy needs the whole state's amax), 16 rows per warp. A read
    copy from batch 4 takes the whole head too, registers capped for 2 CTAs per SM where it fits
    (the tuner's pick on Qwen3.5-122B: nvfp4 1.29-1.36x over uncapped heads at every batch from
    4; fp16 and fp8 from batch 4 and 16, 1.05-1.23x over 64-row tiles at batch 4-16, 1.03-1.07x
    over uncapped heads above)."""
    if shape is not None and shape.read_copy is not None and batch >= 4 and head_v_dim % 16 == 0:
        for ctas in (2, 0):
            cfg = GDNConfig(rows_per_cta=head_v_dim, num_warps=head_v_dim // 16, min_ctas_per_sm=ctas)
            if cfg.check(shape) is None:
                return cfg
    if whole_head:
        return GDNConfig(rows_per_cta=head_v_dim, num_warps=max(1, head_v_dim // 16))
    if window == 1:
        choices = [(8, 2, 0), (16, 2, 0)]
    elif batch <= 16:
        choices = [(64, 4, 0), (32, 2, 0), (16, 2, 0)]
    else:
        choices = [(128, 8, 0), (64, 4, 6), (32, 2, 0), (16, 2, 0)]
    for rows, warps, ctas in choices:
        if head_v_dim % rows == 0:
            cfg = GDNConfig(rows_per_cta=rows, num_warps=warps, min_ctas_per_sm=ctas)
            if shape is None or cfg.check(shape) is None:
                return cfg
    return GDNConfig(rows_per_cta=16, num_warps=1)


def default_gdn_verify_config(head_v_dim: int, batch: int, whole_head: bool = False):
    """16 rows per warp (the MMA's M), the whole head in one CTA where it fits in 8 warps, at
    every batch: one dot GEMM and one staging per head (tuned on the H200, Qwen3.5-122B, T = 4 and
    8: 1.46-1.73x over one-warp CTAs at batch 4-16, 1.04x over 64-row tiles at batch 32-512); an
    nvfp4 copy's writer always takes the whole head."""
    if whole_head:
        return GDNConfig(rows_per_cta=head_v_dim, num_warps=head_v_dim // 16)
    rows = verify_tile_rows(head_v_dim)
    return GDNConfig(rows_per_cta=rows, num_warps=rows // VERIFY_ROWS_PER_WARP)


def default_gdn_snapshot_config(head_v_dim: int, batch: int):
    """At most 8 rows per warp (a warp keeps its rows in registers across the drafts): 16-row
    tiles at batch <= 16, where more CTAs per row hide latency, else 32-row tiles where they
    divide head_v_dim."""
    return GDNConfig(16, 4) if batch <= 16 or head_v_dim % 32 else GDNConfig(32, 4)
