"""Fixtures shared by the GPU kernel tests."""

import pytest

from replayssm_cute.layers.common import PIPELINED_ENV
from replayssm_cute.runtime import launch


def _on_kernel(request, monkeypatch, op_kernel: str):
    """Run the case with REPLAYSSM_CUTE_PIPELINED set for ``request.param`` ("tiles", "pipelined",
    or "regrouped": the pipeline with the other number of consumer groups, ``_regrouped``),
    recording the launch configs of the kernels whose names end in ``op_kernel``; then fail unless
    some launched and every one is of the kind asked for."""
    picked, regrouped = [], []
    pipelined = request.param != "tiles"
    monkeypatch.setenv(PIPELINED_ENV, "1" if pipelined else "0")
    compiled = launch.compiled

    def recording(kernel, shape, config, num_drafts=0):
        picked.append((kernel.name, config))
        return compiled(kernel, shape, config, num_drafts)

    monkeypatch.setattr(launch, "compiled", recording)
    if request.param == "regrouped":
        monkeypatch.setattr(launch, "picked_config", _regrouped(launch.picked_config, regrouped))
    launch.reload()
    yield request.param
    monkeypatch.undo()
    launch.reload()
    launched = [cfg for name, cfg in picked if name.endswith(op_kernel)]
    assert launched and all(("Pipe" in type(cfg).__name__) == pipelined for cfg in launched), picked
    if request.param == "regrouped":
        assert all(cfg in regrouped for cfg in launched), (picked, regrouped)


def _regrouped(picked_config, regrouped: list):
    """``launch.picked_config`` with a pipelined verify's pick replaced by the first config of the
    kernel's space (``pipeline.verify_space``) of the other number of consumer groups (1 <-> 2),
    appended to ``regrouped``; other picks as they were."""
    from replayssm_cute.kernels.pipeline import PipeVerifyConfig, verify_space
    from replayssm_cute.layers.common import sm_count, target_arch

    def regroup(kernel, shape, batch, num_drafts=0):
        config, tuned = picked_config(kernel, shape, batch, num_drafts)
        if isinstance(config, PipeVerifyConfig):
            for candidate in verify_space(shape, kernel.check, sm_count(), target_arch()):
                if candidate.consumer_groups != config.consumer_groups:
                    regrouped.append(candidate)
                    return candidate, tuned
        return config, tuned

    return regroup


@pytest.fixture(params=["tiles", "pipelined"])
def decode_kernel(request, monkeypatch):
    """A decode case on both decode kernels of its layer: the tile kernel (kernels/*/decode.py,
    REPLAYSSM_CUTE_PIPELINED=0) and the persistent pipeline (kernels/*/pipelined.py,
    REPLAYSSM_CUTE_PIPELINED=1). The case fails unless its decodes launched the kernel asked
    for (a shape the pipeline refuses would fall back to the tile kernel)."""
    yield from _on_kernel(request, monkeypatch, "_decode")


@pytest.fixture(params=["tiles", "pipelined", "regrouped"])
def verify_kernel(request, monkeypatch):
    """A verify case on both verify kernels of its layer: the tile kernel (kernels/*/verify.py,
    REPLAYSSM_CUTE_PIPELINED=0) and the persistent pipeline (kernels/*/pipelined_verify.py,
    REPLAYSSM_CUTE_PIPELINED=1), at its default and with the other number of consumer groups (one
    or two). The case fails unless its verify steps launched the kernel (and groups) asked for."""
    yield from _on_kernel(request, monkeypatch, "_verify")
