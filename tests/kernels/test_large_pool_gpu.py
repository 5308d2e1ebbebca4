"""Pools of over 2^31 state elements on the GPU (marked gpu; about 9 GB each).

A TMA box that spans whole state rows (rows * columns <= 256 elements: two fp32 rows of 128) used
to be addressed by one int32 coordinate over the whole pool, which faulted (illegal instruction)
past 2^31 elements. Each case steps the same rows with the same inputs in the top slots of such a
pool and in a small pool, through a flush (or verify + commit), and needs outputs and checkpoints
bit-identical: the small pool's kernels are checked against the float64 recurrence elsewhere.
"""

import pytest
import torch

from replayssm_cute.api import commit, decode, snapshot_verify, verify
from replayssm_cute.kernels.gdn.config import GDNConfig
from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig
from replayssm_cute.kernels.mamba2.config import Mamba2Config
from replayssm_cute.models import ModelSpec
from replayssm_cute.perf import bench_layer

pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("gpu_memory")]

# 65536 fp32 state elements per slot, 128 columns: a two-row box is one 256-element span.
MAMBA2 = ModelSpec("pool-mamba2", "mamba2", 8, 64, 128, 1, 1)
GDN = ModelSpec("pool-gdn", "gdn", 4, 128, 128, 2, 1)
BATCH = 4


def _pools(model, window, drafts):
    layer = bench_layer(model)
    per_slot = model.nheads * model.headdim * model.dstate
    big_slots = 2**31 // per_slot + 2 * BATCH
    dev = torch.device("cuda")
    big = layer.cache(model, big_slots, window, dev, drafts)
    small = layer.cache(model, BATCH + 1, window, dev, drafts)
    gen = torch.Generator(device=dev).manual_seed(0)
    init = torch.randn((BATCH,) + tuple(small.checkpoint.shape[1:]), generator=gen, device=dev) * 0.1
    big_ids = torch.arange(big_slots - BATCH, big_slots, dtype=torch.int32, device=dev)
    small_ids = torch.arange(1, BATCH + 1, dtype=torch.int32, device=dev)
    big.load_prefill(big_ids, init)
    small.load_prefill(small_ids, init)
    assert big.checkpoint.numel() > 2**31
    return layer, gen, (big, big_ids), (small, small_ids)


def _same(got, want, what):
    assert torch.equal(got, want), f"{what}: max |difference| {(got.float() - want.float()).abs().max().item():.3g}"


@pytest.mark.parametrize("model, window, config", [
    (MAMBA2, 1, Mamba2Config(8, 4)),
    (MAMBA2, 16, Mamba2Config(8, 4)),
    (MAMBA2, 1, None),
    (MAMBA2, 16, None),
    (GDN, 1, GDNConfig(8, 4)),
    (GDN, 16, GDNConfig(8, 4)),
    (GDN, 16, GDNPipeConfig(stages=2, ctas=8, rows_per_item=64)),
], ids=["mamba2-conventional-rw2", "mamba2-replay-rw2", "mamba2-conventional-default", "mamba2-replay-default",
        "gdn-conventional-rw2", "gdn-replay-rw2", "gdn-replay-pipelined"])
def test_decode_past_2_31_elements(model, window, config):
    layer, gen, (big, big_ids), (small, small_ids) = _pools(model, window, 0)
    for step in range(window + 2):  # through a flush
        inputs = layer.inputs(model, BATCH, gen, big.device)
        outs = []
        for cache, ids in ((big, big_ids), (small, small_ids)):
            decode(cache, slot_ids=ids, config=config, **inputs)
            outs.append(inputs["out"].clone())
        _same(outs[0], outs[1], f"step {step} output")
    _same(big.checkpoint[big_ids.long()], small.checkpoint[small_ids.long()], "checkpoint")


@pytest.mark.parametrize("model", [MAMBA2, GDN], ids=["mamba2", "gdn"])
def test_verify_commit_past_2_31_elements(model):
    window, drafts = 16, 4
    layer, gen, (big, big_ids), (small, small_ids) = _pools(model, window, drafts)
    for step in range(6):  # 6 steps of up to 4 accepted drafts pass a flush
        inputs = layer.inputs(model, BATCH, gen, big.device, drafts)
        accepted = torch.randint(1, drafts + 1, (BATCH,), generator=gen, device=big.device, dtype=torch.int32)
        outs = []
        for cache, ids in ((big, big_ids), (small, small_ids)):
            verify(cache, slot_ids=ids, **inputs)
            commit(cache, ids, accepted)
            outs.append(inputs["out"].clone())
        _same(outs[0], outs[1], f"step {step} output")
    _same(big.checkpoint[big_ids.long()], small.checkpoint[small_ids.long()], "checkpoint")


@pytest.mark.parametrize("model, config", [(MAMBA2, Mamba2Config(8, 4)), (GDN, GDNConfig(8, 4))],
                         ids=["mamba2-rw2", "gdn-rw2"])
def test_snapshot_verify_past_2_31_elements(model, config):
    drafts = 4
    layer, gen, (big, big_ids), (small, small_ids) = _pools(model, 1, drafts)
    inputs = layer.inputs(model, BATCH, gen, big.device, drafts)
    results = []
    for cache, ids in ((big, big_ids), (small, small_ids)):
        snapshots = torch.empty((BATCH, drafts) + tuple(cache.checkpoint.shape[1:]), device=cache.device)
        snapshot_verify(cache, slot_ids=ids, snapshots=snapshots, config=config, **inputs)
        results.append((inputs["out"].clone(), snapshots))
    _same(results[0][0], results[1][0], "output")
    _same(results[0][1], results[1][1], "snapshots")
