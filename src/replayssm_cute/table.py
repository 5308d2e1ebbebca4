"""One sequence table per model: the ring positions every layer cache of a model shares.

Every layer of a sequence holds the same number of committed records, so the positions live once
per model, not once per layer: per slot the committed record count ``committed`` (h), the ring
``origin`` (record i of the slot lives at ring index (origin + i) % capacity) and ``sr_writes``,
the SR writes of the slot's state so far (the counter of the stochastic-rounding bits,
``replayssm_cute.cache``). A layer cache made with ``table=`` holds only its checkpoint, ring
and state copies; a cache made without one owns a private table.

A model step runs as

    plan = table.plan_decode(slot_ids)                  # one launch; advances the table
    for cache, args in layers: decode(cache, *args, slot_ids, plan=plan)

or, speculatively,

    plan = table.plan_verify(slot_ids, num_drafts=T)    # one launch
    for cache, args in layers: verify(cache, *args, slot_ids, plan=plan)
    table.commit(plan, num_accepted)                    # one launch, accepted counts on the device

The plan (``StepPlan.rows``, (b, 4) int32) holds each row's (slot, h, origin, sr_writes) as the
table held them before the step; the layer kernels read it by batch row and write no position,
counter or flag (kernels/table.py). Standard decode advances the table when it plans, since the
layers read the plan, not the table; a verify step's table moves at its commit, which takes the
verify's plan (so its rows cannot differ from the verify's).

Protocol, enforced on the host: a layer call takes the table's latest plan (an older one is
stale: the table has moved since); between ``plan_verify`` and its ``commit`` no decode plan is
made; every plan and commit names the table's slots. Everything captures in a CUDA graph (no
device->host read outside ``REPLAYSSM_CUTE_DEBUG=1``).

Lifecycle, on the device and graph-capturable: ``reset`` (a prefilled sequence starts with no
records; ``replayssm_cute.reset_slots`` also writes every layer's prefill state as its
checkpoint) and ``fork`` (the table entries of slots ``src`` into ``dst``; ``replayssm_cute.
fork_slots`` also copies every layer's checkpoint and ring).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from . import checks
from .kernels.limits import PLAN_COLUMNS

__all__ = ["SequenceTable", "StepPlan"]


class StepPlan(NamedTuple):
    """A model step's plan (module docstring): its table, slot ids, plan rows (b, 4) int32
    (slot, h, origin, sr_writes before the step) and draft count (0: standard decode, T: a verify
    step awaiting its commit); ``host_ids``: the slot ids read on the host (a CPU table, or debug
    mode), else None; ``draft_counts``: with rows of fewer drafts than T, each row's count (int32
    (b,) on the table's device), which bounds its commit, else None (every row holds T)."""

    table: "SequenceTable"
    slot_ids: torch.Tensor
    rows: torch.Tensor
    num_drafts: int
    host_ids: Optional[Tuple[int, ...]]
    draft_counts: Optional[torch.Tensor] = None

    @property
    def batch(self) -> int:
        return self.slot_ids.shape[0]


