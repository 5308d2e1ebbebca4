"""Fixtures shared by the GPU kernel tests."""

import pytest

from replayssm_cute.layers.common import PIPELINED_ENV
from replayssm_cute.runtime import launch


@pytest.fixture(params=["tiles", "pipelined"])
def decode_kernel(request, monkeypatch):
    """A decode case on both decode kernels of its layer: the tile kernel (kernels/*/decode.py,
    REPLAYSSM_CUTE_PIPELINED=0) and the persistent pipeline (kernels/*/pipelined.py,
    REPLAYSSM_CUTE_PIPELINED=1). The case fails unless its decodes launched the kernel asked
    for (a shape the pipeline refuses would fall back to the tile kernel)."""
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
    decodes = [cfg for name, cfg in picked if name.endswith("_decode")]
    assert decodes and all(cfg.endswith("PipeConfig") == pipelined for cfg in decodes), picked
