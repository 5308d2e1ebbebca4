"""A probe kernel for kernels/state_io.py: writes an fp32 state (slots, heads, rows, K) into one
low-precision format (RTN, or SR with the cache's bits of write ``counter[slot]``), then reads
the stored copy back to fp32, so tests can compare both directions with replayssm_cute.quant and
cache.checkpoint_sr_bits bit for bit. One warp per (head, slot) state.

Run as a script (``python tests/kernels/_state_io_kernel.py``) with CUTE_DSL_ARCH set it compiles
every format for that arch and writes each PTX into the working directory (compile-only checks).
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, Int64, Uint32  # noqa: E402

from replayssm_cute.runtime.compile_cache import compile_options  # noqa: E402
from replayssm_cute.kernels.state_io import (CopyFormat, decode_slice, encode_store, lane_amax, load_scale,  # noqa: E402
                                             nvfp4_state_scale, sr_write_key)


class StateIOProbe:
    def __init__(self, fmt: CopyFormat, rows: int, stochastic: bool):
        self.fmt, self.rows, self.stochastic = fmt, rows, stochastic

    @cute.jit
    def __call__(self, mState, mData, mScale, mStateScale, mSeed, mCounter, mBack, stream):
        self.kernel(mState, mData, mScale, mStateScale, mSeed, mCounter, mBack).launch(
            grid=[mState.shape[1], mState.shape[0], 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mState, mData, mScale, mStateScale, mSeed, mCounter, mBack):
        fmt, R = self.fmt, self.rows
        K = fmt.K
        vec = K // 32
        per = vec // 2 if cutlass.const_expr(fmt.name == "nvfp4") else vec
        lane = cute.arch.lane_idx()
        head, slot, _ = cute.arch.block_idx()
        slot64 = Int64(slot)
        key = sr_write_key(Uint32(mSeed[0]), slot, mCounter[slot])
        G = Float32(1.0)
        if cutlass.const_expr(fmt.has_state_scale):
            amax = Float32(0.0)
            for r in cutlass.range_constexpr(R):
                rS = cute.make_rmem_tensor((vec,), Float32)
                cute.autovec_copy(cute.local_tile(mState[slot64, head, r, None], (vec,), (lane,)), rS)
                amax = lane_amax(rS) if cutlass.const_expr(r == 0) else cutlass.max(amax, lane_amax(rS))
            for i in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_bfly(amax, offset=1 << i)
                amax = cutlass.select_(other != other, other, cutlass.max(amax, other))
            G = nvfp4_state_scale(amax)
            if lane == 0:
                mStateScale[slot64, head] = G
        for r in cutlass.range_constexpr(R):
            rS = cute.make_rmem_tensor((vec,), Float32)
            cute.autovec_copy(cute.local_tile(mState[slot64, head, r, None], (vec,), (lane,)), rS)
            encode_store(fmt, self.stochastic, rS, cute.local_tile(mData[slot64, head, r, None], (per,), (lane,)),
                         mScale, slot64, head, r, lane * vec, G, key, (head * R + r) * K + lane * vec)
        cute.arch.sync_warp()
        cute.arch.fence_acq_rel_cta()
        for r in cutlass.range_constexpr(R):
            rS = cute.make_rmem_tensor((vec,), Float32)
            scale = load_scale(fmt, mScale, mStateScale, slot64, head, r, lane * vec)
            decode_slice(fmt, cute.local_tile(mData[slot64, head, r, None], (per,), (lane,)), scale, rS)
            cute.autovec_copy(rS, cute.local_tile(mBack[slot64, head, r, None], (vec,), (lane,)))


def _fake(fmt: CopyFormat, heads: int, rows: int):
    from cutlass.cute.runtime import make_fake_compact_tensor

    slots = cute.sym_int()

    def compact(dtype, dims, align=16):
        return make_fake_compact_tensor(dtype, dims, stride_order=tuple(reversed(range(len(dims)))), assumed_align=align)

    K = fmt.K
    return (compact(Float32, (slots, heads, rows, K)),
            compact(fmt.storage, (slots, heads, rows, fmt.cols)),
            compact(fmt.scale_dtype, (slots, heads, rows, K // fmt.block_k), align=4) if fmt.scale_dtype else None,
            compact(Float32, (slots, heads), align=4) if fmt.has_state_scale else None,
            compact(cutlass.Int64, (1,), align=8),
            compact(Int32, (slots,), align=4),
            compact(Float32, (slots, heads, rows, K)))


def compile_probe(fmt_name: str, K: int, heads: int, rows: int, stochastic: bool, *extra_options: str):
    fmt = CopyFormat(fmt_name, K)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(StateIOProbe(fmt, rows, stochastic), *_fake(fmt, heads, rows), stream,
                        options=compile_options(*extra_options))


if __name__ == "__main__":
    os.makedirs("dump", exist_ok=True)  # --keep-ptx writes a copy there
    for name in ("fp16", "fp8", "nvfp4"):
        for sr in (False, True):
            label = f"{name}_{'sr' if sr else 'rtn'}"
            ptx = compile_probe(name, int(sys.argv[1]) if len(sys.argv) > 1 else 128, 2, 4, sr,
                                "--keep-ptx", "--dump-dir dump").__ptx__
            with open(f"{label}.ptx", "w") as f:
                f.write(ptx)
            print(label, "compiled")
