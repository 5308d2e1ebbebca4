"""Decode and verify kernels on low-precision and two-precision caches against the CPU reference
(marked gpu).

Each step is teacher-forced: a CPU twin of the GPU cache takes every tensor of the GPU cache,
then both run the same step (``replayssm_cute.reference`` on the CPU), so a mismatch
points at that step. Checked every step, over several windows with rows at different ring
positions, pad rows and idle slots:

* outputs against the reference's (fp32 activations: only fp32 arithmetic differs);
* every stored tensor: ring, cursor and SR counter equal; a copy the step writes equal code for
  code to the reference's except where the two fp32 states straddle a rounding boundary (a few
  in 10^4; decoded values within one step of the format), untouched copies bit-identical;
* with an fp32 checkpoint, the read copy a flush writes is exactly quant's RTN of the checkpoint
  the kernel wrote (scales included): both copies come from one fp32 state;
* idle slots and pad rows bit-identical.

Speculative steps (verify + commit, random accepted counts) are checked the same way after each
commit: a flush is h + T > window, and the commit advances the SR counter of the rows that flushed.

A CUDA graph of a decode step (and of a verify + commit step) replays bit-identically to eager steps
on a clone, and replaying from the same state draws fresh SR bits.
"""

import pytest
import torch

import replayssm_cute as rs
from replayssm_cute import quant

from tests.helpers.numerics import rel_err

pytestmark = pytest.mark.gpu

H, P, N, G = 8, 64, 128, 2  # Mamba-2
HV, V, K, HK = 8, 128, 128, 4  # GDN
CONFIGS = [  # (window, checkpoint_format, read_copy)
    (4, "fp32", "fp16"), (4, "fp32", "fp8"), (4, "fp32", "nvfp4"),
    (4, "fp16", "fp8"), (4, "fp8", "nvfp4"), (4, "fp16", None), (4, "fp8", None), (4, "nvfp4", None),
    (1, "fp16", None), (1, "fp8", None), (1, "nvfp4", None),
]
GDN_CONFIGS = [  # (window, checkpoint_format, read_copy, flush_corrections)
    (4, "fp32", "fp8", "rederive"), (4, "fp32", "fp8", "fold"), (4, "fp16", "nvfp4", "rederive"),
    (4, "fp8", "fp16", "rederive"), (4, "fp32", None, "rederive"), (4, "fp16", None, None),
    (4, "nvfp4", None, None), (1, "fp8", None, None), (1, "nvfp4", None, None),
]
CODE_MATCH = 0.995  # fraction of codes equal to the reference's on a written copy


def _tensors(cache) -> dict:
    """Every tensor of the cache, with its table's positions under the cache's names."""
    named = {k: v for k, v in vars(cache).items() if isinstance(v, torch.Tensor)}
    named.update((n, getattr(cache, n)) for n in ("cursor", "origin", "sr_counter") if getattr(cache, n) is not None)
    return named


def _twin(cache, cpu):
    for name, t in _tensors(cache).items():
        getattr(cpu, name).copy_(t.cpu())


def _mamba2_cache(device, slots, window, ckpt, read, seed=5, max_draft=0):
    return rs.Mamba2Cache(slots, H, P, N, G, window=window, max_draft=max_draft, dtype=torch.float32, device=device,
                          checkpoint_format=ckpt, read_copy=read, sr_seed=seed if ckpt != "fp32" else None)


def _gdn_cache(device, slots, window, ckpt, read, corrections, seed=5, max_draft=0):
    return rs.GDNCache(slots, HV, V, K, HK, window=window, max_draft=max_draft, dtype=torch.float32, device=device,
                       checkpoint_format=ckpt, read_copy=read, sr_seed=seed if ckpt != "fp32" else None,
                       flush_corrections=corrections, keep_v_beta=True if corrections == "rederive" else None)


