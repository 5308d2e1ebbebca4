"""The persistent, warp-specialised decode kernels (kernels/mamba2/pipelined.py,
kernels/gdn/pipelined.py): their config checks, and compile-only builds for sm_90a, sm_100a and
sm_103a with PTX checks (no GPU)."""

import dataclasses
import re
import subprocess
import sys

import pytest

from replayssm_cute.kernels.common import SMEM_PER_SM
from replayssm_cute.kernels.gdn import pipelined as gdn_pipe
from replayssm_cute.kernels.gdn.config import GDNShape
from replayssm_cute.kernels.mamba2.config import Mamba2Shape
from replayssm_cute.kernels.mamba2.pipelined import Mamba2PipeConfig, pipelined_config, pipelined_space
from replayssm_cute.layers.common import PIPELINED_ENV
from replayssm_cute.precompile import config_label

from tests.kernels.test_kernels_compile import _ANSI, _env, _parse, ROOT

ARCHS = ("sm_90a", "sm_100a", "sm_103a")
SUPER = Mamba2Shape(128, 64, 128, 8, 16, 16)
QWEN = GDNShape(64, 128, 128, 16, 16, 16)
MODELS = ("nemotron-super", "qwen3.5-122b")


def test_config_takes_fp32_checkpoints_only():
    assert Mamba2PipeConfig(4, 132).check(SUPER) is None
    for fields, words in [(dict(checkpoint_format="fp16", read_copy="fp8"), "fp32 checkpoint"),
                          (dict(checkpoint_format="fp16"), "fp32"),
                          (dict(window=30, capacity=34), "capacity 34"), (dict(dstate=48), "dstate 48"),
                          (dict(headdim=20), "headdim 20")]:
        shape = Mamba2Shape(**{**SUPER.__dict__, **fields})
        assert words in Mamba2PipeConfig(4, 132).check(shape)
    assert "stages 17" in Mamba2PipeConfig(17, 132).check(SUPER)
    assert "ctas 0" in Mamba2PipeConfig(4, 0).check(SUPER)
    assert "shared memory" in Mamba2PipeConfig(8, 132).check(SUPER)
    odd = Mamba2Shape(**{**SUPER.__dict__, "headdim": 24})
    assert "16-row tiles" in Mamba2PipeConfig(4, 132).check(odd)
    assert "flush_tile is for read copies" in Mamba2PipeConfig(2, 132, flush_tile=True).check(SUPER)
    assert Mamba2PipeConfig(4, 132, mma_fold=False).check(odd) is None


@pytest.mark.parametrize("read", ["fp16", "fp8", "nvfp4"])
def test_read_copies_fold_in_registers_with_smaller_stages(read):
    """Next to a read copy a stage holds the copy's tile (a flush reads the checkpoint from global
    memory and folds on CUDA cores), so more stages fit than on the fp32 tile; with flush_tile the stages have room for a
    flush's fp32 checkpoint tile, which a non-flushing item's copy shares."""
    shape = Mamba2Shape(**{**SUPER.__dict__, "read_copy": read})
    assert "mma_fold must be False" in Mamba2PipeConfig(4, 132).check(shape)
    assert Mamba2PipeConfig(4, 132, mma_fold=False).check(shape) is None
    with_tile = Mamba2PipeConfig(2, 132, flush_tile=True)
    assert with_tile.check(shape) is None and with_tile.stage_tile_bytes(shape) - 64 * 128 * 4 in (0, 16, 64 * 4 + 16, 64 * 8 + 16)
    assert "6 stages need" in Mamba2PipeConfig(6, 132, flush_tile=True).check(shape)
    config = pipelined_config(shape, 132, "sm_90a")  # two CTAs an SM, each two groups of 32-row warps
    assert config.check(shape) is None and not config.mma_fold and config.ctas == 264
    assert (config.min_ctas_per_sm, config.consumer_groups, config.rows_per_warp) == (2, 2, 32)
    assert config.consumer_warps(shape) == 2 and config.warps(shape) == 5
    assert config.stages > pipelined_config(SUPER, 132, "sm_90a").stages
    assert "do not fit" in dataclasses.replace(config, stages=config.stages + 2).check(shape)
    tile = {"fp16": 64 * 256, "fp8": 64 * 128 + 64 * 4, "nvfp4": 64 * 64 + 64 * 8}[read]
    assert Mamba2PipeConfig().tile_bytes(shape) - tile in (0, 16)  # + the scales' alignment slack
    assert Mamba2PipeConfig().tile_bytes(SUPER) == 64 * 128 * 4
    bad = [(dict(window=1, capacity=1), "needs a ring")]
    if read == "nvfp4":
        bad.append((dict(dstate=96), "nvfp4 needs K a multiple of 32 with 2, 4 or 8"))
    for fields, words in bad:
        assert words in Mamba2PipeConfig(4, 132, mma_fold=False).check(Mamba2Shape(**{**shape.__dict__, **fields}))


def test_items_of_several_heads_of_a_group():
    """``heads_per_item`` consecutive heads of one group per item: a divisor of the heads per group
    whose tiles make one TMA box (at most 256 rows). A stage holds every head's tile, ring x and dt,
    x, z and scalars, and the group's B, C and ring B once; the tuner tries 1, 2 and 4 next to a
    read copy only (an fp32 tile already fills a stage)."""
    fp8 = Mamba2Shape(**{**SUPER.__dict__, "read_copy": "fp8"})
    one = Mamba2PipeConfig(2, 264, mma_fold=False, min_ctas_per_sm=2, rows_per_warp=32, consumer_groups=2)
    four = dataclasses.replace(one, heads_per_item=4)
    assert one.check(fp8) is None and four.check(fp8) is None
    per_head_tile = 64 * 128 + 64 * 4  # E4M3 rows and their block scales
    per_head_rest = 16 * 64 * 2 + 2 * 64 * 2 + 32 * 4 + 8 * 4  # ring x, x and z (bf16), ring dt, scalars
    assert four.tile_bytes(fp8) - 4 * per_head_tile in (0, 16)
    assert four.stage_bytes(fp8) - one.stage_bytes(fp8) - 3 * (per_head_tile + per_head_rest) in (-16, 0, 16)
    assert "heads_per_item 3: expected a divisor of the heads per group (16)" in \
        dataclasses.replace(one, heads_per_item=3).check(fp8)
    assert "one TMA box holds (256 rows)" in dataclasses.replace(one, heads_per_item=8).check(fp8)
    assert "heads_per_item 0" in dataclasses.replace(one, heads_per_item=0).check(fp8)
    assert four.key() != one.key()
    assert config_label(four).endswith("_groups2_rpw32_heads4_ctas2") and "_heads" not in config_label(one)
    assert config_label(dataclasses.replace(one, flush_tile=True)).endswith("_flushtile_ctas2")
    space = pipelined_space(fp8, 132, "sm_90a")
    assert {c.heads_per_item for c in space} == {1, 2, 4}
    assert all(c.check(fp8) is None for c in space)
    assert {c.heads_per_item for c in pipelined_space(SUPER, 132, "sm_90a")} == {1}
    assert pipelined_config(fp8, 132, "sm_90a").heads_per_item == 1  # a default only once measured


