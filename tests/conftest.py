"""Tests marked ``gpu`` skip where no CUDA GPU is found."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def tile_decode(monkeypatch):
    """Every decode on the tile kernels (REPLAYSSM_CUTE_PIPELINED=0), for the tests of the tuned
    launch configs: the pipelined decodes, the default on an fp32 checkpoint (Mamba-2; GDN
    ReplaySSM from batch 8), have none."""
    from replayssm_cute.layers.common import PIPELINED_ENV
    from replayssm_cute.runtime import launch

    monkeypatch.setenv(PIPELINED_ENV, "0")
    launch.reload()
    yield
    monkeypatch.undo()
    launch.reload()
