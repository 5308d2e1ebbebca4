"""Small performance helpers shared by the demo and the sweeps: ideal bytes, graph timing and
decode pools for timing, for both layer types (Mamba-2 and Gated DeltaNet).

``ideal_bytes`` is the traffic a decode step cannot avoid (each byte read or written once);
dividing it by a measured time gives the achieved bandwidth. ``time_graph`` times a function by
capturing it once in a CUDA graph and replaying the graph. ``DecodePool`` holds a pool far larger
than L2 with realistic random inputs; ``compile_pool_kernel`` builds the kernel its steps call.
"""

from __future__ import annotations

import math
from typing import Callable, Dict

__all__ = ["DecodePool", "bench_layer", "compile_pool_kernel", "ideal_bytes", "time_graph"]

ROTATION_BYTES = 512 << 20


class _Layer:
    """One layer type as DecodePool and the sweeps see it. A ``ModelSpec`` names the dims alike for
    both types: per head a (headdim x dstate) fp32 state, and ngroups key-side groups (Mamba-2 B and
    C groups, GDN key heads); a record holds a 16-bit value-side row per head, a 16-bit key-side
    row per group and an fp32 scalar per head; the pool's activations are bf16."""

    raw_gates: int  # 16-bit raw per-head scalars per row: Mamba-2 dt, GDN a and b

    @staticmethod
    def _cache_class():
        raise NotImplementedError

    @staticmethod
    def _kernel():
        """(shape function of kernels_host, its arguments after the activation dtype for the
        pool's inputs, compile function, launch-config class, default-config function of
        (headdim, batch, window)), imported on demand."""
        raise NotImplementedError

    @staticmethod
    def fill_ring(cache, gen):
        """Plausible records in every slot's ring (the pool's cursors may start anywhere)."""
        raise NotImplementedError

    @staticmethod
    def inputs(m, batch, gen, device):
        """decode() keyword arguments (slot_ids and config aside), ``out`` included."""
        raise NotImplementedError

    @classmethod
    def record_and_act_bytes(cls, m):
        """(e, act): one ring record and one row's step inputs and outputs, in bytes
        (see ``ideal_bytes``)."""
        e = m.nheads * m.headdim * 2 + m.ngroups * m.dstate * 2 + m.nheads * 4
        act = 2 * m.nheads * m.headdim * 2 + 2 * m.ngroups * m.dstate * 2 + cls.raw_gates * m.nheads * 2
        return e, act

    @classmethod
    def cache(cls, m, slots, window, device):
        import torch

        return cls._cache_class()(slots, m.nheads, m.headdim, m.dstate, m.ngroups, window=window,
                                  dtype=torch.bfloat16, device=device)

    @classmethod
    def kernel_shape(cls, m, window):
        """The kernel shape decode() asks for with the pool's inputs."""
        import torch

        shape_fn, args = cls._kernel()[:2]
        return shape_fn(m.nheads, m.headdim, m.dstate, m.ngroups, window, window, torch.bfloat16, *args)

    @classmethod
    def compile(cls, shape, config):
        return cls._kernel()[2](shape, config)

    @classmethod
    def config(cls, rows_per_cta, num_warps):
        return cls._kernel()[3](rows_per_cta=rows_per_cta, num_warps=num_warps)

    @classmethod
    def default_config(cls, m, batch, window):
        """The launch config decode() picks when given none."""
        return cls._kernel()[4](m.headdim, batch, window)