def test_read_copy_default_caps_registers_for_two_ctas_only_up_to_64_row_heads():
    """Past 64-row heads (Nemotron-Nano, P = 80) the two-CTA register cap spills: one CTA per SM."""
    nano = Mamba2Shape(96, 80, 128, 8, 16, 16, read_copy="fp16")
    config = pipelined_config(nano, 132, "sm_90a")
    assert config.check(nano) is None and (config.ctas, config.min_ctas_per_sm) == (132, 0)
    assert (config.consumer_groups, config.rows_per_warp) == (2, 32)


_SPILL_CHECK = """
import sys
from replayssm_cute import tune
from replayssm_cute.models import get_model
t = tune.TuneTarget(get_model("nemotron-nano-4b"), "standard", 16, 0, "bf16", "fp16")
with tune.ptxas_reports():
    dropped, spills, unreported = tune.compile_candidates([(t, t.default_config(256))], 1, "sm_90a")
print(dropped, spills, unreported)
sys.exit(1 if dropped or spills or unreported else 0)
"""


def test_nano_read_copy_default_compiles_without_spills(tmp_path):
    """The tuner's compile of Nemotron-Nano's fp16 read-copy default (sm_90a), with ptxas's
    report: no spills (the two-CTA register cap spilled at this 80-row head, so the default
    takes one CTA per SM)."""
    env = _env(tmp_path / "cache")
    env["CUTE_DSL_ARCH"] = "sm_90a"
    proc = subprocess.run([sys.executable, "-c", _SPILL_CHECK], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_default_runs_two_ctas_per_sm_where_two_stages_fit_half_an_sm():
    config = pipelined_config(SUPER, 132, "sm_90a")  # 43 KB stages: two CTAs of two stages on each SM
    assert config.check(SUPER) is None and (config.ctas, config.stages) == (264, 2)
    assert 2 * (Mamba2PipeConfig(3, 264).smem_bytes(SUPER) + 1024) > SMEM_PER_SM
    wide = Mamba2Shape(**{**SUPER.__dict__, "headdim": 128})  # 75 KB stages: one CTA, the most stages
    config = pipelined_config(wide, 132, "sm_90a")
    assert config.check(wide) is None and config.ctas == 132
    assert Mamba2PipeConfig(config.stages + 1, 132).check(wide) is not None
    assert config.mma_fold and not pipelined_config(Mamba2Shape(**{**SUPER.__dict__, "headdim": 24}), 132, "sm_90a").mma_fold
    conventional = Mamba2Shape(**{**SUPER.__dict__, "window": 1, "capacity": 1})
    assert not pipelined_config(conventional, 132, "sm_90a").mma_fold


def test_consumer_warps_keep_at_most_rows_per_warp():
    for headdim, warps, wide in [(64, 4, 2), (80, 5, 4), (48, 3, 2), (16, 1, 1), (128, 8, 4)]:
        shape = Mamba2Shape(**{**SUPER.__dict__, "headdim": headdim})
        assert Mamba2PipeConfig().consumer_warps(shape) == warps
        assert Mamba2PipeConfig(rows_per_warp=32).consumer_warps(shape) == wide
        assert Mamba2PipeConfig(rows_per_warp=32, consumer_groups=3).warps(shape) == 1 + 3 * wide


def test_consumer_groups_and_register_cap_checks():
    base = Mamba2PipeConfig(4, 264, mma_fold=False)
    assert dataclasses.replace(base, consumer_groups=2, rows_per_warp=32).check(SUPER) is None
    assert dataclasses.replace(base, stages=2, min_ctas_per_sm=2).check(SUPER) is None
    for fields, words in [(dict(rows_per_warp=8), "rows_per_warp 8"), (dict(consumer_groups=0), "consumer_groups 0"),
                          (dict(consumer_groups=3), "must divide the stages"),
                          (dict(consumer_groups=5), "must divide the stages"),
                          (dict(consumer_groups=8, stages=8), "33 warps"), (dict(min_ctas_per_sm=5), "min_ctas_per_sm 5"),
                          (dict(min_ctas_per_sm=4), "do not fit")]:
        assert words in dataclasses.replace(base, **fields).check(SUPER), fields
    assert Mamba2PipeConfig(4, 132, rows_per_warp=32).check(SUPER) is None  # the MMA fold: two 16-row tiles a warp


def test_gdn_config_takes_fp32_checkpoints_with_or_without_read_copies():
    assert gdn_pipe.GDNPipeConfig(4, 132, 64).check(QWEN) is None
    for read in ("fp16", "fp8", "nvfp4"):  # the cache's defaults next to a read copy: v, beta kept, re-derived
        shape = GDNShape(**{**QWEN.__dict__, "read_copy": read, "keep_v_beta": True, "rederive": True})
        assert gdn_pipe.GDNPipeConfig(4, 132, 128).check(shape) is None
        half = gdn_pipe.GDNPipeConfig(4, 132, 64).check(shape)
        assert (half is None) == (read != "nvfp4"), half  # an nvfp4 copy is written a whole head at a time
    for fields, words in [(dict(checkpoint_format="fp16"), "fp32 checkpoint"),
                          (dict(checkpoint_format="fp16", read_copy="fp8"), "fp32 checkpoint"),
                          (dict(rederive=True), "keep_v_beta"),
                          (dict(rederive=True, keep_v_beta=True, head_k_dim=48), "K = 32 x 2, not 48"),
                          (dict(read_copy="fp8", window=1, capacity=1), "needs a ring"),
                          (dict(window=30, capacity=34), "capacity 34"), (dict(head_k_dim=40), "head_k_dim 40")]:
        shape = GDNShape(**{**QWEN.__dict__, **fields})
        assert words in gdn_pipe.GDNPipeConfig(4, 132, 64).check(shape), fields
    fp16 = GDNShape(**{**QWEN.__dict__, "read_copy": "fp16", "keep_v_beta": True, "rederive": True})
    # a stage holds the copy's rows, half the fp32 rows' bytes, plus v, beta and for the tensor-core
    # flush only the ring keys' row padding; outside the stages the records' coupling (a group's)
    # and, for rows dotted on tensor cores, two buffers of k and q as every lane's B fragments (8
    # k-steps of 16, four words a lane each)
    config = gdn_pipe.GDNPipeConfig(4, 132, 128)
    padding = 16 * gdn_pipe.RING_KEY_PAD * fp16.act_dtype.width // 8
    assert config.ring_key_pad(QWEN) == 0 and config.ring_key_pad(fp16) == gdn_pipe.RING_KEY_PAD
    assert dataclasses.replace(config, mma_flush=False).ring_key_pad(fp16) == 0
    assert config.tensor_core_reads(fp16) and not config.tensor_core_reads(QWEN)
    assert config.stage_bytes(fp16) - config.stage_bytes(QWEN) == -128 * 128 * 2 + 16 * 128 * 2 + 32 * 4 + padding
    cuda_dots = dataclasses.replace(config, mma_dots=False)
    assert not cuda_dots.tensor_core_reads(fp16) and config.stage_bytes(fp16) == cuda_dots.stage_bytes(fp16)
    assert config.smem_bytes(fp16) - cuda_dots.smem_bytes(fp16) == 2 * 8 * 32 * 4 * 4 + 16
    one_head = gdn_pipe.pipelined_config(GDNShape(**{**fp16.__dict__, "num_v_heads": 48}), 132, "sm_90a")  # 3 a key head
    assert one_head.heads_per_item == 1 and one_head.stages > gdn_pipe.pipelined_config(QWEN, 132, "sm_90a").stages
    assert "rows_per_item 48" in gdn_pipe.GDNPipeConfig(4, 132, 48).check(QWEN)
    assert "rows_per_warp 4" in gdn_pipe.GDNPipeConfig(4, 132, 64, 4).check(QWEN)
    assert "rows_per_item 24" in gdn_pipe.GDNPipeConfig(4, 132, 24, 16).check(QWEN)
    assert gdn_pipe.GDNPipeConfig(3, 132, 128, 8).consumer_warps() == 16
    assert "consumer warps" in gdn_pipe.GDNPipeConfig(3, 132, 256, 8).check(GDNShape(**{**QWEN.__dict__, "head_v_dim": 256}))
    assert "shared memory" in gdn_pipe.GDNPipeConfig(8, 132, 128).check(QWEN)
    config = gdn_pipe.pipelined_config(QWEN, 132, "sm_90a")  # whole heads, 8 consumer warps, the most stages that fit
    assert (config.rows_per_item, config.consumer_warps(), config.stages) == (128, 8, 3)
    assert gdn_pipe.GDNPipeConfig(config.stages + 1, 132, 128).check(QWEN) is not None
    wide = gdn_pipe.pipelined_config(GDNShape(**{**QWEN.__dict__, "head_v_dim": 256, "head_k_dim": 64}), 132, "sm_90a")
    assert wide.rows_per_item == 128  # half heads where a whole one needs more than 8 warps
    assert "prefetch 3" in gdn_pipe.GDNPipeConfig(3, 132, 128, prefetch=3).check(QWEN)


def test_gdn_consumer_groups_and_register_cap_checks():
    """Consumer groups: each its own stages (the groups divide them), at most 32 warps a CTA; a
    register cap that the shared memory lets fit; a re-deriving cache's scratch per group."""
    base = gdn_pipe.GDNPipeConfig(4, 132, 64, 16)
    grouped = dataclasses.replace(base, consumer_groups=2)
    assert grouped.check(QWEN) is None and grouped.warps() == 1 + 2 * 4 and base.warps() == 5
    assert grouped.key() != base.key() and dataclasses.replace(base, min_ctas_per_sm=2).key() != base.key()
    for fields, words in [(dict(consumer_groups=0), "consumer_groups 0"), (dict(consumer_groups=3), "must divide the stages"),
                          (dict(consumer_groups=4, rows_per_item=128, rows_per_warp=8), "65 warps"),
                          (dict(min_ctas_per_sm=5), "min_ctas_per_sm 5"), (dict(stages=3, min_ctas_per_sm=2), "do not fit")]:
        assert words in dataclasses.replace(base, **fields).check(QWEN), fields
    fp16 = GDNShape(**{**QWEN.__dict__, "read_copy": "fp16", "keep_v_beta": True, "rederive": True})
    # each group's warps keep their own S_ckpt k_p and re-derived u (cap x rows fp32 each), every
    # consumer warp its head's weighted ring dots (2 x cap fp32), each group the records' coupling
    # (cap x cap fp32) and two buffers of B fragments (8 of 32 lanes x 16 bytes)
    assert grouped.smem_bytes(fp16) - base.smem_bytes(fp16) == 2 * 16 * 64 * 4 + 4 * 2 * 16 * 4 + 16 * 16 * 4 + 2 * 8 * 512
    assert grouped.smem_bytes(QWEN) - base.smem_bytes(QWEN) == 4 * 2 * 16 * 4
    for shape in (QWEN, fp16):
        space = gdn_pipe.pipelined_space(shape, 132, "sm_90a")
        grouped_space = [c for c in space if c.consumer_groups == 2]
        assert grouped_space and all(c.stages % 2 == 0 and c.warps() * (c.ctas // 132) <= 9 for c in grouped_space)
        assert len({c.key() for c in space}) == len(space)
        # a read copy's row dots are timed on both units where 16-row warps take the MMA, else not at all
        cuda_dots = [c for c in space if not c.mma_dots]
        assert all(c.rows_per_warp == 16 for c in cuda_dots) and bool(cuda_dots) == (shape is fp16)
        assert len({config_label(c) for c in space}) == len(space)  # the precompile labels tell them apart
    assert dataclasses.replace(base, mma_dots=False).key() != base.key()


def test_gdn_tensor_core_flush_where_its_layout_fits():
    """A flush next to a read copy runs on tensor cores for 16-row warps with K a multiple of 32 up
    to 128 (a lane's quarter of two rows); elsewhere, or with mma_flush=False, on CUDA cores. Its
    fold coefficients need the per-warp scratch a re-deriving cache has anyway, and its operand loads
    padded ring keys (the CUDA-core flush and the fp32 cache keep them unpadded); the fp8 default
    takes 2 stages (measured), the others as many as fit."""
    shapes = {read: GDNShape(**{**QWEN.__dict__, "read_copy": read, "keep_v_beta": True, "rederive": True})
              for read in ("fp16", "fp8", "nvfp4")}
    fp16 = shapes["fp16"]
    config = gdn_pipe.GDNPipeConfig(4, 132, 128)
    assert config.mma_flush and config.tensor_core_flush(fp16) and not config.tensor_core_flush(QWEN)
    assert not dataclasses.replace(config, rows_per_warp=8).tensor_core_flush(fp16)
    assert not dataclasses.replace(config, mma_flush=False).tensor_core_flush(fp16)
    for K, fits in [(32, True), (64, True), (96, True), (128, True), (48, False), (256, False)]:
        shape = GDNShape(**{**fp16.__dict__, "head_k_dim": K})
        assert config.tensor_core_flush(shape) == fits, K
    assert dataclasses.replace(config, mma_flush=False).key() != config.key()
    folded = GDNShape(**{**fp16.__dict__, "rederive": False})  # no re-derivation: the scratch for the fold only
    per_scratch = 128 * 16 * 4 + 16
    padding = config.stages * 16 * gdn_pipe.RING_KEY_PAD * fp16.act_dtype.width // 8  # its ring keys' rows, per stage
    cuda_flush = dataclasses.replace(config, mma_flush=False)
    assert config.smem_bytes(folded) - cuda_flush.smem_bytes(folded) == per_scratch + padding
    assert config.smem_bytes(fp16) - cuda_flush.smem_bytes(fp16) == padding
    one_head = {read: GDNShape(**{**shape.__dict__, "num_v_heads": 48}) for read, shape in shapes.items()}
    assert gdn_pipe.pipelined_config(one_head["fp8"], 132, "sm_90a").stages == 2
    assert gdn_pipe.pipelined_config(one_head["fp16"], 132, "sm_90a").stages > 2


def test_gdn_items_of_several_value_heads_of_a_key_head():
    """``heads_per_item`` consecutive value heads of one key head per item: whole heads, a divisor
    of the value heads per key head (4 on Qwen3.5-122B), one TMA box (at most 256 rows), a producer
    chunk of at most 4 heads (it holds their v twice). A stage holds each head's rows, u, v, gates,
    beta and coupling, the key head's keys, k, q and ring dots once; the tuner tries them next to a
    read copy only (two fp32 heads fill a stage); a read copy's default takes two heads in two
    stages where the shape lets it (measured), one head where the key head's value heads are odd."""
    fp8 = GDNShape(**{**QWEN.__dict__, "read_copy": "fp8", "keep_v_beta": True, "rederive": True})
    one = gdn_pipe.GDNPipeConfig(2, 132, 128, prefetch=2)
    two = dataclasses.replace(one, heads_per_item=2)
    assert one.check(fp8) is None and two.check(fp8) is None and two.key() != one.key()
    entry, R, cap = fp8.copies.entry, 128, 16
    per_head = (R * entry.row_bytes + entry.scale_smem_bytes(R)  # the copy's rows and block scales
                + cap * R * 2 + cap * R * 2 + 32 * 4  # ring u, v, beta
                + R * 4 + 32 * 4 + gdn_pipe.META * 4)  # this token's v, ring g, the head's scalars
    assert two.stage_bytes(fp8) - one.stage_bytes(fp8) - per_head in (-16, 0, 16)  # the scales' alignment
    # and outside the stages each head's coupling of the records
    assert two.smem_bytes(fp8) - one.smem_bytes(fp8) == 2 * (two.stage_bytes(fp8) - one.stage_bytes(fp8)) + cap * cap * 4
    for fields, words in [(dict(heads_per_item=3), "expected a divisor of the value heads per key head (4)"),
                          (dict(heads_per_item=0), "heads_per_item 0"),
                          (dict(heads_per_item=4), "one TMA box holds (256 rows)"),
                          (dict(heads_per_item=2, rows_per_item=64), "whole heads (rows_per_item 128, not 64)"),
                          (dict(heads_per_item=2, prefetch=4), "at most 4 heads' inputs a chunk")]:
        assert words in dataclasses.replace(one, **fields).check(fp8), fields
    assert config_label(two).endswith("_prefetch2_heads2") and "_heads" not in config_label(one)
    for arch, prefetch in [("sm_90a", 2), ("sm_100a", 1)]:
        space = gdn_pipe.pipelined_space(fp8, 132, arch)
        assert {c.heads_per_item for c in space} == {1, 2}
        assert all(c.check(fp8) is None for c in space)
        assert {c.prefetch for c in space if c.heads_per_item == 2} == {prefetch}
        assert len({config_label(c) for c in space}) == len(space)
    assert {c.heads_per_item for c in gdn_pipe.pipelined_space(QWEN, 132, "sm_90a")} == {1}
    for arch, prefetch in [("sm_90a", 2), ("sm_100a", 1)]:
        default = gdn_pipe.pipelined_config(fp8, 132, arch)
        assert (default.heads_per_item, default.stages, default.prefetch) == (2, 2, prefetch)
        assert default in gdn_pipe.pipelined_space(fp8, 132, arch)
    for read, mma_dots in [("fp16", False), ("fp8", False), ("nvfp4", True)]:
        default = gdn_pipe.pipelined_config(GDNShape(**{**fp8.__dict__, "read_copy": read}), 132, "sm_90a")
        assert (default.heads_per_item, default.mma_dots) == (2, mma_dots), read
    odd = GDNShape(**{**fp8.__dict__, "num_v_heads": 48})  # 3 value heads a key head
    assert gdn_pipe.pipelined_config(odd, 132, "sm_90a").heads_per_item == 1
    assert gdn_pipe.pipelined_config(QWEN, 132, "sm_90a").heads_per_item == 1  # two fp32 heads do not fit a stage


def test_gdn_row_dots_with_fewer_lanes_a_row():
    """``row_lanes`` 8 or 16: lanes sharing a state row in the CUDA-core row dots of the fp32
    checkpoint or an fp16 / fp8 copy (an fp8 row's one scale after its dots), each lane pieces of
    16 bytes or its whole share of the row; refused where the rows are on tensor cores, for nvfp4
    (a scale per 16-element block) and where K is no whole number of pieces a lane. Not a
    default, nor in the tuner's space, until measured."""
    copies = {read: GDNShape(**{**QWEN.__dict__, "read_copy": read, "keep_v_beta": read is not None,
                                "rederive": read is not None}) for read in (None, "fp16", "fp8", "nvfp4")}
    base = gdn_pipe.GDNPipeConfig(2, 132, 128, mma_dots=False)
    for read, shape in copies.items():
        assert gdn_pipe.pipelined_config(shape, 132, "sm_90a").row_lanes == 32
        assert {c.row_lanes for c in gdn_pipe.pipelined_space(shape, 132, "sm_90a")} == {32}
    for read, lanes, piece in [(None, 8, 4), (None, 16, 4), ("fp16", 8, 8), ("fp16", 16, 8), ("fp8", 8, 16),
                               ("fp8", 16, 8)]:
        config = dataclasses.replace(base, row_lanes=lanes)
        assert config.check(copies[read]) is None, (read, lanes)
        assert gdn_pipe.row_piece(copies[read], lanes) == piece
        assert config_label(config).endswith(f"_lanes{lanes}") and config.key() != base.key()
    assert "_lanes" not in config_label(base)
    narrow = GDNShape(3, 32, 48, 1, 16, 16)  # K = 48: pieces of 4 fp32 leave 16 elements for 8 lanes
    for shape, fields, words in [(copies["fp8"], dict(row_lanes=4), "expected one of (8, 16, 32)"),
                                 (copies["nvfp4"], dict(row_lanes=8), "take 32 lanes (scales per block)"),
                                 (copies["fp8"], dict(row_lanes=8, mma_dots=True), "on tensor cores (mma_dots)"),
                                 (narrow, dict(row_lanes=8, rows_per_item=32), "not a whole number of pieces")]:
        assert words in dataclasses.replace(base, **fields).check(shape), fields
    assert dataclasses.replace(base, row_lanes=16, rows_per_item=32).check(narrow) is None  # pieces of 3


@pytest.mark.parametrize("arch, prefetch", [("sm_90a", 4), ("sm_100a", 2), ("sm_103a", 2)])
def test_producer_chunk_per_target(arch, prefetch):
    """The producer's chunk is the target's: 4 items on sm_90a, 2 where 4 spills registers."""
    assert pipelined_config(SUPER, 132, arch).prefetch == prefetch
    assert gdn_pipe.pipelined_config(QWEN, 132, arch).prefetch == prefetch


@pytest.mark.parametrize("arch, forced, window, batch, pipelined", [
    ("sm_90a", None, 16, 8, True), ("sm_90a", None, 16, 16, True), ("sm_90a", None, 16, 32, True),
    ("sm_90a", None, 16, 256, True), ("sm_90a", None, 16, 4, False), ("sm_90a", None, 1, 256, False),
    ("sm_100a", None, 16, 256, False), ("sm_103a", "1", 1, 1, True), ("sm_90a", "0", 16, 256, False),
])
def test_gdn_default_is_the_pipeline_where_it_was_measured(monkeypatch, arch, forced, window, batch, pipelined):
    """GDN ReplaySSM decode defaults to the pipelined kernel on sm_90a (measured on the H200) from
    batch 8 on the plain fp32 cache and from batch 32 next to a read copy; the conventional step,
    smaller batches and sm_100a / sm_103a keep the tile kernels unless REPLAYSSM_CUTE_PIPELINED=1;
    =0 turns it off."""
    from replayssm_cute.layers.gdn import _decode_default

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    if forced is None:
        monkeypatch.delenv(PIPELINED_ENV, raising=False)
    else:
        monkeypatch.setenv(PIPELINED_ENV, forced)
    shape = GDNShape(**{**QWEN.__dict__, "window": window, "capacity": window})
    config = _decode_default(shape, batch)
    assert isinstance(config, gdn_pipe.GDNPipeConfig) == pipelined, config
    # a read copy (v and beta kept, re-derived): from batch 32 by default
    copy = GDNShape(**{**shape.__dict__, "read_copy": "fp8", "keep_v_beta": True, "rederive": window > 1})
    copy_pipelined = forced == "1" or (forced is None and arch == "sm_90a" and batch >= 32)
    if window > 1:
        assert isinstance(_decode_default(copy, batch), gdn_pipe.GDNPipeConfig) == copy_pipelined, forced


@pytest.mark.parametrize("arch, forced, read, pipelined", [
    ("sm_90a", None, None, True), ("sm_100a", None, None, False), ("sm_103a", None, None, False),
    ("sm_100a", "1", None, True), ("sm_90a", "0", None, False), ("sm_90a", None, "fp16", True),
    ("sm_90a", None, "fp8", False), ("sm_90a", None, "nvfp4", False), ("sm_90a", "1", "nvfp4", True),
])
def test_mamba2_default_is_the_pipeline_where_it_was_measured(monkeypatch, arch, forced, read, pipelined):
    """Mamba-2 standard decode defaults to the pipelined kernel on sm_90a (measured on the H200),
    on the fp32 checkpoint and next to an fp16 read copy (fp8 / nvfp4 copies keep the tile kernels,
    measured faster there); sm_100a / sm_103a keep the tile kernels unless
    REPLAYSSM_CUTE_PIPELINED=1; =0 turns it off."""
    from replayssm_cute.layers.mamba2 import _decode_default

    monkeypatch.setenv("CUTE_DSL_ARCH", arch)
    if forced is None:
        monkeypatch.delenv(PIPELINED_ENV, raising=False)
    else:
        monkeypatch.setenv(PIPELINED_ENV, forced)
    config = _decode_default(Mamba2Shape(**{**SUPER.__dict__, "read_copy": read}), 64)
    assert isinstance(config, Mamba2PipeConfig) == pipelined, config
    if pipelined:
        assert config.ctas == 2 * (132 if arch == "sm_90a" else 148)


@pytest.fixture(scope="module", params=[(m, a) for m in MODELS for a in ARCHS], ids=lambda p: f"{p[0]}-{p[1]}")
def build(request, tmp_path_factory):
    model, arch = request.param
    tmp = tmp_path_factory.mktemp(f"pipe-{model}-{arch}")
    env = _env(tmp / "cache")
    env.update(REPLAYSSM_CUTE_PIPELINED="1", REPLAYSSM_CUTE_TUNED="0")
    cmd = [sys.executable, "-m", "replayssm_cute.precompile", "--model", model, "--arch", arch,
           "--workers", "1", "--dump-ptx", str(tmp / "ptx")]
    cmd += ["--read-copies", "fp16,fp8,nvfp4"]  # both pipelines also take read copies
    proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    log = _ANSI.sub("", proc.stdout)
    return arch, proc, log, _parse(log)[1]


def test_pipelined_kernels_build_for_every_arch(build):
    arch, proc, log, kernels = build
    assert proc.returncode == 0, log[-4000:]
    pipe = [k for k in kernels if "_pipe" in k[0]]
    reads = [f"_read_{f}_" for f in ("fp16", "fp8", "nvfp4")]
    assert sorted(k[0].split("_")[1] for k in pipe if "_read_" not in k[0]) == ["conventional", "replay"], log[-4000:]
    assert sorted(f for f in reads if any(f in k[0] for k in pipe)) == sorted(reads), log[-4000:]
    for label, _, ptx, spills in pipe:
        text = open(ptx).read()
        assert f".target {arch}" in text
        assert "cp.async.bulk.tensor" in text, f"{label}: the checkpoint tile is not loaded by TMA"
        assert "cp.async.mbarrier.arrive.noinc" in text, f"{label}: the producer's copies are not counted"
        if label.startswith("mamba2"):
            # fp32 ReplaySSM flushes fold on tensor cores (TF32), the others do not; fp8 / nvfp4
            # rows meet C on tensor cores (fp16), fp16 ones on CUDA cores
            fold = "mma.sync.aligned.m16n8k8" in text
            assert fold == ("_replay_" in label and "_read_" not in label), f"{label}: the fold's unit"
            dots = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text
            assert dots == ("_read_fp8_" in label or "_read_nvfp4_" in label), f"{label}: the read copy's dots"
        else:  # GDN: a read copy's rows meet k and q on tensor cores unless the config says CUDA cores
            dots = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text
            assert dots == ("_read_" in label and "_cudadots" not in label), f"{label}: the read copy's dots"
            if "_read_" in label:  # the defaults: fp16 / fp8 rows on CUDA cores, nvfp4 on tensor cores
                assert ("_cudadots" in label) == ("_read_nvfp4_" not in label), label
                # and every read copy's flush (16-row warps) on tensor cores: S_ckpt k_p and the fold in TF32
                assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in text, f"{label}: the flush's unit"
        if "_read_" in label:  # a flush next to a read copy has its checkpoint prefetched into L2
            assert "cp.async.bulk.prefetch.L2" in text, label
        assert ".local" not in text, f"{label}: local memory"
        opt_in = ("_read_fp8_" in label or "_read_nvfp4_" in label) if label.startswith("mamba2") else "_read_" in label
        if opt_in:
            # their flush paths spill: Mamba-2 fp8 / nvfp4 (opt-in) under the 2-CTA register cap, GDN's
            # re-deriving flush a few bytes (at most 8 on sm_90a, the whole-head kernel held to 168 registers)
            continue
        assert all(r[1] == 0 and r[2] == 0 for r in spills), f"{label}: spills {spills}"


_SEVERAL_HEADS_BUILD = """
import sys
from replayssm_cute import precompile
from replayssm_cute.kernels.mamba2.config import Mamba2Shape
from replayssm_cute.kernels.gdn.config import GDNShape
from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig
from replayssm_cute.kernels.mamba2.pipelined import Mamba2PipeConfig
super_ = dict(nheads=128, headdim=64, dstate=128, ngroups=8, window=16, capacity=16)
for name, read, config in [
        ("fp32", None, Mamba2PipeConfig(2, 132, heads_per_item=2)),
        ("nvfp4", "nvfp4", Mamba2PipeConfig(4, 132, mma_fold=False, rows_per_warp=32, consumer_groups=2,
                                              heads_per_item=2)),
        ("fp8", "fp8", Mamba2PipeConfig(2, 132, mma_fold=True, flush_tile=True, heads_per_item=2))]:
    precompile.dump_ptx("mamba2", Mamba2Shape(**super_, read_copy=read), config, sys.argv[1] + "/" + name + ".ptx")
qwen = dict(num_v_heads=64, head_v_dim=128, head_k_dim=128, num_k_heads=16, window=16, capacity=16,
            keep_v_beta=True, rederive=True)
for name, read, config in [
        ("gdn_fp8", "fp8", GDNPipeConfig(2, 132, 128, prefetch=2, mma_dots=False, heads_per_item=2)),
        ("gdn_fp8_lanes8", "fp8", GDNPipeConfig(2, 132, 128, prefetch=2, mma_dots=False, heads_per_item=2, row_lanes=8)),
        ("gdn_nvfp4", "nvfp4", GDNPipeConfig(2, 132, 128, prefetch=2, heads_per_item=2))]:
    precompile.dump_ptx("gdn", GDNShape(**qwen, read_copy=read), config, sys.argv[1] + "/" + name + ".ptx")
"""


@pytest.mark.parametrize("arch", ARCHS)
def test_items_of_several_heads_build_for_every_arch(arch, tmp_path):
    """Items of two heads (Nemotron-3-Super): the fp32 checkpoint's (its fold on tensor cores, each
    head's rows from its place in the stage), next to an nvfp4 copy (a state scale per head, the
    rows on tensor cores) and with an fp8 copy's flush tile; and of two value heads of a key head
    (Qwen3.5-122B, re-deriving flushes on tensor cores) next to an fp8 copy (rows on CUDA cores) and
    an nvfp4 one (rows on tensor cores), the fp8 rows also with 8 lanes to a row; for each target:
    one TMA box per item, the copies' MMAs."""
    env = _env(tmp_path / "cache")
    env["CUTE_DSL_ARCH"] = arch
    proc = subprocess.run([sys.executable, "-c", _SEVERAL_HEADS_BUILD, str(tmp_path)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, _ANSI.sub("", proc.stdout)[-4000:]
    for name in ("fp32", "nvfp4", "fp8", "gdn_fp8", "gdn_fp8_lanes8", "gdn_nvfp4"):
        text = (tmp_path / f"{name}.ptx").read_text()
        assert f".target {arch}" in text and "cp.async.bulk.tensor" in text, name
        assert ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in text) == (name != "nvfp4"), name
        assert ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text) == (
            name not in ("fp32", "gdn_fp8", "gdn_fp8_lanes8")), name


def test_verify_config_takes_fp32_checkpoints_and_draft_counts_it_fits():
    """The pipelined verify (kernels/mamba2/pipelined_verify.py): an fp32 checkpoint without a read
    copy, 16-row warp tiles, a ring and 1 <= T <= min(16, max_draft, window); its stages (padded
    state tiles, keys and values of every ring position and draft) fit the shared memory; the
    space and the default (its first) at the cache's largest draft count: two CTAs an SM where two
    fit, with registers capped for them, then one with the most stages; then the same in units of
    four of a group's heads (at most MAX_UNIT_HEADS, a divisor of the group's)."""
    from replayssm_cute.kernels.mamba2.pipelined_verify import (Mamba2PipelinedVerify, pipelined_verify_config,
                                                                pipelined_verify_space)
    from replayssm_cute.kernels.pipeline import PipeVerifyConfig, unit_size

    check = Mamba2PipelinedVerify.check
    drafts = Mamba2Shape(128, 64, 128, 8, 16, 24)  # max_draft 8
    config = PipeVerifyConfig(3, 132)
    assert check(drafts, config, 8) is None and check(drafts, config, 1) is None
    for shape, T, words in [(drafts, 9, "num_drafts 9"), (drafts, 0, "num_drafts 0"),
                            (Mamba2Shape(128, 64, 128, 8, 16, 24, read_copy="fp8"), 4, "without a read copy"),
                            (Mamba2Shape(128, 64, 128, 8, 16, 24, checkpoint_format="fp16"), 4, "fp32 checkpoint"),
                            (Mamba2Shape(128, 72, 128, 8, 16, 24), 4, "72 state rows"),
                            (Mamba2Shape(128, 64, 48, 8, 16, 24), 4, "48 state columns"),
                            (Mamba2Shape(128, 64, 128, 8, 24, 40), 8, "capacity 40")]:
        assert words in check(shape, config, T), (shape, T)
    assert "shared memory" in check(drafts, PipeVerifyConfig(8, 132), 8)
    space = pipelined_verify_space(drafts, 132, "sm_90a")
    # Nemotron-3-Super's stage is about 48 KB: two CTAs of 2 stages, or one of up to 4, with two
    # consumer groups (an even number of stages) or one; most items in flight an SM first
    heads = [PipeVerifyConfig(2, 264, 4, 2), PipeVerifyConfig(4, 132, 4, 0, 2), PipeVerifyConfig(2, 132, 4, 0, 2),
             PipeVerifyConfig(4, 132, 4, 0), PipeVerifyConfig(3, 132, 4, 0), PipeVerifyConfig(2, 132, 4, 0)]
    assert space == heads + [dataclasses.replace(c, heads_per_unit=4) for c in heads]
    assert "must divide the stages" in check(drafts, PipeVerifyConfig(3, 132, 4, 0, 2), 8)
    assert "do not fit on an SM" in check(drafts, PipeVerifyConfig(2, 264, 4, 2, 2), 8)
    assert all(check(drafts, c, 8) is None for c in space)
    assert "do not fit on an SM" in check(drafts, PipeVerifyConfig(3, 264, 4, 2), 8)
    assert pipelined_verify_config(drafts, 132, "sm_90a") == space[0]
    # units (one group) where the batch's units fill the grid: 16 rows x 128 heads >= 4 x 264
    assert pipelined_verify_config(drafts, 132, "sm_90a", 16) == PipeVerifyConfig(2, 264, 4, 2, 1, 4)
    assert pipelined_verify_config(drafts, 132, "sm_90a", 8) == space[0]
    assert pipelined_verify_config(SUPER, 132, "sm_90a") is None and pipelined_verify_space(SUPER, 132, "sm_90a") == []
    assert pipelined_verify_config(drafts, 148, "sm_100a").prefetch == 2
    assert config_label(config) == "pipeverify3_grid132"
    assert config_label(PipeVerifyConfig(2, 264, 2, 2)) == "pipeverify2_grid264_prefetch2_ctas2"
    assert config_label(PipeVerifyConfig(4, 132, 4, 0, 2)) == "pipeverify4_grid132_groups2"
    assert config_label(PipeVerifyConfig(2, 132, 4, 0, 2, 4)) == "pipeverify2_grid132_groups2_units4"
    assert "heads_per_unit 3: expected a divisor of 16" in check(drafts, PipeVerifyConfig(2, 132, 4, 0, 1, 3), 8)
    assert (unit_size(16), unit_size(6), unit_size(3), unit_size(1)) == (4, 3, 3, 1)


def test_gdn_verify_config_takes_plain_fp32_caches():
    """The GDN pipelined verify (kernels/gdn/pipelined_verify.py): the checks it shares with
    Mamba-2's (value rows in 16-row warp tiles, key columns in one padded TMA box), no read copy and
    no re-derivation; Qwen3.5-122B's padded (128, 132) tile leaves room for two stages at T = 8,
    in one CTA an SM, and at T = 4 for two consumer groups of one stage each (the default there);
    units of a key head's four value heads (one scratch buffer of drafts a group) fit two groups
    at T = 8 too, and follow the items of one head in the space."""
    from replayssm_cute.kernels.gdn.pipelined_verify import (GDNPipelinedVerify, pipelined_verify_config,
                                                             pipelined_verify_space)
    from replayssm_cute.kernels.pipeline import PipeVerifyConfig

    check = GDNPipelinedVerify.check
    drafts = GDNShape(64, 128, 128, 16, 16, 24)
    assert check(drafts, PipeVerifyConfig(2, 132), 8) is None
    assert "shared memory" in check(drafts, PipeVerifyConfig(4, 132), 8)
    for fields, words in [(dict(read_copy="fp8", keep_v_beta=True, rederive=True), "re-derive"),
                          (dict(read_copy="fp8"), "without a read copy"), (dict(head_v_dim=72), "72 state rows"),
                          (dict(head_k_dim=48), "48 state columns")]:
        assert words in check(GDNShape(**{**drafts.__dict__, **fields}), PipeVerifyConfig(2, 132), 4), fields
    units = [PipeVerifyConfig(2, 132, 4, 0, 2, 4), PipeVerifyConfig(2, 132, 4, 0, 1, 4)]
    assert pipelined_verify_space(drafts, 132, "sm_90a") == [PipeVerifyConfig(2, 132, 4)] + units
    assert pipelined_verify_config(drafts, 132, "sm_90a") == PipeVerifyConfig(2, 132, 4)
    four = GDNShape(64, 128, 128, 16, 16, 20)
    assert pipelined_verify_space(four, 132, "sm_90a") == [PipeVerifyConfig(2, 132, 4, 0, 2), PipeVerifyConfig(2, 132, 4)] + units
    assert pipelined_verify_config(four, 132, "sm_90a") == PipeVerifyConfig(2, 132, 4, 0, 2)
    # units of one group where the batch's units fill the grid (16 rows x 64 heads >= 4 x 132), at T = 4 and 8
    for shape in (drafts, four):
        assert pipelined_verify_config(shape, 132, "sm_90a", 16) == PipeVerifyConfig(2, 132, 4, 0, 1, 4)
        assert pipelined_verify_config(shape, 132, "sm_90a", 8).heads_per_unit == 1
    assert "shared memory" in check(drafts, PipeVerifyConfig(2, 132, 4, 0, 2), 8)
    assert "heads_per_unit 3: expected a divisor of 4" in check(four, PipeVerifyConfig(2, 132, 4, 0, 1, 3), 4)


@pytest.mark.parametrize("layer, max_draft, batch, by_default", [("mamba2", 8, 1, True), ("gdn", 4, 1, True),
                                                                  ("gdn", 8, 8, False), ("gdn", 8, 16, True)])
@pytest.mark.parametrize("forced", ["", "1", "0"])
def test_verify_routing(monkeypatch, layer, max_draft, batch, by_default, forced):
    """On sm_90a verify runs the pipeline by default for Mamba-2, for GDN caches of at most
    PIPELINED_VERIFY_MAX_DRAFTS drafts, and for larger GDN caches where its default is units (the
    batch's units fill the grid: 16 rows of 64 value heads, 4 a unit, on 132 CTAs);
    REPLAYSSM_CUTE_PIPELINED=1 asks for it anywhere it takes the cache, =0 keeps the tile verify."""
    from replayssm_cute.layers import LAYERS
    from replayssm_cute.layers.gdn import PIPELINED_VERIFY_MAX_DRAFTS

    assert PIPELINED_VERIFY_MAX_DRAFTS == 4
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv(PIPELINED_ENV, forced)
    drafts = (Mamba2Shape(128, 64, 128, 8, 16, 16 + max_draft) if layer == "mamba2" else
              GDNShape(64, 128, 128, 16, 16, 16 + max_draft))
    kernel = LAYERS[layer].verify_kernel
    config = kernel.default_config(drafts, batch)
    assert (type(config).__name__ == "PipeVerifyConfig") == {"": by_default, "1": True, "0": False}[forced]
    assert kernel.check(drafts, config, max_draft) is None


_VERIFY_BUILD = """
import os
import sys
from replayssm_cute.kernels.mamba2.config import Mamba2Shape
from replayssm_cute.kernels.mamba2.pipelined_verify import compile_pipelined_verify, pipelined_verify_config
from replayssm_cute.runtime.compile_cache import compile_options
from replayssm_cute.kernels.gdn import pipelined_verify as gdn_verify
from replayssm_cute.kernels.gdn.config import GDNShape
from replayssm_cute.kernels.pipeline import PipeVerifyConfig
arch = os.environ["CUTE_DSL_ARCH"]
for name, shape, T, module, groups in [
        ("super_T8", Mamba2Shape(128, 64, 128, 8, 16, 24), 8, None, None),
        ("odd_T4_z", Mamba2Shape(12, 48, 64, 3, 8, 12, has_z=True), 4, None, None),
        ("gdn_122b_T8", GDNShape(64, 128, 128, 16, 16, 24), 8, gdn_verify, None),
        ("gdn_odd_T4_v_beta", GDNShape(6, 64, 64, 2, 8, 12, keep_v_beta=True), 4, gdn_verify, None),
        ("super_T8_groups", Mamba2Shape(128, 64, 128, 8, 16, 24), 8, None, PipeVerifyConfig(4, 132, 2, 0, 2)),
        ("gdn_122b_T4_groups", GDNShape(64, 128, 128, 16, 16, 20), 4, gdn_verify, PipeVerifyConfig(2, 132, 2, 0, 2)),
        ("gdn_122b_T8_units", GDNShape(64, 128, 128, 16, 16, 24), 8, gdn_verify, PipeVerifyConfig(2, 132, 2, 0, 2, 4)),
        ("gdn_odd_T4_units", GDNShape(6, 64, 64, 2, 8, 12, keep_v_beta=True), 4, gdn_verify,
         PipeVerifyConfig(2, 132, 2, 0, 1, 3)),
        ("super_T8_units", Mamba2Shape(128, 64, 128, 8, 16, 24), 8, None, PipeVerifyConfig(2, 264, 2, 2, 1, 4)),
        ("odd_T4_z_units", Mamba2Shape(12, 48, 64, 3, 8, 12, has_z=True), 4, None, PipeVerifyConfig(4, 132, 2, 0, 2, 4))]:
    pick, build = ((module.pipelined_verify_config, module.compile_pipelined_verify) if module else
                   (pipelined_verify_config, compile_pipelined_verify))
    config = groups or pick(shape, 132, arch)
    fn = build(shape, config, T, compile_options("--keep-ptx", "--dump-dir " + sys.argv[1]))
    open(sys.argv[1] + "/" + name + ".ptx", "w").write(fn.__ptx__)
"""


@pytest.mark.parametrize("arch", ARCHS)
def test_pipelined_verify_builds_for_every_arch(arch, tmp_path):
    """The pipelined verifies: Mamba-2 for Nemotron-3-Super (T = 8) and an odd shape with z (three
    16-row warps, T = 4), GDN for Qwen3.5-122B (T = 8) and an odd shape keeping v and beta (four
    warps, T = 4), both with two consumer groups, and in units of heads that share their products
    (GDN 122B: four, two groups; GDN's odd shape: three, one group; Super: four, two CTAs an SM;
    the odd Mamba-2 shape: four, two groups); for each target: the state tiles by TMA (a
    box per consumer warp), the GEMMs on tensor cores (TF32), the consumers' named barrier (a
    group's: its id a register), the CTA's warps, nothing in local memory."""
    env = _env(tmp_path / "cache")
    env["CUTE_DSL_ARCH"] = arch
    proc = subprocess.run([sys.executable, "-c", _VERIFY_BUILD, str(tmp_path)], env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    assert proc.returncode == 0, _ANSI.sub("", proc.stdout)[-4000:]
    for name, warps, groups in (("super_T8", 4, 1), ("odd_T4_z", 3, 1), ("gdn_122b_T8", 8, 1),
                                ("gdn_odd_T4_v_beta", 4, 1), ("super_T8_groups", 4, 2), ("gdn_122b_T4_groups", 8, 2),
                                ("gdn_122b_T8_units", 8, 2), ("gdn_odd_T4_units", 4, 1), ("super_T8_units", 4, 1),
                                ("odd_T4_z_units", 3, 2)):
        text = (tmp_path / f"{name}.ptx").read_text()
        assert f".target {arch}" in text and "cp.async.bulk.tensor" in text, name
        assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in text, name
        assert f".reqntid {32 * (1 + groups * warps)}, 1, 1" in text, name
        barrier = re.escape(f", {32 * warps};")
        assert re.search((r"bar\.sync \t%r\d+" if groups > 1 else r"bar\.sync \t1") + barrier, text), name
        assert ".local" not in text, name
