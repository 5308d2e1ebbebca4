"""Output error of low-precision SSM state against a float64 recurrence, as a function of the
generation length N (docs/design.md section 5): every cache configuration, on the CPU reference
or on the GPU kernels.

    python sweeps/error_growth.py                          # 4096 tokens, every configuration, both layers
    python sweeps/error_growth.py --tokens 65536 --plot sweeps/results/error_growth_64k.png
    python sweeps/error_growth.py --layers gdn --configs shared-fp8,sep-fp32-fp8,sep-fp32-fp8-fold
    python sweeps/error_growth.py --list                   # the configurations
    python sweeps/error_growth.py --device cuda --plot sweeps/results/error_growth_h200.png
                                                           # GPU kernels: 65536 tokens, batch 64

For each layer type (Mamba-2, Gated DeltaNet) and configuration, a cache is driven step by step
through the public API (``replayssm_cute.decode`` with CPU tensors runs the float64-semantics
reference, ``reference.*_lowprec_cache_`` for low-precision caches) with random inputs, and every step's
output is compared with a plain float64 recurrence run alongside on the same inputs
(``reference.mamba2_conventional_step`` / ``reference.gdn_conventional_step``). Both start from
the same prefill state: ``--prefill`` tokens of the float64 recurrence from zero, rounded to fp32
and handed to ``load_prefill`` (prefill is full precision; rounding enters through the
checkpoint writes of decoding, as in the paper's Section 7.4).

Per step n = 1..N_max:

* rel_err_output = ||y - y_ref|| / ||y_ref||, norms over the whole step output (batch rows x
  heads x head dim); y is the cache's fp32 output, y_ref the float64 recurrence's.
* rel_err_state = ||S_ckpt - S_ref|| / ||S_ref|| of the recurrence checkpoint (decoded, the whole
  batch) on the steps that write it (every step at L = 1, every L-th step otherwise, the
  cursor back at 0); not available on the other steps.

Reported at N = 1, 2, 4, ..., N_max (powers of two up to --tokens): the mean over the steps n
with N / sqrt(2) < n <= N * sqrt(2) (n <= --tokens), so the windows tile the run; rel_err_state
is the mean over the checkpoint writes in that window and empty where there are none (N < L).

Configurations (``--list``): ``conv-*`` conventional decoding (L = 1), the state written every
step, SR below fp32; ``shared-*`` ReplaySSM with one low-precision SR checkpoint serving both
roles; ``replay-fp32`` ReplaySSM with the fp32 checkpoint; ``sep-C-R`` ReplaySSM with a recurrence
checkpoint C (fp32, fp16+SR, fp8+SR) and a read copy R (fp16, fp8, nvfp4; RTN). GDN only:
``sep-C-R`` re-derive the corrections at a flush (paper Algorithm 6, the cache default with a
read copy) and ``sep-C-R-fold`` fold the cached ones; ``replay-fp32`` folds (the default without a
read copy) and ``replay-fp32-rederive`` re-derives.

Inputs: random, activations fp32 (the output is stored in the activation dtype, so bf16 would
put a 2^-9 floor under every configuration). Decays include slow heads: per-head decay rates
-log(alpha) spread log-uniformly over --rates (default 5e-5..0.1: at 4 heads alpha ~ 0.99995,
0.9994, 0.992, 0.905 nominal), times a per-token factor (softplus of a random gate). Note
that a GDN cache keeps its corrections u in an fp16 ring whatever the state formats, so GDN's
ReplaySSM outputs (and a "fold" flush) carry fp16 rounding even with an fp32 checkpoint.

--device cuda: the same study on the GPU kernels. Each layer's configurations are stepped
together (``LayerRun``), one cache per configuration with one pool slot per sequence; defaults
65536 tokens, batch 64, Mamba-2 H,P,N,G = 4,16,64,1 and GDN HV,V,K,H = 4,32,64,1 (the kernels'
nvfp4 path needs N / K >= 64; fp8 keeps one scale per 64-element row there). Every step draws the
inputs once (on the CPU, the stream of the CPU path: with the same batch and shapes the inputs
and SR seeds are the CPU run's), runs the float64 recurrence (and the prefill) on the GPU with
plain torch ops, ``replayssm_cute.decode`` on every configuration's CUDA cache (each writing its rows of one
output buffer), then the errors of all configurations in a few ops; nothing comes back to the
host until the layer is done. The flush schedule is known on the host (every row starts at
cursor 0 and advances in lock-step: configuration c writes its checkpoint at step n iff
n % L_c == 0; checked against the cursors at the end). Steps run as CUDA graphs of
--graph-steps steps (rounded up to a multiple of --window, so every graph starts at a cursor-0
step of every configuration): the first chunk eagerly on a side stream (kernel loads, warm-up),
then one captured chunk replayed, a final partial chunk eagerly; --no-graph runs every step
eagerly. Before the run every configuration's kernel is built in --jobs worker processes into
the on-disk compile cache (each worker runs one decode step), so the run itself only loads
them; a configuration the kernels refuse stops the run there (exit 1, the reason). The CSV's
``backend`` column says what ran (``cpu-reference`` or ``cuda-kernels``), ``batch`` and
``shape`` the sizes. Without a CUDA GPU --device cuda exits 1 with a message.

Runtime on one H200, all 44 runs (estimate; not yet measured): a step issues 44 decode launches
(~4-6 us each at batch 64) and ~200 small torch ops (Mamba-2 88, GDN 108 on average: the
float64 recurrence, output errors, the checkpoint decode and state error of conv-* every step
and of the ReplaySSM configurations every L-th), ~2-4 us each as graph nodes: ~0.7-1 ms a
step, ~45-65 s for 65536 steps; the CPU draws the next chunk meanwhile. Add ~20-30 s of kernel builds on
a cold compile cache (44 kernels, ~2-4 s each, 16 workers), CUDA start-up, prefill and capture:
about 1.5-2 minutes. --no-graph is host-bound (~35 us a decode call, ~8 us a torch op, ~3 ms a
step): about 4 minutes.
"""

