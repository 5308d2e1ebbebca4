"""The shipped H200 tuned configs (src/replayssm_cute/tuned/h200.json): which kernels and batch
buckets decode / verify on an H200 (sm_90a) find a tuned config for, on the kernel class they run
there (the pipelined decode where it is the default), and that every entry is one its kernel takes
at the model's shape."""

import dataclasses
import json

import pytest

from replayssm_cute.models import MODELS
from replayssm_cute.runtime import launch, tuning
from replayssm_cute.tune import TuneTarget

from tests.tools.test_precompile_cli import _h200

SHIPPED = tuning.SHIPPED_DIR / "h200.json"
WINDOW = 16
DRAFTS = (4, 8)

# (mode, T, read copy) kernels every batch bucket of which the shipped file covers for every
# registry model (verify on a read copy is not tuned).
_MODES = ([("conventional", 0, None), ("standard", 0, None)] + [("verify", t, None) for t in DRAFTS]
          + [("standard", 0, read) for read in ("fp16", "fp8", "nvfp4")])


def _target(name, mode, num_drafts, read):
    return TuneTarget(MODELS[name], mode, 1 if mode == "conventional" else WINDOW, num_drafts, "bf16", read)


def _untuned_buckets(t):
    """Buckets where decode / verify of `t` on an H200 picks no tuned entry of its own bucket."""
    key = tuning.tune_key(t.kernel.name, t.shape(), t.num_drafts, _h200())
    own = tuning._loaded_table().get(key, {})
    missing = []
    with launch.use_platform(_h200()):
        for b in tuning.BATCH_BUCKETS:
            config, tuned = launch.picked_config(t.kernel, t.shape(), b, t.num_drafts)
            own_config = launch.config_from_entry(type(config), own[b]) if b in own else None
            if not tuned or config != own_config:
                missing.append(b)
    return missing


@pytest.fixture(autouse=True)
def _shipped_only(monkeypatch, tmp_path):
    """The shipped file alone, as decode reads it on an sm_90a H200 with the default kernels."""
    from replayssm_cute.layers.common import PIPELINED_ENV

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.delenv(PIPELINED_ENV, raising=False)
    monkeypatch.delenv(tuning.ENV_DISABLE, raising=False)
    monkeypatch.setenv(tuning.ENV_USER_FILE, str(tmp_path / "none.json"))
    launch.reload()
    yield
    launch.reload()


@pytest.mark.parametrize("mode, num_drafts, read", _MODES, ids=lambda v: str(v))
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_batch_bucket_of_every_registry_model_is_tuned(name, mode, num_drafts, read):
    """Every bucket, but those where verify runs the pipelined verify (on sm_90a its default since
    2026-12-06, for GDN caches of more than 4 drafts from the bucket where units fill the grid):
    the shipped file has no entries of that kernel yet (its tile entries serve under
    REPLAYSSM_CUTE_PIPELINED=0), so those buckets are untuned until the tuner runs on an H200."""
    t = _target(name, mode, num_drafts, read)
    pipelined_verify = [b for b in tuning.BATCH_BUCKETS if mode == "verify" and hasattr(t.default_config(b), "stages")]
    assert _untuned_buckets(t) == pipelined_verify


def test_every_shipped_entry_is_valid_for_its_kernel():
    """Every entry parses, and its config is of a class its kernel runs (the tile kernel's, or the
    pipelined decode's) and passes the kernel's check at the registry model's shape (so decode
    never falls back to the default over a shipped entry)."""
    from replayssm_cute.kernels.gdn.config import GDNConfig
    from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig
    from replayssm_cute.kernels.mamba2.config import Mamba2Config
    from replayssm_cute.kernels.mamba2.pipelined import Mamba2PipeConfig

    classes = {"mamba2": (Mamba2Config, Mamba2PipeConfig), "gdn": (GDNConfig, GDNPipeConfig)}
    by_dims = {(m.layer, tuple(dataclasses.astuple(m)[2:6])): m for m in MODELS.values()}
    entries = json.loads(SHIPPED.read_text())["entries"]
    for i, entry in enumerate(entries):
        key, batch, fields = tuning.parse_entry(entry)
        layer = entry["kernel"].split("_")[0]
        model = by_dims[(layer, tuple(entry["shape"].values()))]
        read = (entry.get("state", "fp32").split("+") + [None])[1]  # fp32[+read copy[+rederive]]
        t = TuneTarget(model, entry["mode"], entry["window"], entry["num_drafts"], entry["dtype"], read)
        tile, pipe = classes[layer]
        config = (pipe if "stages" in fields else tile)(**fields)
        assert t.check(config) is None, f"entry {i} ({model.name} {entry['mode']} b={batch}): {config}"

