"""From an op's kernel Shape to the callable it launches: the launch config (the caller's, else
the tuned one of runtime.tuning for the active platform, else the kernel's analytical default),
the kernel's check, and the compiled kernel (runtime.compile_cache).

A ``Kernel`` describes one GPU kernel of a layer (the adapters of replayssm_cute.layers hold one
per op). ``launcher(kernel, shape, num_drafts, batch, config)`` is memoised on (kernel, shape,
T, batch bucket, config): after the first call of a signature a call costs one dict lookup.
``reload`` and ``use_platform`` drop the memo, since the tuned configs it picked from changed.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import compile_cache, tuning
from .tuning import Platform, batch_bucket

_CUTE_DTYPE_NAMES = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32"}
_cute_dtypes: dict = {}
_launchers: dict = {}  # (kernel, shape, num_drafts, bucket, config) or a table kernel key -> the compiled callable
_platform_override: Optional[tuple] = None  # (platform,) inside use_platform


def cute_dtype(dtype: torch.dtype):
    """The CuTe DSL dtype class of a torch dtype (imports cutlass on first use)."""
    cute = _cute_dtypes.get(dtype)
    if cute is None:
        import cutlass

        cute = _cute_dtypes[dtype] = getattr(cutlass, _CUTE_DTYPE_NAMES[dtype])
    return cute


@dataclass(frozen=True, eq=False)
class Kernel:
    """One GPU kernel of a layer as the runtime launches it. ``name`` names its compile-cache
    entries and, for the kernels of tuning.KERNELS, its tuned-config entries; ``op`` is the op
    whose errors name it. The callables import the kernel modules (and cutlass) when called."""

    name: str
    op: str
    default_config: Callable  # (shape, batch bucket) -> the analytical default launch config
    check: Callable  # (shape, config, num_drafts) -> None, or why the kernel cannot take them
    build: Callable  # (shape, config, num_drafts, compile options) -> the compiled kernel
    per_draft_count: bool = False  # compiled per T: num_drafts joins its compile-cache key


def compiled(kernel: Kernel, shape, config, num_drafts: int = 0):
    """The compiled `kernel` for (shape, config, T) from the memory / disk compile cache, built
    on a miss (no check: ``launcher`` checks)."""
    key = shape.key() + config.key() + ((num_drafts,) if kernel.per_draft_count else ())

    def build():
        return kernel.build(shape, config, num_drafts, compile_cache.compile_options())

    return compile_cache.get_compiled(kernel.name, key, build)


def launcher(kernel: Kernel, shape, num_drafts: int, batch: int, config=None):
    """The callable that launches `kernel` on `shape` with T = `num_drafts` for `batch` rows:
    with `config`, that one, else the pick of ``picked_config``; checked (errors name the op and
    the argument at fault: 'config' when given, else 'cache'), then compiled. Memoised."""
    key = (kernel, shape, num_drafts, batch_bucket(batch), config, compile_cache.launch_mode())
    fn = _launchers.get(key)
    if fn is None:
        cfg = config if config is not None else picked_config(kernel, shape, batch, num_drafts)[0]
        reason = kernel.check(shape, cfg, num_drafts)
        if reason is not None:
            arg = "config" if config is not None else "cache"
            raise ValueError(f"{kernel.op}: argument '{arg}': the GPU kernel cannot take it: {reason}")
        fn = _launchers[key] = compiled(kernel, shape, cfg, num_drafts)
    return fn


def table_launcher(kind: str, window: int, capacity: int, num_drafts: int, pad_slot_id: int):
    """The callable of a sequence-table kernel (kernels/table.py), memoised: ``kind`` "plan"
    (TablePlan; num_drafts 0 for standard decode) or "commit" (TableCommit)."""
    key = ("table", kind, window, capacity, num_drafts, pad_slot_id, compile_cache.launch_mode())
    fn = _launchers.get(key)
    if fn is None:
        from ..kernels.table import TableShape, compile_commit, compile_plan

        shape = TableShape(window, capacity, num_drafts, pad_slot_id)
        build = compile_plan if kind == "plan" else compile_commit
        fn = _launchers[key] = compile_cache.get_compiled(
            f"table_{kind}", shape.key(), lambda: build(shape, compile_cache.compile_options()))
    return fn


def picked_config(kernel: Kernel, shape, batch: int, num_drafts: int = 0):
    """(config, tuned): the launch config that `kernel` runs `shape` with at `batch` rows and T
    = `num_drafts` when the caller passes no ``config``, and whether it is a tuned one
    (runtime.tuning: the shipped H200 file or the user's file) rather than the analytical
    default. The choice ``launcher`` makes, without compiling anything."""
    bucket = batch_bucket(batch)
    default = kernel.default_config(shape, bucket)
    picked = _tuned_or_default(default, kernel, shape, num_drafts, bucket)
    return picked, picked is not default


def config_from_entry(config_class, fields: dict):
    """The config of class `config_class` a tuned entry's `fields` make, or None where the entry
    has a field the class lacks (a stale file, or the other decode kernel's entry: a tile one where
    the pipelined kernel is the default, or the reverse). A field the entry lacks (one added to the
    class after it was tuned) takes the class's default, not the analytical default's: that may be
    a value the entry's other fields cannot take (two heads an item with a chunk of 4)."""
    try:
        return config_class(**fields)
    except TypeError:
        return None


def _tuned_or_default(default, kernel: Kernel, shape, num_drafts: int, bucket: int):
    """The tuned launch config of `kernel` for `shape`, T = `num_drafts` and this batch bucket
    on the active platform if one is cached and the kernel's check takes it, else `default`."""
    if kernel.name not in tuning.KERNELS:
        return default
    fields = tuning.tuned_fields(kernel.name, shape, num_drafts, bucket, active_platform())
    if fields is None:
        return default
    tuned = config_from_entry(type(default), fields)
    if tuned is None:
        return default
    try:
        reason = kernel.check(shape, tuned, num_drafts)
    except Exception as e:  # a check that fails on a file's values must not fail the decode too
        warnings.warn(f"tuned configs: ignoring the tuned config {tuned} of {kernel.name}: {type(e).__name__}: {e}",
                      RuntimeWarning, stacklevel=2)
        return default
    return tuned if reason is None else default


def active_platform() -> Optional[Platform]:
    """The platform whose tuned configs decode and verify pick: that of the innermost
    ``use_platform``, else this process's (``tuning.current_platform``)."""
    return _platform_override[0] if _platform_override is not None else tuning.current_platform()


@contextlib.contextmanager
def use_platform(platform: Optional[Platform]):
    """Within it, decode and verify look tuned configs up as on `platform` (None: as without a
    GPU, the analytical defaults) instead of this process's GPU: precompile builds what another
    device will pick, tests fake a device. The memoised launchers are dropped on entry and on
    exit, as they were picked for another platform."""
    global _platform_override
    outer, _platform_override = _platform_override, (platform,)
    _launchers.clear()
    try:
        yield
    finally:
        _platform_override = outer
        _launchers.clear()


def reload() -> None:
    """Read the tuned-config files again on the next lookup, and let decode / verify pick their
    configs again (after a tune run, or an edit of a file); the compiled kernels stay in the
    compile cache."""
    tuning.forget_table()
    _launchers.clear()
