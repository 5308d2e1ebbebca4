"""Launch configs that no kernel can take (no rows, no warps, more threads than a CTA or an SM
holds, a negative CTA count, a non-integer field): every kernel check returns a reason naming the
field, never raises or passes, and the runtime refuses such an explicit config before compiling.
On the CPU, nothing compiled.
"""

import re

import pytest
import torch

from replayssm_cute.cache import GDNCache, Mamba2Cache
from replayssm_cute.kernels import config_space as space
from replayssm_cute.kernels.gdn.config import GDNConfig
from replayssm_cute.kernels.gdn.decode import GDNDecode
from replayssm_cute.kernels.gdn.snapshot import GDNSnapshot
from replayssm_cute.kernels.gdn.verify import GDNVerify
from replayssm_cute.kernels.mamba2.config import Mamba2Config
from replayssm_cute.kernels.mamba2.decode import Mamba2Decode
from replayssm_cute.kernels.mamba2.snapshot import Mamba2Snapshot
from replayssm_cute.kernels.mamba2.verify import Mamba2Verify
from replayssm_cute.layers import GDNLayer, Mamba2Layer, model_cache
from replayssm_cute.models import get_model
from replayssm_cute.runtime import launch

SUPER = get_model("nemotron-super")  # headdim 64, dstate 128
QWEN = get_model("qwen3.5-4b")  # head_v_dim = head_k_dim = 128

# (rows_per_cta, num_warps, min_ctas_per_sm) and what the reason must say
BAD = [
    ((0, 0, 0), "rows_per_cta 0: expected at least 1"),
    ((16, 0, 0), "num_warps 0: expected 1..32 (a CTA holds at most 1024 threads)"),
    ((64, 64, 0), "num_warps 64: expected 1..32 (a CTA holds at most 1024 threads)"),  # 2048 threads: no CTA launches
    ((16, 4, -3), "min_ctas_per_sm -3: expected 0 (no register cap) to 32 (the CTAs an SM holds)"),
    ((16, 1, 33), "min_ctas_per_sm 33: expected 0 (no register cap) to 32 (the CTAs an SM holds)"),  # an SM holds 32 CTAs
    ((64, 16, 8), "min_ctas_per_sm 8: 8 CTAs of 16 warps are 4096 threads, more than an SM holds (2048)"),
    ((16.0, 4, 0), "rows_per_cta 16.0: expected an int"),
    ((16, True, 0), "num_warps True: expected an int"),
]


def _shape(layer, model, window, capacity):
    """The Shape of the engines' usual call on a bf16 cache of `model` (capacity = window + max_draft)."""
    cache = model_cache(model, 1, window, "meta", capacity - window)
    return layer.shape(cache, layer.engine_inputs(torch.bfloat16))


def _mamba2(window, capacity):
    return _shape(Mamba2Layer, SUPER, window, capacity)


def _gdn(window, capacity):
    return _shape(GDNLayer, QWEN, window, capacity)


# Every kernel's check on a shape it takes with a good config: (name, config class, check).
CHECKS = [
    ("mamba2 decode", Mamba2Config, lambda c: c.check(_mamba2(16, 20))),
    ("mamba2 conventional", Mamba2Config, lambda c: c.check(_mamba2(1, 1))),
    ("mamba2 verify", Mamba2Config, lambda c: Mamba2Verify.check(_mamba2(16, 20), c, 4)),
    ("mamba2 snapshot", Mamba2Config, lambda c: Mamba2Snapshot.check(_mamba2(1, 1), c, 4)),
    ("gdn decode", GDNConfig, lambda c: c.check(_gdn(16, 20))),
    ("gdn conventional", GDNConfig, lambda c: c.check(_gdn(1, 1))),
    ("gdn verify", GDNConfig, lambda c: GDNVerify.check(_gdn(16, 20), c, 4)),
    ("gdn snapshot", GDNConfig, lambda c: GDNSnapshot.check(_gdn(1, 1), c, 4)),
]
GOOD = {"mamba2 decode": (16, 4, 0), "mamba2 conventional": (32, 2, 0), "mamba2 verify": (64, 4, 0),
        "mamba2 snapshot": (32, 4, 0), "gdn decode": (32, 2, 4), "gdn conventional": (32, 2, 0),
        "gdn verify": (128, 8, 0), "gdn snapshot": (32, 4, 0)}


