"""Mamba2Cache: the per-layer state pool for ReplaySSM decoding.

Layout (DESIGN_NOTES.md; slots = pool size, cap = window + max_draft):

* ``checkpoint`` (slots, H, P, N) float32, N contiguous
* ``ring_x``  (slots, cap, H, P) activation dtype      } None when window == 1
* ``ring_B``  (slots, cap, G, N) activation dtype      }
* ``ring_dt`` (slots, cap, H) float32, dt after softplus }
* ``cursor``  (slots,) int32: committed records h, 0 <= h < window
* ``origin``  (slots,) int32: ring index of record 0; record i lives at (origin + i) % cap
* ``arrivals`` (slots,) int32: zero between steps; kernel-internal completion counter
* ``read_copy``: None (reserved for the low-precision read copy)

window == 1 is conventional decoding: the checkpoint is the state and there is no ring.
A decode row whose slot id equals ``pad_slot_id`` (-1 or 0) is skipped; with
``pad_slot_id == 0`` slot 0 is reserved and never holds a sequence.
"""

from __future__ import annotations

import operator
from typing import Dict, Optional, Sequence, Union

import torch

from . import reference

__all__ = ["Mamba2Cache"]

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_DRAFT = 16
_IDX_DTYPE = torch.int32


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


class Mamba2Cache:
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
        self._setup(num_slots, nheads, headdim, dstate, ngroups, window, max_draft, dtype, device,
                    pad_slot_id, checkpoint=None)

    # ------------------------------------------------------------------ construction

    def _setup(self, num_slots, nheads, headdim, dstate, ngroups, window, max_draft, dtype, device,
               pad_slot_id, checkpoint: Optional[torch.Tensor]) -> None:
        num_slots = _as_int("num_slots", num_slots, 1)
        nheads = _as_int("nheads", nheads, 1)
        headdim = _as_int("headdim", headdim, 1)
        dstate = _as_int("dstate", dstate, 1)
        ngroups = _as_int("ngroups", ngroups, 1)
        window = _as_int("window", window, 1)
        max_draft = _as_int("max_draft", max_draft, 0)
        pad_slot_id = _as_int("pad_slot_id", pad_slot_id)
        if nheads % ngroups != 0:
            raise ValueError(f"nheads ({nheads}) must be a multiple of ngroups ({ngroups})")
        if max_draft > _MAX_DRAFT:
            raise ValueError(f"max_draft must be in [0, {_MAX_DRAFT}], got {max_draft}")
        if window == 1 and max_draft != 0:
            raise ValueError(
                f"max_draft must be 0 when window == 1 (a conventional cache has no ring), got {max_draft}"
            )
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
        self.nheads = nheads
        self.headdim = headdim
        self.dstate = dstate
        self.ngroups = ngroups
        self.window = window
        self.max_draft = max_draft
        self.capacity = window + max_draft
        self.dtype = dtype
        self.pad_slot_id = pad_slot_id

        if checkpoint is None:
            checkpoint = torch.zeros((num_slots, nheads, headdim, dstate), dtype=torch.float32, device=device)
        self.checkpoint = checkpoint
        device = checkpoint.device
        self.device = device

        if window == 1:
            self.ring_x = None
            self.ring_B = None
            self.ring_dt = None
        else:
            cap = self.capacity
            self.ring_x = torch.zeros((num_slots, cap, nheads, headdim), dtype=dtype, device=device)
            self.ring_B = torch.zeros((num_slots, cap, ngroups, dstate), dtype=dtype, device=device)
            self.ring_dt = torch.zeros((num_slots, cap, nheads), dtype=torch.float32, device=device)
        self.cursor = torch.zeros((num_slots,), dtype=_IDX_DTYPE, device=device)
        self.origin = torch.zeros((num_slots,), dtype=_IDX_DTYPE, device=device)
        self.arrivals = torch.zeros((num_slots,), dtype=_IDX_DTYPE, device=device)
        self.read_copy = None

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
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"state must be a torch.Tensor, got {type(state).__name__}")
        if state.dim() != 4:
            raise ValueError(f"state must have shape (slots, nheads, headdim, dstate), got {tuple(state.shape)}")
        if state.dtype != torch.float32:
            raise ValueError(f"state must be float32, got {state.dtype}")
        if not state.is_contiguous():
            raise ValueError("state must be contiguous (N innermost)")
        slots, H, P, N = state.shape
        obj = cls.__new__(cls)
        obj._setup(slots, H, P, N, ngroups, window, max_draft, dtype, state.device, pad_slot_id,
                   checkpoint=state)
        return obj

    # ------------------------------------------------------------------ properties / helpers

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

        state: (n, H, P, N), any floating dtype, one entry per slot id.
        """
        ids = self._slot_ids(slot_ids)
        if not isinstance(state, torch.Tensor):
            raise TypeError(f"state must be a torch.Tensor, got {type(state).__name__}")
        if not state.dtype.is_floating_point:
            raise TypeError(f"state must be a floating-point tensor, got {state.dtype}")
        expected = (len(ids), self.nheads, self.headdim, self.dstate)
        if tuple(state.shape) != expected:
            raise ValueError(f"state must have shape {expected}, got {tuple(state.shape)}")
        if not ids:
            return
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.checkpoint[idx] = state.to(device=self.device, dtype=torch.float32)
        self.cursor[idx] = 0
        self.origin[idx] = 0

    def materialize(self, slot_ids: Union[torch.Tensor, Sequence[int]], A: torch.Tensor) -> torch.Tensor:
        """Current state of each slot, float64 (n, H, P, N): checkpoint + replay of its records."""
        ids = self._slot_ids(slot_ids, allow_duplicates=True)
        return reference.mamba2_materialize(self, ids, A)

    def memory_per_slot(self) -> Dict[str, int]:
        """Bytes per slot of every tensor, plus "total"."""
        H, P, N, G, cap = self.nheads, self.headdim, self.dstate, self.ngroups, self.capacity
        act = torch.empty((), dtype=self.dtype).element_size()
        ring = not self.is_conventional
        idx = torch.empty((), dtype=_IDX_DTYPE).element_size()
        sizes = {
            "checkpoint": H * P * N * 4,
            "ring_x": cap * H * P * act if ring else 0,
            "ring_B": cap * G * N * act if ring else 0,
            "ring_dt": cap * H * 4 if ring else 0,
            "cursor": idx,
            "origin": idx,
            "arrivals": idx,
        }
        sizes["total"] = sum(sizes.values())
        return sizes

    def __repr__(self) -> str:
        return (
            f"Mamba2Cache(num_slots={self.num_slots}, nheads={self.nheads}, headdim={self.headdim}, "
            f"dstate={self.dstate}, ngroups={self.ngroups}, window={self.window}, "
            f"max_draft={self.max_draft}, capacity={self.capacity}, dtype={self.dtype}, "
            f"device={self.device}, pad_slot_id={self.pad_slot_id})"
        )