class _Mamba2Layer:
    state = (H, P, N)

    def __init__(self, gen, dev):
        self.A = -(1.0 + torch.rand(H, generator=gen, device=dev))
        self.dt_bias = -3.0 + torch.rand(H, generator=gen, device=dev)
        self.D = torch.randn(H, generator=gen, device=dev)

    def decode(self, cache, inputs, ids, out, config=None):
        x, dt, B, C = inputs
        dev = cache.checkpoint.device
        return rs.decode(cache, x.to(dev), dt.to(dev), self.A.to(dev), B.to(dev), C.to(dev), ids.to(dev),
                         D=self.D.to(dev), dt_bias=self.dt_bias.to(dev), dt_softplus=True, out=out, config=config)

    def verify(self, cache, inputs, ids, out, config=None):
        x, dt, B, C = inputs
        dev = cache.checkpoint.device
        return rs.verify(cache, x.to(dev), dt.to(dev), self.A.to(dev), B.to(dev), C.to(dev), ids.to(dev),
                         D=self.D.to(dev), dt_bias=self.dt_bias.to(dev), dt_softplus=True, out=out, config=config)

    @staticmethod
    def inputs(b, gen, dev, T=None):
        return _inputs(b, gen, dev, T)

    out_shape = (H, P)


class _GDNLayer:
    state = (HV, V, K)

    def __init__(self, gen, dev):
        self.A_log = torch.rand(HV, generator=gen, device=dev) - 1.0
        self.dt_bias = torch.rand(HV, generator=gen, device=dev) - 2.0

    def decode(self, cache, inputs, ids, out, config=None):
        q, k, v, a, b = inputs
        dev = cache.checkpoint.device
        return rs.decode(cache, q.to(dev), k.to(dev), v.to(dev), a.to(dev), b.to(dev), self.A_log.to(dev),
                         self.dt_bias.to(dev), ids.to(dev), out=out, config=config)

    def verify(self, cache, inputs, ids, out, config=None):
        q, k, v, a, b = inputs
        dev = cache.checkpoint.device
        return rs.verify(cache, q.to(dev), k.to(dev), v.to(dev), a.to(dev), b.to(dev), self.A_log.to(dev),
                         self.dt_bias.to(dev), ids.to(dev), out=out, config=config)

    @staticmethod
    def inputs(b, gen, dev, T=None):
        lead = (b,) if T is None else (b, T)
        return (torch.randn(lead + (HK, K), generator=gen, device=dev),
                torch.randn(lead + (HK, K), generator=gen, device=dev),
                torch.randn(lead + (HV, V), generator=gen, device=dev), torch.randn(lead + (HV,), generator=gen, device=dev),
                torch.randn(lead + (HV,), generator=gen, device=dev))

    out_shape = (HV, V)


def _codes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.view(torch.int16) if t.dtype == torch.float16 else t


def _compare_copy(name, got, want, fmt_name):
    """A written copy's data: codes equal but for boundary cases, decoded within one code step."""
    if fmt_name == "fp32" or got.dtype == torch.float32:
        rel = rel_err(got, want, allow_zero=True)
        assert rel < 2e-5, f"{name}: rel {rel:.2e}"  # fp32 arithmetic (verify: split-TF32 GEMMs)
        return
    g, w = _codes(got).to(torch.int32), _codes(want).to(torch.int32)
    if fmt_name == "nvfp4" and name.endswith("read_copy") or name == "checkpoint" and fmt_name == "nvfp4":
        g = torch.stack((g & 0xF, g >> 4), -1)
        w = torch.stack((w & 0xF, w >> 4), -1)
    match = (g == w).double().mean().item()
    assert match >= CODE_MATCH, f"{name}: {match:.4f} of codes equal"


def _inputs(b, gen, device, T=None):
    lead = (b,) if T is None else (b, T)
    x = torch.randn(lead + (H, P), generator=gen, device=device)
    dt = torch.randn(lead + (H,), generator=gen, device=device) * 0.5
    B = torch.randn(lead + (G, N), generator=gen, device=device)
    C = torch.randn(lead + (G, N), generator=gen, device=device)
    return x, dt, B, C


@pytest.mark.parametrize("window,ckpt,read", CONFIGS)
def test_mamba2_decode_lowprec_teacher_forced(window, ckpt, read):
    _teacher_forced(_Mamba2Layer, lambda dev: _mamba2_cache(dev, 10, window, ckpt, read), window, ckpt, read)


@pytest.mark.parametrize("window,ckpt,read,corrections", GDN_CONFIGS)
def test_gdn_decode_lowprec_teacher_forced(window, ckpt, read, corrections):
    _teacher_forced(_GDNLayer, lambda dev: _gdn_cache(dev, 10, window, ckpt, read, corrections), window, ckpt, read)