class _Mamba2Layer(_Layer):
    """Mamba-2 (H heads of P x N, G groups), vLLM ``selective_state_update`` arguments: D and
    dt_bias given, dt_softplus on, no z, dt in bf16."""

    raw_gates = 1

    @staticmethod
    def _cache_class():
        from .cache import Mamba2Cache

        return Mamba2Cache

    @staticmethod
    def _kernel():
        import torch

        from .kernels.mamba2.decode import Mamba2Config
        from .kernels_host import compile_mamba2, default_mamba2_config, mamba2_shape

        args = (torch.bfloat16, True, False, True, True, -1)
        return mamba2_shape, args, compile_mamba2, Mamba2Config, default_mamba2_config

    @staticmethod
    def fill_ring(cache, gen):
        cache.ring_x.normal_(generator=gen)
        cache.ring_B.normal_(generator=gen)
        cache.ring_dt.uniform_(0.01, 0.05, generator=gen)

    @staticmethod
    def inputs(m, batch, gen, device):
        """A = -U(1, 2), dt_bias = U(-4, -3), random x, dt, B, C, D."""
        import torch

        H, P, N, G = m.nheads, m.headdim, m.dstate, m.ngroups
        bf = torch.bfloat16
        rand, randn = _generators(gen, device)
        A = -(1 + rand(H))
        dt_bias = -4 + rand(H)
        D = randn(H)
        x = randn(batch, H, P).to(bf)
        dt = (0.5 * randn(batch, H)).to(bf)
        B = randn(batch, G, N).to(bf)
        C = randn(batch, G, N).to(bf)
        out = torch.empty(batch, H, P, dtype=bf, device=device)
        return dict(x=x, dt=dt, A=A, B=B, C=C, D=D, dt_bias=dt_bias, dt_softplus=True, out=out)


class _GDNLayer(_Layer):
    """Gated DeltaNet (HV = nheads value heads of V = headdim x K = dstate, H = ngroups key
    heads), vLLM / FlashInfer arguments: separate q, k, v, raw gates a, b in bf16, fp32 A_log and
    dt_bias, the default q scale."""

    raw_gates = 2

    @staticmethod
    def _cache_class():
        from .cache import GDNCache

        return GDNCache

    @staticmethod
    def _kernel():
        import torch

        from .kernels.gdn.decode import GDNConfig
        from .kernels_host import compile_gdn, default_gdn_config, gdn_shape

        args = (torch.bfloat16, torch.float32, torch.float32, None, False, -1)
        return gdn_shape, args, compile_gdn, GDNConfig, default_gdn_config

    @staticmethod
    def _gates(head_shape, a_shape, gen, device):
        """A_log = log U(1, 16), dt_bias = U(-4, -3) of `head_shape` and raw a = N(0, 1/4) of
        `a_shape`: decays exp(g), g = -exp(A_log) softplus(a + dt_bias), mostly in (0.5, 1)."""
        rand, randn = _generators(gen, device)
        A_log = (1 + 15 * rand(*head_shape)).log()
        dt_bias = -4 + rand(*head_shape)
        return A_log, dt_bias, 0.5 * randn(*a_shape)

    @staticmethod
    def fill_ring(cache, gen):
        """Records as decoding writes them: u ~ N(0, 1), unit-norm keys, g from the pool's gates."""
        import torch.nn.functional as F

        device = cache.checkpoint.device
        _, randn = _generators(gen, device)
        cache.ring_u.normal_(generator=gen)
        cache.ring_k.copy_(F.normalize(randn(*cache.ring_k.shape), dim=-1))
        A_log, dt_bias, a = _GDNLayer._gates(cache.ring_g.shape, cache.ring_g.shape, gen, device)
        cache.ring_g.copy_(-A_log.exp() * F.softplus(a + dt_bias))

    @staticmethod
    def inputs(m, batch, gen, device):
        """Random q, k, v, raw gates a, b; A_log, dt_bias per head (see ``_gates``)."""
        import torch

        HV, V, K, H = m.nheads, m.headdim, m.dstate, m.ngroups
        bf = torch.bfloat16
        _, randn = _generators(gen, device)
        A_log, dt_bias, a = _GDNLayer._gates((HV,), (batch, HV), gen, device)
        q = randn(batch, H, K).to(bf)
        k = randn(batch, H, K).to(bf)
        v = randn(batch, HV, V).to(bf)
        b = randn(batch, HV).to(bf)
        out = torch.empty(batch, HV, V, dtype=bf, device=device)
        return dict(q=q, k=k, v=v, a=a.to(bf), b=b, A_log=A_log, dt_bias=dt_bias, out=out)


_LAYERS = {"mamba2": _Mamba2Layer, "gdn": _GDNLayer}


