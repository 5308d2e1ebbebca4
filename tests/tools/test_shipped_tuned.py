"""The shipped H200 tuned configs (src/replayssm_cute/tuned/h200.json): which kernels and batch
buckets they cover, and that every entry is one its kernel takes at the model's shape."""

import json

import pytest

from replayssm_cute.models import MODELS
from replayssm_cute.runtime import tuning
from replayssm_cute.tune import TuneTarget

SHIPPED = tuning.SHIPPED_DIR / "h200.json"
WINDOW = 16


def _entries():
    return json.loads(SHIPPED.read_text())["entries"]


def _covered(layer_dims, kernel, mode, num_drafts):
    """Batch buckets with an entry for these layer dims, kernel, mode and T (fp32 state, bf16)."""
    return {e["batch"] for e in _entries()
            if e["kernel"] == kernel and e["mode"] == mode and e["num_drafts"] == num_drafts
            and tuple(e["shape"].values()) == layer_dims and e.get("state", "fp32") == "fp32"
            and e["dtype"] == "bf16" and e["device"] == "NVIDIA H200"}


def _dims(model):
    return (model.nheads, model.headdim, model.dstate, model.ngroups)


@pytest.mark.parametrize("mode", ["conventional", "standard"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_batch_bucket_of_every_registry_model_is_tuned(name, mode):
    model = MODELS[name]
    covered = _covered(_dims(model), f"{model.layer}_decode", mode, 0)
    missing = sorted(set(tuning.BATCH_BUCKETS) - covered)
    if _dims(model) == _dims(MODELS["nemotron-super"]) and mode == "standard":
        # its batch-8 winner, (64, 8, 4), spills 20 bytes at sm_90a (a 64-register cap) and was
        # dropped: the batch-4 entry (64, 4, 4) serves batch 8
        assert missing == [8]
    else:
        assert not missing, f"{name} {mode}: no tuned entry at batch {missing}"


# Verify entries (T = 4 and 8): the buckets still untuned, where the tuning runs ran out of device
# time. Untuned buckets take the nearest tuned one, then the analytical default.
_ALL = list(tuning.BATCH_BUCKETS)
_VERIFY_MISSING = {("nemotron-super", 4): [], ("nemotron-super", 8): [1024],
                   ("nemotron-nano-4b", 4): [], ("nemotron-nano-4b", 8): [],
                   ("nemotron-nano-9b-v2", 4): [1024], ("nemotron-nano-9b-v2", 8): [1024],
                   ("qwen3.5-122b", 4): [], ("qwen3.5-122b", 8): [1024],
                   ("qwen3.5-4b", 4): _ALL, ("qwen3.5-4b", 8): _ALL}


@pytest.mark.parametrize("name, num_drafts", sorted(_VERIFY_MISSING))
def test_verify_buckets_tuned(name, num_drafts):
    model = MODELS[name]
    covered = _covered(_dims(model), f"{model.layer}_verify", "verify", num_drafts)
    assert sorted(set(tuning.BATCH_BUCKETS) - covered) == _VERIFY_MISSING[name, num_drafts]


def test_every_shipped_entry_is_valid_for_its_kernel():
    """Every entry parses and its config passes the kernel's check at the registry model's shape
    (so decode never falls back to the default over a shipped entry)."""
    by_dims = {(m.layer, _dims(m)): m for m in MODELS.values()}
    from replayssm_cute.kernels.gdn.config import GDNConfig
    from replayssm_cute.kernels.mamba2.config import Mamba2Config

    for i, entry in enumerate(_entries()):
        key, batch, fields = tuning.parse_entry(entry)
        layer = entry["kernel"].split("_")[0]
        model = by_dims[(layer, tuple(entry["shape"].values()))]
        target = TuneTarget(model, entry["mode"], entry["window"], entry["num_drafts"], entry["dtype"])
        config = (GDNConfig if layer == "gdn" else Mamba2Config)(**fields)
        assert target.check(config) is None, f"entry {i} ({model.name} {entry['mode']} b={batch}): {config}"