VERIFY_CONFIGS = [("fp32", "fp16"), ("fp32", "nvfp4"), ("fp16", "fp8"), ("fp8", None), ("nvfp4", None)]
GDN_VERIFY_CONFIGS = [("fp32", "fp8", "rederive"), ("fp32", "fp16", "fold"), ("fp16", "nvfp4", "rederive"),
                      ("fp8", None, None), ("fp32", None, "rederive")]


@pytest.mark.parametrize("ckpt,read", VERIFY_CONFIGS)
@pytest.mark.parametrize("drafts", [2, 3])
def test_mamba2_verify_lowprec_teacher_forced(ckpt, read, drafts):
    _teacher_forced(_Mamba2Layer, lambda dev: _mamba2_cache(dev, 10, 4, ckpt, read, max_draft=drafts), 4, ckpt,
                    read, drafts=drafts)


@pytest.mark.parametrize("ckpt,read,corrections", GDN_VERIFY_CONFIGS)
@pytest.mark.parametrize("drafts", [2, 3])
def test_gdn_verify_lowprec_teacher_forced(ckpt, read, corrections, drafts):
    _teacher_forced(_GDNLayer, lambda dev: _gdn_cache(dev, 10, 4, ckpt, read, corrections, max_draft=drafts), 4,
                    ckpt, read, drafts=drafts)


@pytest.mark.parametrize("layer", ["mamba2", "gdn"])
def test_verify_lowprec_small_batch_configs(layer):
    """One warp per CTA (the small-batch verify tiles) on an fp16 + SR checkpoint with an fp8 read copy."""
    from replayssm_cute.kernels.gdn.config import GDNConfig
    from replayssm_cute.kernels.mamba2.config import Mamba2Config

    if layer == "mamba2":
        _teacher_forced(_Mamba2Layer, lambda dev: _mamba2_cache(dev, 10, 4, "fp16", "fp8", max_draft=2), 4, "fp16",
                        "fp8", Mamba2Config(16, 1), drafts=2)
    else:
        _teacher_forced(_GDNLayer, lambda dev: _gdn_cache(dev, 10, 4, "fp16", "fp8", "rederive", max_draft=2), 4,
                        "fp16", "fp8", GDNConfig(16, 1), drafts=2)


@pytest.mark.parametrize("layer,ckpt,read,rows,warps,ctas", [
    ("mamba2", "fp32", "fp16", 64, 2, 8), ("mamba2", "fp32", "fp8", 64, 2, 8), ("mamba2", "fp16", "fp8", 64, 2, 12),
    ("gdn", "fp32", "fp16", 128, 8, 0), ("gdn", "fp32", "fp8", 64, 4, 8),
    ("mamba2", "fp32", "nvfp4", 64, 2, 8), ("gdn", "fp32", "nvfp4", 128, 8, 0),
    ("gdn", "fp32", "fp8", 128, 8, 2), ("gdn", "fp32", "nvfp4", 128, 8, 2),
])
def test_light_read_copies_at_large_batch_configs(layer, ckpt, read, rows, warps, ctas):
    """The configs large batches run light read copies with (32 rows per warp, register caps that
    spill the flush path; nvfp4's two-pass flush): teacher-forced as above."""
    from replayssm_cute.kernels.gdn.config import GDNConfig
    from replayssm_cute.kernels.mamba2.config import Mamba2Config

    if layer == "mamba2":
        _teacher_forced(_Mamba2Layer, lambda dev: _mamba2_cache(dev, 10, 4, ckpt, read), 4, ckpt, read,
                        Mamba2Config(rows, warps, ctas))
    else:
        _teacher_forced(_GDNLayer, lambda dev: _gdn_cache(dev, 10, 4, ckpt, read, "rederive"), 4, ckpt, read,
                        GDNConfig(rows, warps, ctas))


PIPELINED_READ_CONFIGS = [  # stages, ctas, consumer groups, rows per warp, flush_tile, mma_fold, heads per item
    (2, 3, 1, 16, False, False, 1), (6, 8, 1, 16, False, False, 1), (4, 5, 2, 32, False, False, 1),
    (6, 4, 3, 32, False, False, 1), (2, 3, 1, 16, True, True, 1), (4, 5, 2, 32, True, True, 1),
    (4, 4, 2, 32, True, False, 1),
    (2, 3, 1, 16, False, False, 2), (2, 5, 2, 32, False, False, 4), (2, 3, 1, 16, True, True, 2),
    (2, 4, 2, 32, True, False, 2)]


