"""The Gated DeltaNet layer on the host: what the ops of replayssm_cute.api do for a ``GDNCache``.

Arguments follow vLLM's / FlashInfer's GDN decode (api's module docstring): each op's signature,
their checks (the packed ``mixed_qkv`` rows of decode included), the CPU reference of each op
(replayssm_cute.reference), and each op's GPU kernel (kernels/gdn/: its ``Kernel`` for the
runtime, the Shape of a call, its argument list).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

from .. import checks
from ..cache import GDNCache
from ..runtime.launch import Kernel, cute_dtype
from .common import (checkpoint_arg, memoised_shape, pipelined_choice, random_generators, ring_args, state_copy_args,
                     whole_head)

# The pipelined GDN decode (kernels/gdn/pipelined.py) serves ReplaySSM decoding on the plain fp32 cache from
# batch 8 and next to a read copy (v / beta records, re-derived corrections) from batch 32, where it was measured
# level with or faster than the tile kernels (sweeps/results/README.md: "GDN re-deriving flush", "GDN read
# copies on the pipeline by default"); the conventional step, smaller batches and an fp32 read with v / beta
# records keep the tile kernels unless REPLAYSSM_CUTE_PIPELINED=1. Read copies at batch 8 / 16 were faster on the
# pipeline too on Qwen3.5-122B ("GDN items of two value heads by default"), but stay on the tiles until every
# registry GDN shape is tuned there.
PIPELINED_MIN_BATCH = 8
PIPELINED_READ_COPY_MIN_BATCH = 32

# The pipelined verify (kernels/gdn/pipelined_verify.py) serves caches of at most this many drafts at every batch:
# faster than the tile verify at T = 2 and 4. Larger caches take it where its default is units of a key head's
# value heads (batches whose units fill the grid): at T = 8 items of one head, one CTA an SM of two whole-head
# stages, are slower than the tile verify, units faster (sweeps/results/README.md, "Verify in units").
PIPELINED_VERIFY_MAX_DRAFTS = 4


def pipelined_verify_by_default(shape, config) -> bool:
    """Whether the pipelined verify serves ``shape`` by default at its default ``config``."""
    return shape.capacity - shape.window <= PIPELINED_VERIFY_MAX_DRAFTS or config.heads_per_unit > 1


def pipelined_by_default(shape, bucket: int) -> bool:
    if shape.window == 1:
        return False
    if shape.read_copy is not None:
        return bucket >= PIPELINED_READ_COPY_MIN_BATCH
    return bucket >= PIPELINED_MIN_BATCH and not shape.keep_v_beta


class GDNInputs(NamedTuple):
    """A GDN op's validated arguments: token tensors (b, ...) for decode, (b, T, ...) for verify
    and snapshot_verify (q, k, v views into ``mixed_qkv`` when decode was given that); ``out``
    allocated if not given."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    slot_ids: torch.Tensor
    scale: Optional[float]
    out: torch.Tensor


def _gdn_param(name: str, t, HV: int, act, device) -> torch.Tensor:
    """A_log / dt_bias: (HV,) packed, fp32 or the activation dtype (read as is, in fp32)."""
    if not isinstance(t, torch.Tensor):
        checks.fail(name, f"a ({HV},) tensor", type(t).__name__)
    checks.no_autograd(name, t)
    if tuple(t.shape) != (HV,):
        checks.fail(name, f"shape ({HV},)", tuple(t.shape))
    if t.dtype not in (torch.float32, act):
        checks.fail(name, f"dtype torch.float32 or {act}", t.dtype)
    if t.device != device:
        checks.fail(name, f"a tensor on {device}", t.device)
    if HV > 1 and t.stride(0) != 1:
        checks.fail(name, "one value per head, packed (head stride 1)", f"strides {t.stride()}")
    return t


