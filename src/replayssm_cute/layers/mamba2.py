"""The Mamba-2 layer on the host: what the ops of replayssm_cute.api do for a ``Mamba2Cache``.

Arguments follow vLLM's ``selective_state_update`` (api's module docstring): each op's signature,
their checks, the CPU reference of each op (replayssm_cute.reference), and each op's GPU kernel
(kernels/mamba2/: its ``Kernel`` for the runtime, the Shape of a call, its argument list).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

from .. import checks
from ..cache import Mamba2Cache
from ..runtime.launch import Kernel, cute_dtype
from .common import (checkpoint_arg, memoised_shape, pipelined_choice, random_generators, ring_args, state_copy_args,
                     whole_head)

# Standard decode on an fp32 checkpoint runs the pipelined kernel (kernels/mamba2/pipelined.py) on the
# targets of PIPELINED_ARCHS: faster than the tile kernel at every batch measured on the H200
# (sweeps/results/README.md); so does an fp16 read copy next to it. With an fp8 or nvfp4 copy the
# pipelined window mean was slower than the tile kernel's (its flushes are), so they keep the tile kernels.
PIPELINED_READ_COPIES = (None, "fp16")


def pipelined_by_default(shape) -> bool:
    """Whether decode runs ``shape`` on the pipelined kernel where it was measured (PIPELINED_ARCHS)."""
    return shape.read_copy in PIPELINED_READ_COPIES

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Mamba2Inputs(NamedTuple):
    """A Mamba-2 op's validated arguments: token tensors (b, ...) for decode, (b, T, ...) for
    verify and snapshot_verify; A, D, dt_bias as (H,) views; ``out`` allocated if not given."""

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    slot_ids: torch.Tensor
    D: Optional[torch.Tensor]
    z: Optional[torch.Tensor]
    dt_bias: Optional[torch.Tensor]
    dt_softplus: bool
    out: torch.Tensor


def _per_head(name: str, t: Optional[torch.Tensor], H: int, trailing: tuple, device) -> Optional[torch.Tensor]:
    """Accept (H,) or a stride-0 expansion (H, *trailing); return the (H,) fp32 view."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        checks.fail(name, "a torch.Tensor", type(t).__name__)
    checks.no_autograd(name, t)
    if t.dtype != torch.float32:
        checks.fail(name, "dtype torch.float32", t.dtype)
    if t.device != device:
        checks.fail(name, f"a tensor on {device}", t.device)
    if t.dim() > 1:
        if tuple(t.shape) != (H,) + trailing or any(st != 0 for st in t.stride()[1:]):
            checks.fail(name, f"shape ({H},) or a stride-0 expansion of shape {(H,) + trailing}",
                        f"shape {tuple(t.shape)} strides {t.stride()}")
        t = t[(slice(None),) + (0,) * len(trailing)]
    if tuple(t.shape) != (H,):
        checks.fail(name, f"shape ({H},)", tuple(t.shape))
    if H > 1 and t.stride(0) != 1:
        checks.fail(name, "one value per head, packed (head stride 1)", f"strides {t.stride()}")
    return t


def _decode_default(shape, bucket: int):
    from ..kernels.mamba2.defaults import default_mamba2_config
    from ..kernels.mamba2.pipelined import pipelined_config

    config = pipelined_choice(shape, pipelined_config, by_default=pipelined_by_default(shape))
    if config is not None:
        return config
    return default_mamba2_config(shape.headdim, bucket, shape.window, whole_head(shape), shape)


def _decode_check(shape, config, num_drafts: int):
    return config.check(shape)


def _decode_build(shape, config, num_drafts: int, options: str):
    from ..kernels.mamba2.pipelined import Mamba2PipeConfig, compile_pipelined_decode

    if isinstance(config, Mamba2PipeConfig):
        return compile_pipelined_decode(shape, config, options)
    from ..kernels.mamba2.decode import compile_decode

    return compile_decode(shape, config, options)