@pytest.mark.parametrize("read", ["fp16", "fp8", "nvfp4"])
@pytest.mark.parametrize("stages, ctas, groups, rows, flush_tile, mma_fold, heads", PIPELINED_READ_CONFIGS)
def test_mamba2_pipelined_read_copies(read, stages, ctas, groups, rows, flush_tile, mma_fold, heads):
    """The pipelined decode next to a read copy on small grids: every CTA reuses its stages many
    times, with flushing items and non-flushing ones in the same ring (a flush's stage holds no
    tile and its rows fold in registers from global memory, or with flush_tile the fp32 checkpoint
    tile where the others hold the read copy's, folded on tensor or CUDA cores), with one or several consumer groups (16- and 32-row warps, each group
    its own stages), items of one, two or four heads of a group (nvfp4: a state scale per head);
    teacher-forced as above (the read copy a flush writes is quant's RTN of the checkpoint)."""
    from replayssm_cute.kernels.mamba2.pipelined import Mamba2PipeConfig

    config = Mamba2PipeConfig(stages, ctas, mma_fold=mma_fold, rows_per_warp=rows, consumer_groups=groups,
                              flush_tile=flush_tile, heads_per_item=heads)
    _teacher_forced(_Mamba2Layer, lambda dev: _mamba2_cache(dev, 10, 4, "fp32", read), 4, "fp32", read, config)


GDN_PIPELINED_READ_CONFIGS = [  # stages, ctas, rows per item, rows per warp, consumer groups
    (2, 3, 128, 16, 1), (3, 4, 128, 8, 1), (3, 5, 64, 16, 1), (4, 2, 32, 8, 1), (4, 3, 64, 16, 2), (2, 2, 128, 16, 2)]
GDN_PIPELINED_READ_CASES = [  # an nvfp4 copy is written a whole head (V rows) at a time
    (read, corrections) + config + (True, True, 1)
    for read, corrections in [("fp16", "rederive"), ("fp8", "rederive"), ("nvfp4", "rederive"), ("fp8", "fold"),
                              (None, "rederive")]
    for config in GDN_PIPELINED_READ_CONFIGS if read != "nvfp4" or config[2] == V] + [
    # 16-row warps with their read-copy rows on CUDA cores (the fp16 / fp8 default), the others on tensor cores
    (read, "rederive", 2, 3, 128, 16, 1, False, True, 1) for read in ("fp16", "fp8", "nvfp4")] + [
    # 16-row warps whose flushes re-derive and fold on CUDA cores (the tensor-core flush's alternative)
    (read, corrections, stages, 4, 128, 16, groups, True, False, 1)
    for read, corrections, stages, groups in [("fp16", "rederive", 3, 1), ("fp8", "fold", 4, 2), ("nvfp4", "rederive", 3, 1)]] + [
    # items of both value heads of a key head: rows on tensor or CUDA cores, flushes on tensor or CUDA cores
    (read, corrections, stages, ctas, 128, rows_per_warp, groups, mma_dots, mma_flush, 2)
    for read, corrections, stages, ctas, rows_per_warp, groups, mma_dots, mma_flush in [
        ("fp16", "rederive", 2, 3, 16, 1, False, True), ("fp8", "rederive", 2, 4, 16, 1, False, True),
        ("nvfp4", "rederive", 2, 3, 16, 1, True, True), ("fp8", "fold", 2, 2, 16, 2, True, True),
        ("nvfp4", "rederive", 2, 2, 16, 1, True, False), ("fp16", "rederive", 2, 3, 8, 1, True, True)]]


@pytest.mark.parametrize("read, corrections, stages, ctas, rows, rows_per_warp, groups, mma_dots, mma_flush, heads",
                         GDN_PIPELINED_READ_CASES)
