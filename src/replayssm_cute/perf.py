"""Small performance helpers shared by the demo and the sweeps: ideal bytes and graph timing.

``ideal_bytes`` is the traffic a decode step cannot avoid (each byte read or written once);
dividing it by a measured time gives the achieved bandwidth. ``time_graph`` times a function by
capturing it once in a CUDA graph and replaying the graph.
"""

from __future__ import annotations

import math
from typing import Callable, Dict

__all__ = ["DecodePool", "ideal_bytes", "time_graph"]

ROTATION_BYTES = 512 << 20


def ideal_bytes(model, batch: int, window: int) -> Dict[str, float]:
    """Ideal bytes moved per decode step of ``batch`` rows of one layer of ``model``.

    ``model`` has ``nheads`` H, ``headdim`` P, ``dstate`` N and ``ngroups`` G (a
    ``models.ModelSpec``, sharded if need be); ``window`` is the ReplaySSM window L. With
    S = H*P*N*4 (fp32 state), e = H*P*2 + G*N*2 + H*4 (one ring record: x and B in 16-bit, dt
    fp32) and act = 2*H*P*2 + 2*G*N*2 + H*2 (x and the output y, B and C, raw dt, all 16-bit):

    * ``conventional``: B*(2S + act), state read and written back;
    * ``window_mean``: mean over the L steps of a window (h = 0..L-1, flush included),
      B*(S + S/L + e(L-1)/2 + e(L-1)/L + act);
    * ``flush``: the step at h = L-1, B*(2S + (L-1)e + act);
    * ``nonflush_mean``: mean of the L-1 other steps, B*(S + e(L-2)/2 + e + act).
    """
    H, P, N, G = model.nheads, model.headdim, model.dstate, model.ngroups
    L = window
    S = H * P * N * 4
    e = H * P * 2 + G * N * 2 + H * 4
    act = 2 * H * P * 2 + 2 * G * N * 2 + H * 2
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
    """A bf16 decode pool at one model shape and batch for timing: the slots are split into sets
    of `batch` rows whose states total >= 512 MiB (far above the 60 MB L2), so stepping through
    the sets streams every checkpoint from HBM; fixed random inputs with realistic decays. With
    `stagger`, row r of every set starts at ring position r mod L."""

    def __init__(self, model, batch, window, stagger=False, seed=0):
        import torch

        from .cache import Mamba2Cache

        H, P, N, G = model.nheads, model.headdim, model.dstate, model.ngroups
        self.model, self.batch, self.window = model, batch, window
        self.state_bytes = H * P * N * 4
        self.nsets = max(2, math.ceil(ROTATION_BYTES / (batch * self.state_bytes)))
        slots = self.nsets * batch
        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.cache = Mamba2Cache(slots, H, P, N, G, window=window, dtype=torch.bfloat16, device=dev)
        self.cache.checkpoint.normal_(generator=gen).mul_(0.1)
        if window > 1:
            self.cache.ring_x.normal_(generator=gen)
            self.cache.ring_B.normal_(generator=gen)
            self.cache.ring_dt.uniform_(0.01, 0.05, generator=gen)
            if stagger:
                r = torch.arange(slots, device=dev) % batch
                self.cache.cursor.copy_((r % window).int())
        self.sets = [torch.arange(i * batch, (i + 1) * batch, dtype=torch.int32, device=dev)
                     for i in range(self.nsets)]
        self.A = -(1 + torch.rand(H, generator=gen, device=dev))
        self.dt_bias = -4 + torch.rand(H, generator=gen, device=dev)
        self.D = torch.randn(H, generator=gen, device=dev)
        bf = torch.bfloat16
        self.x = torch.randn(batch, H, P, generator=gen, device=dev).to(bf)
        self.dt = (0.5 * torch.randn(batch, H, generator=gen, device=dev)).to(bf)
        self.B = torch.randn(batch, G, N, generator=gen, device=dev).to(bf)
        self.C = torch.randn(batch, G, N, generator=gen, device=dev).to(bf)
        self.out = torch.empty(batch, H, P, dtype=bf, device=dev)

    def step(self, slot_ids, config=None):
        from .api import decode

        decode(self.cache, self.x, self.dt, self.A, self.B, self.C, slot_ids, D=self.D,
                  dt_bias=self.dt_bias, dt_softplus=True, out=self.out, config=config)

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
