"""Launch-config spaces for the autotuner (replayssm_cute.tune), shared by every kernel.

Every kernel here takes the same three knobs (Mamba2Config and GDNConfig): rows_per_cta state
rows of one head per CTA, num_warps warps splitting them, and min_ctas_per_sm, which caps
registers so that many CTAs fit on an SM. ``config_space`` lists the combinations worth timing
for a head of ``rows`` state rows; each kernel's own check (shared memory, rows per warp, ring
capacity, ...) then keeps those it takes. ``launch_check`` refuses the values no launch takes
(every kernel check runs it first, and so does the tuned-config file parser). Pure Python: no
cutlass, no GPU.
"""

from typing import List, Optional

TUNE_NUM_WARPS = tuple(range(1, 9))
TUNE_MIN_CTAS_PER_SM = (0, 2, 4, 6, 8, 12, 16)  # 8+: light read-copy tiles (small shared memory)
MIN_TILE_ROWS = 8  # smaller tiles launch more CTAs than rows are worth (at least one warp each)

REGISTERS_PER_SM = 64 * 1024  # sm_90 / sm_100 / sm_103
THREADS_PER_SM = 2048
MAX_CTAS_PER_SM = 32
MAX_THREADS_PER_CTA = 1024
MAX_WARPS_PER_CTA = MAX_THREADS_PER_CTA // 32
MAX_REGISTERS_PER_THREAD = 255
# Below this a capped kernel spills its per-lane state: such configs are not worth compiling.
MIN_REGISTERS_PER_THREAD = 64


def register_budget(num_warps: int, min_ctas_per_sm: int) -> int:
    """Registers per thread the compiler may use when min_ctas_per_sm CTAs of num_warps warps
    must fit on an SM (allocated per warp in steps of 8 per thread); 0 if their threads do not
    fit at all; MAX_REGISTERS_PER_THREAD without a cap (min_ctas_per_sm 0)."""
    if min_ctas_per_sm == 0:
        return MAX_REGISTERS_PER_THREAD
    threads = min_ctas_per_sm * num_warps * 32
    if threads > THREADS_PER_SM:
        return 0
    return min(MAX_REGISTERS_PER_THREAD, REGISTERS_PER_SM // threads // 8 * 8)


LAUNCH_FIELDS = ("rows_per_cta", "num_warps", "min_ctas_per_sm")
# The pipelined decode kernels' configs (kernels/*/pipelined.py) share these; a tuned-file entry
# is one of theirs when its config has "stages" (``pipelined_launch_check``).
PIPELINED_FIELDS = ("stages", "ctas", "prefetch")
PIPELINED_BOOL_FIELDS = ("mma_fold", "flush_tile", "mma_dots", "mma_flush")
PIPELINE_STAGE_CHOICES = (2, 3, 4, 5, 6, 8, 10, 12, 16)  # the tuner's stage counts
HEADS_PER_ITEM_CHOICES = (1, 2, 4)  # the tuner's heads per pipelined item, next to a read copy
MAX_STAGES = 16
MAX_CTAS = 4096
PREFETCH_CHOICES = (1, 2, 4)
VERIFY_ROWS_PER_WARP = 16  # the verify kernels' warps each take an m16n8k8 MMA's M rows


def verify_tile_rows(head_rows: int) -> int:
    """State rows per CTA of the verify kernels' default tile for a head of ``head_rows`` rows:
    the whole head where it takes at most 8 warps, else 64 or 32 rows dividing it, else one
    warp's 16 (both layers' defaults, kernels/*/config.py)."""
    for rows in (head_rows, 64, 32):
        if rows <= 8 * VERIFY_ROWS_PER_WARP and head_rows % rows == 0:
            return rows
    return VERIFY_ROWS_PER_WARP


def launch_check(rows_per_cta, num_warps, min_ctas_per_sm) -> Optional[str]:
    """None if the three knobs make a launch at all, else why not, naming the field: integers,
    at least one row, 1 to MAX_WARPS_PER_CTA warps, 0 (no register cap) to MAX_CTAS_PER_SM CTAs
    whose threads fit on an SM together. Each kernel's check runs it first (the later checks
    divide by these) and then adds its own limits."""
    for name, value in zip(LAUNCH_FIELDS, (rows_per_cta, num_warps, min_ctas_per_sm)):
        if type(value) is not int:  # what compile-cache keys and tuned files hold (no bools, no floats)
            return f"{name} {value!r}: expected an int"
    if rows_per_cta < 1:
        return f"rows_per_cta {rows_per_cta}: expected at least 1"
    if not 1 <= num_warps <= MAX_WARPS_PER_CTA:
        return (f"num_warps {num_warps}: expected 1..{MAX_WARPS_PER_CTA} "
                f"(a CTA holds at most {MAX_THREADS_PER_CTA} threads)")
    if not 0 <= min_ctas_per_sm <= MAX_CTAS_PER_SM:
        return (f"min_ctas_per_sm {min_ctas_per_sm}: expected 0 (no register cap) to {MAX_CTAS_PER_SM} "
                f"(the CTAs an SM holds)")
    if register_budget(num_warps, min_ctas_per_sm) == 0:
        return (f"min_ctas_per_sm {min_ctas_per_sm}: {min_ctas_per_sm} CTAs of {num_warps} warps are "
                f"{min_ctas_per_sm * num_warps * 32} threads, more than an SM holds ({THREADS_PER_SM})")
    return None


def pipelined_launch_check(config: dict) -> Optional[str]:
    """None if a pipelined config's fields (a tuned-file entry's) make a launch at all, else why
    not, naming the field: ints (bools for PIPELINED_BOOL_FIELDS), 2..MAX_STAGES stages,
    1..MAX_CTAS CTAs, a producer chunk of PREFETCH_CHOICES. The kernel's check adds the rest."""
    for name in PIPELINED_FIELDS:
        if name not in config:
            return f"{name}: missing (a pipelined config has {', '.join(PIPELINED_FIELDS)})"
    for name, value in config.items():
        if type(value) is not (bool if name in PIPELINED_BOOL_FIELDS else int):
            return f"{name} {value!r}: expected {'a bool' if name in PIPELINED_BOOL_FIELDS else 'an int'}"
    if not 2 <= config["stages"] <= MAX_STAGES:
        return f"stages {config['stages']}: expected 2..{MAX_STAGES}"
    if not 1 <= config["ctas"] <= MAX_CTAS:
        return f"ctas {config['ctas']}: expected 1..{MAX_CTAS}"
    if config["prefetch"] not in PREFETCH_CHOICES:
        return f"prefetch {config['prefetch']}: expected one of {PREFETCH_CHOICES}"
    return None


def config_space(config_cls, rows: int) -> List:
    """Every config_cls(rows_per_cta, num_warps, min_ctas_per_sm) worth timing for heads of
    `rows` state rows, before a kernel's check: rows_per_cta over the divisors of `rows` from
    MIN_TILE_ROWS up, num_warps in TUNE_NUM_WARPS dividing it, min_ctas_per_sm in
    TUNE_MIN_CTAS_PER_SM where the register cap leaves at least MIN_REGISTERS_PER_THREAD."""
    return [config_cls(rows_per_cta=tile, num_warps=warps, min_ctas_per_sm=ctas)
            for tile in range(MIN_TILE_ROWS, rows + 1) if rows % tile == 0
            for warps in TUNE_NUM_WARPS if tile % warps == 0
            for ctas in TUNE_MIN_CTAS_PER_SM if register_budget(warps, ctas) >= MIN_REGISTERS_PER_THREAD]