def test_gdn_pipelined_read_copies(read, corrections, stages, ctas, rows, rows_per_warp, groups, mma_dots, mma_flush,
                                   heads):
    """The pipelined GDN decode next to a read copy (or re-deriving on the fp32 checkpoint) on
    small grids: every CTA reuses its stages many times, with flushing items (no box: the
    checkpoint rows from global memory, re-derived corrections from the staged v and beta and the
    records' coupling the consumer warps share) and non-flushing ones (the copy's rows) in the same
    ring, whole and partial heads, one or two consumer groups (each its own stages, named barrier
    and re-derivation scratch; nvfp4's state scale reduced over one group's warps), the copy's
    rows dotted on tensor cores (16-row warps, ``mma_dots``) or CUDA cores, a flush's S_ckpt k_p
    and fold on tensor cores (16-row warps next to a read copy, ``mma_flush``) or CUDA cores, items
    of one value head or both of a key head (each head's scales, state scale, gates, v, beta and
    coupling from its place in the stage, the key head's ring dots once); teacher-forced as above."""
    from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig

    config = GDNPipeConfig(stages, ctas, rows, rows_per_warp, prefetch=4 // heads, consumer_groups=groups,
                           mma_dots=mma_dots, mma_flush=mma_flush, heads_per_item=heads)
    _teacher_forced(_GDNLayer, lambda dev: _gdn_cache(dev, 10, 4, "fp32", read, corrections), 4, "fp32", read, config)


GDN_ROW_LANES_CASES = [(read,) + case for read in ("fp16", "fp8", None)  # row lanes, rows per warp, heads an item
                       for case in [(8, 16, 2), (16, 16, 1), (8, 8, 1)] if read is not None or case[2] == 1]


@pytest.mark.parametrize("read, row_lanes, rows_per_warp, heads", GDN_ROW_LANES_CASES)
def test_gdn_pipelined_row_dots_with_fewer_lanes_a_row(read, row_lanes, rows_per_warp, heads):
    """The row dots of non-flushing items on CUDA cores with 8 or 16 lanes to a state row
    (``row_lanes``: each lane longer pieces of fewer rows, the partial dots reduced over the row's
    lanes; an fp8 row's scale after its dots): the fp16 / fp8 copy's rows, or the fp32
    checkpoint's, 8- or 16-row warps, items of one or two value heads; teacher-forced as above."""
    from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig

    config = GDNPipeConfig(2, 3, 128, rows_per_warp, prefetch=4 // heads, mma_dots=False, heads_per_item=heads,
                           row_lanes=row_lanes)
    _teacher_forced(_GDNLayer, lambda dev: _gdn_cache(dev, 10, 4, "fp32", read, "rederive"), 4, "fp32", read, config)


@pytest.mark.parametrize("read, window", [("fp16", 16), ("fp8", 12), ("nvfp4", 16)])
def test_gdn_pipelined_tensor_core_flush_long_windows(read, window):
    """The tensor-core flush where the ring spans two 8-record MMA tiles, whole (16) or in part
    (12: the positions past the ring are clamped and zeroed): re-derived corrections, the
    registry's whole-head 16-row warps; teacher-forced as above."""
    from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig

    config = GDNPipeConfig(3, 4, 128, 16)
    assert config.mma_flush
    _teacher_forced(_GDNLayer, lambda dev: _gdn_cache(dev, 10, window, "fp32", read, "rederive"), window, "fp32", read,
                    config)


