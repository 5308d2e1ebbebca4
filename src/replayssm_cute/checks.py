"""Argument checks that every op (replayssm_cute.api) and every layer adapter
(replayssm_cute.layers) share: the error form, tensors outside autograd, token tensors, slot ids
and debug mode's host-side checks.

Errors are ``ValueError("decode: argument '<name>': expected ..., got ...")``; api renames the
``decode:`` prefix to the op that raised it.
"""

from __future__ import annotations

import operator
import os
from typing import Optional

import torch

from .kernels.limits import MAX_DRAFT


def fail(name: str, expected: str, got) -> None:
    raise ValueError(f"decode: argument '{name}': expected {expected}, got {got}")


def no_autograd(name: str, t: torch.Tensor) -> None:
    """The steps are inference-only: refuse a tensor that requires grad while autograd records
    (the CPU path would pull the cache into the graph)."""
    if t.requires_grad and torch.is_grad_enabled():
        fail(name, f"a tensor outside autograd (the kernels are inference-only: call under torch.no_grad() or "
             f"torch.inference_mode(), or pass {name}.detach())", "requires_grad=True with grad mode on")


def activation(name: str, t: torch.Tensor, shape: tuple, dtype, device, aligned: bool = True) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    no_autograd(name, t)
    if tuple(t.shape) != shape:
        fail(name, f"shape {shape}", tuple(t.shape))
    if t.dtype != dtype:
        fail(name, f"dtype {dtype} (the cache's activation dtype; no implicit casts)", t.dtype)
    if t.device != device:
        fail(name, f"a tensor on {device}", t.device)
    # The kernels take any batch stride but need the inner dims packed.
    inner = [1]
    for d in reversed(shape[2:]):
        inner.insert(0, inner[0] * d)
    if shape[0] > 0 and tuple(t.stride()[1:]) != tuple(inner[-(len(shape) - 1):]) and t.numel() > 0:
        fail(name, f"inner dims contiguous (strides (*, {', '.join(map(str, inner[-(len(shape) - 1):]))}))",
             f"strides {t.stride()}")
    # Rows load as 16-byte vectors on the GPU: base and batch stride must be 16-byte aligned.
    if aligned and device.type == "cuda" and (t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16):
        fail(name, "a 16-byte aligned base address and batch stride",
             f"address {t.data_ptr():#x}, batch stride {t.stride(0)} elements")
    return t


def slot_ids(slot_ids, b: int, device) -> torch.Tensor:
    if not isinstance(slot_ids, torch.Tensor) or slot_ids.dtype != torch.int32 or tuple(slot_ids.shape) != (b,):
        fail("slot_ids", f"an int32 tensor of shape ({b},)",
             f"{getattr(slot_ids, 'dtype', type(slot_ids).__name__)} {tuple(getattr(slot_ids, 'shape', ()))}")
    if slot_ids.device != device or not slot_ids.is_contiguous():
        fail("slot_ids", f"a contiguous tensor on {device}", f"{slot_ids.device}, strides {slot_ids.stride()}")
    return slot_ids


def row_counts(name: str, t, b: int, device) -> None:
    """A per-row count tensor (commit's num_accepted, a verify plan's draft counts): a contiguous
    int32 tensor of shape (b,) on `device`."""
    if (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (b,) or t.device != device
            or not t.is_contiguous()):
        fail(name, f"a contiguous int32 tensor of shape ({b},) on {device}",
             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def slots_in_pool(cache, slot_ids: torch.Tensor) -> None:
    """Debug mode: host-side slot checks (synchronises)."""
    ids = slot_ids.tolist()
    live = [s for s in ids if s != cache.pad_slot_id]
    bad = [s for s in live if not 0 <= s < cache.num_slots or (cache.pad_slot_id == 0 and s == 0)]
    if bad:
        raise IndexError(f"decode: slot_ids {bad[:8]} outside the pool of {cache.num_slots} slots "
                         f"(pad sentinel {cache.pad_slot_id})")
    if len(set(live)) != len(live):
        raise ValueError("decode: slot_ids name the same slot twice in one step")


def debug_enabled() -> bool:
    return os.environ.get("REPLAYSSM_CUTE_DEBUG", "0") not in ("", "0")


def debug_host_checks(device) -> bool:
    """Debug mode's host-side checks run now: debug on and no CUDA graph being captured (they
    read device tensors back, which synchronises)."""
    return debug_enabled() and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def as_int(name: str, value, minimum: Optional[int] = None) -> int:
    """A constructor's integer argument: an int (not a bool), at least `minimum`; else a
    TypeError / ValueError naming it."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


def pool_arguments(num_slots, window, max_draft, pad_slot_id, device):
    """The pool arguments a cache and its sequence table share, checked (errors name the
    argument) and normalised: (num_slots, window, max_draft, pad_slot_id, torch.device)."""
    num_slots = as_int("num_slots", num_slots, 1)
    window = as_int("window", window, 1)
    max_draft = as_int("max_draft", max_draft, 0)
    pad_slot_id = as_int("pad_slot_id", pad_slot_id)
    if max_draft > MAX_DRAFT:
        raise ValueError(f"max_draft must be in [0, {MAX_DRAFT}], got {max_draft}")
    if window == 1 and max_draft != 0:
        raise ValueError(f"max_draft must be 0 when window == 1 (a conventional pool has no ring), got {max_draft}")
    if pad_slot_id not in (-1, 0):
        raise ValueError(f"pad_slot_id must be -1 or 0, got {pad_slot_id}")
    if pad_slot_id == 0 and num_slots < 2:
        raise ValueError(f"num_slots must be >= 2 when pad_slot_id == 0 (slot 0 is reserved), got {num_slots}")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise TypeError(f"device must be a torch.device or device string, got {device!r}") from e
    return num_slots, window, max_draft, pad_slot_id, device
