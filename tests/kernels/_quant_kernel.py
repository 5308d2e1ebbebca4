"""A probe kernel running the device quantisers (kernels/quant.py) element by element, for the
bit-exactness tests against replayssm_cute.quant: out[0..5] = codes of x in fp16 / E4M3 / E2M1,
RTN then SR, with the random bits of element i = sr_bits(seed, i) in out[6].

Run as a script (``python tests/kernels/_quant_kernel.py``) with CUTE_DSL_ARCH set it compiles and
prints the PTX, for the compile-only checks of every target.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, Uint32  # noqa: E402

from replayssm_cute.runtime.compile_cache import compile_options  # noqa: E402
from replayssm_cute.kernels.quant import E2M1, E4M3, F16, round_to_code, sr_bits  # noqa: E402

THREADS = 128
FORMATS = (F16, E4M3, E2M1)


@cute.kernel
def _probe_kernel(mX: cute.Tensor, mSeed: cute.Tensor, mOut: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * THREADS + tidx
    if i < mX.shape[0]:
        x = mX[i]
        bits = sr_bits(Uint32(mSeed[0]), Uint32(i))
        for f in cutlass.range_constexpr(len(FORMATS)):
            mOut[2 * f, i] = round_to_code(x, bits, FORMATS[f], False)
            mOut[2 * f + 1, i] = round_to_code(x, bits, FORMATS[f], True)
        mOut[2 * len(FORMATS), i] = Int32(bits)


@cute.jit
def _probe(mX: cute.Tensor, mSeed: cute.Tensor, mOut: cute.Tensor, stream):
    _probe_kernel(mX, mSeed, mOut).launch(
        grid=[(mX.shape[0] + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)


def build(options: str = ""):
    """Compiled probe: f(x fp32 (n,), seed int32 (1,), out int32 (7, n)) on the current stream."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    n = cute.sym_int()
    x = make_fake_compact_tensor(Float32, (n,), assumed_align=4)
    seed = make_fake_compact_tensor(Int32, (1,), assumed_align=4)
    out = make_fake_compact_tensor(Int32, (2 * len(FORMATS) + 1, n), stride_order=(1, 0), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_probe, x, seed, out, stream, options=compile_options(*filter(None, [options])))


if __name__ == "__main__":
    print(build("--keep-ptx").__ptx__)
