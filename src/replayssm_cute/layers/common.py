"""What the kernels of every layer type share on the host: the checkpoint, the ring and the step's
plan rows, and the trailing state-copy arguments (kernels/state_io.py) of their
argument lists, as a cache holds them; a cache's kernel Shapes, memoised; and the rule of their
default launch configs for an nvfp4 copy (``whole_head``)."""

from __future__ import annotations

import os
import weakref

import torch

_shapes = weakref.WeakKeyDictionary()  # cache -> {static inputs: kernel Shape}


def checkpoint_arg(cache) -> torch.Tensor:
    """The checkpoint as the kernels take it (fp8 codes as uint8)."""
    t = cache.checkpoint
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def ring_args(cache, names: tuple, plan) -> tuple:
    """The ring tensors `names` of a ReplaySSM cache and the step's plan rows; at window 1 no
    ring, and the plan only where SR writes need the slot's write counter."""
    rows = None if plan is None else plan.rows
    if cache.window > 1:
        return tuple(getattr(cache, n) for n in names) + (rows,)
    return (None,) * len(names) + (rows if cache.sr_counter is not None else None,)


def state_copy_args(cache) -> tuple:
    """The kernels' trailing state-copy arguments of ``cache`` (kernels/state_io.py): checkpoint
    scale and state scale, read copy data, scale and state scale, SR seed (None where
    the configuration has none); fp8 / E4M3 codes as uint8 views."""
    def codes(t):
        return t.view(torch.uint8) if t is not None and t.dtype == torch.float8_e4m3fn else t

    return (codes(getattr(cache, "checkpoint_scale", None)), getattr(cache, "checkpoint_state_scale", None),
            codes(cache.read_copy), codes(getattr(cache, "read_copy_scale", None)),
            getattr(cache, "read_copy_state_scale", None), cache.sr_seed)


def memoised_shape(cache, static: tuple, build):
    """``build(cache, static)``, the kernel Shape of a call on `cache` with `static` inputs, built
    once per cache and static inputs (a cache's layout is fixed when it is made): a call then
    costs two dict lookups instead of a Shape built and compared field by field (~3 us)."""
    per_cache = _shapes.get(cache)
    if per_cache is None:
        per_cache = _shapes[cache] = {}
    shape = per_cache.get(static)
    if shape is None:
        shape = per_cache[static] = build(cache, static)
    return shape


PIPELINED_ENV = "REPLAYSSM_CUTE_PIPELINED"
# Targets a layer's pipelined decode is the default on: measured there (the H200). sm_100a and
# sm_103a builds are compile-checked only; REPLAYSSM_CUTE_PIPELINED=1 picks them there.
PIPELINED_ARCHS = ("sm_90a",)


def whole_head(shape) -> bool:
    """Whether a kernel Shape needs a CTA per head: the writer of an nvfp4 copy needs the whole
    state's amax."""
    return "nvfp4" in (shape.checkpoint_format, shape.read_copy)


def random_generators(gen, device):
    """torch.rand and torch.randn (fp32) drawing from `gen` on `device`: the benchmarks' inputs."""
    return (lambda *shape: torch.rand(*shape, generator=gen, device=device),
            lambda *shape: torch.randn(*shape, generator=gen, device=device))


def pipelined_choice(shape, pipelined_config, by_default):
    """The pipelined kernel's config for ``shape`` (``pipelined_config(shape, SM count, arch)``; None
    where it cannot take the shape) where ``REPLAYSSM_CUTE_PIPELINED=1`` asks for it, or where
    the layer uses it by default on a target it has been measured on (PIPELINED_ARCHS):
    ``by_default`` is a bool, or a predicate on that config; else None: the tile kernels serve
    (``REPLAYSSM_CUTE_PIPELINED=0`` keeps every layer on them)."""
    choice = os.environ.get(PIPELINED_ENV, "")
    if choice == "0" or (choice != "1" and (not by_default or target_arch() not in PIPELINED_ARCHS)):
        return None
    config = pipelined_config(shape, sm_count(), target_arch())
    if choice != "1" and callable(by_default) and config is not None and not by_default(config):
        return None
    return config


def target_arch() -> str:
    """The arch kernels are built for: $CUTE_DSL_ARCH, else the visible GPU's, else sm_90a."""
    from ..runtime import compile_cache

    if os.environ.get(compile_cache.ENV_ARCH) or torch.cuda.is_available():
        return compile_cache.target_arch()
    return "sm_90a"


def sm_count() -> int:
    """SMs of the visible GPU; without one, those of the target arch's usual part (H100 / H200:
    132, B200 / B300: 148): the persistent grid is one or two CTAs per SM."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).multi_processor_count
    return 132 if target_arch() == "sm_90a" else 148
