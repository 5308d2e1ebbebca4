"""Fixtures shared by the GPU kernel tests."""

import pytest

from replayssm_cute.layers.common import PIPELINED_ENV
from replayssm_cute.runtime import launch


def _on_kernel(request, monkeypatch, op_kernel: str):
    """Run the case with REPLAYSSM_CUTE_PIPELINED set for ``request.param`` ("tiles" or
    "pipelined"), recording the launch configs of the kernels whose names end in ``op_kernel``;
    then fail unless some launched and every one is of the kind asked for."""
    picked = []
    pipelined = request.param == "pipelined"
    monkeypatch.setenv(PIPELINED_ENV, "1" if pipelined else "0")
    compiled = launch.compiled

    def recording(kernel, shape, config, num_drafts=0):
        picked.append((kernel.name, type(config).__name__))
        return compiled(kernel, shape, config, num_drafts)

    monkeypatch.setattr(launch, "compiled", recording)
    launch.reload()
    yield request.param
    monkeypatch.undo()
    launch.reload()
    launched = [cfg for name, cfg in picked if name.endswith(op_kernel)]
    assert launched and all(("Pipe" in cfg) == pipelined for cfg in launched), picked


@pytest.fixture(params=["tiles", "pipelined"])
def decode_kernel(request, monkeypatch):
    """A decode case on both decode kernels of its layer: the tile kernel (kernels/*/decode.py,
    REPLAYSSM_CUTE_PIPELINED=0) and the persistent pipeline (kernels/*/pipelined.py,
    REPLAYSSM_CUTE_PIPELINED=1). The case fails unless its decodes launched the kernel asked
    for (a shape the pipeline refuses would fall back to the tile kernel)."""
    yield from _on_kernel(request, monkeypatch, "_decode")


@pytest.fixture(params=["tiles", "pipelined"])
def verify_kernel(request, monkeypatch):
    """A verify case on both verify kernels of its layer: the tile kernel (kernels/*/verify.py,
    REPLAYSSM_CUTE_PIPELINED=0) and the persistent pipeline (kernels/*/pipelined_verify.py,
    REPLAYSSM_CUTE_PIPELINED=1). The case fails unless its verify steps launched the kernel asked
    for."""
    yield from _on_kernel(request, monkeypatch, "_verify")
