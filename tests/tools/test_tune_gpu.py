"""The autotuner end to end on the GPU (marked gpu): a short tune of one small Mamba-2 shape writes
its winner to the user's tuned-config file, and the next decode call at that bucket launches with
it (the float64 reference agrees), while a batch far from every tuned bucket keeps the default.

A small pool (--pool-mb 4) keeps this fast; it is no measurement (see sweeps/ and
docs/benchmarking.md for the protocol the real tuning runs).
"""

import pytest
import torch

import replayssm_cute as rs
from replayssm_cute import tune
from replayssm_cute.kernels.mamba2.config import Mamba2Config
from replayssm_cute.kernels.mamba2.defaults import default_mamba2_config
from replayssm_cute.runtime import launch, tuning

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("tile_decode")]  # tuned configs are the tile kernels'

H, P, N, G = 4, 16, 32, 1
WINDOW = 4
BATCH = 8


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.ENV_USER_FILE, str(tmp_path / "tuned.json"))
    monkeypatch.delenv(tuning.ENV_DISABLE, raising=False)
    launch.reload()
    yield tmp_path / "tuned.json"
    launch.reload()


def _decode_inputs(batch, gen):
    dev = torch.device("cuda")
    bf = torch.bfloat16
    return dict(x=torch.randn(batch, H, P, generator=gen, device=dev).to(bf),
                dt=(0.5 * torch.randn(batch, H, generator=gen, device=dev)).to(bf),
                A=-(1 + torch.rand(H, generator=gen, device=dev)),
                B=torch.randn(batch, G, N, generator=gen, device=dev).to(bf),
                C=torch.randn(batch, G, N, generator=gen, device=dev).to(bf),
                D=torch.randn(H, generator=gen, device=dev),
                dt_bias=-4 + torch.rand(H, generator=gen, device=dev), dt_softplus=True)


def _launch_config(cache, batch, gen):
    """The launch config the next decode of `batch` rows of `cache` picks (seen at its compile:
    runtime.launch.compiled); decode's outputs are checked against the float64 reference on the
    CPU on the way."""
    picked = []
    compiled = launch.compiled

    def spy(kernel, shape, cfg, num_drafts=0):
        picked.append((kernel.name, cfg))
        return compiled(kernel, shape, cfg, num_drafts)

    slots = torch.arange(batch, dtype=torch.int32, device="cuda")
    inputs = _decode_inputs(batch, gen)
    ref_cache = rs.Mamba2Cache(batch, H, P, N, G, window=WINDOW, dtype=torch.bfloat16, device="cpu")
    ref_cache.load_prefill(slots.cpu(), cache.materialize(slots, inputs["A"]).float().cpu())
    launch.compiled = spy
    try:
        y = rs.decode(cache, slot_ids=slots, **inputs)
    finally:
        launch.compiled = compiled
    want = rs.decode(ref_cache, slot_ids=slots.cpu(), **{k: v.cpu() if torch.is_tensor(v) else v
                                                         for k, v in inputs.items()})
    torch.testing.assert_close(y.float().cpu(), want.float(), rtol=2e-2, atol=2e-2)
    assert len(picked) == 1 and picked[0][0] == "mamba2_decode"
    return picked[0][1]


def test_tune_writes_a_cache_that_the_next_decode_uses(user_file, monkeypatch, capsys):
    argv = ["--shape", f"mamba2:{H},{P},{N},{G}", "--modes", "standard", "--window", str(WINDOW),
            "--batch", str(BATCH), "--pool-mb", "4", "--replays", "5"]
    assert tune.main(argv) == 0
    out = capsys.readouterr().out
    assert "best config" in out and "speedup" in out and str(user_file) in out

    (entry,) = tuning.read_entries(user_file)
    assert entry["kernel"] == "mamba2_decode" and entry["mode"] == "standard" and entry["batch"] == BATCH
    assert entry["device"] == torch.cuda.get_device_name() and entry["window"] == WINDOW
    assert entry["time_us"] > 0 and entry["default_time_us"] > 0 and entry["tbps"] > 0
    assert entry["candidates"] >= 2
    winner = Mamba2Config(**entry["config"])

    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = rs.Mamba2Cache(2 * BATCH, H, P, N, G, window=WINDOW, dtype=torch.bfloat16, device="cuda")
    cache.load_prefill(torch.arange(2 * BATCH, dtype=torch.int32, device="cuda"),
                       0.1 * torch.randn(2 * BATCH, H, P, N, generator=gen, device="cuda"))
    launch.reload()
    assert _launch_config(cache, BATCH - 2, gen) == winner  # bucket 8: the tuned one
    assert _launch_config(cache, 1, gen) == default_mamba2_config(P, 1, WINDOW)
    monkeypatch.setenv(tuning.ENV_DISABLE, "0")
    launch.reload()
    assert _launch_config(cache, BATCH, gen) == default_mamba2_config(P, BATCH, WINDOW)