import argparse
import contextlib
import csv
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import replayssm_cute as rs  # noqa: E402
from replayssm_cute.layers import LAYERS as LAYER_HOSTS  # noqa: E402
from result_files import check_out, default_out, device_tag  # noqa: E402

PROG = "error_growth"
LAYERS = tuple(LAYER_HOSTS)  # ("mamba2", "gdn")
DEFAULT_TOKENS = 4096
DEFAULT_BATCH = 2
CUDA_DEFAULT_TOKENS = 65536  # --device cuda: the long run
CUDA_DEFAULT_BATCH = 64  # --device cuda: sequences (pool slots) per cache; the GPU steps cost about the same
DEFAULT_GRAPH_STEPS = 64
MAX_TOKENS = 65536
BACKENDS = {"cpu": "cpu-reference", "cuda": "cuda-kernels"}
DEFAULT_SHAPES = {"mamba2": (4, 16, 32, 1), "gdn": (4, 32, 32, 1)}  # H,P,N,G | HV,V,K,H
# --device cuda: the kernels' nvfp4 reads and writes take 2, 4 or 8 elements of the innermost dim
# per lane, so N / K = 64 at least (the CPU defaults' 32 would drop every nvfp4 configuration)
CUDA_DEFAULT_SHAPES = {"mamba2": (4, 16, 64, 1), "gdn": (4, 32, 64, 1)}
SHAPE_NAMES = {name: host.dims_names for name, host in LAYER_HOSTS.items()}
DEFAULT_RATES = (5e-5, 0.1)
COLUMNS = ("layer", "config", "checkpoint_format", "read_copy", "shared", "window", "flush_corrections", "N",
           "rel_err_output", "rel_err_state", "backend", "batch", "shape")
NO_CUDA = (f"{PROG}: no CUDA GPU found: --device cuda runs the decode kernels and needs one (--device cpu, the "
           "default, runs the float64-semantics CPU reference)")
NO_MATPLOTLIB = ("--plot needs matplotlib, which is not installed: pip install 'replayssm-cute[plots]' "
                 "(or pip install matplotlib), or leave out --plot")
MAMBA2_DT_MEAN = 0.1  # dt ~ softplus(dt_bias + noise) with softplus(dt_bias) = this


# ----------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Config:
    """One cache configuration. ``window`` None: the sweep's --window (ReplaySSM); 1:
    conventional. ``flush_corrections`` None: the cache's default."""

    name: str
    checkpoint_format: str
    read_copy: Optional[str]
    window: Optional[int]
    flush_corrections: Optional[str] = None
    layers: tuple = LAYERS
    about: str = ""


def _configurations() -> Dict[str, Config]:
    cfgs = [Config("conv-fp32", "fp32", None, 1, about="conventional (L = 1), fp32 state: the floor")]
    cfgs += [Config(f"conv-{f}", f, None, 1, about=f"conventional (L = 1), {f}+SR state written every step")
             for f in ("fp16", "fp8", "nvfp4")]
    cfgs += [Config(f"shared-{f}", f, None, None, about=f"ReplaySSM, one {f}+SR checkpoint for both roles")
             for f in ("fp16", "fp8", "nvfp4")]
    cfgs.append(Config("replay-fp32", "fp32", None, None,
                       about="ReplaySSM, fp32 checkpoint, no read copy (GDN: cached corrections folded)"))
    cfgs.append(Config("replay-fp32-rederive", "fp32", None, None, "rederive", ("gdn",),
                       about="ReplaySSM, fp32 checkpoint, no read copy, corrections re-derived at a flush"))
    for c in ("fp32", "fp16", "fp8"):
        ck = "fp32" if c == "fp32" else f"{c}+SR"
        for r in ("fp16", "fp8", "nvfp4"):
            cfgs.append(Config(f"sep-{c}-{r}", c, r, None,
                               about=f"ReplaySSM, {ck} recurrence checkpoint + {r} read copy (GDN: re-derive)"))
    for c in ("fp32", "fp16", "fp8"):
        for r in ("fp16", "fp8", "nvfp4"):
            cfgs.append(Config(f"sep-{c}-{r}-fold", c, r, None, "fold", ("gdn",),
                               about=f"as sep-{c}-{r}, the cached corrections folded at a flush"))
    return {c.name: c for c in cfgs}


CONFIGS = _configurations()


# ----------------------------------------------------------------------------- layers


def head_rates(nheads: int, rates: Sequence[float]) -> torch.Tensor:
    """Per-head decay rates -log(alpha), log-uniformly spaced over [rates[0], rates[1]], float64."""
    lo, hi = rates
    if nheads == 1:
        return torch.tensor([lo], dtype=torch.float64)
    return torch.logspace(math.log10(lo), math.log10(hi), nheads, dtype=torch.float64)


