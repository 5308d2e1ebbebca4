"""Fixtures shared by the GPU kernel tests."""

import dataclasses

import pytest

from replayssm_cute.layers.common import PIPELINED_ENV
from replayssm_cute.runtime import launch


def _on_kernel(request, monkeypatch, op_kernel: str):
    """Run the case with REPLAYSSM_CUTE_PIPELINED set for ``request.param`` ("tiles", "pipelined",
    "regrouped": the pipeline with the other number of consumer groups, or "units": the pipeline
    in units of heads that share their products on a small grid, ``_replaced``), recording the launch
    configs of the kernels whose names end in ``op_kernel``; then fail unless some launched and
    every one is of the kind asked for."""
    picked, replaced = [], []
    pipelined = request.param != "tiles"
    monkeypatch.setenv(PIPELINED_ENV, "1" if pipelined else "0")
    compiled = launch.compiled

    def recording(kernel, shape, config, num_drafts=0):
        picked.append((kernel.name, config))
        return compiled(kernel, shape, config, num_drafts)

    monkeypatch.setattr(launch, "compiled", recording)
    if request.param in _REPLACEMENTS:
        monkeypatch.setattr(launch, "picked_config", _replaced(launch.picked_config, request.param, replaced))
    launch.reload()
    yield request.param
    monkeypatch.undo()
    launch.reload()
    launched = [cfg for name, cfg in picked if name.endswith(op_kernel)]
    assert launched and all(("Pipe" in type(cfg).__name__) == pipelined for cfg in launched), picked
    if request.param in _REPLACEMENTS:
        assert all(cfg in replaced for cfg in launched), (picked, replaced)


def _other_groups(config, space):
    """The first config of the space with the other number of consumer groups (1 <-> 2)."""
    return next(c for c in space if c.consumer_groups != config.consumer_groups and c.heads_per_unit == 1)


def _units(config, space):
    """The first config of the space in units of several heads, on a grid of 7 CTAs: every
    group then walks many units, its stages and its unit scratch reused across them."""
    return dataclasses.replace(next(c for c in space if c.heads_per_unit > 1), ctas=7)


_REPLACEMENTS = {"regrouped": _other_groups, "units": _units}


def _replaced(picked_config, param: str, replaced: list):
    """``launch.picked_config`` with a pipelined verify's pick replaced by ``_REPLACEMENTS[param]``
    of the kernel's space (``pipelined_verify_space``: items of one head, then units of the heads
    that share their products), appended to ``replaced``; other picks as they were."""
    from replayssm_cute.kernels.gdn import pipelined_verify as gdn_verify
    from replayssm_cute.kernels.mamba2 import pipelined_verify as mamba2_verify
    from replayssm_cute.kernels.pipeline import PipeVerifyConfig
    from replayssm_cute.layers.common import sm_count, target_arch

    def replace(kernel, shape, batch, num_drafts=0):
        config, tuned = picked_config(kernel, shape, batch, num_drafts)
        if isinstance(config, PipeVerifyConfig):
            module = gdn_verify if hasattr(shape, "num_k_heads") else mamba2_verify
            space = module.pipelined_verify_space(shape, sm_count(), target_arch())
            candidate = _REPLACEMENTS[param](config, space)
            replaced.append(candidate)
            return candidate, tuned
        return config, tuned

    return replace


@pytest.fixture(params=["tiles", "pipelined"])
def decode_kernel(request, monkeypatch):
    """A decode case on both decode kernels of its layer: the tile kernel (kernels/*/decode.py,
    REPLAYSSM_CUTE_PIPELINED=0) and the persistent pipeline (kernels/*/pipelined.py,
    REPLAYSSM_CUTE_PIPELINED=1). The case fails unless its decodes launched the kernel asked
    for (a shape the pipeline refuses would fall back to the tile kernel)."""
    yield from _on_kernel(request, monkeypatch, "_decode")


@pytest.fixture(params=["tiles", "pipelined", "regrouped", "units"])
def verify_kernel(request, monkeypatch):
    """A verify case on both verify kernels of its layer: the tile kernel (kernels/*/verify.py,
    REPLAYSSM_CUTE_PIPELINED=0) and the persistent pipeline (kernels/*/pipelined_verify.py,
    REPLAYSSM_CUTE_PIPELINED=1), at its default, with the other number of consumer groups (one
    or two), and in units of heads that share their products on a grid of 7 CTAs (``_units``).
    The case fails unless its verify steps launched the kernel (and config) asked for."""
    yield from _on_kernel(request, monkeypatch, "_verify")