def bench_layer(model):
    """What the pool and the sweeps know about ``model.layer``: record and activation bytes, the
    pool's cache, ring contents and inputs, the kernel shape they make decode() ask for, how to
    compile it, its launch configs (``config(rows_per_cta, num_warps)``) and the default one."""
    try:
        return _LAYERS[model.layer]
    except KeyError:
        raise ValueError(f"{model.name}: unknown layer type {model.layer!r}; "
                         f"known: {', '.join(_LAYERS)}") from None


def _generators(gen, device):
    """torch.rand and torch.randn (fp32) drawing from `gen` on `device`."""
    import torch

    return (lambda *shape: torch.rand(*shape, generator=gen, device=device),
            lambda *shape: torch.randn(*shape, generator=gen, device=device))


def compile_pool_kernel(model, window: int, config):
    """Build (or load from the compile cache) the kernel a ``DecodePool(model, b, window)`` step
    launches with ``config``; needs no GPU when ``CUTE_DSL_ARCH`` is set."""
    layer = bench_layer(model)
    return layer.compile(layer.kernel_shape(model, window), config)


def ideal_bytes(model, batch: int, window: int) -> Dict[str, float]:
    """Ideal bytes moved per decode step of ``batch`` rows of one layer of ``model``.

    ``model`` is a ``models.ModelSpec`` (sharded if need be): Mamba-2 with ``nheads`` H,
    ``headdim`` P, ``dstate`` N, ``ngroups`` G, or GDN with ``nheads`` HV, ``headdim`` V,
    ``dstate`` K, ``ngroups`` H; ``window`` is the ReplaySSM window L. With S the fp32 state per
    sequence (H*P*N*4, or HV*V*K*4), e one ring record and act the step's inputs and outputs
    (shared/docs/performance.md):

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
    e, act = bench_layer(model).record_and_act_bytes(model)
    S = model.nheads * model.headdim * model.dstate * 4
    L = window
    b = batch
    return {
        "conventional": b * (2 * S + act),
        "window_mean": b * (S + S / L + e * (L - 1) / 2 + e * (L - 1) / L + act),
        "flush": b * (2 * S + (L - 1) * e + act),
        "nonflush_mean": b * (S + e * (L - 2) / 2 + e + act),
    }


def time_graph(fn: Callable[[], object], launches_per_replay: int, replays: int = 15) -> float:
    """Median microseconds per launch over ``replays`` replays of a CUDA graph that calls fn() once.

    fn() runs once on a side stream first (compiles, allocator warm-up), then is captured; the
    graph is replayed a few times untimed, then each replay is timed with CUDA events and divided
    by ``launches_per_replay``.
    """
    import torch

    if launches_per_replay < 1:
        raise ValueError(f"launches_per_replay must be >= 1, got {launches_per_replay}")
    if replays < 1:
        raise ValueError(f"replays must be >= 1, got {replays}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
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
    row r of every set starts at ring position r mod L. `device` and `rotation_bytes` are for
    tests (a CPU pool steps through the float64 reference)."""

    def __init__(self, model, batch, window, stagger=False, seed=0, *, device="cuda",
                 rotation_bytes=ROTATION_BYTES):
        import torch

        layer = bench_layer(model)
        self.model, self.batch, self.window = model, batch, window
        self.state_bytes = model.nheads * model.headdim * model.dstate * 4
        self.nsets = max(2, math.ceil(rotation_bytes / (batch * self.state_bytes)))
        slots = self.nsets * batch
        dev = torch.device(device)
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.cache = layer.cache(model, slots, window, dev)
        self.cache.checkpoint.normal_(generator=gen).mul_(0.1)
        if window > 1:
            layer.fill_ring(self.cache, gen)
            if stagger:
                r = torch.arange(slots, device=dev) % batch
                self.cache.cursor.copy_((r % window).int())
        self.sets = [torch.arange(i * batch, (i + 1) * batch, dtype=torch.int32, device=dev)
                     for i in range(self.nsets)]
        self.inputs = layer.inputs(model, batch, gen, dev)  # decode() keyword arguments
        self.out = self.inputs["out"]

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