def _teacher_forced(layer_cls, make_cache, window, ckpt, read, config=None, drafts=0):
    """``drafts`` > 0: verify + commit steps of T = drafts (random accepted counts), else decode steps."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(window * 31 + len(ckpt) + len(read or "") + 7 * drafts)
    batch, slots = 6, 10
    cache, cpu = make_cache(dev), make_cache("cpu")
    layer = layer_cls(gen, dev)
    ids = torch.tensor([7, 2, 9, 0, 4, 5], dtype=torch.int32, device=dev)
    cache.load_prefill(ids, torch.randn((batch,) + layer.state, generator=gen, device=dev) * 0.3)
    idle = [1, 3, 6, 8]
    idle_before = {k: v[idle].clone() for k, v in _tensors(cache).items() if v.dim() and v.shape[0] == slots}
    lead = (batch, drafts) if drafts else (batch,)
    out_pad = torch.full(lead + layer.out_shape, 7.0, device=dev)
    flushes = 0
    for step in range(4 * window + 3):
        step_ids = ids.clone()
        step_ids[3] = -1  # a pad row
        if step < window - 1:  # stagger: rows at different ring positions
            step_ids[step % batch] = -1 if step % batch != 3 else step_ids[step % batch]
        if step % 3 == 1:
            step_ids[1] = slots + 3  # out of the pool: a pad row
        inputs = layer.inputs(batch, gen, dev, drafts or None)
        _twin(cache, cpu)
        before = {k: v.clone() for k, v in _tensors(cache).items()}
        out = out_pad.clone()
        ref_out = out_pad.cpu()
        if drafts:
            accepted = torch.randint(1, drafts + 1, (batch,), generator=gen, device=dev, dtype=torch.int32)
            layer.verify(cache, inputs, step_ids, out, config)
            rs.commit(cache, step_ids, accepted)
            layer.verify(cpu, [t.cpu() for t in inputs], step_ids.cpu(), ref_out)
            rs.commit(cpu, step_ids.cpu(), accepted.cpu())
        else:
            layer.decode(cache, inputs, step_ids, out, config)
            layer.decode(cpu, [t.cpu() for t in inputs], step_ids.cpu(), ref_out)
        torch.cuda.synchronize()
        live = [r for r in range(batch) if 0 <= int(step_ids[r]) < slots]
        got, want = out.cpu(), ref_out
        for r in range(batch):
            if r not in live:
                assert torch.equal(got[r], torch.full_like(got[r], 7.0)), f"step {step}: pad row {r} written"
        rel = rel_err(got[live], want[live])
        assert rel < 2e-5, f"step {step}: outputs rel {rel:.2e}"
        live_slots = [int(step_ids[r]) for r in live]
        cursors = {s: int(before["cursor"][s]) for s in live_slots}
        flushed = [s for s in live_slots if (cursors[s] + drafts > window if drafts else cursors[s] + 1 >= window)]
        flushes += len(flushed)
        for name, t in _tensors(cache).items():
            g, w = t.cpu(), getattr(cpu, name)
            if name in ("cursor", "origin", "sr_counter", "sr_seed"):
                assert torch.equal(g, w), f"step {step}: {name} {g.tolist()} != {w.tolist()}"
            elif name.startswith(("checkpoint", "read_copy")):
                for s in live_slots:
                    if s in flushed:
                        fmt = ckpt if name.startswith("checkpoint") else read
                        if name.endswith("scale"):
                            # scales follow the amax: equal unless the fp32 amax differs in the last bits
                            close = torch.isclose(g[s].float(), w[s].float(), rtol=2 ** -7) if \
                                g.dtype != torch.float8_e4m3fn else (g[s].view(torch.uint8).int() - w[s].view(torch.uint8).int()).abs() <= 1
                            assert bool(close.all()), f"step {step}: {name} of slot {s}"
                        else:
                            _compare_copy(name, g[s], w[s], fmt)
                    else:
                        assert torch.equal(_codes(g[s]), _codes(before[name][s].cpu())), \
                            f"step {step}: {name} of non-flushing slot {s} changed"
            else:  # ring tensors
                rel = rel_err(g, w, allow_zero=True)
                assert rel < 1e-4, f"step {step}: {name} rel {rel:.2e}"  # fp16 u: an ulp at a boundary
        if ckpt == "fp32" and read is not None:
            for s in flushed:
                ref = quant.FP8E4M3(block_k=128) if read == "fp8" else quant.FORMATS[read]
                enc = ref.encode_rtn(cache.checkpoint[s].cpu())
                assert torch.equal(_codes(cache.read_copy[s].cpu()), _codes(enc.data)), f"step {step}: read copy"
                for i, sc in enumerate(enc.scales):
                    stored = getattr(cache, ("read_copy_scale", "read_copy_state_scale")[i])[s].cpu()
                    assert torch.equal(_codes(stored), _codes(sc)), f"step {step}: read copy scale {i}"
    assert flushes >= 2 * batch // 2
    for k, v in idle_before.items():
        assert torch.equal(_codes(getattr(cache, k)[idle]), _codes(v)), f"idle slots: {k} changed"


@pytest.mark.parametrize("window,ckpt,read", [(1, "fp16", None), (4, "fp16", "fp8")])
def test_mamba2_lowprec_cuda_graph_replay(window, ckpt, read):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(3)
    batch, slots = 4, 6
    cache = _mamba2_cache(dev, slots, window, ckpt, read, seed=77)
    ids = torch.tensor([0, 3, 5, 1], dtype=torch.int32, device=dev)
    cache.load_prefill(ids, torch.randn(batch, H, P, N, generator=gen, device=dev) * 0.3)
    A = -(1.0 + torch.rand(H, generator=gen, device=dev))
    D = torch.randn(H, generator=gen, device=dev)
    static = list(_inputs(batch, gen, dev))
    out = torch.empty(batch, H, P, device=dev)

    def step():
        rs.decode(cache, static[0], static[1], A, static[2], static[3], ids, D=D, out=out)

    step()  # compile outside the capture
    counter_before = int(cache.sr_counter[ids[0]])
    eager = _mamba2_cache(dev, slots, window, ckpt, read, seed=77)
    for name, t in _tensors(cache).items():
        getattr(eager, name).copy_(t)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for name, t in _tensors(eager).items():  # capture did not run the step
        assert torch.equal(_codes(getattr(cache, name)), _codes(t)), name
    eager_out = torch.empty_like(out)
    for i in range(3 * window):
        new = _inputs(batch, gen, dev)
        for s, n in zip(static, new):
            s.copy_(n)
        graph.replay()
        rs.decode(eager, new[0], new[1], A, new[2], new[3], ids, D=D, out=eager_out)
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out), f"replay {i}: outputs"
        for name, t in _tensors(eager).items():
            assert torch.equal(_codes(getattr(cache, name)), _codes(t)), f"replay {i}: {name}"
    assert int(cache.sr_counter[ids[0]]) - counter_before == 3  # one SR write per flush, 3 flushes
    # Fresh bits: the same state and inputs replayed again round differently.
    saved = {k: v.clone() for k, v in _tensors(cache).items()}
    for _ in range(window):
        graph.replay()
    first = cache.checkpoint[ids].clone()
    for k, v in saved.items():
        if k != "sr_counter":
            getattr(cache, k).copy_(v)
    for _ in range(window):
        graph.replay()
    second = cache.checkpoint[ids]
    differ = (_codes(first) != _codes(second)).double().mean().item()
    assert 0.05 < differ < 0.9, f"{differ:.3f} of SR codes differ between replays with fresh bits"


def test_mamba2_lowprec_verify_cuda_graph_replay():
    """verify + commit on an fp16 + SR checkpoint with an fp8 read copy, captured in one graph:
    replays equal eager steps on a clone bit for bit, and flushes advance the SR counter."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(4)
    batch, slots, T = 4, 6, 3
    cache = _mamba2_cache(dev, slots, 4, "fp16", "fp8", seed=78, max_draft=T)
    ids = torch.tensor([0, 3, 5, 1], dtype=torch.int32, device=dev)
    cache.load_prefill(ids, torch.randn(batch, H, P, N, generator=gen, device=dev) * 0.3)
    A = -(1.0 + torch.rand(H, generator=gen, device=dev))
    D = torch.randn(H, generator=gen, device=dev)
    static = list(_inputs(batch, gen, dev, T))
    accepted = torch.tensor([1, 2, 3, 2], dtype=torch.int32, device=dev)
    out = torch.empty(batch, T, H, P, device=dev)

    def step(c, tokens, o):
        rs.verify(c, tokens[0], tokens[1], A, tokens[2], tokens[3], ids, D=D, out=o)
        rs.commit(c, ids, accepted)

    step(cache, static, out)  # compile outside the capture
    eager = _mamba2_cache(dev, slots, 4, "fp16", "fp8", seed=78, max_draft=T)
    for name, t in _tensors(cache).items():
        getattr(eager, name).copy_(t)
    counter_before = cache.sr_counter.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(cache, static, out)
    eager_out = torch.empty_like(out)
    for i in range(6):
        new = _inputs(batch, gen, dev, T)
        for s_, n in zip(static, new):
            s_.copy_(n)
        graph.replay()
        step(eager, new, eager_out)
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out), f"replay {i}: outputs"
        for name, t in _tensors(eager).items():
            assert torch.equal(_codes(getattr(cache, name)), _codes(t)), f"replay {i}: {name}"
    # each row flushes every few steps (h + T > 4): every slot's counter moved
    assert bool((cache.sr_counter[ids.long()] > counter_before[ids.long()]).all())