def _split_mixed_qkv(mixed_qkv, H: int, K: int, HV: int, V: int, act, device):
    """Views q (b, H, K), k (b, H, K), v (b, HV, V) into vLLM's packed [q | k | v] rows."""
    width = 2 * H * K + HV * V
    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != width:
        checks.fail("mixed_qkv", f"a (batch, {width}) tensor ([q | k | v] = 2 * {H} * {K} + {HV} * {V})",
                    getattr(mixed_qkv, "shape", type(mixed_qkv).__name__))
    checks.no_autograd("mixed_qkv", mixed_qkv)
    if mixed_qkv.dtype != act:
        checks.fail("mixed_qkv", f"dtype {act} (the cache's activation dtype; no implicit casts)", mixed_qkv.dtype)
    if mixed_qkv.device != device:
        checks.fail("mixed_qkv", f"a tensor on {device}", mixed_qkv.device)
    if mixed_qkv.stride(1) != 1:
        checks.fail("mixed_qkv", "a packed last dim (stride 1); any row stride", f"strides {mixed_qkv.stride()}")
    b, rs, off = mixed_qkv.shape[0], mixed_qkv.stride(0), mixed_qkv.storage_offset()
    q = mixed_qkv.as_strided((b, H, K), (rs, K, 1), off)
    k = mixed_qkv.as_strided((b, H, K), (rs, K, 1), off + H * K)
    v = mixed_qkv.as_strided((b, HV, V), (rs, V, 1), off + 2 * H * K)
    return q, k, v


def _decode_default(shape, bucket: int):
    from ..kernels.gdn.defaults import default_gdn_config
    from ..kernels.gdn.pipelined import pipelined_config

    config = pipelined_choice(shape, pipelined_config, by_default=pipelined_by_default(shape, bucket))
    if config is not None:
        return config
    return default_gdn_config(shape.head_v_dim, bucket, shape.window, shape, whole_head(shape))


def _decode_check(shape, config, num_drafts: int):
    return config.check(shape)


def _decode_build(shape, config, num_drafts: int, options: str):
    from ..kernels.gdn.pipelined import GDNPipeConfig, compile_pipelined_decode

    if isinstance(config, GDNPipeConfig):
        return compile_pipelined_decode(shape, config, options)
    from ..kernels.gdn.decode import compile_decode

    return compile_decode(shape, config, options)


def _verify_default(shape, bucket: int):
    from ..kernels.gdn.defaults import default_gdn_verify_config
    from ..kernels.gdn.pipelined_verify import pipelined_verify_config

    config = pipelined_choice(shape, functools.partial(pipelined_verify_config, bucket=bucket),
                              by_default=functools.partial(pipelined_verify_by_default, shape))
    if config is not None:
        return config
    return default_gdn_verify_config(shape.head_v_dim, bucket, whole_head(shape))


def _verify_check(shape, config, num_drafts: int):
    from ..kernels.gdn.pipelined_verify import GDNPipelinedVerify
    from ..kernels.gdn.verify import GDNVerify
    from ..kernels.pipeline import PipeVerifyConfig

    if isinstance(config, PipeVerifyConfig):
        return GDNPipelinedVerify.check(shape, config, num_drafts)
    return GDNVerify.check(shape, config, num_drafts)


def _verify_build(shape, config, num_drafts: int, options: str):
    from ..kernels.gdn.pipelined_verify import compile_pipelined_verify
    from ..kernels.gdn.verify import compile_verify
    from ..kernels.pipeline import PipeVerifyConfig

    if isinstance(config, PipeVerifyConfig):
        return compile_pipelined_verify(shape, config, num_drafts, options)
    return compile_verify(shape, config, num_drafts, options)


def _snapshot_default(shape, bucket: int):
    from ..kernels.gdn.defaults import default_gdn_snapshot_config

    return default_gdn_snapshot_config(shape.head_v_dim, bucket)


def _snapshot_check(shape, config, num_drafts: int):
    from ..kernels.gdn.snapshot import GDNSnapshot

    return GDNSnapshot.check(shape, config, num_drafts)


def _snapshot_build(shape, config, num_drafts: int, options: str):
    from ..kernels.gdn.snapshot import compile_snapshot

    return compile_snapshot(shape, config, num_drafts, options)


