"""A tiny CuTe DSL kernel (x += 1 over a 1-D fp32 tensor) for the compile-cache tests.

Compiled the fast way: fake tensor with a symbolic length, TVM-FFI, environment stream. Without a
GPU it targets sm_90a (CUTE_DSL_ARCH must be set before cutlass is first imported; the build also
passes --gpu-arch, so the binary matches the cache key either way).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402

from replayssm_cute.runtime.compile_cache import compile_options, get_compiled  # noqa: E402

THREADS = 128
NAME = "tiny_add_one"
KEY = ("float32", THREADS)


@cute.kernel
def _add_one_kernel(x: cute.Tensor, n: cutlass.Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * THREADS + tidx
    if i < n:
        x[i] = x[i] + cutlass.Float32(1.0)


@cute.jit
def _add_one(x: cute.Tensor, stream):
    n = cute.size(x, mode=[0])
    _add_one_kernel(x, n).launch(
        grid=[(n + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream
    )


def build():
    """Compile from a fake fp32 tensor of symbolic length; call the result as f(x)."""
    x = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),))
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(_add_one, x, stream, options=compile_options())


def add_one_fn():
    return get_compiled(NAME, KEY, build)


def race_worker(cache_dir, barrier, results):
    """One of several processes asking for the same entry at once (multiprocessing target)."""
    os.environ["REPLAYSSM_CUTE_CACHE_DIR"] = str(cache_dir)
    built = []

    def counting_build():
        built.append(1)
        return build()

    try:
        barrier.wait(timeout=120)
        fn = get_compiled(NAME, KEY, counting_build)
        results.put(("ok", os.getpid(), len(built), type(fn).__name__))
    except BaseException as e:  # report, don't hang the parent
        results.put(("error", os.getpid(), repr(e), ""))