def _verify_default(shape, bucket: int):
    from ..kernels.mamba2.defaults import default_mamba2_verify_config
    from ..kernels.mamba2.pipelined_verify import pipelined_verify_config

    # the pipelined verify (kernels/mamba2/pipelined_verify.py) where it takes the cache: faster than the
    # tile verify at every (batch, T, a) measured (sweeps/results/README.md, "Verify on the pipeline")
    config = pipelined_choice(shape, functools.partial(pipelined_verify_config, bucket=bucket), by_default=True)
    if config is not None:
        return config
    return default_mamba2_verify_config(shape.headdim, bucket, whole_head(shape))


def _verify_check(shape, config, num_drafts: int):
    from ..kernels.mamba2.pipelined_verify import Mamba2PipelinedVerify
    from ..kernels.mamba2.verify import Mamba2Verify
    from ..kernels.pipeline import PipeVerifyConfig

    if isinstance(config, PipeVerifyConfig):
        return Mamba2PipelinedVerify.check(shape, config, num_drafts)
    return Mamba2Verify.check(shape, config, num_drafts)


def _verify_build(shape, config, num_drafts: int, options: str):
    from ..kernels.mamba2.pipelined_verify import compile_pipelined_verify
    from ..kernels.mamba2.verify import compile_verify
    from ..kernels.pipeline import PipeVerifyConfig

    if isinstance(config, PipeVerifyConfig):
        return compile_pipelined_verify(shape, config, num_drafts, options)
    return compile_verify(shape, config, num_drafts, options)


def _snapshot_default(shape, bucket: int):
    from ..kernels.mamba2.defaults import default_mamba2_snapshot_config

    return default_mamba2_snapshot_config(shape.headdim, bucket)


def _snapshot_check(shape, config, num_drafts: int):
    from ..kernels.mamba2.snapshot import Mamba2Snapshot

    return Mamba2Snapshot.check(shape, config, num_drafts)


def _snapshot_build(shape, config, num_drafts: int, options: str):
    from ..kernels.mamba2.snapshot import compile_snapshot

    return compile_snapshot(shape, config, num_drafts, options)


def _shape(cache, static: tuple):
    """The kernel Shape of a call on `cache` with `static` inputs (``Mamba2Layer.shape`` memoises it)."""
    from ..kernels.mamba2.config import Mamba2Shape

    dt_dtype, has_D, has_z, has_dt_bias, dt_softplus = static
    return Mamba2Shape(cache.nheads, cache.headdim, cache.dstate, cache.ngroups, cache.window, cache.capacity,
                       cute_dtype(cache.dtype), cute_dtype(dt_dtype), has_D, has_z, has_dt_bias, dt_softplus,
                       cache.pad_slot_id, cache.checkpoint_format, cache.read_copy_format)


