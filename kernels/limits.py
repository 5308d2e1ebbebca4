"""Limits the kernels build in, shared with the host checks (no cutlass import, so the host
can read them without loading the DSL)."""

MAX_CAPACITY = 32  # window + max_draft ring records: one lane per record
MAX_DRAFT = 16  # draft tokens T a verify step takes, so a pool's draft room
PLAN_COLUMNS = 4  # a step plan's row: slot, h, origin, sr_writes (kernels/table.py)