def scatter_rows(ids: torch.Tensor, live: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How to scatter one value per row into the slots ``ids`` where ``live``, with no host read
    (graph-capturable): (target, row, any_live). Write ``values[row]`` at ``target``: a skipped
    row is aimed at the first live row's slot with that row's value, so duplicate writes agree;
    with no live row every row targets slot 0 and must write slot 0's own value back (select on
    ``any_live``)."""
    first = torch.argmax(live.to(torch.int32))  # 0 when no row is live
    row = torch.where(live, torch.arange(ids.shape[0], device=ids.device), first)
    any_live = live.any()
    return torch.where(any_live, ids[row], torch.zeros_like(ids)), row, any_live


class SequenceTable:
    """Per-slot ring positions shared by the layer caches of one model (module docstring).

    ``SequenceTable(num_slots, window, max_draft=0, *, device="cpu", pad_slot_id=-1)``: the pool
    arguments every cache sharing it must have too. A table on the CPU runs the float64
    reference backend's plans; elsewhere the plan and commit kernels.
    """

    def __init__(self, num_slots: int, window: int, max_draft: int = 0, *, device="cpu", pad_slot_id: int = -1):
        self.num_slots, self.window, self.max_draft, self.pad_slot_id, device = checks.pool_arguments(
            num_slots, window, max_draft, pad_slot_id, device)
        self.capacity = self.window + self.max_draft
        zeros = lambda: torch.zeros((self.num_slots,), dtype=torch.int32, device=device)  # noqa: E731
        self.committed = zeros()
        self.origin = zeros()
        self.sr_writes = zeros()
        self.device = self.committed.device  # "cuda" resolved to the current device, as tensors have it
        self.pending: Optional[StepPlan] = None  # a verify plan awaiting its commit
        self.last_plan: Optional[StepPlan] = None  # a layer call takes only the latest plan

    def __repr__(self) -> str:
        return (f"SequenceTable(num_slots={self.num_slots}, window={self.window}, max_draft={self.max_draft}, "
                f"device={str(self.device)!r}, pad_slot_id={self.pad_slot_id})")

    # ------------------------------------------------------------------ what a cache must match

    def mismatch(self, num_slots: int, window: int, max_draft: int, device, pad_slot_id: int) -> Optional[str]:
        """None if a cache with these pool arguments can share this table, else what differs."""
        mine = dict(num_slots=self.num_slots, window=self.window, max_draft=self.max_draft, device=self.device,
                    pad_slot_id=self.pad_slot_id)
        theirs = dict(num_slots=num_slots, window=window, max_draft=max_draft,
                      device=torch.empty(0, device=device).device, pad_slot_id=pad_slot_id)
        diff = [f"{k} {theirs[k]} (table: {v})" for k, v in mine.items() if theirs[k] != v]
        return ", ".join(diff) if diff else None

    # ------------------------------------------------------------------ plans and commits

    def plan_decode(self, slot_ids: torch.Tensor) -> StepPlan:
        """The plan of a standard decode step for ``slot_ids`` (an int32 (b,) tensor on the
        table's device); advances the table by one token per live row (module docstring)."""
        self._refuse_while_pending("plan_decode")
        return self._plan(slot_ids, 0, "plan_decode")

    def plan_verify(self, slot_ids: torch.Tensor, num_drafts: int,
                    draft_counts: Optional[torch.Tensor] = None) -> StepPlan:
        """The plan of a verify step of ``num_drafts`` (T) drafts per row; the table moves at
        ``commit(plan, num_accepted)``, which must come before any other plan. ``draft_counts``
        (contiguous int32 (b,) on the table's device; e.g. ``cu_seqlens.diff()``): where rows hold
        fewer drafts than T (verify's packed form), each row's count, so that the commit can
        refuse to accept more (checked where commit reads on the host: the CPU and debug mode)."""
        self._refuse_while_pending("plan_verify")
        if isinstance(num_drafts, bool) or not isinstance(num_drafts, int):
            raise TypeError(f"plan_verify: argument 'num_drafts': expected an int, got {type(num_drafts).__name__}")
        if not 1 <= num_drafts <= min(self.max_draft, self.window):
            raise ValueError(f"plan_verify: argument 'num_drafts': expected 1 <= T <= min(max_draft {self.max_draft}, "
                             f"window {self.window}), got {num_drafts}")
        plan = self._plan(slot_ids, num_drafts, "plan_verify", draft_counts)
        self.last_plan = self.pending = plan
        return plan

    def commit(self, plan: StepPlan, num_accepted: torch.Tensor) -> None:
        """Accept the first ``num_accepted[r]`` (1..T) drafts of each row of the pending verify
        ``plan``: h moves by them; a row that folded at the verify (h + T > L) starts from its
        drafts (origin past the folded records, h = a, one more SR write). ``num_accepted``: a
        contiguous int32 (b,) tensor on the table's device, never read on the host outside debug
        mode, where values outside 1..T are refused."""
        if not isinstance(plan, StepPlan) or plan.table is not self:
            raise ValueError("commit: argument 'plan': expected the plan_verify plan of this table, got "
                             f"{type(plan).__name__}" + ("" if not isinstance(plan, StepPlan) else " of another table"))
        if self.pending is None:
            raise ValueError("commit: argument 'plan': no verify step awaits its commit on this table "
                             "(plan_verify, the layers' verify, then commit once)")
        if plan is not self.pending:
            raise ValueError("commit: argument 'plan': expected the pending plan_verify plan of this table, got "
                             "another plan (stale, or a decode plan)")
        b, T = plan.batch, plan.num_drafts
        checks.row_counts("num_accepted", num_accepted, b, self.device)
        if self.device.type == "cpu" or checks.debug_host_checks(self.device):
            live = self.live(plan.rows[:, 0])
            counts = [T] * b if plan.draft_counts is None else plan.draft_counts.tolist()
            bad = [(r, int(a), n) for r, (a, ok, n) in enumerate(zip(num_accepted.tolist(), live.tolist(), counts))
                   if ok and not 1 <= a <= n]
            if bad and plan.draft_counts is None:
                raise ValueError(f"commit: argument 'num_accepted': expected values in [1, {T}], got "
                                 f"{[a for _, a, _ in bad[:8]]}")
            if bad:
                raise ValueError("commit: argument 'num_accepted': expected values in [1, the row's draft count] "
                                 "(its tokens in verify's cu_seqlens), got "
                                 + ", ".join(f"row {r}: {a} of {n}" for r, a, n in bad[:8]))
        if b > 0 and self.device.type == "cpu":
            self._commit_reference(plan, num_accepted)
        elif b > 0:
            from .runtime.launch import table_launcher

            table_launcher("commit", self.window, self.capacity, T, self.pad_slot_id)(
                plan.rows, num_accepted, self.committed, self.origin, self.sr_writes)
        self.pending = None

    def reset(self, slot_ids: torch.Tensor) -> None:
        """Start the named slots' sequences afresh (after a prefill): no committed records, ring
        origin 0. On the device, graph-capturable; pad and out-of-pool ids are skipped. Does not
        write a checkpoint (``replayssm_cute.reset_slots`` does both)."""
        self._refuse_while_pending("reset")
        ids = self.slot_tensor(slot_ids, "slot_ids")
        target, _, any_live = scatter_rows(ids, self.live(ids))
        for t in (self.committed, self.origin):
            t.index_put_((target,), torch.where(any_live, 0, t[target]))

    def fork(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Table entries of slots ``src[i]`` into ``dst[i]`` (the layers' checkpoints and rings
        by ``replayssm_cute.fork_slots``); rows where either id is pad or outside the pool are
        skipped. On the device, graph-capturable."""
        self._refuse_while_pending("fork")
        src = self.slot_tensor(src, "src")
        dst = self.slot_tensor(dst, "dst", src.shape[0])
        target, row, any_live = scatter_rows(dst, self.live(src) & self.live(dst))
        source = torch.where(any_live, src[row], target)
        for t in (self.committed, self.origin, self.sr_writes):
            t.index_put_((target,), t[source])

    # ------------------------------------------------------------------ internals

    def _refuse_while_pending(self, op: str) -> None:
        if self.pending is not None:
            raise RuntimeError(f"{op}: a verify step awaits its commit on this table (plan_verify with T = "
                               f"{self.pending.num_drafts}); commit it first: verify, then commit, then anything else")

    def slot_tensor(self, ids, name: str, b: Optional[int] = None) -> torch.Tensor:
        """``ids`` checked as an int32 (b,) contiguous tensor on the table's device (errors name
        the argument ``name``)."""
        n = b if b is not None else (ids.shape[0] if isinstance(ids, torch.Tensor) and ids.dim() == 1 else -1)
        if n < 0:
            checks.fail(name, "an int32 tensor of shape (batch,)", getattr(ids, "shape", type(ids).__name__))
        try:
            return checks.slot_ids(ids, n, self.device)
        except ValueError as e:
            raise ValueError(str(e).replace("argument 'slot_ids'", f"argument '{name}'")) from None

    def live(self, ids: torch.Tensor) -> torch.Tensor:
        """Which ids name a slot of the pool (not pad, not outside): the rows a step touches."""
        live = (ids >= 0) & (ids < self.num_slots)
        return live & (ids != 0) if self.pad_slot_id == 0 else live

    def _plan(self, slot_ids, num_drafts: int, op: str, draft_counts: Optional[torch.Tensor] = None) -> StepPlan:
        try:
            ids = self.slot_tensor(slot_ids, "slot_ids")
        except ValueError as e:
            raise ValueError(f"{op}: {e}") from None
        b = ids.shape[0]
        if draft_counts is not None:  # checked against the checked ids, before the plan is written
            checks.row_counts("draft_counts", draft_counts, b, self.device)
        host_read = self.device.type == "cpu" or checks.debug_host_checks(self.device)
        if host_read:
            self.check_distinct(ids, op)
        rows = torch.empty((b, PLAN_COLUMNS), dtype=torch.int32, device=self.device)
        if b > 0 and self.device.type == "cpu":
            self._plan_reference(ids, rows, num_drafts)
        elif b > 0:
            from .runtime.launch import table_launcher

            table_launcher("plan", self.window, self.capacity, num_drafts, self.pad_slot_id)(
                ids, rows, self.committed, self.origin, self.sr_writes)
        plan = StepPlan(self, ids, rows, num_drafts, tuple(ids.tolist()) if host_read else None, draft_counts)
        self.last_plan = plan
        return plan

    def check_distinct(self, ids: torch.Tensor, op: str) -> None:
        """No live slot named twice in ``ids`` (a host read: the CPU path, and debug mode on the GPU)."""
        live_ids = [s for s, ok in zip(ids.tolist(), self.live(ids).tolist()) if ok]
        if len(set(live_ids)) != len(live_ids):
            raise ValueError(f"{op}: argument 'slot_ids': expected distinct live slots, got {live_ids[:8]}")

    def _plan_reference(self, ids: torch.Tensor, rows: torch.Tensor, num_drafts: int) -> None:
        """kernels/table.py TablePlan on the CPU, after checking that every live slot's h is in
        range (h == window only with draft room: after a speculative commit), before anything is
        written."""
        slots, live = ids.tolist(), self.live(ids).tolist()
        top = self.window if self.max_draft > 0 else self.window - 1
        for s in (s for s, ok in zip(slots, live) if ok):
            if not 0 <= int(self.committed[s]) <= top:
                raise RuntimeError(f"cache.cursor[{s}] = {int(self.committed[s])} is outside [0, {top}] (the table's "
                                   f"committed count); the cache is corrupt")
        for r, (s, ok) in enumerate(zip(slots, live)):
            h, o, w = (int(self.committed[s]), int(self.origin[s]), int(self.sr_writes[s])) if ok else (0, 0, 0)
            rows[r] = torch.tensor([s, h, o, w], dtype=torch.int32)
            if ok and num_drafts == 0:
                flush = h + 1 >= self.window
                self.committed[s] = 0 if flush else h + 1
                self.sr_writes[s] = w + int(flush)

    def _commit_reference(self, plan: StepPlan, num_accepted: torch.Tensor) -> None:
        """kernels/table.py TableCommit on the CPU."""
        T = plan.num_drafts
        live = self.live(plan.rows[:, 0]).tolist()
        for (s, h, o, w), a, ok in zip(plan.rows.tolist(), num_accepted.tolist(), live):
            if not ok:
                continue
            if h + T > self.window:
                self.origin[s] = (o + h) % self.capacity
                self.committed[s] = a
                self.sr_writes[s] = w + 1
            else:
                self.committed[s] = h + a