def _shape(cache, static: tuple):
    """The kernel Shape of a call on `cache` with `static` inputs (``GDNLayer.shape`` memoises it)."""
    from ..kernels.gdn.config import GDNShape

    gate_dtype, A_log_dtype, dt_bias_dtype, scale = static
    rederive = cache.window > 1 and cache.flush_corrections == "rederive"
    return GDNShape(cache.num_v_heads, cache.head_v_dim, cache.head_k_dim, cache.num_k_heads, cache.window,
                    cache.capacity, cute_dtype(cache.dtype), cute_dtype(gate_dtype), cute_dtype(A_log_dtype),
                    cute_dtype(dt_bias_dtype), float(scale or 0.0), cache.keep_v_beta, cache.pad_slot_id,
                    cache.checkpoint_format, cache.read_copy_format, rederive)


class GDNLayer:
    """Gated DeltaNet on the host (module docstring); the op protocol as ``Mamba2Layer``'s."""

    name = "gdn"
    titles = ("GDN", "Gated DeltaNet")  # (short, long) names in tables and plots
    cache_type = GDNCache
    tokens = "v"  # the token tensor: its leading dims are (batch,) or (batch, T)
    # verify's packed (varlen) form: the token tensors laid out (total_tokens, ...), then the optional ones
    packed_tokens = ("q", "k", "v", "a", "b")
    packed_optional_tokens = ()
    decode_kernel = Kernel("gdn_decode", "decode", _decode_default, _decode_check, _decode_build)
    verify_kernel = Kernel("gdn_verify", "verify", _verify_default, _verify_check, _verify_build,
                           per_draft_count=True)
    snapshot_kernel = Kernel("gdn_snapshot", "snapshot_verify", _snapshot_default, _snapshot_check,
                             _snapshot_build, per_draft_count=True)

    @staticmethod
    def launch_config():
        """The launch config class of the GDN kernels (imports cutlass)."""
        from ..kernels.gdn.config import GDNConfig

        return GDNConfig

    @staticmethod
    def launch_configs(op: str) -> tuple:
        """The launch config classes ``op`` takes: decode and verify also their pipelined kernel's
        (imports cutlass)."""
        from ..kernels.gdn.config import GDNConfig

        if op == "decode":
            from ..kernels.gdn.pipelined import GDNPipeConfig

            return (GDNConfig, GDNPipeConfig)
        if op == "verify":
            from ..kernels.pipeline import PipeVerifyConfig

            return (GDNConfig, PipeVerifyConfig)
        return (GDNConfig,)

    @staticmethod
    def decode_args(cache, q=None, k=None, v=None, a=None, b=None, A_log=None, dt_bias=None, slot_ids=None, *,
                    scale=None, out=None, mixed_qkv=None):
        """decode's arguments by name (q = k = v = None with the packed ``mixed_qkv``)."""
        return locals()

    @staticmethod
    def verify_args(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, *, scale=None, out=None):
        """verify's arguments by name: decode's with tokens (b, T, ...), no ``mixed_qkv``."""
        return locals()

    @staticmethod
    def snapshot_verify_args(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, snapshots, *, scale=None, out=None):
        """snapshot_verify's arguments by name."""
        return locals()

    @staticmethod
    def inputs(cache, q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out, mixed_qkv=None, *,
               drafts: bool) -> GDNInputs:
        """Validated GDN arguments; with `drafts` every token tensor has a draft axis after batch."""
        HV, V, K, H = cache.num_v_heads, cache.head_v_dim, cache.head_k_dim, cache.num_k_heads
        device = cache.checkpoint.device
        act = cache.dtype
        if mixed_qkv is not None:
            if drafts:
                checks.fail("mixed_qkv", "None for verify (pass q, k, v laid out (batch, T, ...))", "a tensor")
            if q is not None or k is not None or v is not None:
                checks.fail("mixed_qkv", "q, k and v to be None when mixed_qkv is given", "both")
            q, k, v = _split_mixed_qkv(mixed_qkv, H, K, HV, V, act, device)
        rank = 4 if drafts else 3
        if not isinstance(v, torch.Tensor) or v.dim() != rank:
            checks.fail("v", f"a (batch, T, {HV}, {V}) tensor" if drafts else
                        f"a (batch, {HV}, {V}) tensor (or mixed_qkv)", getattr(v, "shape", type(v).__name__))
        lead = tuple(v.shape[:rank - 2])  # (b,) or (b, T)
        # Scalar loads on the GPU: any batch stride and alignment, inner dims packed.
        q = checks.activation("q", q, lead + (H, K), act, device, aligned=False)
        k = checks.activation("k", k, lead + (H, K), act, device, aligned=False)
        v = checks.activation("v", v, lead + (HV, V), act, device, aligned=False)
        if not isinstance(a, torch.Tensor) or a.dtype not in (act, torch.float32):
            checks.fail("a", f"a {lead + (HV,)} tensor of dtype {act} or torch.float32",
                        getattr(a, "dtype", type(a).__name__))
        a = checks.activation("a", a, lead + (HV,), a.dtype, device, aligned=False)
        b = checks.activation("b", b, lead + (HV,), a.dtype, device, aligned=False)
        A_log = _gdn_param("A_log", A_log, HV, act, device)
        dt_bias = _gdn_param("dt_bias", dt_bias, HV, act, device)
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not 0 < scale < float("inf")):
            checks.fail("scale", "None or a positive finite float", scale)
        slot_ids = checks.slot_ids(slot_ids, lead[0], device)
        if out is None:  # zeros: the rows a step skips must not come back as stale memory
            out = torch.zeros(lead + (HV, V), dtype=act, device=device)
        else:
            out = checks.activation("out", out, lead + (HV, V), act, device, aligned=False)
        if checks.debug_host_checks(device):
            checks.slots_in_pool(cache, slot_ids)
        return GDNInputs(q, k, v, a, b, A_log, dt_bias, slot_ids, scale, out)

    @staticmethod
    def static_inputs(inputs: GDNInputs) -> tuple:
        """What a call fixes about its kernel besides the cache: the gate, A_log and dt_bias
        dtypes and the q scale."""
        return inputs.a.dtype, inputs.A_log.dtype, inputs.dt_bias.dtype, inputs.scale

    @staticmethod
    def engine_inputs(act_dtype: torch.dtype, with_z: bool = False) -> tuple:
        """The ``static_inputs`` of the serving engines' usual call: the gates a, b in the
        activation dtype, fp32 A_log and dt_bias, the default q scale. GDN has no gated variant
        (`with_z`): its output gate (RMSNorm, silu(z)) is applied outside the kernel."""
        if with_z:
            raise ValueError("GDN kernels take no z: the output gate is applied outside the kernel")
        return act_dtype, torch.float32, torch.float32, None

    @staticmethod
    def shape(cache, static: tuple):
        """The kernel Shape (kernels/gdn/config.py) of a call on `cache` with `static`
        (``static_inputs``); the same for every op (snapshot_verify's cache is conventional).
        Memoised per cache and static inputs (``common.memoised_shape``)."""
        return memoised_shape(cache, static, _shape)

    # ------------------------------------------------------------------------------------ decode

    @staticmethod
    def decode_reference(cache, i: GDNInputs, plan):
        from ..reference import gdn_decode_cache_

        return gdn_decode_cache_(cache, i.q, i.k, i.v, i.a, i.b, i.A_log, i.dt_bias, i.slot_ids, scale=i.scale,
                                 out=i.out, plan=plan)

    @staticmethod
    def decode_kernel_args(cache, i: GDNInputs, plan) -> tuple:
        return (checkpoint_arg(cache), i.q, i.k, i.v, i.a, i.b, i.A_log, i.dt_bias, i.slot_ids, i.out,
                *ring_args(cache, ("ring_u", "ring_k", "ring_g", "ring_v", "ring_beta"), plan), *state_copy_args(cache))

    # ------------------------------------------------------------------------------------ verify

    @staticmethod
    def verify_reference(cache, i: GDNInputs, plan) -> None:
        from ..reference import gdn_verify_cache_

        gdn_verify_cache_(cache, i.q, i.k, i.v, i.a, i.b, i.A_log, i.dt_bias, i.slot_ids, scale=i.scale, out=i.out,
                          plan=plan)

    @staticmethod
    def verify_kernel_args(cache, i: GDNInputs, plan) -> tuple:
        return (checkpoint_arg(cache), i.q, i.k, i.v, i.a, i.b, i.A_log, i.dt_bias, i.slot_ids, i.out, cache.ring_u,
                cache.ring_k, cache.ring_g, cache.ring_v, cache.ring_beta, plan.rows, *state_copy_args(cache))

    # -------------------------------------------- random weights, tokens and checks (tools, tests)
    # `dims` are a cache's dims after the slots, as a ModelSpec's (nheads, headdim, dstate, ngroups):
    # HV value heads of V x K, H key heads.

    dims_names = "HV,V,K,H"
    raw_gates = 2  # 16-bit raw per-head scalars of a row's step inputs: a and b

    @staticmethod
    def dims_text(dims: tuple) -> str:
        HV, V, K, H = dims
        return f"HV={HV} value heads, V={V}, K={K}, H={H} key heads"

    @staticmethod
    def row_shapes(dims: tuple) -> tuple:
        """(state shape, output shape) of one row."""
        HV, V, K, _ = dims
        return (HV, V, K), (HV, V)

    @staticmethod
    def random_params(dims: tuple, gen, device) -> dict:
        """decode's weights as vLLM / FlashInfer take them: A_log = log U(1, 16), dt_bias = U(-4, -3)
        (with ``random_tokens``' gates, decays exp(g), g = -exp(A_log) softplus(a + dt_bias), mostly
        in (0.5, 1)); the default q scale."""
        HV = dims[0]
        rand, _ = random_generators(gen, device)
        return dict(A_log=(1 + 15 * rand(HV)).log(), dt_bias=-4 + rand(HV))

    @staticmethod
    def random_tokens(dims: tuple, lead: tuple, dtype, gen, device) -> dict:
        """A step's tokens of leading dims `lead` in `dtype`: raw q, k, v, b ~ N(0, 1), raw a ~
        N(0, 1/4)."""
        HV, V, K, H = dims
        _, randn = random_generators(gen, device)
        return dict(q=randn(*lead, H, K).to(dtype), k=randn(*lead, H, K).to(dtype), v=randn(*lead, HV, V).to(dtype),
                    a=(0.5 * randn(*lead, HV)).to(dtype), b=randn(*lead, HV).to(dtype))

    @staticmethod
    def bench_ring(cache, gen):
        """Records as decoding writes them: u ~ N(0, 1), unit-norm keys, g from gates drawn as
        ``random_params`` and ``random_tokens`` draw them; where the cache keeps them (a read copy),
        v ~ N(0, 1) and beta = sigmoid(N(0, 1))."""
        import torch.nn.functional as F

        device = cache.checkpoint.device
        rand, randn = random_generators(gen, device)
        cache.ring_u.normal_(generator=gen)
        cache.ring_k.copy_(F.normalize(randn(*cache.ring_k.shape), dim=-1))
        shape = cache.ring_g.shape
        A_log, dt_bias, a = (1 + 15 * rand(*shape)).log(), -4 + rand(*shape), 0.5 * randn(*shape)
        cache.ring_g.copy_(-A_log.exp() * F.softplus(a + dt_bias))
        if cache.ring_v is not None:
            cache.ring_v.normal_(generator=gen)
            cache.ring_beta.copy_(randn(*cache.ring_beta.shape).sigmoid())

    @staticmethod
    def study_params(dims: tuple, decay_rates: torch.Tensor, dt_mean: float, device) -> dict:
        """The error-growth study's weights for per-value-head decay rates -log(alpha) (float64,
        (HV,)): g = -exp(A_log) softplus(a + dt_bias) with softplus(dt_bias) = 1, so -log(alpha) is
        the rate times O(1) (``dt_mean`` is Mamba-2's)."""
        HV = dims[0]
        return dict(A_log=torch.log(decay_rates).float().to(device),
                    dt_bias=torch.full((HV,), math.log(math.expm1(1.0)), dtype=torch.float32).to(device))

    @staticmethod
    def study_tokens(dims: tuple, batch: int, g: torch.Generator) -> dict:
        """The study's random fp32 tokens on the CPU: q, k, v, b ~ N(0, 1), raw gate a ~ N(0, 1/4)."""
        HV, V, K, H = dims
        return {"q": torch.randn(batch, H, K, generator=g), "k": torch.randn(batch, H, K, generator=g),
                "v": torch.randn(batch, HV, V, generator=g), "a": 0.5 * torch.randn(batch, HV, generator=g),
                "b": torch.randn(batch, HV, generator=g)}

    @staticmethod
    def conventional_reference(S: torch.Tensor, tokens: dict, params: dict):
        """(o, state after the token) of the float64 conventional step from state ``S``."""
        from ..reference import gdn_conventional_step

        t = tokens
        return gdn_conventional_step(S, t["q"], t["k"], t["v"], t["a"], t["b"], params["A_log"], params["dt_bias"],
                                     params.get("scale"))

    @staticmethod
    def materialize(cache, slot_ids, params: dict) -> torch.Tensor:
        """``cache.materialize`` (float64); GDN rebuilds its state from the records alone."""
        return cache.materialize(slot_ids)

    @staticmethod
    def check_tolerances(window: int, dtype: torch.dtype) -> tuple:
        """(outputs, states) relative L2 a decode step in ``dtype`` keeps against the float64
        recurrence, and a note on why. With a ring (window > 1) the records keep u in fp16 (unit
        roundoff 4.9e-4) and the key in the activation dtype, so outputs and states are only that
        close (about 3e-4 observed with fp32 activations); the conventional step keeps fp32 states."""
        out = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-3}[dtype]
        if window == 1:
            return out, 2e-5, None
        state = {torch.bfloat16: 5e-3, torch.float16: 2e-3, torch.float32: 1e-3}[dtype]
        return out, state, ("why GDN ReplaySSM has a looser tolerance: its ring stores each token's correction u "
                            "in fp16 (and the key in the activation dtype), so its outputs and states carry that "
                            "rounding; the conventional step keeps no ring")

    # ------------------------------------------------------------------------------- materialize

    @staticmethod
    def replay_rings(cache) -> tuple:
        """The rings a state is rebuilt from (``replay``), record by record: the cached corrections,
        or (k, g, v, beta) where a flush re-derives them."""
        if cache.flush_corrections == "rederive":
            return ("ring_k", "ring_g", "ring_v", "ring_beta")
        return ("ring_u", "ring_k", "ring_g")

    @staticmethod
    def replay(cache, state: torch.Tensor, records: tuple, params=None) -> torch.Tensor:
        """The state after ``records`` (the ``replay_rings``, (n, h, ...) oldest first) from
        ``state``, float64, as the next flush folds them; a record of zeros leaves it as it is.
        GDN takes no parameters (``params`` must be None)."""
        from .. import checks
        from ..reference import gdn_replay, gdn_replay_rederive

        if params is not None:
            checks.fail("A", "None (a GDN state is rebuilt from its records alone)", type(params).__name__)
        if cache.flush_corrections == "rederive":
            return gdn_replay_rederive(state, *records)[0]
        return gdn_replay(state, *records)

    # --------------------------------------------------------------------------- snapshot_verify

    @staticmethod
    def snapshot_reference(cache, i: GDNInputs, snapshots: torch.Tensor):
        from ..reference import gdn_snapshot_verify_cache_

        return gdn_snapshot_verify_cache_(cache, i.q, i.k, i.v, i.a, i.b, i.A_log, i.dt_bias, i.slot_ids, snapshots,
                                          scale=i.scale, out=i.out)

    @staticmethod
    def snapshot_kernel_args(cache, i: GDNInputs, snapshots: torch.Tensor) -> tuple:
        return (cache.checkpoint, i.q, i.k, i.v, i.a, i.b, i.A_log, i.dt_bias, i.slot_ids, i.out, snapshots)
