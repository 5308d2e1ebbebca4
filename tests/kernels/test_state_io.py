"""The kernels' state-copy reads and writes (kernels/state_io.py) against replayssm_cute.quant and
the cache's SR bits (cache.checkpoint_sr_bits).

CPU: the probe kernel (tests/kernels/_state_io_kernel.py) compiles every format, RTN and SR, for
sm_90a, sm_100a and sm_103a without local memory. GPU (marked): the stored codes and scales equal the
reference's bit for bit (RTN; SR given the same bits), including rows with large dynamic range,
zero blocks and a non-finite state; decoding the stored copy gives quant's decoded values.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from replayssm_cute import quant
from replayssm_cute.cache import checkpoint_sr_bits

HERE = Path(__file__).parent


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_state_io_probe_compiles_for_every_target(arch, tmp_path):
    env = dict(os.environ, CUTE_DSL_ARCH=arch, REPLAYSSM_CUTE_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, str(HERE / "_state_io_kernel.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("compiled") == 6
    ptx_files = list(tmp_path.glob("*.ptx"))
    assert len(ptx_files) == 6, [p.name for p in ptx_files]
    for path in ptx_files:
        ptx = path.read_text()
        assert re.search(rf"^\.target {arch}\b", ptx, re.M)
        assert ".local" not in ptx
        assert "mul.lo.s32" in ptx or "mul.lo.u32" in ptx or "rtn" in path.name  # SR: fmix32 rounds
        if "fp8" in path.name:
            assert "div.rp.f32" in ptx and "rcp.rz.f32" in ptx and "max.NaN.f32" in ptx
        if "nvfp4" in path.name:  # the read-back decodes E2M1 in hardware where the target can
            assert ("cvt.rn.f16x2.e2m1x2" in ptx) == (arch != "sm_90a"), path.name


def _states(slots: int, heads: int, rows: int, K: int, gen: torch.Generator) -> torch.Tensor:
    """Random states with per-row magnitudes over many binades, a zero row and a zero block."""
    x = torch.randn(slots, heads, rows, K, generator=gen)
    x = x * torch.exp2(torch.randint(-20, 12, (slots, heads, rows, 1), generator=gen).float())
    x[0, 0, 1] = 0.0
    x[0, 1, 2, :16] = 0.0
    x[1, 0, 0, 5] = 1e-42  # a subnormal
    return x


def _unsigned_nan(codes: torch.Tensor) -> torch.Tensor:
    return torch.where(codes & 0x7F == 0x7F, torch.full_like(codes, 0x7F), codes)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", ["fp16", "fp8", "nvfp4"])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("K", [64, 128])
def test_state_io_matches_the_reference(fmt_name, stochastic, K):
    from tests.kernels._state_io_kernel import compile_probe

    dev = torch.device("cuda")
    slots, heads, rows = 3, 2, 8
    gen = torch.Generator().manual_seed(11 + K)
    x = _states(slots, heads, rows, K, gen)
    x[2, 1, 3, 7] = float("inf")  # the (2, 1) state is not finite
    fmt = quant.FP8E4M3(block_k=128 if K % 128 == 0 else K) if fmt_name == "fp8" else quant.FORMATS[fmt_name]
    seed, counter = 0x5EED1234, torch.tensor([0, 7, 2**31 - 1], dtype=torch.int32)

    probe = compile_probe(fmt_name, K, heads, rows, stochastic)
    if fmt_name == "fp16":
        data = torch.empty(slots, heads, rows, K, dtype=torch.float16, device=dev)
    else:
        cols = K // 2 if fmt_name == "nvfp4" else K
        data = torch.empty(slots, heads, rows, cols, dtype=torch.uint8, device=dev)
    scale = state_scale = None
    if fmt_name == "fp8":
        scale = torch.empty(slots, heads, rows, K // fmt.block_k, dtype=torch.float32, device=dev)
    if fmt_name == "nvfp4":
        scale = torch.empty(slots, heads, rows, K // 16, dtype=torch.uint8, device=dev)
        state_scale = torch.empty(slots, heads, dtype=torch.float32, device=dev)
    back = torch.empty(slots, heads, rows, K, dtype=torch.float32, device=dev)
    probe(x.to(dev), data, scale, state_scale, torch.tensor([seed], dtype=torch.int64, device=dev),
          counter.to(dev), back)
    torch.cuda.synchronize()

    for s in range(slots):
        xs = x[s]
        if stochastic:
            bits = checkpoint_sr_bits(seed, s, int(counter[s]), (heads, rows, K))
            ref = fmt.encode_sr(xs, bits)
        else:
            ref = fmt.encode_rtn(xs)
        got = data[s].cpu()
        want = ref.data.view(torch.uint8) if fmt_name != "fp16" else ref.data
        if fmt_name == "fp16":
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"slot {s}"
        else:
            if fmt_name == "fp8":  # the sign of a NaN made by Inf * 0 is the platform's (x86: set)
                got, want = _unsigned_nan(got), _unsigned_nan(want)
            assert torch.equal(got, want), f"slot {s}: {(got != want).sum()} codes differ"
        if fmt_name == "fp8":
            assert torch.equal(scale[s].cpu().view(torch.int32), ref.scales[0].view(torch.int32))
        if fmt_name == "nvfp4":
            assert torch.equal(scale[s].cpu(), ref.scales[0].view(torch.uint8))
            assert torch.equal(state_scale[s].cpu(), ref.scales[1], ) or (
                torch.isnan(ref.scales[1]) == torch.isnan(state_scale[s].cpu())).all()
        finite = torch.isfinite(ref.dequantized)
        assert torch.equal(back[s].cpu()[finite], ref.dequantized[finite]), f"slot {s}: decoded values"
        assert torch.equal(torch.isnan(back[s].cpu()), torch.isnan(ref.dequantized))


# ----------------------------------------------------------------------------- reading on tensor cores


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode): byte k of the result is byte (selector nibble k) of b:a."""
    pool = (a | (b << 32)).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[(selector >> (4 * k)) & 7] for k in range(4)), "little")


