"""State pools for ReplaySSM decoding: Mamba2Cache and GDNCache.

Mamba2Cache layout (DESIGN_NOTES.md; slots = pool size, cap = window + max_draft):

* ``checkpoint`` (slots, H, P, N) float32, N contiguous
* ``ring_x``  (slots, cap, H, P) activation dtype      } None when window == 1
* ``ring_B``  (slots, cap, G, N) activation dtype      }
* ``ring_dt`` (slots, cap, H) float32, dt after softplus }

GDNCache layout (HV value heads of size V, H key heads of size K):

* ``checkpoint`` (slots, HV, V, K) float32, K contiguous
* ``ring_u``  (slots, cap, HV, V) float16, corrections u           } None when window == 1
* ``ring_k``  (slots, cap, H, K) activation dtype, normalised keys  }
* ``ring_g``  (slots, cap, HV) float32, log decay g                 }
* ``ring_v``  (slots, cap, HV, V) activation dtype } only with keep_v_beta (two-precision
* ``ring_beta`` (slots, cap, HV) float32           } variant), else None

Both:

* ``cursor``  (slots,) int32: committed records h, 0 <= h < window
* ``origin``  (slots,) int32: ring index of record 0; record i lives at (origin + i) % cap
* ``arrivals`` (slots,) int32: zero between steps; kernel-internal completion counter
* ``read_copy``: None (reserved for the low-precision read copy)

window == 1 is conventional decoding: the checkpoint is the state and there is no ring.
A decode row whose slot id equals ``pad_slot_id`` (-1 or 0) is skipped; with
``pad_slot_id == 0`` slot 0 is reserved and never holds a sequence.
"""

from __future__ import annotations

import math
import operator
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import reference

__all__ = ["Mamba2Cache", "GDNCache"]

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_DRAFT = 16
_IDX_DTYPE = torch.int32
_INDEX_TENSORS = ("cursor", "origin", "arrivals")


def _as_int(name: str, value, minimum: Optional[int] = None) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