class Mamba2Layer:
    """Mamba-2 on the host (module docstring). Each op binds its arguments by name (``*_args``),
    ``inputs`` checks them, then the op runs its ``*_reference`` on the CPU, or on the GPU
    launches its ``*_kernel`` on the ``shape`` of the cache and the call's ``static_inputs``
    with its ``*_kernel_args``."""

    name = "mamba2"
    titles = ("Mamba-2", "Mamba-2")  # (short, long) names in tables and plots
    cache_type = Mamba2Cache
    tokens = "x"  # the token tensor: its leading dims are (batch,) or (batch, T)
    # verify's packed (varlen) form: the token tensors laid out (total_tokens, ...), then the optional ones
    packed_tokens = ("x", "dt", "B", "C")
    packed_optional_tokens = ("z",)
    decode_kernel = Kernel("mamba2_decode", "decode", _decode_default, _decode_check, _decode_build)
    verify_kernel = Kernel("mamba2_verify", "verify", _verify_default, _verify_check, _verify_build,
                           per_draft_count=True)
    snapshot_kernel = Kernel("mamba2_snapshot", "snapshot_verify", _snapshot_default, _snapshot_check,
                             _snapshot_build, per_draft_count=True)

    @staticmethod
    def launch_config():
        """The launch config class of the Mamba-2 kernels (imports cutlass)."""
        from ..kernels.mamba2.config import Mamba2Config

        return Mamba2Config

    @staticmethod
    def launch_configs(op: str) -> tuple:
        """The launch config classes ``op`` takes: decode and verify also their pipelined kernel's
        (imports cutlass)."""
        from ..kernels.mamba2.config import Mamba2Config

        if op == "decode":
            from ..kernels.mamba2.pipelined import Mamba2PipeConfig

            return (Mamba2Config, Mamba2PipeConfig)
        if op == "verify":
            from ..kernels.pipeline import PipeVerifyConfig

            return (Mamba2Config, PipeVerifyConfig)
        return (Mamba2Config,)

    @staticmethod
    def decode_args(cache, x, dt, A, B, C, slot_ids, D=None, z=None, dt_bias=None, dt_softplus=False, out=None):
        """decode's arguments by name (verify takes the same, tokens (b, T, ...))."""
        return locals()

    verify_args = decode_args

    @staticmethod
    def snapshot_verify_args(cache, x, dt, A, B, C, slot_ids, snapshots, D=None, z=None, dt_bias=None,
                             dt_softplus=False, out=None):
        """snapshot_verify's arguments by name."""
        return locals()

    @staticmethod
    def inputs(cache, x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out, *, drafts: bool) -> Mamba2Inputs:
        """Validated Mamba-2 arguments; with `drafts` every token tensor has a draft axis after batch."""
        H, P, N, G = cache.nheads, cache.headdim, cache.dstate, cache.ngroups
        device = cache.checkpoint.device
        rank = 4 if drafts else 3
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            checks.fail("x", "a (batch, T, nheads, headdim) tensor" if drafts else "a (batch, nheads, headdim) tensor",
                        getattr(x, "shape", type(x).__name__))
        lead = tuple(x.shape[:rank - 2])  # (b,) or (b, T)
        if x.dtype not in _ACT_DTYPES:
            checks.fail("x", f"one of {_ACT_DTYPES}", x.dtype)
        act = cache.dtype
        x = checks.activation("x", x, lead + (H, P), act, device)
        if not isinstance(dt, torch.Tensor):
            checks.fail("dt", "a torch.Tensor", type(dt).__name__)
        if dt.dim() == rank:
            if tuple(dt.shape) != lead + (H, P) or dt.stride(-1) != 0:
                checks.fail("dt", f"shape {lead + (H,)} or a stride-0 expansion of shape {lead + (H, P)}",
                            f"shape {tuple(dt.shape)} strides {dt.stride()}")
            dt = dt[..., 0]
        if dt.dtype not in (act, torch.float32):
            checks.fail("dt", f"dtype {act} or torch.float32", dt.dtype)
        dt = checks.activation("dt", dt, lead + (H,), dt.dtype, device, aligned=False)
        if A is None:
            checks.fail("A", "a tensor", None)
        A = _per_head("A", A, H, (P, N), device)
        D = _per_head("D", D, H, (P,), device)
        dt_bias = _per_head("dt_bias", dt_bias, H, (P,), device)
        B = checks.activation("B", B, lead + (G, N), act, device)
        C = checks.activation("C", C, lead + (G, N), act, device)
        if z is not None:
            z = checks.activation("z", z, lead + (H, P), act, device)
        slot_ids = checks.slot_ids(slot_ids, lead[0], device)
        if out is None:  # zeros: the rows a step skips must not come back as stale memory
            out = torch.zeros(lead + (H, P), dtype=act, device=device)
        else:
            out = checks.activation("out", out, lead + (H, P), act, device)
        if not isinstance(dt_softplus, bool):
            checks.fail("dt_softplus", "a bool", type(dt_softplus).__name__)
        if checks.debug_host_checks(device):
            checks.slots_in_pool(cache, slot_ids)
        return Mamba2Inputs(x, dt, A, B, C, slot_ids, D, z, dt_bias, dt_softplus, out)

    @staticmethod
    def static_inputs(inputs: Mamba2Inputs) -> tuple:
        """What a call fixes about its kernel besides the cache: dt dtype, has_D, has_z,
        has_dt_bias, dt_softplus."""
        return (inputs.dt.dtype, inputs.D is not None, inputs.z is not None, inputs.dt_bias is not None,
                inputs.dt_softplus)

    @staticmethod
    def engine_inputs(act_dtype: torch.dtype, with_z: bool = False) -> tuple:
        """The ``static_inputs`` of the serving engines' usual call: dt in the activation dtype,
        D and dt_bias given, dt_softplus on, z with `with_z` (the gated variant)."""
        return act_dtype, True, with_z, True, True

    @staticmethod
    def shape(cache, static: tuple):
        """The kernel Shape (kernels/mamba2/config.py) of a call on `cache` with `static`
        (``static_inputs``); the same for every op (snapshot_verify's cache is conventional).
        Memoised per cache and static inputs (``common.memoised_shape``)."""
        return memoised_shape(cache, static, _shape)

    # ------------------------------------------------------------------------------------ decode

    @staticmethod
    def decode_reference(cache, i: Mamba2Inputs, plan):
        from ..reference import mamba2_decode_cache_

        return mamba2_decode_cache_(cache, i.x, i.dt, i.A, i.B, i.C, i.slot_ids, D=i.D, z=i.z, dt_bias=i.dt_bias,
                                    dt_softplus=i.dt_softplus, out=i.out, plan=plan)

    @staticmethod
    def decode_kernel_args(cache, i: Mamba2Inputs, plan) -> tuple:
        return (checkpoint_arg(cache), i.x, i.dt, i.A, i.B, i.C, i.D, i.z, i.dt_bias, i.slot_ids, i.out,
                *ring_args(cache, ("ring_x", "ring_B", "ring_dt"), plan), *state_copy_args(cache))

    # ------------------------------------------------------------------------------------ verify

    @staticmethod
    def verify_reference(cache, i: Mamba2Inputs, plan) -> None:
        from ..reference import mamba2_verify_cache_

        mamba2_verify_cache_(cache, i.x, i.dt, i.A, i.B, i.C, i.slot_ids, D=i.D, z=i.z, dt_bias=i.dt_bias,
                             dt_softplus=i.dt_softplus, out=i.out, plan=plan)

    @staticmethod
    def verify_kernel_args(cache, i: Mamba2Inputs, plan) -> tuple:
        return (checkpoint_arg(cache), i.x, i.dt, i.A, i.B, i.C, i.D, i.z, i.dt_bias, i.slot_ids, i.out,
                cache.ring_x, cache.ring_B, cache.ring_dt, plan.rows, *state_copy_args(cache))

    # -------------------------------------------- random weights, tokens and checks (tools, tests)
    # `dims` are a cache's dims after the slots, as a ModelSpec's (nheads, headdim, dstate, ngroups).

    dims_names = "H,P,N,G"
    raw_gates = 1  # 16-bit raw per-head scalars of a row's step inputs: dt

    @staticmethod
    def dims_text(dims: tuple) -> str:
        H, P, N, G = dims
        return f"H={H} P={P} N={N} G={G}"

    @staticmethod
    def row_shapes(dims: tuple) -> tuple:
        """(state shape, output shape) of one row."""
        H, P, N, _ = dims
        return (H, P, N), (H, P)

    @staticmethod
    def random_params(dims: tuple, gen, device) -> dict:
        """decode's weights as vLLM's ``selective_state_update`` takes them: A = -U(1, 2), dt_bias =
        U(-4, -3), D ~ N(0, 1), dt_softplus on."""
        H = dims[0]
        rand, randn = random_generators(gen, device)
        return dict(A=-(1 + rand(H)), dt_bias=-4 + rand(H), D=randn(H), dt_softplus=True)

    @staticmethod
    def random_tokens(dims: tuple, lead: tuple, dtype, gen, device) -> dict:
        """A step's tokens of leading dims `lead` in `dtype`: x, B, C ~ N(0, 1), raw dt ~ N(0, 1/4)."""
        H, P, N, G = dims
        _, randn = random_generators(gen, device)
        return dict(x=randn(*lead, H, P).to(dtype), dt=(0.5 * randn(*lead, H)).to(dtype),
                    B=randn(*lead, G, N).to(dtype), C=randn(*lead, G, N).to(dtype))

    @staticmethod
    def bench_ring(cache, gen):
        """Plausible records in every slot's ring (the benchmarks' pools start anywhere)."""
        cache.ring_x.normal_(generator=gen)
        cache.ring_B.normal_(generator=gen)
        cache.ring_dt.uniform_(0.01, 0.05, generator=gen)

    @staticmethod
    def study_params(dims: tuple, decay_rates: torch.Tensor, dt_mean: float, device) -> dict:
        """The error-growth study's weights for per-head decay rates -log(alpha) (float64, (H,)):
        alpha = exp(A dt), dt = softplus(dt_raw + dt_bias) with softplus(dt_bias) = ``dt_mean``."""
        H = dims[0]
        return dict(A=(-decay_rates / dt_mean).float().to(device),
                    dt_bias=torch.full((H,), math.log(math.expm1(dt_mean)), dtype=torch.float32).to(device),
                    dt_softplus=True)

    @staticmethod
    def study_tokens(dims: tuple, batch: int, g: torch.Generator) -> dict:
        """The study's random fp32 tokens on the CPU: x, dt ~ N(0, 1/4), B and C ~ N(0, 1/N)."""
        H, P, N, G = dims
        return {"x": torch.randn(batch, H, P, generator=g), "dt": 0.5 * torch.randn(batch, H, generator=g),
                "B": torch.randn(batch, G, N, generator=g) / math.sqrt(N),
                "C": torch.randn(batch, G, N, generator=g) / math.sqrt(N)}

    @staticmethod
    def conventional_reference(S: torch.Tensor, tokens: dict, params: dict):
        """(y, state after the token) of the float64 conventional step from state ``S``."""
        from ..reference import mamba2_conventional_step

        t, p = tokens, params
        return mamba2_conventional_step(S, t["x"], t["dt"], p["A"], t["B"], t["C"], p.get("D"), t.get("z"),
                                        p.get("dt_bias"), p.get("dt_softplus", False))

    @staticmethod
    def materialize(cache, slot_ids, params: dict) -> torch.Tensor:
        """``cache.materialize`` (float64) with the layer's weights."""
        return cache.materialize(slot_ids, params["A"])

    @staticmethod
    def check_tolerances(window: int, dtype: torch.dtype) -> tuple:
        """(outputs, states) relative L2 a decode step in ``dtype`` keeps against the float64
        recurrence, and a note on why (None: fp32 states, outputs rounded to the activations)."""
        return {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 2e-5}[dtype], 2e-5, None

    # ------------------------------------------------------------------------------- materialize

    @staticmethod
    def replay_rings(cache) -> tuple:
        """The rings a state is rebuilt from (``replay``), record by record."""
        return ("ring_x", "ring_B", "ring_dt")

    @staticmethod
    def replay(cache, state: torch.Tensor, records: tuple, A: torch.Tensor) -> torch.Tensor:
        """The state after ``records`` (the ``replay_rings``, (n, h, ...) oldest first) from
        ``state``, float64; a record of zeros leaves it as it is. ``A``: materialize's."""
        from ..reference import mamba2_replay

        return mamba2_replay(state, *records, cache._decay_rates(A))

    # --------------------------------------------------------------------------- snapshot_verify

    @staticmethod
    def snapshot_reference(cache, i: Mamba2Inputs, snapshots: torch.Tensor):
        from ..reference import mamba2_snapshot_verify_cache_

        return mamba2_snapshot_verify_cache_(cache, i.x, i.dt, i.A, i.B, i.C, i.slot_ids, snapshots, D=i.D, z=i.z,
                                             dt_bias=i.dt_bias, dt_softplus=i.dt_softplus, out=i.out)

    @staticmethod
    def snapshot_kernel_args(cache, i: Mamba2Inputs, snapshots: torch.Tensor) -> tuple:
        return (cache.checkpoint, i.x, i.dt, i.A, i.B, i.C, i.D, i.z, i.dt_bias, i.slot_ids, i.out, snapshots)
