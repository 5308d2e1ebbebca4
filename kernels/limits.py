"""Limits the kernels build in and how they launch, shared with the host (no cutlass import, so
the host can read them without loading the DSL)."""

import os

MAX_CAPACITY = 32  # window + max_draft ring records: one lane per record
MAX_DRAFT = 16  # draft tokens T a verify step takes, so a pool's draft room
PLAN_COLUMNS = 4  # a step plan's row: slot, h, origin, sr_writes (kernels/table.py)

# Programmatic dependent launch (sm_90 and newer): a kernel may start while the one before it in
# the stream finishes; it waits for it (griddepcontrol.wait) before reading what that one writes.
PDL_ENV = "REPLAYSSM_CUTE_PDL"


def programmatic_launch() -> bool:
    """Whether kernels are built to launch programmatically ($REPLAYSSM_CUTE_PDL, default on; 0
    turns it off). Read when a kernel is compiled, and part of its compile-cache key."""
    return os.environ.get(PDL_ENV, "1").strip() != "0"