class _SlotPool:
    """What every layer's state pool shares: the pool arguments (slots, window, drafts,
    activation dtype, device, pad sentinel), the fp32 checkpoint, the ring tensors, the
    per-slot index tensors, slot-id validation, prefill hand-over and the memory report.

    A subclass names its layer dimensions (``_DIMS``, constructor order), the per-slot
    checkpoint shape (``_STATE_DIMS``), its innermost state dimension (``_INNERMOST``),
    checks its dimensions (``_check_dims``) and lists its ring tensors (``_ring_layout``).
    """

    _DIMS: Tuple[str, ...] = ()
    _STATE_DIMS: Tuple[str, ...] = ()
    _INNERMOST: str = ""
    _REPR_EXTRA: Tuple[str, ...] = ()

    # ------------------------------------------------------------------ subclass hooks

    def _check_dims(self, **dims: int) -> None:
        """Layer-specific checks of the (already int, >= 1) dimensions."""

    def _check_options(self, window: int) -> None:
        """Layer-specific checks of further options against the window."""

    def _ring_layout(self) -> List[Tuple[str, tuple, torch.dtype, bool]]:
        """Ring tensors in order: (name, shape of one record, dtype, kept by this config)."""
        return []

    # ------------------------------------------------------------------ construction

    def _setup_pool(self, num_slots, dims: Sequence, window, max_draft, dtype, device, pad_slot_id,
                    checkpoint: Optional[torch.Tensor]) -> None:
        num_slots = _as_int("num_slots", num_slots, 1)
        dims = {name: _as_int(name, value, 1) for name, value in zip(self._DIMS, dims)}
        window = _as_int("window", window, 1)
        max_draft = _as_int("max_draft", max_draft, 0)
        pad_slot_id = _as_int("pad_slot_id", pad_slot_id)
        self._check_dims(**dims)
        if max_draft > _MAX_DRAFT:
            raise ValueError(f"max_draft must be in [0, {_MAX_DRAFT}], got {max_draft}")
        if window == 1 and max_draft != 0:
            raise ValueError(
                f"max_draft must be 0 when window == 1 (a conventional cache has no ring), got {max_draft}"
            )
        self._check_options(window)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if dtype not in _ACT_DTYPES:
            raise ValueError(f"dtype must be one of torch.bfloat16, torch.float16, torch.float32, got {dtype}")
        if pad_slot_id not in (-1, 0):
            raise ValueError(f"pad_slot_id must be -1 or 0, got {pad_slot_id}")
        if pad_slot_id == 0 and num_slots < 2:
            raise ValueError(
                f"num_slots must be >= 2 when pad_slot_id == 0 (slot 0 is reserved), got {num_slots}"
            )
        try:
            device = torch.device(device)
        except (TypeError, RuntimeError) as e:
            raise TypeError(f"device must be a torch.device or device string, got {device!r}") from e

        self.num_slots = num_slots
        for name, value in dims.items():
            setattr(self, name, value)
        self.window = window
        self.max_draft = max_draft
        self.capacity = window + max_draft
        self.dtype = dtype
        self.pad_slot_id = pad_slot_id

        if checkpoint is None:
            checkpoint = torch.zeros((num_slots,) + self._state_shape, dtype=torch.float32, device=device)
        self.checkpoint = checkpoint
        device = checkpoint.device
        self.device = device

        for name, shape, ring_dtype, kept in self._ring_layout():
            ring = None
            if kept and not self.is_conventional:
                ring = torch.zeros((num_slots, self.capacity) + shape, dtype=ring_dtype, device=device)
            setattr(self, name, ring)
        for name in _INDEX_TENSORS:
            setattr(self, name, torch.zeros((num_slots,), dtype=_IDX_DTYPE, device=device))
        self.read_copy = None

    @classmethod
    def _check_engine_state(cls, state) -> None:
        """Validate an engine's state pool for ``from_state``: fp32, contiguous, right rank."""
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"state must be a torch.Tensor, got {type(state).__name__}")
        if state.dim() != 1 + len(cls._STATE_DIMS):
            raise ValueError(
                f"state must have shape (slots, {', '.join(cls._STATE_DIMS)}), got {tuple(state.shape)}"
            )
        if state.dtype != torch.float32:
            raise ValueError(f"state must be float32, got {state.dtype}")
        if not state.is_contiguous():
            raise ValueError(f"state must be contiguous ({cls._INNERMOST} innermost)")

    # ------------------------------------------------------------------ properties / helpers

    @property
    def _state_shape(self) -> tuple:
        """Shape of one slot's checkpoint."""
        return tuple(getattr(self, name) for name in self._STATE_DIMS)

    @property
    def is_conventional(self) -> bool:
        """True when window == 1: plain conventional decoding, no ring."""
        return self.window == 1

    def _slot_ids(self, slot_ids, name: str = "slot_ids", allow_duplicates: bool = False) -> list:
        if isinstance(slot_ids, torch.Tensor):
            if slot_ids.dim() != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(slot_ids.shape)}")
            if slot_ids.dtype.is_floating_point or slot_ids.dtype.is_complex or slot_ids.dtype == torch.bool:
                raise TypeError(f"{name} must hold integers, got {slot_ids.dtype}")
            ids = [int(s) for s in slot_ids.tolist()]
        else:
            try:
                ids = [_as_int(name, s) for s in slot_ids]
            except TypeError:
                raise TypeError(f"{name} must be an integer tensor or a sequence of ints") from None
        for s in ids:
            if not 0 <= s < self.num_slots:
                raise ValueError(f"{name} entry {s} is outside [0, num_slots={self.num_slots})")
            if self.pad_slot_id == 0 and s == 0:
                raise ValueError(f"{name} names slot 0, which is reserved when pad_slot_id == 0")
        if not allow_duplicates and len(set(ids)) != len(ids):
            raise ValueError(f"{name} names a slot more than once: {ids}")
        return ids

    # ------------------------------------------------------------------ public API

    def load_prefill(self, slot_ids: Union[torch.Tensor, Sequence[int]], state: torch.Tensor) -> None:
        """Hand over prefill states: checkpoint[slot] = state (cast to fp32), cursor = origin = 0.

        state: (n, *checkpoint shape of one slot), any floating dtype, one entry per slot id.
        """
        ids = self._slot_ids(slot_ids)
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"state must be a torch.Tensor, got {type(state).__name__}")
        if not state.dtype.is_floating_point:
            raise TypeError(f"state must be a floating-point tensor, got {state.dtype}")
        expected = (len(ids),) + self._state_shape
        if tuple(state.shape) != expected:
            raise ValueError(f"state must have shape {expected}, got {tuple(state.shape)}")
        if not ids:
            return
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.checkpoint[idx] = state.to(device=self.device, dtype=torch.float32)
        self.cursor[idx] = 0
        self.origin[idx] = 0

    def memory_per_slot(self) -> Dict[str, int]:
        """Bytes per slot of every tensor (0 for a ring this configuration does not keep),
        plus "total"."""
        sizes = {"checkpoint": math.prod(self._state_shape) * 4}
        for name, shape, ring_dtype, kept in self._ring_layout():
            kept = kept and not self.is_conventional
            itemsize = torch.empty((), dtype=ring_dtype).element_size()
            sizes[name] = self.capacity * math.prod(shape) * itemsize if kept else 0
        idx = torch.empty((), dtype=_IDX_DTYPE).element_size()
        for name in _INDEX_TENSORS:
            sizes[name] = idx
        sizes["total"] = sum(sizes.values())
        return sizes

    def __repr__(self) -> str:
        fields = ("num_slots",) + self._DIMS + ("window", "max_draft", "capacity", "dtype", "device",
                                                  "pad_slot_id") + self._REPR_EXTRA
        return f"{type(self).__name__}(" + ", ".join(f"{f}={getattr(self, f)}" for f in fields) + ")"


