"""Fixtures shared by the GPU kernel tests."""

import pytest

from replayssm_cute.runtime import launch, tuning


@pytest.fixture(params=["tiles", "pipelined"])
def decode_kernel(request, monkeypatch):
    """A decode case on both decode kernels of its layer: the tile kernel (kernels/*/decode.py)
    and the persistent pipeline (kernels/*/pipelined.py, picked by REPLAYSSM_CUTE_PIPELINED=1
    with the tuned configs off). With the pipeline, the case fails unless a decode actually
    launched it (a shape it refuses would fall back to the tile kernel)."""
    picked = []
    if request.param == "pipelined":
        monkeypatch.setenv("REPLAYSSM_CUTE_PIPELINED", "1")
        monkeypatch.setenv(tuning.ENV_DISABLE, "0")
        compiled = launch.compiled

        def recording(kernel, shape, config, num_drafts=0):
            picked.append((kernel.name, type(config).__name__))
            return compiled(kernel, shape, config, num_drafts)

        monkeypatch.setattr(launch, "compiled", recording)
    launch.reload()
    yield request.param
    monkeypatch.undo()
    launch.reload()
    if request.param == "pipelined":
        decodes = [cfg for name, cfg in picked if name.endswith("_decode")]
        assert decodes and all(cfg.endswith("PipeConfig") for cfg in decodes), picked