def test_e2m1_byte_permute_decode_gives_quants_values():
    """The sm_90a E2M1 decode of mma_row_dots (magnitudes by a byte-permute table, signs moved in by
    a multiply), modelled step for step on the host, equals quant's E2M1 value of every code, for
    every 16-bit piece (4 codes, low nibble first) and both fp16 pairs."""
    from replayssm_cute.kernels.state_io import _E2M1_F16_HIGH

    pieces = torch.arange(1 << 16)
    codes = torch.stack([(pieces >> (4 * i)) & 0xF for i in range(4)], 1)
    want = quant.E2M1.values(codes).to(torch.float16)
    got = torch.empty_like(want)
    t0, t1 = _E2M1_F16_HIGH
    for piece in range(1 << 16):
        m = _prmt(t0, t1, piece & 0x7777)
        q = piece & 0x8888
        lo = _prmt(m, 0, 0x1404) | ((q * 0x1001000) & 0x80008000)
        hi = _prmt(m, 0, 0x3424) | ((q * 0x10010) & 0x80008000)
        got[piece] = torch.tensor([lo & 0xFFFF, lo >> 16, hi & 0xFFFF, hi >> 16], dtype=torch.int32).to(
            torch.int16).view(torch.float16)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # -0.0 for code 8 included


@pytest.mark.parametrize("fmt_name, K", [("fp8", 128), ("fp8", 256), ("fp8", 64), ("nvfp4", 128), ("nvfp4", 256)])
def test_mma_row_dots_pieces_cover_each_row_once_within_one_group_of_blocks(fmt_name, K):
    """mma_row_dots' k permutation: lane t's piece of k-step s starts at _piece_col(t, s); over the
    4 lanes and K / 16 steps the pieces (4 values each) cover every column once, each lane's pieces
    tile whole 16-byte chunks, and each step's pieces lie in one group of 8 scale blocks (its MMA
    columns)."""
    from replayssm_cute.kernels.state_io import CopyFormat, _piece_bytes, _piece_col, _step_tile, mma_dots_error

    fmt = CopyFormat(fmt_name, K)
    assert mma_dots_error(fmt, 32) is None and mma_dots_error(fmt, 16) is None
    cols = sorted(c + i for t in range(4) for s in range(K // 16) for c in [_piece_col(fmt, t, s)] for i in range(4))
    assert cols == list(range(K))
    ppc = 16 // _piece_bytes(fmt)
    for t in range(4):
        assert all(_piece_col(fmt, t, s) % (4 * ppc) == 4 * (s % ppc) for s in range(K // 16))
        for s in range(K // 16):
            assert _piece_col(fmt, t, s) // fmt.block_k // 8 == _step_tile(fmt, s)


def test_mma_row_dots_takes_low_precision_rows_of_whole_tiles():
    from replayssm_cute.kernels.gdn.config import rows_fit_tensor_cores as gdn_rows
    from replayssm_cute.kernels.mamba2.config import rows_on_tensor_cores as mamba2_rows
    from replayssm_cute.kernels.state_io import CopyFormat, mma_dots_error

    assert mma_dots_error(CopyFormat("fp16", 128), 16) is None
    assert "CUDA cores" in mma_dots_error(CopyFormat("fp32", 128), 32)
    # Mamba-2 keeps fp16 rows on CUDA cores (measured), GDN takes every read copy's
    assert not mamba2_rows(CopyFormat("fp16", 128), 16) and mamba2_rows(CopyFormat("fp8", 128), 16)
    assert all(gdn_rows(CopyFormat(f, 128), 16, 4) for f in ("fp16", "fp8", "nvfp4"))
    assert not gdn_rows(None, 16, 4) and not gdn_rows(CopyFormat("fp8", 128), 8, 4)
    assert "values per lane" in mma_dots_error(CopyFormat("fp16", 32), 16, 1)
    assert "values per lane" in mma_dots_error(CopyFormat("fp16", 512), 16, 16)
    assert "16-row tiles" in mma_dots_error(CopyFormat("fp8", 128), 8)
    assert "16-row tiles" in mma_dots_error(CopyFormat("fp8", 128), 64)
    assert "multiple of 128" in mma_dots_error(CopyFormat("nvfp4", 64), 32)
    assert "multiple of 64" in mma_dots_error(CopyFormat("fp8", 96), 32)


@pytest.mark.parametrize("fmt_name, K", [("fp16", 64), ("fp16", 128), ("fp16", 256), ("fp8", 128), ("fp8", 256),
                                        ("fp8", 384), ("nvfp4", 128), ("nvfp4", 256)])
@pytest.mark.parametrize("vectors", [1, 2])
def test_mma_row_dots_columns_hold_each_block_of_each_vector_once(fmt_name, K, vectors):
    """Vector v's scale block b is MMA column v x dot_columns + b (distinct columns, the blocks of
    one vector never in another's); each k-step's MMAs (dot_fragments) meet the n-tile of every
    vector's columns of the blocks its pieces read, and no other."""
    from replayssm_cute.kernels.state_io import CopyFormat, _piece_col, _tile_vectors, dot_columns, dot_fragments

    fmt = CopyFormat(fmt_name, K)
    blocks = K // fmt.block_k
    columns = dot_columns(fmt, vectors)
    assert columns >= blocks
    assert blocks * vectors > 8 or columns * vectors <= 8  # blocks that fit share one n-tile
    cols = {(v, b): v * columns + b for v in range(vectors) for b in range(blocks)}
    assert len(set(cols.values())) == len(cols)
    fragments = dot_fragments(fmt, vectors)
    assert len(set(fragments)) == len(fragments)
    for step in range(K // 16):
        read = {_piece_col(fmt, t, step) // fmt.block_k for t in range(4)}
        want = {cols[v, b] // 8 for v in range(vectors) for b in read}
        assert {tile for s, tile in fragments if s == step} == want
        for tile in want:
            assert set(_tile_vectors(columns, vectors, tile)) == {v for v in range(vectors) for b in read
                                                                  if cols[v, b] // 8 == tile}


@pytest.mark.parametrize("fmt_name, K", [("fp16", 64), ("fp16", 128), ("fp16", 256), ("fp8", 64), ("fp8", 128),
                                        ("fp8", 256), ("nvfp4", 128), ("nvfp4", 256)])
def test_b_fragments_gather_each_piece_from_the_lane_that_holds_it(fmt_name, K):
    """With each lane holding K / 32 consecutive values, lane 4 g + t's B values of k-step s
    (its piece's values 2 half, 2 half + 1) are fp16 pair ``pair`` of lane a t + b."""
    from replayssm_cute.kernels.state_io import CopyFormat, _b_source, _piece_col, mma_dots_error

    fmt = CopyFormat(fmt_name, K)
    vec = K // 32
    assert mma_dots_error(fmt, 16, vec) is None
    for step in range(K // 16):
        for half in range(2):
            a, b, pair = _b_source(fmt, vec, step, half)
            for t in range(4):
                lane = a * t + b
                assert 0 <= lane < 32 and 0 <= pair < vec // 2
                assert lane * vec + 2 * pair == _piece_col(fmt, t, step) + 2 * half