class Mamba2Cache(_SlotPool):
    """State pool of one Mamba-2 layer: fp32 checkpoints plus a ring of input records.

    Args:
        num_slots: pool size (sequences that can be held at once; with pad_slot_id == 0
            slot 0 is reserved, so num_slots - 1 are usable).
        nheads, headdim, dstate, ngroups: H, P, N, G of the layer (this shard).
        window: ReplaySSM window L (>= 1); 1 means conventional decoding (no ring).
        max_draft: ring room for speculative drafts, 0..16 (must be 0 when window == 1).
        dtype: activation dtype of ring_x / ring_B: bfloat16, float16 or float32.
        device: where the tensors live.
        pad_slot_id: slot id of padding rows, -1 or 0.
    """

    _DIMS = ("nheads", "headdim", "dstate", "ngroups")
    _STATE_DIMS = ("nheads", "headdim", "dstate")
    _INNERMOST = "N"

    def __init__(
        self,
        num_slots: int,
        nheads: int,
        headdim: int,
        dstate: int,
        ngroups: int,
        *,
        window: int = 16,
        max_draft: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        device: Union[str, torch.device] = "cpu",
        pad_slot_id: int = -1,
    ) -> None:
        self._setup_pool(num_slots, (nheads, headdim, dstate, ngroups), window, max_draft, dtype, device,
                         pad_slot_id, checkpoint=None)

    def _check_dims(self, nheads, headdim, dstate, ngroups) -> None:
        if nheads % ngroups != 0:
            raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")

    def _ring_layout(self):
        return [
            ("ring_x", (self.nheads, self.headdim), self.dtype, True),
            ("ring_B", (self.ngroups, self.dstate), self.dtype, True),
            ("ring_dt", (self.nheads,), torch.float32, True),
        ]

    @classmethod
    def from_state(
        cls,
        state: torch.Tensor,
        ngroups: int,
        *,
        window: int = 1,
        max_draft: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        pad_slot_id: int = -1,
    ) -> "Mamba2Cache":
        """Wrap an engine's state pool (slots, H, P, N) float32, contiguous, without copying.

        The returned cache's ``checkpoint`` IS ``state``: decoding updates the engine's
        tensor in place. With window > 1 the ring and the index tensors are allocated on
        the state's device; cursors start at 0, so ``state`` is taken as the current state
        of every slot.
        """
        cls._check_engine_state(state)
        slots, H, P, N = state.shape
        obj = cls.__new__(cls)
        obj._setup_pool(slots, (H, P, N, ngroups), window, max_draft, dtype, state.device, pad_slot_id,
                        checkpoint=state)
        return obj

    def materialize(self, slot_ids: Union[torch.Tensor, Sequence[int]], A: torch.Tensor) -> torch.Tensor:
        """Current state of each slot, float64 (n, H, P, N): checkpoint + replay of its records."""
        ids = self._slot_ids(slot_ids, allow_duplicates=True)
        return reference.mamba2_materialize(self, ids, A)


_GDN_DIM_MULTIPLE = 16
_GDN_MAX_DIM = 256