class _StudyLayer:
    """One layer of the study: its adapter's (replayssm_cute.layers) weights for the decay rates,
    random tokens, float64 conventional step and cache; decode through the API by keyword."""

    def __init__(self, layer: str, shape, batch: int, rates, device="cpu"):
        self.host, self.name, self.shape, self.batch = LAYER_HOSTS[layer], layer, tuple(shape), batch
        self.params = self.host.study_params(self.shape, head_rates(self.shape[0], rates), MAMBA2_DT_MEAN, device)
        self.state_shape, self.out_shape = self.host.row_shapes(self.shape)

    def make_cache(self, window: int, device, **formats):
        return self.host.cache_type(self.batch, *self.shape, window=window, dtype=torch.float32, device=device,
                                    **formats)

    def draw(self, g: torch.Generator) -> dict:
        return self.host.study_tokens(self.shape, self.batch, g)

    def reference(self, S: torch.Tensor, t: dict):
        return self.host.conventional_reference(S, t, self.params)

    def decode(self, cache, t: dict, ids: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        return rs.decode(cache, slot_ids=ids, out=out, **t, **self.params)


def make_layer(layer: str, shape, batch: int, rates, device="cpu"):
    """The layer's parameters on ``device``; its random inputs are always drawn on the CPU."""
    return _StudyLayer(layer, shape, batch, rates, device)


def cache_options(cfg: Config, layer: str, window: int, seed: int) -> dict:
    """Keyword arguments of the cache constructor for ``cfg`` (the window included)."""
    opts = {"window": cfg.window or window, "checkpoint_format": cfg.checkpoint_format, "read_copy": cfg.read_copy}
    if cfg.checkpoint_format != "fp32":
        opts["sr_seed"] = seed & 0xFFFFFFFF
    if layer == "gdn" and cfg.flush_corrections is not None:
        opts["flush_corrections"] = cfg.flush_corrections
        if cfg.flush_corrections == "rederive" and cfg.read_copy is None:
            opts["keep_v_beta"] = True  # re-deriving needs the cached (v, beta)
    return opts


def make_cache(lay, cfg: Config, window: int, seed: int, device="cpu"):
    """The cache of one configuration on ``device``: on the CPU ``decode`` runs the reference,
    on CUDA the kernels."""
    opts = cache_options(cfg, lay.name, window, seed)
    return lay.make_cache(opts.pop("window"), device, **opts)


def checkpoint_value(cache) -> torch.Tensor:
    """The recurrence checkpoint of every slot, decoded to fp32 (slots, *state): what
    ``cache.read_state(all slots)`` returns, without taking the slot ids to the host (no
    synchronisation, CUDA-graph capturable)."""
    fmt, data, scales = cache._copy("checkpoint")
    return data if fmt is None else fmt.decode(data, scales)


# ----------------------------------------------------------------------------- one run


@dataclass(frozen=True)
class Job:
    layer: str
    config: str
    shape: tuple
    batch: int
    tokens: int
    prefill: int
    window: int
    rates: tuple
    seed: int
    device: str = "cpu"


def _rel(err: torch.Tensor, ref: torch.Tensor) -> float:
    den = float(torch.linalg.vector_norm(ref))
    return float(torch.linalg.vector_norm(err)) / den if den > 0 else float("nan")


def _to(t: dict, device) -> dict:
    return {k: v.to(device) for k, v in t.items()}


def prefill_state(lay, prefill: int, g: torch.Generator, device="cpu") -> torch.Tensor:
    """The state after ``prefill`` tokens of the float64 recurrence from zero (on ``device``,
    the inputs drawn on the CPU), rounded to fp32."""
    S = torch.zeros((lay.batch,) + lay.state_shape, dtype=torch.float64, device=device)
    for _ in range(prefill):
        S = lay.reference(S, _to(lay.draw(g), device))[1]
    return S.to(torch.float32)


def result_meta(cfg: Config, cache, job: Job, backend: str) -> dict:
    """The CSV's configuration fields of one run (shape: H,P,N,G or HV,V,K,H joined by 'x')."""
    return {"layer": job.layer, "config": cfg.name, "checkpoint_format": cfg.checkpoint_format,
            "read_copy": cfg.read_copy or "none", "shared": cache.shared, "window": cache.window,
            "flush_corrections": getattr(cache, "flush_corrections", "") or "", "backend": backend,
            "batch": job.batch, "shape": "x".join(map(str, job.shape))}


def run_job(job: Job, tick=None) -> dict:
    """Drive one configuration's cache for job.tokens steps next to the float64 recurrence.
    Returns {"out": per-step rel_err_output, "state": per-step rel_err_state (nan where the
    checkpoint is not written), "meta": the CSV's configuration fields}. ``tick(n)`` is
    called every few steps with the number of steps done since the last call."""
    cfg = CONFIGS[job.config]
    lay = make_layer(job.layer, job.shape, job.batch, job.rates)
    g = torch.Generator().manual_seed(job.seed)  # the same inputs for every configuration of a layer
    S32 = prefill_state(lay, job.prefill, g)
    cache = make_cache(lay, cfg, job.window, job.seed, job.device)
    ids = torch.arange(job.batch, dtype=torch.int32)
    cache.load_prefill(ids, S32)
    S = S32.to(torch.float64)
    rel_out = torch.full((job.tokens,), float("nan"), dtype=torch.float64)
    rel_state = torch.full((job.tokens,), float("nan"), dtype=torch.float64)
    every = 64
    for n in range(job.tokens):
        t = lay.draw(g)
        y_ref, S = lay.reference(S, t)
        y = lay.decode(cache, t, ids)
        rel_out[n] = _rel(y.to(torch.float64) - y_ref, y_ref)
        if not bool(cache.cursor.any()):  # every row flushed: the checkpoint holds the state after token n
            rel_state[n] = _rel(cache.read_state(ids, "checkpoint").to(torch.float64) - S, S)
        if tick is not None and (n + 1) % every == 0:
            tick(every)
    if tick is not None and job.tokens % every:
        tick(job.tokens % every)
    return {"out": rel_out, "state": rel_state, "meta": result_meta(cfg, cache, job, BACKENDS["cpu"])}


def points(tokens: int) -> List[int]:
    """N = 1, 2, 4, ... <= tokens."""
    return [1 << i for i in range(tokens.bit_length()) if 1 << i <= tokens]


def window_steps(N: int, tokens: int) -> range:
    """Steps n (1-based) averaged for point N: N / sqrt(2) < n <= N sqrt(2), n <= tokens (exact:
    2 n^2 > N^2 and n^2 <= 2 N^2)."""
    return range(math.isqrt(N * N // 2) + 1, min(math.isqrt(2 * N * N), tokens) + 1)


def summarize(result: dict, tokens: int) -> List[dict]:
    """CSV rows of one run: per point N the window means of rel_err_output and rel_err_state."""
    rows = []
    for N in points(tokens):
        steps = window_steps(N, tokens)
        out = result["out"][steps.start - 1: steps.stop - 1]
        st = result["state"][steps.start - 1: steps.stop - 1]
        st = st[~torch.isnan(st)]
        rows.append(dict(result["meta"], N=N, rel_err_output=float(out.mean()),
                         rel_err_state=float(st.mean()) if len(st) else None))
    return rows


# ----------------------------------------------------------------------------- a layer's configurations together (GPU)


def graph_chunk(window: int, steps: int) -> int:
    """Steps per captured graph: ``steps`` rounded up to a multiple of the ReplaySSM window, so
    every chunk starts at a cursor-0 step of every configuration (windows 1 and ``window``) and
    the flush pattern is the same in every chunk."""
    return window * max(1, -(-steps // window))


def writes_checkpoint(n: int, window: int) -> bool:
    """Whether step n (0-based) of a run started at cursor 0 writes the checkpoint: every step
    at window 1, every window-th step (the cursor back at 0) otherwise."""
    return (n + 1) % window == 0


class _Graph:
    """A CUDA graph of ``fn`` (captured, not run)."""

    def __init__(self, fn):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            fn()

    def replay(self) -> None:
        self.graph.replay()


class _FakeGraph:
    """The CPU stand-in of _Graph: the same control flow, ``fn`` run at every replay (so a CPU
    run checks that a chunk's steps read nothing but the static buffers)."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


@contextlib.contextmanager
def _side_stream(device: torch.device):
    """Eager warm-up before a capture runs on a side stream, as torch asks (no-op on the CPU)."""
    if device.type != "cuda":
        yield
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        yield
    torch.cuda.current_stream().wait_stream(side)


class LayerRun:
    """Every configuration of one layer driven together, one cache per configuration (batch
    rows = pool slots = independent sequences), next to one float64 recurrence.

    ``jobs``: the layer's runs (same layer, shape, batch, tokens, prefill, window, rates, seed
    and device; any configurations). On the device: the configurations' caches, the float64
    state ``S``, the inputs of one chunk (``chunk`` steps, drawn on the CPU in the order of
    ``run_job``, so with the same batch the inputs, prefill and SR seeds are those of the CPU
    path), one output buffer ``Y`` (configurations, batch, *out) that every decode writes
    into, and the per-step errors. ``step(i, n)`` reads chunk row i and writes error row i, all
    in place, so a chunk of steps captures in one CUDA graph; the host never waits on the
    device until ``results()``. With a CPU device the caches run the reference (``decode`` on
    CPU tensors): the same code path, for checking it without a GPU.
    """

    def __init__(self, jobs: List[Job], chunk: int):
        j0 = jobs[0]
        for j in jobs:
            if replace(j, config=j0.config) != j0:
                raise ValueError(f"LayerRun: jobs differ beyond their configuration: {j} vs {j0}")
        self.job, self.chunk, self.tokens = j0, chunk, j0.tokens
        self.device = torch.device(j0.device)
        self.cfgs = [CONFIGS[j.config] for j in jobs]
        self.lay = make_layer(j0.layer, j0.shape, j0.batch, j0.rates, self.device)
        self.g = torch.Generator().manual_seed(j0.seed)  # the same inputs for every configuration
        S32 = prefill_state(self.lay, j0.prefill, self.g, self.device)
        self.ids = torch.arange(j0.batch, dtype=torch.int32, device=self.device)
        self.caches = [make_cache(self.lay, cfg, j0.window, j0.seed, self.device) for cfg in self.cfgs]
        for cache in self.caches:
            cache.load_prefill(self.ids, S32)
        self.windows = [cache.window for cache in self.caches]
        if chunk % j0.window:
            raise ValueError(f"LayerRun: chunk {chunk} is not a multiple of the window {j0.window}")
        self.S = S32.to(torch.float64)  # the float64 recurrence, updated in place
        C, f64, nan = len(self.cfgs), torch.float64, float("nan")
        self.Y = torch.zeros((C, j0.batch) + self.lay.out_shape, dtype=torch.float32, device=self.device)
        self.inputs = {k: torch.zeros((chunk,) + v.shape, dtype=v.dtype, device=self.device)
                       for k, v in self.lay.draw(torch.Generator().manual_seed(0)).items()}
        self.err_out = torch.full((chunk, C), nan, dtype=f64, device=self.device)
        self.err_state = torch.full((chunk, C), nan, dtype=f64, device=self.device)
        self.rel_out = torch.full((C, self.tokens), nan, dtype=f64, device=self.device)
        self.rel_state = torch.full((C, self.tokens), nan, dtype=f64, device=self.device)
        self.graphed_chunks = 0

    def fill(self, count: int) -> None:
        """Draw the next ``count`` steps' inputs (CPU generator, one step after the other) into
        the chunk buffers."""
        draws = [self.lay.draw(self.g) for _ in range(count)]
        for k, buf in self.inputs.items():
            buf[:count].copy_(torch.stack([d[k] for d in draws]))

    def step(self, i: int, n: int) -> None:
        """Step n (0-based) of the run from chunk row i: the float64 recurrence, every
        configuration's decode, error row i (output error of every configuration; state error of
        those that write their checkpoint at step n)."""
        t = {k: buf[i] for k, buf in self.inputs.items()}
        y_ref, S_new = self.lay.reference(self.S, t)
        self.S.copy_(S_new)
        for c, cache in enumerate(self.caches):
            self.lay.decode(cache, t, self.ids, out=self.Y[c])
        dims = tuple(range(1, self.Y.dim()))
        err = torch.linalg.vector_norm(self.Y.to(torch.float64) - y_ref, dim=dims)
        self.err_out[i].copy_(err / torch.linalg.vector_norm(y_ref))
        den = None
        for c, cache in enumerate(self.caches):
            if writes_checkpoint(n, self.windows[c]):
                if den is None:
                    den = torch.linalg.vector_norm(self.S)
                diff = checkpoint_value(cache).to(torch.float64) - self.S
                self.err_state[i, c].copy_(torch.linalg.vector_norm(diff) / den)

    def _steps(self, count: int, n0: int) -> None:
        for i in range(count):
            self.step(i, n0 + i)

    def run(self, graphs: bool = True, tick=None) -> None:
        """All the steps, chunk by chunk: the first eagerly (on a side stream on CUDA: compiles
        and warms up), then with ``graphs`` one captured chunk replayed for every full chunk
        (a CPU device replays a _FakeGraph), a final partial chunk eagerly. ``tick(k)`` after
        each chunk with the configuration-steps done."""
        graph, n0 = None, 0
        while n0 < self.tokens:
            count = min(self.chunk, self.tokens - n0)
            self.fill(count)
            self.err_state.fill_(float("nan"))
            if graph is not None and count == self.chunk:
                graph.replay()  # n0 is a multiple of the chunk: the chunk's flush pattern is the captured one
                self.graphed_chunks += 1
            elif n0 == 0:
                with _side_stream(self.device):
                    self._steps(count, n0)
            else:
                self._steps(count, n0)
            self.rel_out[:, n0:n0 + count].copy_(self.err_out[:count].T)
            self.rel_state[:, n0:n0 + count].copy_(self.err_state[:count].T)
            n0 += count
            if graphs and graph is None and self.tokens - n0 >= self.chunk:
                graph = (_Graph if self.device.type == "cuda" else _FakeGraph)(lambda: self._steps(self.chunk, 0))
            if tick is not None:
                tick(count * len(self.cfgs))

    def check_cursors(self) -> None:
        """The host's flush schedule held: every row of every ReplaySSM cache sits at cursor
        tokens % L (one synchronisation)."""
        for cfg, cache, L in zip(self.cfgs, self.caches, self.windows):
            if L > 1 and not bool((cache.cursor == self.tokens % L).all()):
                raise RuntimeError(f"{self.job.layer} {cfg.name}: cursors {cache.cursor.tolist()} after "
                                   f"{self.tokens} steps, expected {self.tokens % L}: the flush schedule assumed "
                                   "for the state errors does not hold")

    def results(self) -> Dict[str, dict]:
        """{configuration: run_job's result} (the per-step errors on the CPU)."""
        self.check_cursors()
        out, state = self.rel_out.cpu(), self.rel_state.cpu()
        backend = BACKENDS[self.device.type]
        return {cfg.name: {"out": out[c], "state": state[c],
                           "meta": result_meta(cfg, cache, self.job, backend)}
                for c, (cfg, cache) in enumerate(zip(self.cfgs, self.caches))}


def run_layer(jobs: List[Job], graph_steps: int = DEFAULT_GRAPH_STEPS, graphs: bool = True,
              tick=None) -> Dict[str, dict]:
    """Every job of one layer stepped together (``LayerRun``): {configuration: result}."""
    run = LayerRun(jobs, graph_chunk(jobs[0].window, graph_steps))
    run.run(graphs, tick)
    return run.results()


def _compile_one(job: Job) -> Optional[str]:
    """One decode step of ``job``'s configuration on a scratch cache on its device: builds the
    kernel into the compile cache. None, or why it failed."""
    try:
        lay = make_layer(job.layer, job.shape, job.batch, job.rates, job.device)
        cache = make_cache(lay, CONFIGS[job.config], job.window, job.seed, job.device)
        ids = torch.arange(job.batch, dtype=torch.int32, device=job.device)
        lay.decode(cache, _to(lay.draw(torch.Generator().manual_seed(0)), job.device), ids)
        if torch.device(job.device).type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # reported by the caller
        return f"{type(e).__name__}: {e}"
    return None


def precompile(jobs: List[Job], workers: int) -> Dict[tuple, str]:
    """Build every job's decode kernel before the run: in ``workers`` spawned processes through
    the on-disk compile cache (compiles take seconds each; the run then loads them), in this
    process when that cache is off or workers <= 1. Returns {(layer, config): why} for the
    configurations whose step failed."""
    from replayssm_cute.runtime.compile_cache import disk_cache_enabled

    failed = {}
    if workers <= 1 or not disk_cache_enabled():
        for job in jobs:
            why = _compile_one(job)
            if why is not None:
                failed[(job.layer, job.config)] = why
        return failed
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=ctx) as pool:
            whys = list(pool.map(_compile_one, jobs))
    except Exception as e:  # the pool itself (not a configuration) failed: compile on first use instead
        print(f"{PROG}: compiling in worker processes failed ({type(e).__name__}: {e}); the run compiles "
              "each kernel on its first step instead", file=sys.stderr, flush=True)
        return failed
    for job, why in zip(jobs, whys):
        if why is not None:
            failed[(job.layer, job.config)] = why
    return failed


# ----------------------------------------------------------------------------- output


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6e}"
    return str(v)


def write_csv(rows: List[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows:
            w.writerow([_fmt(r[c]) for c in COLUMNS])
    os.replace(tmp, path)


def read_csv(path) -> List[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def summary_table(rows: List[dict], at: Sequence[int]) -> str:
    """Markdown table: rel_err_output at the points ``at``, one row per configuration, one column
    group per layer."""
    layers = [la for la in LAYERS if any(r["layer"] == la for r in rows)]
    val = {(r["layer"], r["config"], int(r["N"])): float(r["rel_err_output"]) for r in rows}
    names = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    head = ["configuration"] + [f"{LAYER_HOSTS[la].titles[0]} N={N}" for la in layers for N in at]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for c in names:
        cells = [val.get((la, c, N)) for la in layers for N in at]
        lines.append("| " + " | ".join([c] + ["" if v is None else f"{v:.2e}" for v in cells]) + " |")
    return "\n".join(lines)


def plot(rows: List[dict], path: Path) -> None:
    """A log-log plot of rel_err_output against N, one panel per layer, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [la for la in LAYERS if any(r["layer"] == la for r in rows)]
    fig, axes = plt.subplots(1, len(layers), figsize=(7.5 * len(layers), 6.5), squeeze=False)
    styles = {"conv": ":", "shared": "--", "replay": "-.", "sep": "-"}
    for ax, la in zip(axes[0], layers):
        names = [c for c in CONFIGS if any(r["layer"] == la and r["config"] == c for r in rows)]
        cmap = plt.get_cmap("tab20")
        for i, c in enumerate(names):
            pts = sorted((int(r["N"]), float(r["rel_err_output"])) for r in rows
                         if r["layer"] == la and r["config"] == c)
            ax.loglog([p[0] for p in pts], [max(p[1], 1e-12) for p in pts], styles[c.split("-")[0]],
                      color=cmap(i % 20), marker="o", markersize=3, label=c)
        backend = next((r.get("backend") for r in rows if r["layer"] == la), None) or BACKENDS["cpu"]
        ax.set_title(f"{LAYER_HOSTS[la].titles[1]}: output error vs float64 "
                     f"({'GPU kernels' if backend == BACKENDS['cuda'] else 'CPU reference'})")
        ax.set_xlabel("generation length N (tokens)")
        ax.set_ylabel("relative output error (window mean)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def require_matplotlib() -> Optional[str]:
    """None when matplotlib imports, else the message to show."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return NO_MATPLOTLIB
    return None


# ----------------------------------------------------------------------------- driver


def _int_tuple(ap, flag: str, text: str, n: int) -> tuple:
    try:
        vals = tuple(int(v) for v in text.split(","))
    except ValueError:
        ap.error(f"{flag}: expected {n} comma-separated integers, got {text!r}")
    if len(vals) != n or min(vals) < 1:
        ap.error(f"{flag}: expected {n} comma-separated integers >= 1, got {text!r}")
    return vals


def _names(ap, flag: str, text: str, valid: Sequence[str]) -> List[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        ap.error(f"{flag}: empty list")
    bad = [s for s in names if s not in valid]
    if bad:
        ap.error(f"{flag}: unknown {', '.join(map(repr, bad))}; choose from {', '.join(valid)}")
    return list(dict.fromkeys(names))


def make_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=None,
                    help=f"generation length N_max (default {DEFAULT_TOKENS}, --device cuda {CUDA_DEFAULT_TOKENS}; "
                         f"up to {MAX_TOKENS})")
    ap.add_argument("--configs", default="all", help="comma-separated configurations (--list), or 'all' (default)")
    ap.add_argument("--layers", default=",".join(LAYERS), help="comma-separated: mamba2, gdn (default both)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inputs and of the SR bits (default 0)")
    ap.add_argument("--batch", type=int, default=None,
                    help=f"batch rows: independent sequences, one pool slot each (default {DEFAULT_BATCH}, "
                         f"--device cuda {CUDA_DEFAULT_BATCH})")
    ap.add_argument("--window", type=int, default=16, help="ReplaySSM window L (default 16; conv-* use 1)")
    ap.add_argument("--prefill", type=int, default=256,
                    help="tokens of float64 recurrence from zero before decoding (default 256)")
    ap.add_argument("--rates", default=f"{DEFAULT_RATES[0]:g},{DEFAULT_RATES[1]:g}",
                    help="MIN,MAX per-head decay rates -log(alpha), log-uniform over the heads "
                         f"(default {DEFAULT_RATES[0]:g},{DEFAULT_RATES[1]:g})")
    ap.add_argument("--mamba2-shape", default=None,
                    help=f"Mamba-2 H,P,N,G (default {','.join(map(str, DEFAULT_SHAPES['mamba2']))}, --device cuda "
                         f"{','.join(map(str, CUDA_DEFAULT_SHAPES['mamba2']))})")
    ap.add_argument("--gdn-shape", default=None,
                    help=f"GDN HV,V,K,H (default {','.join(map(str, DEFAULT_SHAPES['gdn']))}, --device cuda "
                         f"{','.join(map(str, CUDA_DEFAULT_SHAPES['gdn']))})")
    ap.add_argument("--out", type=Path, default=None,
                    help="CSV to write (default sweeps/results/error_growth_cpu_<date>.csv, a new file per "
                         "day, <date> today's, YYYY-MM-DD; --device cuda: error_growth_<gpu>_<date>.csv there, "
                         "e.g. error_growth_h200_2026-12-01.csv)")
    ap.add_argument("--plot", type=Path, metavar="FILE.png", help="also write a log-log plot per layer (matplotlib)")
    ap.add_argument("--jobs", type=int, default=None,
                    help="worker processes (default: CPU cores): cpu, one configuration each at a time; cuda, "
                         "the kernel compiles before the run")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu (default): the float64-semantics reference; cuda: the decode kernels "
                         "(replayssm_cute.decode on CUDA caches), all configurations of a layer stepped together")
    ap.add_argument("--graph-steps", type=int, default=None,
                    help=f"--device cuda: steps per CUDA graph, rounded up to a multiple of --window "
                         f"(default {DEFAULT_GRAPH_STEPS})")
    ap.add_argument("--no-graph", action="store_true",
                    help="--device cuda: run every step eagerly, no CUDA graphs (host-bound, several times slower)")
    ap.add_argument("--progress-every", type=float, default=10.0, help="seconds between progress lines (default 10)")
    ap.add_argument("--list", action="store_true", help="list the configurations and exit")
    return ap


def parse(argv=None):
    """Parsed and validated arguments, with ``jobs`` (a list of Job) added."""
    ap = make_parser()
    args = ap.parse_args(argv)
    if args.list:
        return args
    cuda = args.device == "cuda"
    if args.tokens is None:
        args.tokens = CUDA_DEFAULT_TOKENS if cuda else DEFAULT_TOKENS
    if args.batch is None:
        args.batch = CUDA_DEFAULT_BATCH if cuda else DEFAULT_BATCH
    for la in LAYERS:
        if getattr(args, f"{la}_shape") is None:
            setattr(args, f"{la}_shape", ",".join(map(str, (CUDA_DEFAULT_SHAPES if cuda else DEFAULT_SHAPES)[la])))
    if not cuda and (args.no_graph or args.graph_steps is not None):
        ap.error("--graph-steps and --no-graph apply to --device cuda only")
    if args.graph_steps is None:
        args.graph_steps = DEFAULT_GRAPH_STEPS
    if args.graph_steps < 1:
        ap.error(f"--graph-steps must be >= 1, got {args.graph_steps}")
    if not 1 <= args.tokens <= MAX_TOKENS:
        ap.error(f"--tokens must be in [1, {MAX_TOKENS}], got {args.tokens}")
    if args.batch < 1:
        ap.error(f"--batch must be >= 1, got {args.batch}")
    if args.window < 2:
        ap.error(f"--window must be >= 2 (ReplaySSM; the conv-* configurations use 1), got {args.window}")
    if args.prefill < 0:
        ap.error(f"--prefill must be >= 0, got {args.prefill}")
    if args.jobs is not None and args.jobs < 1:
        ap.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.progress_every <= 0:
        ap.error(f"--progress-every must be > 0, got {args.progress_every}")
    try:
        rates = tuple(float(v) for v in args.rates.split(","))
    except ValueError:
        rates = ()
    if len(rates) != 2 or not (0 < rates[0] <= rates[1] < 20):
        ap.error(f"--rates: expected MIN,MAX with 0 < MIN <= MAX < 20 (decay rates -log(alpha)), got {args.rates!r}")
    args.rates = rates
    layers = _names(ap, "--layers", args.layers, LAYERS)
    configs = list(CONFIGS) if args.configs.strip() == "all" else _names(ap, "--configs", args.configs, list(CONFIGS))
    shapes = {"mamba2": _int_tuple(ap, "--mamba2-shape", args.mamba2_shape, 4),
              "gdn": _int_tuple(ap, "--gdn-shape", args.gdn_shape, 4)}
    if args.plot is not None and (msg := require_matplotlib()):
        ap.error(msg)
    jobs = []
    for la in layers:
        for c in configs:
            if la not in CONFIGS[c].layers:
                continue
            job = Job(la, c, shapes[la], args.batch, args.tokens, args.prefill, args.window, rates, args.seed,
                      args.device)
            try:  # the cache's own checks (shape rules, formats) before any work
                make_cache(make_layer(la, job.shape, 1, rates), CONFIGS[c], args.window, args.seed)
            except (ValueError, TypeError) as e:
                ap.error(f"{la} configuration {c} at --{la}-shape {','.join(map(str, job.shape))}: {e}")
            jobs.append(job)
    if not jobs:
        ap.error(f"no configuration of --configs applies to --layers {','.join(layers)} "
                 "(the *-fold and *-rederive configurations are GDN only)")
    args.gpu_name = None
    if cuda:
        if not torch.cuda.is_available():
            print(NO_CUDA, file=sys.stderr)
            raise SystemExit(1)
        args.gpu_name = torch.cuda.get_device_name()
    if args.out is None:
        args.out = default_out(PROG, device_tag(args.gpu_name))
    check_out(ap, "--out", args.out)
    if args.plot is not None:
        check_out(ap, "--plot", args.plot)
    args.layer_list, args.config_list, args.jobs_list = layers, configs, jobs
    return args


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _Progress:
    def __init__(self, total: int, every: float):
        self.total, self.every, self.t0, self.last = total, every, time.perf_counter(), time.perf_counter()

    def due(self) -> float:
        """Seconds until the next progress line is due."""
        return max(0.05, self.every - (time.perf_counter() - self.last))

    def line(self, done: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self.last < self.every:
            return
        self.last = now
        el = now - self.t0
        eta = f", ETA {_duration(el * (self.total - done) / done)}" if 0 < done < self.total else ""
        print(f"{PROG}: {done / self.total:6.1%} of {self.total} config-steps, {_duration(el)} elapsed{eta}",
              flush=True)


_COUNTER = None


def _init_worker(counter) -> None:
    global _COUNTER
    _COUNTER = counter
    torch.set_num_threads(1)


def _tick(n: int) -> None:
    with _COUNTER.get_lock():
        _COUNTER.value += n


def _worker(job: Job) -> dict:
    return run_job(job, _tick)


def run_all(jobs: List[Job], workers: int, progress: _Progress, on_result) -> None:
    """Run every job (in this process with one worker, else in a spawn pool), calling
    ``on_result(job, result)`` as each finishes."""
    if workers == 1:
        done = [0]

        def tick(n):
            done[0] += n
            progress.line(done[0])

        for job in jobs:
            on_result(job, run_job(job, tick))
        return
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    ctx = multiprocessing.get_context("spawn")
    counter = ctx.Value("q", 0)
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(counter,)) as pool:
        pending = {pool.submit(_worker, job): job for job in jobs}
        while pending:
            finished, _ = wait(pending, timeout=progress.due(), return_when=FIRST_COMPLETED)
            for fut in finished:
                job = pending.pop(fut)
                on_result(job, fut.result())
            progress.line(counter.value)


def run_all_layers(jobs: List[Job], graph_steps: int, graphs: bool, progress: _Progress, on_result) -> None:
    """Every job, each layer's configurations stepped together (``run_layer``), calling
    ``on_result(job, result)`` for each once its layer is done."""
    done = [0]

    def tick(n):
        done[0] += n
        progress.line(done[0])

    for layer in dict.fromkeys(j.layer for j in jobs):
        group = [j for j in jobs if j.layer == layer]
        t0 = time.perf_counter()
        results = run_layer(group, graph_steps, graphs, tick)
        print(f"  {layer}: {len(group)} configurations x {group[0].tokens} steps in "
              f"{_duration(time.perf_counter() - t0)}", flush=True)
        for job in group:
            on_result(job, results[job.config])


def main(argv=None) -> int:
    args = parse(argv)
    if args.list:
        for c in CONFIGS.values():
            only = "" if c.layers == LAYERS else "  [GDN only]"
            print(f"{c.name:22s} {c.about}{only}")
        return 0
    jobs = args.jobs_list
    workers = min(args.jobs or os.cpu_count() or 1, len(jobs))
    cuda = args.device == "cuda"
    print(f"{PROG}: {len(jobs)} runs ({', '.join(args.layer_list)}), {args.tokens} tokens each after a "
          f"{args.prefill}-token float64 prefill, batch {args.batch}, L = {args.window}, seed {args.seed}, "
          f"{workers} {'compile ' if cuda else ''}worker(s); Mamba-2 H,P,N,G = {args.mamba2_shape}, "
          f"GDN HV,V,K,H = {args.gdn_shape}; decay rates {args.rates[0]:g}..{args.rates[1]:g}", flush=True)
    if cuda:
        steps = ("eager steps (--no-graph)" if args.no_graph else
                 f"CUDA graphs of {graph_chunk(args.window, args.graph_steps)} steps")
        print(f"{PROG}: {args.gpu_name}: replayssm_cute.decode on CUDA caches, float64 recurrence on the GPU, "
              f"{steps}", flush=True)
        t0 = time.perf_counter()
        failed = precompile(jobs, workers)
        if failed:
            for (la, c), why in failed.items():
                print(f"{PROG}: {la} configuration {c}: the GPU decode step failed: {why}", file=sys.stderr)
            return 1
        print(f"{PROG}: kernels ready in {_duration(time.perf_counter() - t0)}", flush=True)
    order = {(j.layer, j.config): i for i, j in enumerate(jobs)}
    results: Dict[tuple, List[dict]] = {}

    def on_result(job: Job, result: dict) -> None:
        results[(job.layer, job.config)] = summarize(result, job.tokens)
        rows = [r for key in sorted(results, key=order.get) for r in results[key]]
        write_csv(rows, args.out)  # partial results survive an interrupted long run
        last = results[(job.layer, job.config)][-1]
        print(f"  {job.layer:6s} {job.config:22s} rel_err_output at N={last['N']}: {last['rel_err_output']:.3e}",
              flush=True)

    progress = _Progress(len(jobs) * args.tokens, args.progress_every)
    if cuda:
        run_all_layers(jobs, args.graph_steps, not args.no_graph, progress, on_result)
    else:
        run_all(jobs, workers, progress, on_result)
    rows = [r for key in sorted(results, key=order.get) for r in results[key]]
    write_csv(rows, args.out)
    progress.line(len(jobs) * args.tokens, force=True)
    print(f"wrote {args.out}")
    at = [N for N in (64, 1024, args.tokens) if N in points(args.tokens)] or points(args.tokens)[-1:]
    print(f"\nrel_err_output (window mean) at N = {', '.join(map(str, dict.fromkeys(at)))}:")
    print(summary_table(read_csv(args.out), list(dict.fromkeys(at))))
    if args.plot is not None:
        plot(read_csv(args.out), args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
