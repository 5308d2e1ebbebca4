"""State pools for ReplaySSM decoding: Mamba2Cache and GDNCache.

Mamba2Cache layout (docs/design.md section 8; slots = pool size, cap = window + max_draft):

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

* ``table``: the ``SequenceTable`` of the slots' ring positions, shared by every layer cache of
  a model made with ``table=`` (else the cache's own): ``cursor`` (its ``committed``), (slots,)
  int32, committed records h, 0 <= h <= window; ``origin`` (slots,) int32, ring index of record
  0 (record i lives at (origin + i) % cap); ``sr_counter`` (its ``sr_writes``) with an SR
  checkpoint. The layer kernels read them through a step's plan and never write them
  (replayssm_cute.table).
* ``read_copy``: None, or the low-precision read copy (below)

window == 1 is conventional decoding: the checkpoint is the state and there is no ring.
A decode row whose slot id equals ``pad_slot_id`` (-1 or 0) is skipped; with
``pad_slot_id == 0`` slot 0 is reserved and never holds a sequence.

Shapes. A cache on the CPU is the float64 reference backend and takes any shape. A cache on
any other device must be one the GPU kernels run, checked at construction: Mamba-2 headdim a
multiple of 16 and dstate a multiple of 32 up to 256, GDN head_v_dim and head_k_dim multiples
of 16 up to 256, and window + max_draft (the ring) at most 32 (one lane per record).

Speculative protocol. ``api.verify`` leaves ``pending_verify`` set (``pending_drafts`` is its
T) until ``api.commit`` consumes it: verify, then commit, then anything else. Meanwhile every
other op on the cache that reads or writes slot state (decode, verify, load_prefill,
materialize, read_state) is refused, since the drafts sit in the ring behind positions that
only the commit makes consistent. The pending verify is the table's: on a shared table it
holds every layer of the model (replayssm_cute.table).

Low-precision state (docs/design.md section 5; ``checkpoint_format``, ``read_copy``, ``shared``)
---------------------------------------------------------------------------------------------------
Two roles: the **recurrence checkpoint** ``checkpoint`` (what a flush reads and rebuilds from)
and the **read copy** ``read_copy`` (what non-flush steps read; never read back into the
recurrence). Configurations:

* ``checkpoint_format``: "fp32" (default), "fp16" or "fp8"; low precision is written with
  stochastic rounding (SR). "nvfp4" only as a single checkpoint (``shared`` or window == 1).
* ``read_copy``: None (default: non-flush steps read the checkpoint), "fp16", "fp8" or "nvfp4",
  written with round-to-nearest-even (RTN). Must be None when window == 1.
* ``shared=True``: one low-precision checkpoint (SR) serves both roles: the paper's comparison
  point. A low-precision ``checkpoint_format`` with ``read_copy=None`` is that configuration
  whether or not ``shared=True`` is passed (``cache.shared`` says so).
* window == 1 with a low-precision ``checkpoint_format``: conventional decoding with a
  low-precision state, SR-written at every step.

Every write (``load_prefill`` and each flush; every step at window 1) casts one fp32 state
independently into each copy (never one copy from the other): SR into a low-precision
checkpoint, RTN into the read copy. Storage follows ``replayssm_cute.quant`` exactly (``S`` =
the per-slot state dims, (H, P, N) or (HV, V, K); K = N or head_k_dim the innermost dim; the
prefix is ``checkpoint`` or ``read_copy``):

=========  ======================================  ==============================  ===========================
format     ``<prefix>``                            ``<prefix>_scale``              ``<prefix>_state_scale``
=========  ======================================  ==============================  ===========================
fp32       (slots, *S) float32                     None                            None
fp16       (slots, *S) float16                     None                            None
fp8        (slots, *S) float8_e4m3fn               (slots, *S[:-1], K / bk) fp32   None
nvfp4      (slots, *S[:-1], K / 2) uint8 (E2M1,    (slots, *S[:-1], K / 16)        (slots, S[0]) float32,
           element 2i in the low nibble)           float8_e4m3fn                   a power of two
=========  ======================================  ==============================  ===========================

fp8's block ``bk`` is 128 when K is a multiple of 128, else K (one scale per state row). Decoded
values are ``quant.FORMATS[fmt].decode(data, scales)`` (``read_state``).

Stochastic-rounding bits. ``sr_seed`` (1,) int64 on the device (its low 32 bits are the seed;
``cache.sr_seed.fill_(seed)`` reseeds) and ``sr_counter`` (slots,) int32, the number of SR
writes of each slot so far (both None with an fp32 checkpoint). The w-th SR write of slot s
(w = sr_counter[s] before the write, taken mod 2^32) rounds element e of the slot's state with
the 32 bits ::

    key_s = sr_bits(seed, s);  key_w = sr_bits(key_s, w);  r[e] = sr_bits(key_w, e)

(``quant.sr_bits(seed, offset) = fmix32(offset ^ fmix32(seed ^ 0x9E3779B9))``, a key passed
on as the next seed as its uint32 pattern), e the flat index of the element in the slot's
full-precision state, ``e = (head * S[1] + row) * K + col``, and then ``sr_counter[s] = w +
1``. A kernel computes key_w once per CTA from the counter in the step's plan; the table's
plan (decode) or commit (verify) advances the counter, so CUDA-graph replays draw fresh bits and
a fixed seed reproduces a run. Layers sharing a table share the counter (every layer of a
sequence flushes at the same steps) and differ by their seeds. Why not one flat 32-bit offset: sr_bits depends on offset ^ key
only, so an offset cannot hold (write, slot, element) for a pool of ~2^30 elements without
wrapping within a few steps; keying by (slot, write) keeps every element of one write
distinct and changes the stream at every write.

GDN with a read copy also keeps (v, beta) per record (``keep_v_beta`` is forced on) and by
default re-derives every correction at a flush from the recurrence checkpoint and (beta, v,
k, g) (``flush_corrections="rederive"``, paper Algorithm 6); ``"fold"`` folds the cached ones.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from . import checks, quant, reference
from .kernels.limits import MAX_CAPACITY
from .table import SequenceTable, StepPlan

__all__ = ["Mamba2Cache", "GDNCache", "checkpoint_sr_bits", "CHECKPOINT_FORMATS",
           "READ_COPY_FORMATS"]

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

CHECKPOINT_FORMATS = ("fp32", "fp16", "fp8", "nvfp4")  # nvfp4: shared or window == 1 only
READ_COPY_FORMATS = (None, "fp16", "fp8", "nvfp4")
_COPIES = ("checkpoint", "read_copy")  # prefixes of the two state copies' tensors
_SCALE_SUFFIXES = ("_scale", "_state_scale")
_SEED_MASK = (1 << 32) - 1


def _format(name: str, K: int):
    """The quant format object of ``name`` for a state with innermost dim K (None for fp32)."""
    if name == "fp32":
        return None
    if name == "fp8":
        return quant.FP8E4M3(block_k=128 if K % 128 == 0 else K)
    return quant.FORMATS[name]


def _copy_layout(name: str, state_shape: tuple) -> List[Tuple[str, tuple, torch.dtype]]:
    """Per-slot tensors of one state copy in format ``name``: (suffix, shape, dtype), data first,
    then the scales in quant's order (module docstring)."""
    K = state_shape[-1]
    rows = state_shape[:-1]
    if name in ("fp32", "fp16"):
        return [("", state_shape, torch.float32 if name == "fp32" else torch.float16)]
    if name == "fp8":
        bk = _format(name, K).block_k
        return [("", state_shape, torch.float8_e4m3fn), ("_scale", rows + (K // bk,), torch.float32)]
    return [("", rows + (K // 2,), torch.uint8), ("_scale", rows + (K // 16,), torch.float8_e4m3fn),
            ("_state_scale", state_shape[:-2], torch.float32)]


def checkpoint_sr_bits(seed, slot, counter, state_shape: Sequence[int], device=None) -> torch.Tensor:
    """The SR bits of write ``counter`` of slot ``slot`` (module docstring): int32 ``state_shape``;
    with ``slot`` and ``counter`` integer tensors (n,), the bits of n writes (n, *state_shape)
    computed on the device, without a host read.

    ``seed``: an int or the cache's ``sr_seed`` tensor (low 32 bits used); ``counter`` is taken
    mod 2^32. ``r[e] = sr_bits(sr_bits(sr_bits(seed, slot), counter), e)``, e the flat index.
    """
    if isinstance(seed, torch.Tensor):
        device = seed.device if device is None else device
        seed = seed.reshape(-1)[0].to(device=device, dtype=torch.int64)

    def word(v):
        v = v.to(device=device, dtype=torch.int64) if isinstance(v, torch.Tensor) else torch.tensor(v, device=device)
        return v & _SEED_MASK

    key = quant.sr_bits(quant.sr_bits(seed, word(slot)), word(counter))
    flat = torch.arange(math.prod(state_shape), dtype=torch.int64, device=device)
    return quant.sr_bits(key.unsqueeze(-1), flat).view(tuple(key.shape) + tuple(state_shape))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """E4M3 codes as uint8 (selects and scatters of float8 tensors are not implemented everywhere)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class _SlotPool:
    """What every layer's state pool shares: the pool arguments (slots, window, drafts,
    activation dtype, device, pad sentinel), the fp32 checkpoint, the ring tensors, the
    per-slot index tensors, slot-id validation, prefill hand-over and the memory report.

    A subclass names its layer dimensions (``_DIMS``, constructor order), the per-slot
    checkpoint shape (``_STATE_DIMS``), its innermost state dimension (``_INNERMOST``), the
    GPU kernels' range of its dimensions (``_KERNEL_DIMS``), checks its dimensions
    (``_check_dims``) and lists its ring tensors (``_ring_layout``).
    """

    _DIMS: Tuple[str, ...] = ()
    _STATE_DIMS: Tuple[str, ...] = ()
    _INNERMOST: str = ""
    # (dimension, the multiple the kernels need, their maximum or None) for a cache off the CPU
    _KERNEL_DIMS: Tuple[Tuple[str, int, Optional[int]], ...] = ()
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
                    checkpoint: Optional[torch.Tensor], checkpoint_format="fp32", read_copy=None,
                    shared=False, sr_seed=None, table: Optional[SequenceTable] = None) -> None:
        num_slots, window, max_draft, pad_slot_id, device = checks.pool_arguments(
            num_slots, window, max_draft, pad_slot_id, device)
        dims = {name: checks.as_int(name, value, 1) for name, value in zip(self._DIMS, dims)}
        self._check_dims(**dims)
        self._check_precision(checkpoint_format, read_copy, shared, sr_seed, window, dims)
        self._check_options(window)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if dtype not in _ACT_DTYPES:
            raise ValueError(f"dtype must be one of torch.bfloat16, torch.float16, torch.float32, got {dtype}")
        if checkpoint is not None:  # from_state: the engine's fp32 pool is the checkpoint
            device = checkpoint.device
        if table is not None:
            if not isinstance(table, SequenceTable):
                raise TypeError(f"table must be None or a SequenceTable, got {type(table).__name__}")
            diff = table.mismatch(num_slots, window, max_draft, device, pad_slot_id)
            if diff is not None:
                raise ValueError(f"table: a cache shares a SequenceTable made with its own pool arguments; got {diff}")
        if device.type != "cpu":
            self._check_kernel_range(dims, window, max_draft, device)

        self.num_slots = num_slots
        for name, value in dims.items():
            setattr(self, name, value)
        self.window = window
        self.max_draft = max_draft
        self.capacity = window + max_draft
        self.dtype = dtype
        self.pad_slot_id = pad_slot_id

        self._allocate_copies(num_slots, device, checkpoint)
        device = self.checkpoint.device
        self.device = device

        for name, shape, ring_dtype, kept in self._ring_layout():
            ring = None
            if kept and not self.is_conventional:
                ring = torch.zeros((num_slots, self.capacity) + shape, dtype=ring_dtype, device=device)
            setattr(self, name, ring)
        self.owns_table = table is None
        self.table = SequenceTable(num_slots, window, max_draft, device=device, pad_slot_id=pad_slot_id) \
            if table is None else table
        self.sr_seed = None
        if self.checkpoint_format != "fp32":
            self.sr_seed = torch.tensor([self._sr_seed_value], dtype=torch.int64, device=device)

    def _check_kernel_range(self, dims: dict, window: int, max_draft: int, device) -> None:
        """A cache off the CPU must have a shape the GPU kernels run (``_KERNEL_DIMS`` and the
        ring); the CPU cache, the float64 reference backend, takes any shape."""
        where = (f"for a cache on {device} (the GPU kernels' range; a cache on the CPU, the float64 reference "
                 f"backend, takes any shape)")
        for name, multiple, maximum in self._KERNEL_DIMS:
            d = dims[name]
            if d % multiple or (maximum is not None and d > maximum):
                bound = "" if maximum is None else f" in [{multiple}, {maximum}]"
                raise ValueError(f"{name} must be a multiple of {multiple}{bound} {where}, got {d}")
        if window + max_draft > MAX_CAPACITY:
            raise ValueError(
                f"window + max_draft (the ring capacity) must be at most {MAX_CAPACITY} {where}: one lane "
                f"per record, got window {window} + max_draft {max_draft} = {window + max_draft}"
            )

    def _check_precision(self, checkpoint_format, read_copy, shared, sr_seed, window: int, dims: dict) -> None:
        """Validate and record the state formats (module docstring); errors name the argument."""
        if not isinstance(checkpoint_format, str) or checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
        if read_copy is not None and (not isinstance(read_copy, str) or read_copy not in READ_COPY_FORMATS):
            raise ValueError(f"read_copy must be None or one of {READ_COPY_FORMATS[1:]}, got {read_copy!r}")
        if not isinstance(shared, bool):
            raise TypeError(f"shared must be a bool, got {type(shared).__name__}")
        if shared and checkpoint_format == "fp32":
            raise ValueError(
                "shared=True needs a low-precision checkpoint_format ('fp16', 'fp8' or 'nvfp4'): the shared "
                "configuration is one low-precision checkpoint serving both roles, got checkpoint_format='fp32'"
            )
        if shared and read_copy is not None:
            raise ValueError(
                f"read_copy must be None when shared=True (one checkpoint serves both roles), got {read_copy!r}"
            )
        if window == 1 and read_copy is not None:
            raise ValueError(
                f"read_copy must be None when window == 1 (conventional decoding reads and writes one state "
                f"every step), got {read_copy!r}"
            )
        if checkpoint_format == "nvfp4" and read_copy is not None:
            raise ValueError(
                "checkpoint_format='nvfp4' is only a single checkpoint (shared=True or window == 1); next to a "
                f"read copy the recurrence checkpoint is 'fp32', 'fp16' or 'fp8', got read_copy={read_copy!r}"
            )
        K_name = self._STATE_DIMS[-1]
        for arg, fmt in (("checkpoint_format", checkpoint_format), ("read_copy", read_copy)):
            if fmt == "nvfp4" and dims[K_name] % quant.NVFP4.block_k != 0:
                raise ValueError(
                    f"{arg}='nvfp4' needs {K_name} to be a multiple of {quant.NVFP4.block_k} (one E4M3 scale "
                    f"per 16 elements along it), got {dims[K_name]}"
                )
        if sr_seed is not None:
            if isinstance(sr_seed, bool) or not isinstance(sr_seed, int) or not 0 <= sr_seed <= _SEED_MASK:
                raise ValueError(f"sr_seed must be None or an int in [0, 2^32), got {sr_seed!r}")
            if checkpoint_format == "fp32":
                raise ValueError(
                    "sr_seed needs a low-precision checkpoint_format (an fp32 checkpoint is written without "
                    "stochastic rounding)"
                )
        elif checkpoint_format != "fp32":
            # torch's default generator: torch.manual_seed makes the cache's seed reproducible
            sr_seed = int(torch.randint(0, 1 << 32, (1,), dtype=torch.int64))
        self.checkpoint_format = checkpoint_format
        self.read_copy_format = read_copy
        self._sr_seed_value = sr_seed

    def _allocate_copies(self, num_slots: int, device, checkpoint: Optional[torch.Tensor]) -> None:
        """The tensors of the two state copies (module docstring), zeros, or ``checkpoint`` (an
        engine's fp32 pool) as the checkpoint; tensors a format does not use are None."""
        for prefix, fmt in zip(_COPIES, (self.checkpoint_format, self.read_copy_format)):
            for suffix in ("",) + _SCALE_SUFFIXES:
                setattr(self, prefix + suffix, None)
            for suffix, shape, dt in ([] if fmt is None else _copy_layout(fmt, self._state_shape)):
                if prefix == "checkpoint" and suffix == "" and checkpoint is not None:
                    t = checkpoint
                else:
                    t = torch.zeros((num_slots,) + shape, dtype=dt, device=device)
                setattr(self, prefix + suffix, t)

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
    def cursor(self) -> torch.Tensor:
        """(slots,) int32: committed records h of each slot (the table's ``committed``)."""
        return self.table.committed

    @property
    def origin(self) -> torch.Tensor:
        """(slots,) int32: ring index of each slot's record 0 (the table's)."""
        return self.table.origin

    @property
    def sr_counter(self) -> Optional[torch.Tensor]:
        """(slots,) int32: SR writes of each slot (the table's ``sr_writes``), with a
        low-precision checkpoint; else None."""
        return self.table.sr_writes if self.checkpoint_format != "fp32" else None

    @property
    def pending_verify(self) -> Optional[StepPlan]:
        """The verify plan awaiting its commit on the cache's table, or None."""
        return self.table.pending

    @property
    def pending_drafts(self) -> Optional[int]:
        """T of the verify awaiting its commit, or None (module docstring: the protocol)."""
        return None if self.pending_verify is None else self.pending_verify.num_drafts

    def _refuse_while_verify_pending(self, op: str) -> None:
        """Refuse ``op`` between a verify and its commit: the drafts sit in the ring behind
        positions that only the commit makes consistent (a flushing row's checkpoint already
        holds the fold while the table still says what verify read)."""
        if self.pending_verify is not None:
            raise ValueError(
                f"{op}: argument 'cache': a verify of {self.pending_verify.num_drafts} drafts awaits its commit; "
                f"the protocol is verify, then commit, then anything else: call commit(cache, slot_ids, "
                f"num_accepted) with the verify's slot ids first"
            )

    @property
    def is_conventional(self) -> bool:
        """True when window == 1: plain conventional decoding, no ring."""
        return self.window == 1

    @property
    def shared(self) -> bool:
        """True when one low-precision checkpoint serves both roles (no read copy); at window 1
        that is conventional decoding with a low-precision state."""
        return self.checkpoint_format != "fp32" and self.read_copy_format is None

    @property
    def is_plain(self) -> bool:
        """True for the layout the GPU kernels take today: an fp32 checkpoint, no read copy and
        (GDN) cached corrections folded at a flush. Other configurations run the CPU reference
        (``reference.*_lowprec_cache_``) only."""
        return (self.checkpoint_format == "fp32" and self.read_copy_format is None
                and getattr(self, "flush_corrections", "fold") == "fold")

    def _copy(self, copy: str) -> Tuple[object, torch.Tensor, Tuple[torch.Tensor, ...]]:
        """(quant format or None for fp32, data, scales in quant's order) of "checkpoint" or
        "read_copy"."""
        fmt = self.checkpoint_format if copy == "checkpoint" else self.read_copy_format
        if copy not in _COPIES or fmt is None:
            raise ValueError(f"copy must be 'checkpoint' or, on a cache with a read copy, 'read_copy'; got {copy!r}")
        scales = tuple(getattr(self, copy + sfx) for sfx in _SCALE_SUFFIXES if getattr(self, copy + sfx) is not None)
        return _format(fmt, self._state_shape[-1]), getattr(self, copy), scales

    def read_state(self, slot_ids: Union[torch.Tensor, Sequence[int]], copy: str = "checkpoint") -> torch.Tensor:
        """The stored value of a state copy, decoded to float32 (n, *state shape): ``copy`` is
        "checkpoint" (the recurrence checkpoint) or "read_copy". Slot ids may repeat. Refused
        while a verify awaits its commit."""
        self._refuse_while_verify_pending("read_state")
        return self._decoded(self._slot_ids(slot_ids, allow_duplicates=True), copy)

    def _decoded(self, ids: List[int], copy: str) -> torch.Tensor:
        """``read_state`` of validated ids without the protocol's guard: what a step itself reads."""
        fmt, data, scales = self._copy(copy)
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        if fmt is None:
            return data[idx].clone()
        return fmt.decode(data[idx], tuple(t[idx] for t in scales))

    def _write_state_(self, ids: List[int], state: torch.Tensor, sr_writes: Optional[List[int]] = None) -> None:
        """Write one fp32 state per slot of ``ids`` (validated, distinct) into every copy
        (``write_rows_``). The SR bits are those of write ``sr_writes[i]`` (a step's plan: the
        table advances itself), or by default of the table's counter, which is then advanced (a
        hand-over outside a step). Positions are not touched."""
        idx = torch.tensor(ids, dtype=torch.long, device=self.device)
        counters = self.table.sr_writes
        writes = counters[idx] if sr_writes is None else torch.tensor(sr_writes, dtype=torch.int32, device=self.device)
        self.write_rows_(idx, state, writes)
        if self.sr_counter is not None and sr_writes is None:
            counters[idx] += 1

    def write_rows_(self, target: torch.Tensor, state: torch.Tensor, sr_writes: torch.Tensor,
                    write: Optional[torch.Tensor] = None) -> None:
        """Write ``state[i]`` (cast to fp32) into every copy of slot ``target[i]``: as is into an fp32
        checkpoint, with SR into a low-precision one (the bits of write ``sr_writes[i]`` of that
        slot), with RTN into the read copy. On the device with no host read (graph-capturable);
        ``write``, a 0-d bool tensor, False writes every target's stored bytes back instead (a
        lifecycle call with no live row, ``table.scatter_rows``). Rows naming one slot must carry
        the same state."""
        state = state.to(device=self.device, dtype=torch.float32)
        for copy in _COPIES:
            if copy == "read_copy" and self.read_copy_format is None:
                continue
            fmt, data, scales = self._copy(copy)
            if fmt is None:
                values = (state,)
            else:
                enc = (fmt.encode_sr(state, checkpoint_sr_bits(self.sr_seed, target, sr_writes, self._state_shape))
                       if copy == "checkpoint" else fmt.encode_rtn(state))
                values = (enc.data,) + tuple(enc.scales)
            for dst, value in zip((data,) + scales, values):
                dst, value = _as_bytes(dst), _as_bytes(value)
                if write is not None:
                    value = torch.where(write, value, dst[target])
                dst.index_put_((target,), value)

    def _slot_ids(self, slot_ids, name: str = "slot_ids", allow_duplicates: bool = False,
                  allow_pad: bool = False) -> list:
        """Validated slot ids as a list: each in [0, num_slots) and not the reserved slot 0 (with
        ``allow_pad`` the pad sentinel passes too), distinct unless ``allow_duplicates``."""
        if isinstance(slot_ids, torch.Tensor):
            if slot_ids.dim() != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(slot_ids.shape)}")
            if slot_ids.dtype.is_floating_point or slot_ids.dtype.is_complex or slot_ids.dtype == torch.bool:
                raise TypeError(f"{name} must hold integers, got {slot_ids.dtype}")
            ids = [int(s) for s in slot_ids.tolist()]
        else:
            try:
                ids = [checks.as_int(name, s) for s in slot_ids]
            except TypeError:
                raise TypeError(f"{name} must be an integer tensor or a sequence of ints") from None
        for s in ids:
            if allow_pad and s == self.pad_slot_id:
                continue
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

        With low-precision formats every copy is written from the fp32 state: SR into a
        low-precision checkpoint (advancing sr_counter), RTN into the read copy.

        state: (n, *checkpoint shape of one slot), any floating dtype, one entry per slot id.
        Refused while a verify awaits its commit, and on a cache sharing its table with other
        layers (their positions would move too; reset the table once per model step instead).
        """
        self._refuse_while_verify_pending("load_prefill")
        if not self.owns_table:
            raise ValueError("load_prefill: argument 'cache': the cache shares a SequenceTable; hand prefill states "
                             "over for every layer of the model, then call table.reset(slot_ids) once")
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
        self._write_state_(ids, state)
        self.cursor[idx] = 0
        self.origin[idx] = 0

    def memory_per_slot(self) -> Dict[str, int]:
        """Bytes per slot of every tensor (0 for a ring this configuration does not keep),
        plus "total". The state copies' parts come first: "checkpoint" (its data), then
        "checkpoint_scale" / "checkpoint_state_scale", "read_copy", "read_copy_scale",
        "read_copy_state_scale" where the configuration has them; then, when the cache owns its
        sequence table, the table's "cursor", "origin" and "sr_counter" (a shared table belongs to
        the model: three int32 per slot). (``sr_seed``, 8 bytes, is per cache.)"""
        sizes = {}
        for prefix, fmt in zip(_COPIES, (self.checkpoint_format, self.read_copy_format)):
            for suffix, shape, dt in ([] if fmt is None else _copy_layout(fmt, self._state_shape)):
                sizes[prefix + suffix] = math.prod(shape) * torch.empty((), dtype=dt).element_size()
        for name, shape, ring_dtype, kept in self._ring_layout():
            kept = kept and not self.is_conventional
            itemsize = torch.empty((), dtype=ring_dtype).element_size()
            sizes[name] = self.capacity * math.prod(shape) * itemsize if kept else 0
        if self.owns_table:
            table = self.table
            sizes.update(cursor=table.committed.element_size(), origin=table.origin.element_size(),
                         sr_counter=table.sr_writes.element_size())
        sizes["total"] = sum(sizes.values())
        return sizes

    def __repr__(self) -> str:
        fields = ("num_slots",) + self._DIMS + ("window", "max_draft", "capacity", "dtype", "device",
                                                  "pad_slot_id") + self._REPR_EXTRA
        if not self.is_plain:
            fields += ("checkpoint_format", "read_copy_format", "shared") + (
                ("flush_corrections",) if hasattr(self, "flush_corrections") else ())
        return f"{type(self).__name__}(" + ", ".join(f"{f}={getattr(self, f)}" for f in fields) + ")"


class Mamba2Cache(_SlotPool):
    """State pool of one Mamba-2 layer: fp32 checkpoints plus a ring of input records.

    Args:
        num_slots: pool size (sequences that can be held at once; with pad_slot_id == 0
            slot 0 is reserved, so num_slots - 1 are usable).
        nheads, headdim, dstate, ngroups: H, P, N, G of the layer (this shard); off the CPU
            headdim a multiple of 16 and dstate a multiple of 32 up to 256 (the GPU kernels'
            range; module docstring).
        window: ReplaySSM window L (>= 1); 1 means conventional decoding (no ring).
        max_draft: ring room for speculative drafts, 0..16 (must be 0 when window == 1); off
            the CPU window + max_draft <= 32.
        dtype: activation dtype of ring_x / ring_B: bfloat16, float16 or float32.
        device: where the tensors live.
        pad_slot_id: slot id of padding rows, -1 or 0.
        checkpoint_format: recurrence checkpoint "fp32" (default), "fp16" or "fp8" (low precision
            is written with stochastic rounding); "nvfp4" only as a single checkpoint (shared or
            window == 1). Module docstring: layouts and the SR bits.
        read_copy: None (default) or "fp16", "fp8", "nvfp4": the copy non-flush steps read,
            written with round-to-nearest at every flush and prefill load; None at window 1.
        shared: True asserts the shared configuration: one low-precision checkpoint (SR) for
            both roles, read_copy None (the same as a low-precision checkpoint_format without
            read copy).
        sr_seed: seed of the SR bits, an int in [0, 2^32), or None: drawn from torch's default
            generator; only with a low-precision checkpoint. Held in ``cache.sr_seed``.
    """

    _DIMS = ("nheads", "headdim", "dstate", "ngroups")
    _STATE_DIMS = ("nheads", "headdim", "dstate")
    _INNERMOST = "N"
    # kernels/mamba2: N / 32 elements per lane (Mamba2Config.check_tiles), 16-row tiles
    _KERNEL_DIMS = (("headdim", 16, None), ("dstate", 32, 256))

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
        checkpoint_format: str = "fp32",
        read_copy: Optional[str] = None,
        shared: bool = False,
        sr_seed: Optional[int] = None,
        table: Optional[SequenceTable] = None,
    ) -> None:
        self._setup_pool(num_slots, (nheads, headdim, dstate, ngroups), window, max_draft, dtype, device,
                         pad_slot_id, checkpoint=None, checkpoint_format=checkpoint_format, read_copy=read_copy,
                         shared=shared, sr_seed=sr_seed, table=table)

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
        """Current state of each slot, float64 (n, H, P, N): checkpoint + replay of its records
        (a low-precision checkpoint decoded first). ``A`` in any form decode takes: (H,) or its
        stride-0 expansion (H, P, N), float32 (or float64), on the cache's device. Rows naming
        the pad sentinel are skipped as decode skips them: their state comes back zero. Refused
        while a verify awaits its commit."""
        self._refuse_while_verify_pending("materialize")
        ids = self._slot_ids(slot_ids, allow_duplicates=True, allow_pad=True)
        return reference.mamba2_materialize(self, ids, self._decay_rates(A))

    def _decay_rates(self, A) -> torch.Tensor:
        """materialize's ``A`` as the (H,) view, or a ValueError naming it."""
        H, P, N = self.nheads, self.headdim, self.dstate
        taken = (isinstance(A, torch.Tensor) and A.dtype in (torch.float32, torch.float64)
                 and A.device == self.device)
        if taken and tuple(A.shape) == (H, P, N) and A.stride()[1:] == (0, 0):
            A = A[:, 0, 0]
        if not taken or tuple(A.shape) != (H,):
            got = (f"{A.dtype}, shape {tuple(A.shape)}, strides {A.stride()}, on {A.device}"
                   if isinstance(A, torch.Tensor) else type(A).__name__)
            raise ValueError(
                f"materialize: argument 'A': expected a float32 or float64 tensor on {self.device} of shape "
                f"({H},) or its stride-0 expansion of shape {(H, P, N)} (strides (s, 0, 0)), got {got}"
            )
        return A


_FLUSH_CORRECTIONS = ("rederive", "fold")


class GDNCache(_SlotPool):
    """State pool of one Gated DeltaNet layer: fp32 checkpoints plus a ring of records.

    A record holds the token's correction u (fp16), its normalised key k (activation dtype,
    once per key head) and its log decay g (fp32); with ``keep_v_beta`` also v (activation
    dtype) and beta (fp32), which the two-precision variant needs to re-derive u at a flush.

    Args:
        num_slots: pool size (with pad_slot_id == 0 slot 0 is reserved).
        num_v_heads, head_v_dim, head_k_dim, num_k_heads: HV, V, K, H of the layer (this
            shard); HV a multiple of H; off the CPU V and K multiples of 16 up to 256 (the
            GPU kernels' range; module docstring).
        window: ReplaySSM window L (>= 1); 1 means conventional decoding (no ring).
        max_draft: ring room for speculative drafts, 0..16 (must be 0 when window == 1); off
            the CPU window + max_draft <= 32.
        dtype: activation dtype of ring_k (and ring_v): bfloat16, float16 or float32.
        device: where the tensors live.
        pad_slot_id: slot id of padding rows, -1 or 0.
        keep_v_beta: also keep v and beta per record (must be False when window == 1). None
            (default): True exactly when there is a read copy, where it must be (forced).
        checkpoint_format, read_copy, shared, sr_seed: the state copies, as ``Mamba2Cache``.
        flush_corrections: what a flush folds: "rederive" (re-derive every u_j from the
            recurrence checkpoint and the cached (beta, v, k, g), paper Algorithm 6; needs
            keep_v_beta) or "fold" (the cached u_j). None (default): "rederive" with a read
            copy, else "fold".
    """

    _DIMS = ("num_v_heads", "head_v_dim", "head_k_dim", "num_k_heads")
    _STATE_DIMS = ("num_v_heads", "head_v_dim", "head_k_dim")
    _INNERMOST = "K"
    _REPR_EXTRA = ("keep_v_beta",)
    # kernels/gdn: GDNConfig.check_tiles
    _KERNEL_DIMS = (("head_v_dim", 16, 256), ("head_k_dim", 16, 256))

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
        keep_v_beta: Optional[bool] = None,
        checkpoint_format: str = "fp32",
        read_copy: Optional[str] = None,
        shared: bool = False,
        sr_seed: Optional[int] = None,
        flush_corrections: Optional[str] = None,
        table: Optional[SequenceTable] = None,
    ) -> None:
        self._setup(num_slots, (num_v_heads, head_v_dim, head_k_dim, num_k_heads), window, max_draft, dtype,
                    device, pad_slot_id, keep_v_beta, checkpoint=None, checkpoint_format=checkpoint_format,
                    read_copy=read_copy, shared=shared, sr_seed=sr_seed, flush_corrections=flush_corrections,
                    table=table)

    def _setup(self, num_slots, dims, window, max_draft, dtype, device, pad_slot_id, keep_v_beta,
               checkpoint: Optional[torch.Tensor], flush_corrections=None, **formats) -> None:
        if keep_v_beta is not None and not isinstance(keep_v_beta, bool):
            raise TypeError(f"keep_v_beta must be a bool or None, got {type(keep_v_beta).__name__}")
        if flush_corrections is not None and flush_corrections not in _FLUSH_CORRECTIONS:
            raise ValueError(
                f"flush_corrections must be None or one of {_FLUSH_CORRECTIONS}, got {flush_corrections!r}"
            )
        self.keep_v_beta = keep_v_beta
        self.flush_corrections = flush_corrections
        self._setup_pool(num_slots, dims, window, max_draft, dtype, device, pad_slot_id, checkpoint, **formats)

    def _check_dims(self, num_v_heads, head_v_dim, head_k_dim, num_k_heads) -> None:
        if num_v_heads % num_k_heads != 0:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")

    def _check_options(self, window: int) -> None:
        """Resolve keep_v_beta and flush_corrections against the window and the read copy."""
        has_read_copy = self.read_copy_format is not None
        if self.keep_v_beta is None:
            self.keep_v_beta = has_read_copy
        elif has_read_copy and not self.keep_v_beta:
            raise ValueError(
                "keep_v_beta must be True (or None) with a read copy: a flush re-derives the corrections "
                f"from the recurrence checkpoint and the cached (beta, v), got read_copy={self.read_copy_format!r}"
            )
        if window == 1 and self.keep_v_beta:
            raise ValueError("keep_v_beta must be False when window == 1 (a conventional cache has no ring)")
        if self.flush_corrections is None:
            self.flush_corrections = "rederive" if has_read_copy else "fold"
        elif self.flush_corrections == "rederive" and not self.keep_v_beta:
            raise ValueError(
                "flush_corrections='rederive' needs keep_v_beta=True (a flush re-derives u_j from the cached v_j "
                "and beta_j)"
            )

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
        """Current state of each slot, float64 (n, HV, V, K): checkpoint + replay of its records
        (a low-precision checkpoint decoded first; with flush_corrections "rederive" the
        corrections re-derived as the next flush will). Rows naming the pad sentinel are skipped
        as decode skips them: their state comes back zero. Refused while a verify awaits its
        commit."""
        self._refuse_while_verify_pending("materialize")
        return reference.gdn_materialize(self, self._slot_ids(slot_ids, allow_duplicates=True, allow_pad=True))