class GDNCache(_SlotPool):
    """State pool of one Gated DeltaNet layer: fp32 checkpoints plus a ring of records.

    A record holds the token's correction u (fp16), its normalised key k (activation dtype,
    once per key head) and its log decay g (fp32); with ``keep_v_beta`` also v (activation
    dtype) and beta (fp32), which the two-precision variant needs to re-derive u at a flush.

    Args:
        num_slots: pool size (with pad_slot_id == 0 slot 0 is reserved).
        num_v_heads, head_v_dim, head_k_dim, num_k_heads: HV, V, K, H of the layer (this
            shard); HV a multiple of H; V and K multiples of 16 up to 256.
        window: ReplaySSM window L (>= 1); 1 means conventional decoding (no ring).
        max_draft: ring room for speculative drafts, 0..16 (must be 0 when window == 1).
        dtype: activation dtype of ring_k (and ring_v): bfloat16, float16 or float32.
        device: where the tensors live.
        pad_slot_id: slot id of padding rows, -1 or 0.
        keep_v_beta: also keep v and beta per record (must be False when window == 1).
    """

    _DIMS = ("num_v_heads", "head_v_dim", "head_k_dim", "num_k_heads")
    _STATE_DIMS = ("num_v_heads", "head_v_dim", "head_k_dim")
    _INNERMOST = "K"
    _REPR_EXTRA = ("keep_v_beta",)

    def __init__(
        self,
        num_slots: int,
        num_v_heads: int,
        head_v_dim: int,
        head_k_dim: int,
        num_k_heads: int,
        *,
        window: int = 16,
        max_draft: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        device: Union[str, torch.device] = "cpu",
        pad_slot_id: int = -1,
        keep_v_beta: bool = False,
    ) -> None:
        self._setup(num_slots, (num_v_heads, head_v_dim, head_k_dim, num_k_heads), window, max_draft, dtype,
                    device, pad_slot_id, keep_v_beta, checkpoint=None)

    def _setup(self, num_slots, dims, window, max_draft, dtype, device, pad_slot_id, keep_v_beta,
               checkpoint: Optional[torch.Tensor]) -> None:
        if not isinstance(keep_v_beta, bool):
            raise TypeError(f"keep_v_beta must be a bool, got {type(keep_v_beta).__name__}")
        self.keep_v_beta = keep_v_beta
        self._setup_pool(num_slots, dims, window, max_draft, dtype, device, pad_slot_id, checkpoint)

    def _check_dims(self, num_v_heads, head_v_dim, head_k_dim, num_k_heads) -> None:
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
        for name, d in (("head_v_dim", head_v_dim), ("head_k_dim", head_k_dim)):
            if d % _GDN_DIM_MULTIPLE != 0 or d > _GDN_MAX_DIM:
                raise ValueError(
                    f"{name} must be a multiple of {_GDN_DIM_MULTIPLE} in "
                    f"[{_GDN_DIM_MULTIPLE}, {_GDN_MAX_DIM}], got {d}"
                )

    def _check_options(self, window: int) -> None:
        if window == 1 and self.keep_v_beta:
            raise ValueError("keep_v_beta must be False when window == 1 (a conventional cache has no ring)")

    def _ring_layout(self):
        HV, V, K, H = self.num_v_heads, self.head_v_dim, self.head_k_dim, self.num_k_heads
        return [
            ("ring_u", (HV, V), torch.float16, True),
            ("ring_k", (H, K), self.dtype, True),
            ("ring_g", (HV,), torch.float32, True),
            ("ring_v", (HV, V), self.dtype, self.keep_v_beta),
            ("ring_beta", (HV,), torch.float32, self.keep_v_beta),
        ]

    @classmethod
    def from_state(
        cls,
        state: torch.Tensor,
        num_k_heads: int,
        *,
        window: int = 1,
        max_draft: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        pad_slot_id: int = -1,
        keep_v_beta: bool = False,
    ) -> "GDNCache":
        """Wrap an engine's state pool (slots, HV, V, K) float32, contiguous, without copying.

        The returned cache's ``checkpoint`` IS ``state``: decoding updates the engine's
        tensor in place. With window > 1 the ring and the index tensors are allocated on
        the state's device; cursors start at 0, so ``state`` is taken as the current state
        of every slot.
        """
        cls._check_engine_state(state)
        slots, HV, V, K = state.shape
        obj = cls.__new__(cls)
        obj._setup(slots, (HV, V, K, num_k_heads), window, max_draft, dtype, state.device, pad_slot_id,
                   keep_v_beta, checkpoint=state)
        return obj

    def materialize(self, slot_ids: Union[torch.Tensor, Sequence[int]]) -> torch.Tensor:
        """Current state of each slot, float64 (n, HV, V, K): checkpoint + replay of its records."""
        ids = self._slot_ids(slot_ids, allow_duplicates=True)
        return reference.gdn_materialize(self, ids)