@pytest.mark.parametrize("name,cls,check", CHECKS, ids=[c[0] for c in CHECKS])
def test_every_kernel_check_takes_its_good_config(name, cls, check):
    assert check(cls(*GOOD[name])) is None


@pytest.mark.parametrize("fields,reason", BAD, ids=[str(f) for f, _ in BAD])
@pytest.mark.parametrize("name,cls,check", CHECKS, ids=[c[0] for c in CHECKS])
def test_every_kernel_check_names_the_launch_field_at_fault(name, cls, check, fields, reason):
    assert check(cls(*fields)) == reason


@pytest.mark.parametrize("fields", [(64, 32, 0), (8, 1, 32), (64, 32, 2), (16, 8, 8), (16, 4, 16)])
def test_launch_limits_are_inclusive(fields):
    """1024 threads a CTA, 32 CTAs and 2048 threads an SM."""
    assert space.launch_check(*fields) is None


def test_a_whole_head_over_32_warps_passes_the_decode_check():
    """2 rows per warp, 1024 threads: the most a CTA launches, and the decode kernel takes it."""
    assert Mamba2Config(64, 32, 0).check(_mamba2(16, 20)) is None
    assert GDNConfig(128, 32, 0).check(_gdn(16, 20)) is None


@pytest.mark.parametrize("fields,reason", BAD[:4], ids=[str(f) for f, _ in BAD[:4]])
def test_kernels_refuse_before_compiling(fields, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        Mamba2Decode(_mamba2(16, 20), Mamba2Config(*fields))
    with pytest.raises(ValueError, match=re.escape(reason)):
        GDNDecode(_gdn(16, 20), GDNConfig(*fields))
    with pytest.raises(ValueError, match=re.escape(reason)):
        Mamba2Verify(_mamba2(16, 20), Mamba2Config(*fields), 4)


@pytest.mark.parametrize("fields,reason", BAD[:6], ids=[str(f) for f, _ in BAD[:6]])
def test_an_explicit_config_no_kernel_takes_is_an_argument_error(monkeypatch, fields, reason):
    monkeypatch.setattr(launch.compile_cache, "get_compiled", lambda *a: pytest.fail("compiled"))
    mamba2 = Mamba2Cache(2, SUPER.nheads, SUPER.headdim, SUPER.dstate, SUPER.ngroups, window=16, max_draft=4,
                         device="meta")
    gdn = GDNCache(2, QWEN.nheads, QWEN.headdim, QWEN.dstate, QWEN.ngroups, window=16, max_draft=4, device="meta")
    m_shape = Mamba2Layer.shape(mamba2, (torch.bfloat16, True, False, True, True))
    g_shape = GDNLayer.shape(gdn, (torch.bfloat16, torch.float32, torch.float32, None))
    calls = [
        lambda: launch.launcher(Mamba2Layer.decode_kernel, m_shape, 0, 64, Mamba2Config(*fields)),
        lambda: launch.launcher(Mamba2Layer.verify_kernel, m_shape, 4, 64, Mamba2Config(*fields)),
        lambda: launch.launcher(GDNLayer.decode_kernel, g_shape, 0, 64, GDNConfig(*fields)),
        lambda: launch.launcher(GDNLayer.verify_kernel, g_shape, 4, 64, GDNConfig(*fields)),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=re.escape(f"argument 'config': the GPU kernel cannot take it: {reason}")):
            call()
