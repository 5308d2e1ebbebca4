"""Small performance helpers shared by the demo and the sweeps: ideal bytes, graph timing and
decode pools for timing, for both layer types (Mamba-2 and Gated DeltaNet).

``ideal_bytes`` is the traffic a decode step cannot avoid (each byte read or written once), and
``verify_ideal_bytes`` that of a speculative verify + commit step over its cursor cycle
(``cursor_cycle``); dividing it by a measured time gives the achieved bandwidth. ``time_graph``
times a function by capturing it once in a CUDA graph and replaying the graph. ``DecodePool``
holds a pool far larger than L2 with realistic random inputs (T tokens per row for speculative
steps: verify + commit, or the conventional snapshot baseline; with ``read_copy`` a low-precision
read copy next to the fp32 checkpoint); ``compile_pool_kernel`` builds the kernels its steps call.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, NamedTuple, Optional

from . import quant
from .layers import LAYERS, model_cache
from .runtime import launch
from .runtime.tuning import batch_bucket

__all__ = ["DecodePool", "bench_layer", "compile_table_kernels", "compile_pool_kernel", "cursor_cycle",
           "ideal_bytes", "time_graph", "verify_ideal_bytes"]

ROTATION_BYTES = 512 << 20


class _Layer:
    """One layer type as DecodePool and the sweeps see it. A ``ModelSpec`` names the dims alike for
    both types: per head a (headdim x dstate) fp32 state, and ngroups key-side groups (Mamba-2 B and
    C groups, GDN key heads); a record holds a 16-bit value-side row per head, a 16-bit key-side
    row per group and an fp32 scalar per head; the pool's activations are bf16. The pool's inputs
    are the serving engines' usual ones (the adapter's ``engine_inputs``)."""

    host: type  # the layer's adapter (replayssm_cute.layers): cache type, kernels, Shape of a call, bench inputs

    @classmethod
    def fill_ring(cls, cache, gen):
        """Plausible records in every slot's ring (the pool's cursors may start anywhere)."""
        cls.host.bench_ring(cache, gen)

    @classmethod
    def inputs(cls, m, batch, gen, device, drafts=0):
        """decode() keyword arguments (slot_ids and config aside), ``out`` included: the layer's
        random weights and bf16 tokens (``random_params``, ``random_tokens``); with ``drafts`` T > 0,
        those of verify() and snapshot_verify(): token tensors (batch, T, ...)."""
        import torch

        dims, lead = (m.nheads, m.headdim, m.dstate, m.ngroups), (batch, drafts) if drafts else (batch,)
        params = cls.host.random_params(dims, gen, device)
        tokens = cls.host.random_tokens(dims, lead, torch.bfloat16, gen, device)
        out = torch.empty(*lead, *cls.host.row_shapes(dims)[1], dtype=torch.bfloat16, device=device)
        return dict(tokens, **params, out=out)

    @classmethod
    def record_and_act_bytes(cls, m):
        """(e, act): one ring record and one row's step inputs and outputs, in bytes
        (see ``ideal_bytes``)."""
        e = m.nheads * m.headdim * 2 + m.ngroups * m.dstate * 2 + m.nheads * 4
        act = 2 * m.nheads * m.headdim * 2 + 2 * m.ngroups * m.dstate * 2 + cls.host.raw_gates * m.nheads * 2
        return e, act

    @staticmethod
    def cache(m, slots, window, device, drafts=0, dtype=None, read_copy=None):
        """The pool's cache (activation `dtype`, default bf16); with a ring (window > 1) it has
        room for `drafts` drafts. `read_copy` ("fp16", "fp8", "nvfp4") adds that read copy next
        to the fp32 checkpoint (``checkpoint_format="fp32"``; cache.py's low-precision state)."""
        return model_cache(m, slots, window, device, drafts if window > 1 else 0, dtype, read_copy)

    @classmethod
    def _shape(cls, cache):
        """The kernel Shape of a step of the pool's inputs on ``cache``."""
        return cls.host.shape(cache, cls.host.engine_inputs(cache.dtype))

    @classmethod
    def decode_kernel(cls, cache, batch, config=None):
        """The kernel that a decode() of `batch` rows with the pool's inputs launches on ``cache``
        (built, or loaded from the compile cache, on a miss): the Shape of the cache (read copy
        included) and, with ``config`` None, the launch config the API picks."""
        return launch.launcher(cls.host.decode_kernel, cls._shape(cache), 0, batch, config)

    @classmethod
    def kernel_shape(cls, m, window, drafts=0, dtype=None, read_copy=None):
        """The kernel Shape the API asks for with the pool's inputs on ``cache(m, ..., window,
        drafts, dtype, read_copy)``."""
        return cls._shape(cls.cache(m, 1, window, "meta", drafts, dtype, read_copy))

    @classmethod
    def compile(cls, shape, config):
        return launch.compiled(cls.host.decode_kernel, shape, config)

    @classmethod
    def config(cls, rows_per_cta, num_warps):
        return cls.host.launch_config()(rows_per_cta=rows_per_cta, num_warps=num_warps)

    @classmethod
    def default_config(cls, m, batch, window):
        """The analytical launch config decode() picks for the pool when given none (and none is
        tuned)."""
        return cls.host.decode_kernel.default_config(cls.kernel_shape(m, window), batch_bucket(batch))

    @classmethod
    def _speculative(cls, window):
        """The Kernel of a speculative step on a cache of `window`: verify() (window > 1) or the
        conventional snapshot baseline, snapshot_verify() (window 1)."""
        return cls.host.verify_kernel if window > 1 else cls.host.snapshot_kernel

    @classmethod
    def speculative_kernel(cls, cache, drafts, batch, config=None):
        """The kernel that a verify() (ring cache) or snapshot_verify() (conventional cache) of
        T = ``drafts`` with the pool's inputs launches on ``cache`` (built, or loaded from the
        compile cache, on a miss)."""
        return launch.launcher(cls._speculative(cache.window), cls._shape(cache), drafts, batch, config)

    @classmethod
    def speculative_check(cls, m, window, drafts, config):
        """Why that kernel cannot take ``config`` at this shape, or None."""
        return cls._speculative(window).check(cls.kernel_shape(m, window, drafts), config, drafts)

    @classmethod
    def default_speculative_config(cls, m, batch, window, drafts):
        """verify's analytical launch config for the pool of T = ``drafts`` when given none (and
        none is tuned); None for the snapshot baseline, which the sweeps time at the API's pick."""
        if window == 1:
            return None
        return cls.host.verify_kernel.default_config(cls.kernel_shape(m, window, drafts), batch_bucket(batch))

    @classmethod
    def speculative_space(cls, m, window, drafts, batch):
        """The pipelined verify's configs (``pipelined_verify_space``) where verify runs it by
        default on the pool of T = ``drafts`` at ``batch`` rows; else [] (the tile grid serves)."""
        import importlib

        from .layers.common import sm_count, target_arch

        default = cls.default_speculative_config(m, batch, window, drafts)
        if default is None or not hasattr(default, "stages"):
            return []
        module = importlib.import_module(f"replayssm_cute.kernels.{m.layer}.pipelined_verify")
        return module.pipelined_verify_space(cls.kernel_shape(m, window, drafts), sm_count(), target_arch())


_LAYERS = {name: type(f"_{host.__name__}", (_Layer,), {"host": host}) for name, host in LAYERS.items()}


def bench_layer(model):
    """What the pool and the sweeps know about ``model.layer``: record and activation bytes, the
    pool's cache, ring contents and inputs, the kernel shape they make decode() ask for, how to
    compile it, its launch configs (``config(rows_per_cta, num_warps)``) and the default one."""
    try:
        return _LAYERS[model.layer]
    except KeyError:
        raise ValueError(f"{model.name}: unknown layer type {model.layer!r}; "
                         f"known: {', '.join(_LAYERS)}") from None


def compile_pool_kernel(model, window: int, config, drafts: int = 0, batch: int = 1, read_copy=None):
    """Build (or load from the compile cache) the kernel a ``DecodePool(model, batch, window)``
    step launches with ``config``; with ``drafts`` T > 0, that of a ``DecodePool(model, batch,
    window, drafts=T)`` speculative step: verify (window > 1) or the snapshot baseline (window 1);
    ``compile_table_kernels`` builds the plan of a ReplaySSM step (and a verify's commit); with ``read_copy``, those of a
    pool with that read copy (``DecodePool(..., read_copy=...)``). Needs no GPU when
    ``CUTE_DSL_ARCH`` is set. `batch` matters only where the API picks a config (None) by it.
    A decode step with a read copy or with ``config`` None is looked up as decode() does, from
    a cache of the pool's layout on the meta device."""
    layer = bench_layer(model)
    if not drafts and read_copy is None and config is not None:
        return layer.compile(layer.kernel_shape(model, window), config)
    # dims and formats only, nothing allocated
    cache = layer.cache(model, 1, window, "meta", drafts=drafts, read_copy=read_copy)
    if not drafts:
        return layer.decode_kernel(cache, batch, config)
    return layer.speculative_kernel(cache, drafts, batch, config)


def compile_table_kernels(window: int, drafts: int = 0) -> None:
    """Build (or load from the compile cache) the sequence-table kernels of a pool of window L and
    room for T = ``drafts`` drafts (the same for every layer type and dims: they move positions):
    the plan of a decode step, and with T the plan of a verify step and its commit."""
    capacity = window + drafts
    launch.table_launcher("plan", window, capacity, 0, -1)
    if drafts:
        launch.table_launcher("plan", window, capacity, drafts, -1)
        launch.table_launcher("commit", window, capacity, drafts, -1)


def _step_sizes(model):
    """(S, e, act): fp32 state per sequence, one ring record and one token's step inputs and
    outputs, in bytes (see ``ideal_bytes``)."""
    e, act = bench_layer(model).record_and_act_bytes(model)
    return model.nheads * model.headdim * model.dstate * 4, e, act


def ideal_bytes(model, batch: int, window: int) -> Dict[str, float]:
    """Ideal bytes moved per decode step of ``batch`` rows of one layer of ``model``.

    ``model`` is a ``models.ModelSpec`` (sharded if need be): Mamba-2 with ``nheads`` H,
    ``headdim`` P, ``dstate`` N, ``ngroups`` G, or GDN with ``nheads`` HV, ``headdim`` V,
    ``dstate`` K, ``ngroups`` H; ``window`` is the ReplaySSM window L. With S the fp32 state per
    sequence (H*P*N*4, or HV*V*K*4), e one ring record and act the step's inputs and outputs
    (docs/benchmarking.md):

    * Mamba-2: e = H*P*2 + G*N*2 + H*4 (x and B in 16-bit, dt fp32),
      act = 2*H*P*2 + 2*G*N*2 + H*2 (x and the output y, B and C, raw dt, all 16-bit);
    * GDN: e = HV*V*2 + H*K*2 + HV*4 (u and k in 16-bit, g fp32),
      act = 2*H*K*2 + 2*HV*V*2 + 2*HV*2 (q and k, v and the output, raw gates a and b, all 16-bit);

    and per step:

    * ``conventional``: B*(2S + act), state read and written back;
    * ``window_mean``: mean over the L steps of a window (h = 0..L-1, flush included),
      B*(S + S/L + e(L-1)/2 + e(L-1)/L + act);
    * ``flush``: the step at h = L-1, B*(2S + (L-1)e + act);
    * ``nonflush_mean``: mean of the L-1 other steps, B*(S + e(L-2)/2 + e + act).
    """
    S, e, act = _step_sizes(model)
    L = window
    b = batch
    return {
        "conventional": b * (2 * S + act),
        "window_mean": b * (S + S / L + e * (L - 1) / 2 + e * (L - 1) / L + act),
        "flush": b * (2 * S + (L - 1) * e + act),
        "nonflush_mean": b * (S + e * (L - 2) / 2 + e + act),
    }


def cursor_cycle(window: int, drafts: int, accepted: int) -> List[int]:
    """Committed records h at the start of each verify step over one period of the cursor cycle
    of a row that accepts ``accepted`` of ``drafts`` drafts at every step (window L, T drafts,
    1 <= a <= T <= L): from h = 0, a step flushes when h + T > L and leaves h = a, else h + a.
    Each period starts at h = a and ends with its one flush; the transient h = 0 of a fresh
    slot is left out."""
    from .reference import spec_flush

    if not 1 <= accepted <= drafts <= window:
        raise ValueError(f"cursor_cycle needs 1 <= accepted <= drafts <= window, got accepted "
                         f"{accepted}, drafts {drafts}, window {window}")
    seen, h = [], 0
    while h not in seen:
        seen.append(h)
        h = accepted if spec_flush(h, drafts, window) else h + accepted
    return seen[seen.index(h):]


def verify_ideal_bytes(model, batch: int, window: int, drafts: int, accepted: int) -> Dict[str, float]:
    """Ideal bytes per speculative step of ``batch`` rows of one layer of ``model``, every row
    verifying T = ``drafts`` drafts and accepting a = ``accepted``, with S, e and act as in
    ``ideal_bytes`` (act per token):

    * ``verify``: mean over one period of ``cursor_cycle(window, T, a)`` of a verify + commit
      step starting at h committed records: B*(S + h*e + T*e + T*act), plus S on the flush step
      (h + T > L): the checkpoint read once per step and written once per flush, the committed
      records read once (the flush folds the ones the outputs read), the T draft records
      written, the T tokens' inputs and outputs;
    * ``conventional``: a conventional standard decode step, B*(2S + act);
    * ``snapshot``: the conventional speculative baseline, B*((1 + T)*S + S + T*act): the state
      read once and a snapshot written per draft, plus one state written back at the commit;
    * ``snapshot_kernel``: what its snapshot_verify() alone moves (no commit), B*((1 + T)*S + T*act).
    """
    from .reference import spec_flush

    S, e, act = _step_sizes(model)
    T, b = drafts, batch
    steps = [S * (1 + spec_flush(h, T, window)) + (h + T) * e + T * act
             for h in cursor_cycle(window, T, accepted)]
    return {
        "verify": b * sum(steps) / len(steps),
        "conventional": b * (2 * S + act),
        "snapshot": b * ((1 + T) * S + S + T * act),
        "snapshot_kernel": b * ((1 + T) * S + T * act),
    }


def time_graph(fn: Callable[[], object], launches_per_replay: int, replays: int = 15,
               warmup: Optional[Callable[[], object]] = None) -> float:
    """Median microseconds per launch over ``replays`` replays of a CUDA graph that calls fn() once.

    fn() (or ``warmup()``, when given: the tuner's single step, since a whole fn() of thousands of
    small launches costs seconds of host time per config) runs once on a side stream first
    (compiles, allocator warm-up), then fn() is captured; the graph is replayed a few times
    untimed, then each replay is timed with CUDA events and divided by ``launches_per_replay``.
    """
    import torch

    if launches_per_replay < 1:
        raise ValueError(f"launches_per_replay must be >= 1, got {launches_per_replay}")
    if replays < 1:
        raise ValueError(f"replays must be >= 1, got {replays}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        (warmup or fn)()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / launches_per_replay)
    times.sort()
    return times[len(times) // 2]


class DecodePool:
    """A bf16 decode pool of one layer of `model` (Mamba-2 or GDN, by ``model.layer``) at one batch
    for timing: the slots are split into sets of `batch` rows whose states total >= 512 MiB (far
    above the 60 MB L2), so stepping through the sets streams every checkpoint from HBM; fixed
    random inputs with realistic decays, rings filled with plausible records. With `stagger`,
    row r of every set starts at ring position r mod L. With `drafts` T > 0 the inputs are T
    tokens per row and the rings have room for T drafts: ``verify_fn`` steps verify + commit, or
    with window 1 ``snapshot_fn`` the conventional snapshot baseline. `dtype` (fp16, fp32)
    replaces bf16 for the cache and every bf16 input (the autotuner's other activation dtypes).
    `read_copy` ("fp16", "fp8", "nvfp4"; window > 1) gives the cache that read copy next to its
    fp32 checkpoint, RTN-encoded from it (``load_prefill``): then the sets total >= 512 MiB of
    read copy (with its scales), the state a non-flush step reads. `device` and
    `rotation_bytes` are for tests (a CPU pool steps through the float64 reference)."""

    def __init__(self, model, batch, window, stagger=False, seed=0, *, drafts=0, device="cuda",
                 rotation_bytes=ROTATION_BYTES, dtype=None, read_copy=None):
        import torch

        layer = bench_layer(model)
        self.model, self.batch, self.window, self.drafts = model, batch, window, drafts
        self.read_copy = read_copy
        self.rotation_bytes = rotation_bytes
        self.state_bytes = model.nheads * model.headdim * model.dstate * 4
        read_bytes = self.state_bytes
        if read_copy is not None:
            mem = layer.cache(model, 1, window, "meta", drafts, dtype, read_copy).memory_per_slot()
            read_bytes = sum(v for k, v in mem.items() if k.startswith("read_copy"))
        self.nsets = max(2, math.ceil(rotation_bytes / (batch * read_bytes)))
        slots = self.nsets * batch
        dev = torch.device(device)
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.cache = layer.cache(model, slots, window, dev, drafts, dtype, read_copy)
        self.cache.checkpoint.normal_(generator=gen).mul_(0.1)
        if read_copy is not None:
            self._encode_read_copy()
        if window > 1:
            layer.fill_ring(self.cache, gen)
            if stagger:
                r = torch.arange(slots, device=dev) % batch
                self.cache.cursor.copy_((r % window).int())
        self.sets = [torch.arange(i * batch, (i + 1) * batch, dtype=torch.int32, device=dev)
                     for i in range(self.nsets)]
        self.inputs = layer.inputs(model, batch, gen, dev, drafts)  # the API's keyword arguments
        if dtype is not None:
            self.inputs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16 else v
                           for k, v in self.inputs.items()}
        self.out = self.inputs["out"]

    def _encode_read_copy(self, chunk_bytes: int = 256 << 20):
        """Write every slot's read copy from its fp32 checkpoint (RTN, as a prefill load or a
        flush does), about `chunk_bytes` of checkpoint at a time; cursors and origins to 0."""
        import torch

        c = self.cache
        n = max(1, chunk_bytes // self.state_bytes)
        for start in range(0, c.num_slots, n):
            ids = torch.arange(start, min(start + n, c.num_slots), device=c.device)
            c.load_prefill(ids, c.checkpoint[ids])

    def step(self, slot_ids, config=None):
        from .api import decode

        decode(self.cache, slot_ids=slot_ids, config=config, **self.inputs)

    def window_fn(self, config=None):
        def fn():
            for _ in range(self.window):
                for ids in self.sets:
                    self.step(ids, config)
        return fn, self.window * self.nsets

    def flush_fn(self, config=None):
        def fn():
            self.cache.cursor.fill_(self.window - 1)
            for ids in self.sets:
                self.step(ids, config)
        return fn, self.nsets

    def cursor_fn(self, h, config=None):
        """(fn, nsets): fn sets every cursor to `h` (0 <= h < window) and steps every slot set
        once, so each step starts at h committed records (h = window - 1: ``flush_fn``)."""
        if not 0 <= h < self.window:
            raise ValueError(f"cursor_fn: h must be in [0, window {self.window}), got {h}")

        def fn():
            self.cache.cursor.fill_(h)
            for ids in self.sets:
                self.step(ids, config)
        return fn, self.nsets

    def nonflush_fn(self, config=None):
        """(fn, (window - 1) * nsets): fn sets every cursor to 0 and runs the window - 1
        non-flush steps h = 0..window-2 on every slot set (h + 1 < window: no row flushes), so
        its mean per step is the non-flush mean of a window, measured rather than derived."""
        if self.window < 2:
            raise ValueError("nonflush_fn: a conventional pool (window 1) has no non-flush steps")

        def fn():
            self.cache.cursor.fill_(0)
            for _ in range(self.window - 1):
                for ids in self.sets:
                    self.step(ids, config)
        return fn, (self.window - 1) * self.nsets

    def verify_fn(self, accepted, steps, config=None):
        """(fn, steps * nsets): fn runs `steps` speculative steps on every slot set, each a verify()
        of the pool's T drafts and a commit() of `accepted` of them in every row. The cursors
        follow ``cursor_cycle``: start them on it and give whole periods to come back."""
        import torch

        from .api import commit, verify

        num_accepted = torch.full((self.batch,), accepted, dtype=torch.int32, device=self.cache.device)

        def fn():
            for _ in range(steps):
                for ids in self.sets:
                    verify(self.cache, slot_ids=ids, config=config, **self.inputs)
                    commit(self.cache, ids, num_accepted)
        return fn, steps * self.nsets

    def snapshot_fn(self, config=None):
        """(fn, nsets): fn runs the conventional speculative baseline on every slot set of a
        conventional pool (window 1) with T drafts: a snapshot_verify(), the state read once and
        a snapshot written per draft, into snapshot buffers that rotate over >= rotation_bytes
        so that the writes reach HBM (kept in ``snapshots``). The commit (a copy or a pointer
        switch) is not run."""
        import torch

        from .api import snapshot_verify

        shape = (self.batch, self.drafts) + tuple(self.cache.checkpoint.shape[1:])
        count = min(self.nsets, math.ceil(self.rotation_bytes / (math.prod(shape) * 4)))
        self.snapshots = [torch.empty(shape, dtype=torch.float32, device=self.cache.device)
                          for _ in range(count)]
        buffers = self.snapshots

        def fn():
            for i, ids in enumerate(self.sets):
                snapshot_verify(self.cache, slot_ids=ids, snapshots=buffers[i % count], config=config,
                                **self.inputs)
        return fn, self.nsets


# ----------------------------------------------------------------------------- read copies
# The byte model of a cache with a low-precision read copy (sweeps/bench_read_precision.py's
# module docstring; the tuner's ideal bytes for read-copy kernels). S the fp32 checkpoint, R the
# state a non-flush step reads (the read copy with its scales).


def read_copy_arg(fmt: str) -> Optional[str]:
    """The cache's ``read_copy`` for read format `fmt`: None for fp32 (the plain cache)."""
    return None if fmt == "fp32" else fmt


def quant_format(fmt: str, K: int):
    """``fmt`` as replayssm_cute.quant stores it for innermost dim K: fp8 scales per 128 elements
    when K is a multiple of 128, else per state row (cache.py's rule); the name otherwise."""
    if fmt == "fp8":
        return quant.FP8E4M3(block_k=128 if K % 128 == 0 else K)
    return fmt


def state_bytes(model, fmt: str) -> int:
    """Bytes of one sequence's state in read format `fmt`, scales included: nheads states of
    (headdim x dstate) (Mamba-2 P x N, GDN V x K)."""
    return model.nheads * quant.bytes_per_state(quant_format(fmt, model.dstate), model.headdim, model.dstate)


def state_ratio(model, fmt: str) -> float:
    """The ideal byte ratio of read format `fmt`: the fp32 state over the format with its scales."""
    return state_bytes(model, "fp32") / state_bytes(model, fmt)


class StepSizes(NamedTuple):
    """Bytes per row (see the module docstring): S the fp32 checkpoint, R the state a non-flush
    step reads, e / e_w / e_f the record read per committed record / written / read at a flush,
    act the step's inputs and outputs, R_w the read copy a flush writes (0 without one)."""

    S: int
    R: int
    e: float
    e_w: float
    e_f: float
    act: int
    R_w: int


def step_sizes(model, fmt: str, window: int) -> StepSizes:
    """The StepSizes of ``model``'s pool (bf16 records and activations) with read format `fmt`.
    e and act are perf's (``record_and_act_bytes``); the records a read-copy cache keeps beyond
    them (GDN's v and beta) come from the cache layout (``memory_per_slot`` of a meta cache)."""
    layer = bench_layer(model)
    e, act = layer.record_and_act_bytes(model)
    S = state_bytes(model, "fp32")
    R = state_bytes(model, fmt)
    cache = layer.cache(model, 1, window, "meta", read_copy=read_copy_arg(fmt))
    mem = cache.memory_per_slot()
    extra = sum(mem.get(name, 0) for name in ("ring_v", "ring_beta")) / cache.capacity
    e_f = e
    if getattr(cache, "flush_corrections", "fold") == "rederive":  # k, g, v, beta: not the cached u
        e_f = e - mem["ring_u"] / cache.capacity + extra
    return StepSizes(S=S, R=R, e=e, e_w=e + extra, e_f=e_f, act=act, R_w=0 if fmt == "fp32" else R)


def read_ideal_bytes(model, batch: int, window: int, fmt: str, cursor: Optional[int] = None) -> Dict[str, float]:
    """Ideal bytes per step of ``batch`` rows reading format `fmt` (module docstring):
    ``nonflush`` (the mean over h = 0..L-2, or the step at h = ``cursor``), ``flush``,
    ``window_mean`` and ``conventional`` (window 1, fp32). With fp32 these are perf.ideal_bytes's."""
    z = step_sizes(model, fmt, window)
    L, b = window, batch
    h = (L - 2) / 2 if cursor is None else cursor
    nonflush_mean = z.R + z.e * (L - 2) / 2 + z.e_w + z.act
    flush = 2 * z.S + z.R_w + (L - 1) * z.e_f + z.act
    return {
        "nonflush": b * (z.R + z.e * h + z.e_w + z.act),
        "flush": b * flush,
        "window_mean": b * ((L - 1) * nonflush_mean + flush) / L,
        "conventional": ideal_bytes(model, batch, window)["conventional"],
    }


def verify_read_ideal_bytes(model, batch: int, window: int, drafts: int, accepted: int, fmt: str) -> float:
    from .reference import spec_flush

    """Ideal bytes of a verify + commit step of ``batch`` rows (T = ``drafts``, a = ``accepted``)
    reading format `fmt`, the mean over one period of perf.cursor_cycle (module docstring); with
    fp32, perf.verify_ideal_bytes's ``verify``."""
    z = step_sizes(model, fmt, window)
    T = drafts
    steps = []
    for h in cursor_cycle(window, T, accepted):
        if spec_flush(h, T, window):
            steps.append(2 * z.S + z.R_w + h * z.e_f + T * z.e_w + T * z.act)
        else:
            steps.append(z.R + h * z.e + T * z.e_w + T * z.act)
    return batch * sum(steps) / len(steps)
