"""The autotuner on the CPU: config spaces and their validity filters, the tuned-config file (keys,
round trip, merge), the lookup decode / verify make (buckets, fallbacks, overrides, the switch),
the CLI's argument errors, its no-GPU message, a compile-only run, the ptxas spill check, and the
timing processes (a candidate that faults the GPU is dropped, the run goes on).

Timing needs a GPU: tests/tools/test_tune_gpu.py tunes a small shape end to end.
"""

import dataclasses
import functools
import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from replayssm_cute import precompile, tune
from replayssm_cute.layers import GDNLayer, Mamba2Layer
from replayssm_cute.runtime import launch, tuning
from replayssm_cute.cache import GDNCache, Mamba2Cache
from replayssm_cute.kernels import config_space as space
from replayssm_cute.kernels.gdn.config import GDNConfig
from replayssm_cute.kernels.mamba2.config import Mamba2Config
from replayssm_cute.models import MODELS, ModelSpec, get_model
from replayssm_cute.kernels.gdn import defaults as gdefaults
from replayssm_cute.kernels.mamba2 import defaults as mdefaults

from tests.helpers import ROOT

PLATFORM = tuning.Platform("NVIDIA H200", "sm_90a", "0.1.0", "4.8.1")
SUPER = get_model("nemotron-super")

# The tuned launch configs are the tile kernels': the tests run decode on them.
pytestmark = pytest.mark.usefixtures("tile_decode")


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """A private user file and compile cache, an H200 platform, no shipped entries, fresh lookups."""
    monkeypatch.setenv(tuning.ENV_USER_FILE, str(tmp_path / "user.json"))
    monkeypatch.setenv("REPLAYSSM_CUTE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(tuning.ENV_DISABLE, raising=False)
    monkeypatch.setattr(tuning, "current_platform", lambda: PLATFORM)
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "shipped")
    if "CUTE_DSL_ARCH" in os.environ:
        monkeypatch.setenv("CUTE_DSL_ARCH", os.environ["CUTE_DSL_ARCH"])
    else:
        monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    launch.reload()
    yield
    launch.reload()


# ------------------------------------------------------------------------------- config spaces


def test_register_budget():
    assert space.register_budget(4, 0) == 255  # no cap
    assert space.register_budget(1, 2) == 255  # 65536 / 64 threads: capped at 255
    assert space.register_budget(4, 6) == 80  # 65536 / 768 = 85, in steps of 8
    assert space.register_budget(8, 4) == 64
    assert space.register_budget(8, 6) == 40
    assert space.register_budget(8, 9) == 0  # 2304 threads do not fit on an SM


@pytest.mark.parametrize("cls", [Mamba2Config, GDNConfig])
@pytest.mark.parametrize("rows", [16, 64, 80, 128])
def test_space_enumerates_divisible_tiles_within_the_register_floor(cls, rows):
    configs = cls.space(rows)
    assert len(configs) == len(set(configs)) and all(type(c) is cls for c in configs)
    for c in configs:
        assert rows % c.rows_per_cta == 0 and c.rows_per_cta >= space.MIN_TILE_ROWS
        assert c.rows_per_cta % c.num_warps == 0 and c.num_warps in space.TUNE_NUM_WARPS
        assert c.min_ctas_per_sm in space.TUNE_MIN_CTAS_PER_SM
        assert space.register_budget(c.num_warps, c.min_ctas_per_sm) >= space.MIN_REGISTERS_PER_THREAD
    # every tile and warp count that divides, uncapped, is there
    want = {(t, w) for t in range(8, rows + 1) if rows % t == 0 for w in range(1, 9) if t % w == 0}
    assert {(c.rows_per_cta, c.num_warps) for c in configs if c.min_ctas_per_sm == 0} == want
    assert cls(rows_per_cta=rows, num_warps=8, min_ctas_per_sm=6) not in configs  # 40 registers


def _target(model, mode, dtype="bf16", window=16, drafts=4):
    window, drafts = {"conventional": (1, 0), "standard": (window, 0), "verify": (window, drafts)}[mode]
    return tune.TuneTarget(model, mode, window, drafts, dtype)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mode", tuning.MODES)
def test_candidates_pass_the_kernel_check_and_hold_the_defaults(name, mode):
    t = _target(get_model(name), mode)
    configs = t.candidates()
    assert configs and all(t.check(c) is None for c in configs)
    tile = [c for c in configs if not hasattr(c, "stages")]
    if tile:
        rejected = [c for c in type(tile[0]).space(t.model.headdim) if c not in tile]
        assert all(t.check(c) is not None for c in rejected)
    for batch in (1, 16, 32, 1024):
        assert t.default_config(batch) in configs  # the tuner can only match or beat the default
    if mode == "verify":
        assert {c.rows_per_warp for c in configs} == {16}  # the MMA's M


def test_gdn_space_filters_shared_memory_and_rows_per_warp():
    # K = 256: a 128-row tile is 128 KiB of state, so two such CTAs do not fit on an SM
    t = _target(ModelSpec("wide", "gdn", 8, 128, 256, 2, 1), "standard")
    configs = t.candidates()
    assert GDNConfig(128, 8, 0) in configs
    assert GDNConfig(128, 8, 2) not in configs and "shared memory" in t.check(GDNConfig(128, 8, 2))
    assert GDNConfig(64, 2, 0) not in configs  # 32 rows per warp
    assert "power of two up to 16" in t.check(GDNConfig(64, 2, 0))


@pytest.mark.parametrize("layer", ["mamba2", "gdn"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_target_shapes_are_what_decode_and_verify_build(layer, dtype):
    """The tuner compiles the shapes decode / verify build for the pool's inputs: precompile's
    (the engines' usual arguments, every 16-bit input in the activation dtype)."""
    m = SUPER if layer == "mamba2" else get_model("qwen3.5-122b")
    made = {label: shape for label, shape, _ in precompile.variants(m, 16, [dtype])}
    assert _target(m, "conventional", dtype).shape() in made.values()
    assert _target(m, "standard", dtype).shape() in made.values()
    verify = [v.shape for v in precompile.draft_variants(m, 16, [4], [dtype]) if v.kind == "verify"]
    assert _target(m, "verify", dtype).shape() == verify[0]


# --------------------------------------------------------------------------- keys and the file


def _shape(window=16, capacity=None, dtype=torch.bfloat16, model=SUPER):
    cache = Mamba2Cache(1, model.nheads, model.headdim, model.dstate, model.ngroups, window=window,
                        max_draft=(capacity or window) - window, dtype=dtype, device="meta")
    return Mamba2Layer.shape(cache, Mamba2Layer.engine_inputs(dtype))


def _tuned_fields(kernel, shape, num_drafts, bucket):
    return tuning.tuned_fields(kernel, shape, num_drafts, bucket, launch.active_platform())


MAMBA2_STATIC = (torch.bfloat16, True, False, True, True)
GDN_STATIC = (torch.bfloat16, torch.float32, torch.float32, None)


def _mamba2_decode(cache, batch, config=None):
    return launch.launcher(Mamba2Layer.decode_kernel, Mamba2Layer.shape(cache, MAMBA2_STATIC), 0, batch, config)


def _entry(batch=64, config=(32, 2, 0), kernel="mamba2_decode", window=16, num_drafts=0, platform=PLATFORM,
           dtype=torch.bfloat16, **extra):
    key = tuning.tune_key(kernel, _shape(window, window + num_drafts, dtype), num_drafts, platform)
    rows, warps, ctas = config
    return {**key.fields(batch), "config": {"rows_per_cta": rows, "num_warps": warps, "min_ctas_per_sm": ctas},
            "time_us": 80.0, **extra}


def test_key_names_device_versions_layer_dtype_mode_and_batch():
    e = _entry(batch=256, kernel="mamba2_verify", num_drafts=4, dtype=torch.float16)
    assert list(e)[:len(tuning.KEY_FIELDS)] == list(tuning.KEY_FIELDS)
    assert e["device"] == "NVIDIA H200" and e["arch"] == "sm_90a"
    assert e["package"] == "0.1.0" and e["cutlass"] == "4.8.1"
    assert e["shape"] == {"nheads": 128, "headdim": 64, "dstate": 128, "ngroups": 8}
    assert (e["dtype"], e["mode"], e["window"], e["num_drafts"], e["batch"]) == ("fp16", "verify", 16, 4, 256)
    assert tuning.tune_key("mamba2_decode", _shape(1), 0, PLATFORM).mode == "conventional"
    assert tuning.tune_key("mamba2_decode", _shape(16), 0, PLATFORM).mode == "standard"
    # the ring capacity (drafts room) is not part of a decode key
    assert tuning.tune_key("mamba2_decode", _shape(16, 24), 0, PLATFORM) == \
        tuning.tune_key("mamba2_decode", _shape(16), 0, PLATFORM)
    gdn = get_model("qwen3.5-4b")
    shape = GDNLayer.shape(GDNCache(1, gdn.nheads, gdn.headdim, gdn.dstate, gdn.ngroups, window=16, device="meta"),
                           GDN_STATIC)
    assert dict(tuning.tune_key("gdn_decode", shape, 0, PLATFORM).shape) == \
        {"num_v_heads": 32, "head_v_dim": 128, "head_k_dim": 128, "num_k_heads": 16}


def test_file_round_trip_and_merge(tmp_path):
    path = tmp_path / "sub" / "tuned.json"
    first = [_entry(1, (16, 4, 0)), _entry(64, (32, 2, 0))]
    assert tuning.write_entries(path, first) == first
    data = json.loads(path.read_text())
    assert data == {"format": tuning.FORMAT, "entries": first}
    assert '\n  "entries": [\n' in path.read_text()  # indented: readable and diffable
    assert tuning.read_entries(path) == first
    # a new key is added, an existing key replaced, the rest kept, in key order
    merged = tuning.write_entries(path, [_entry(64, (64, 4, 0)), _entry(256, (64, 4, 0))])
    assert [(e["batch"], e["config"]["rows_per_cta"]) for e in merged] == [(1, 16), (64, 64), (256, 64)]
    assert tuning.read_entries(path) == merged
    assert [p.name for p in path.parent.iterdir()] == ["tuned.json"]  # no temp files left


def test_missing_file_reads_empty(tmp_path):
    assert tuning.read_entries(tmp_path / "none.json") == []


@pytest.mark.parametrize("text,message", [
    (b"{", "not JSON"),
    (b'{"format": "replayssm_cute-tuned-v1", "entries": [\xff]}', "not JSON"),  # not UTF-8
    (b"[" * 100_000, "not JSON"),  # deeper than the JSON parser recurses
    (b'{"entries": []}', "expected a tuned-config file"),
    (b'{"format": "replayssm_cute-tuned-v1", "entries": {}}', "expected a tuned-config file"),
])
def test_bad_files_are_named(tmp_path, text, message):
    path = tmp_path / "t.json"
    path.write_bytes(text)
    with pytest.raises(ValueError, match=message) as e:
        tuning.read_entries(path)
    assert str(path) in str(e.value)
    with pytest.raises(ValueError, match=message):  # nor is one merged into
        tuning.write_entries(path, [_entry()])


def _config(rows, warps, ctas):
    return {"config": {"rows_per_cta": rows, "num_warps": warps, "min_ctas_per_sm": ctas}}


@pytest.mark.parametrize("change,message", [
    (dict(batch=100), "'batch': expected a power of two up to 1024"),
    (dict(batch="64"), "'batch': expected an int"),
    (dict(kernel="rwkv_decode"), "'kernel': expected one of"),
    (dict(mode="conventional"), "'mode': mamba2_decode at window 16 is 'standard'"),
    (dict(shape={"nheads": 128}), "'shape': expected integer nheads, headdim, dstate, ngroups"),
    (dict(config={"rows_per_cta": 32.0}), "'config': expected an object of integer launch parameters"),
    (dict(device=None), "'device': expected a string"),
    # launch fields no kernel takes: each decode at that bucket would fail
    (_config(0, 0, 0), "'config': rows_per_cta 0: expected at least 1"),
    (_config(64, 64, 0), r"'config': num_warps 64: expected 1\.\.32"),
    (_config(32, 2, -3), "'config': min_ctas_per_sm -3: expected 0"),
    (_config(64, 16, 8), "'config': min_ctas_per_sm 8: 8 CTAs of 16 warps are 4096 threads"),
    (dict(config={"rows_per_cta": 32, "num_warps": 2}), "'config': expected integer rows_per_cta, num_warps, "
                                                         "min_ctas_per_sm"),
])
def test_bad_entries_are_ignored_one_by_one_naming_file_index_and_field(tmp_path, change, message):
    path = tmp_path / "t.json"
    good = [_entry(64), _entry(256)]
    path.write_text(json.dumps({"format": tuning.FORMAT, "entries": [good[0], {**_entry(), **change}, good[1]]}))
    with pytest.warns(RuntimeWarning, match=f"ignoring entry 1 of {path}: entry field {message}"):
        assert tuning.read_entries(path) == good


def test_lookup_keeps_the_good_entries_of_a_file_with_bad_ones():
    tuning.user_file().write_text(json.dumps({"format": tuning.FORMAT, "entries": [
        "not an entry", {**_entry(64), **_config(64, 64, 0)}, _entry(256, (64, 4, 0))]}))
    with pytest.warns(RuntimeWarning) as record:
        assert _tuned_fields("mamba2_decode", _shape(), 0, 256)["rows_per_cta"] == 64
    assert _tuned_fields("mamba2_decode", _shape(), 0, 64)["num_warps"] == 4  # bucket 256's, not entry 1's
    assert [str(w.message).split(":")[1] for w in record] == [f" ignoring entry {i} of {tuning.user_file()}"
                                                                for i in (0, 1)]


def test_merging_into_a_file_drops_its_bad_entries_with_a_warning(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": tuning.FORMAT, "entries": [_entry(1), {**_entry(64), **_config(0, 0, 0)}]}))
    with pytest.warns(RuntimeWarning, match="ignoring entry 1"):
        assert tuning.write_entries(path, [_entry(256)]) == [_entry(1), _entry(256)]
    assert tuning.read_entries(path) == [_entry(1), _entry(256)]
    with pytest.raises(ValueError, match="'config': rows_per_cta 0"):  # the caller's own entries must be good
        tuning.write_entries(path, [{**_entry(64), **_config(0, 0, 0)}])


def test_shipped_h200_file_is_valid_and_packaged():
    shipped = Path(tuning.__file__).parent / "tuned" / "h200.json"
    for entry in tuning.read_entries(shipped):
        assert entry["device"] == "NVIDIA H200" and entry["arch"] == "sm_90a"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"tuned/*.json"' in pyproject


# --------------------------------------------------------------------------------- the lookup


@pytest.mark.parametrize("batch,bucket", [(1, 1), (2, 2), (3, 4), (16, 16), (17, 32), (100, 128), (1024, 1024),
                                          (5000, 1024)])
def test_batch_bucket(batch, bucket):
    assert tuning.batch_bucket(batch) == bucket


@pytest.mark.parametrize("tuned,bucket,nearest", [
    ([64], 64, 64), ([1, 64, 256], 128, 64),  # tie between 64 and 256: the smaller
    ([1, 64, 256], 512, 256), ([1, 64, 256], 16, 64), ([1, 64, 256], 4, 1),
    ([1, 64, 256], 8, None),  # 8x from both
    ([256], 1024, 256), ([256], 32, None), ([], 64, None),
])
def test_nearest_bucket(tuned, bucket, nearest):
    assert tuning.nearest_bucket(tuned, bucket) == nearest


def _write_user(entries):
    tuning.write_entries(tuning.user_file(), entries)
    launch.reload()


def test_lookup_nearest_bucket_and_fallback():
    _write_user([_entry(1, (16, 2, 0)), _entry(64, (32, 2, 0)), _entry(256, (64, 4, 0))])
    shape = _shape()
    get = lambda bucket: _tuned_fields("mamba2_decode", shape, 0, bucket)  # noqa: E731
    assert get(64) == {"rows_per_cta": 32, "num_warps": 2, "min_ctas_per_sm": 0}
    assert get(128)["rows_per_cta"] == 32 and get(1024)["rows_per_cta"] == 64 and get(2)["rows_per_cta"] == 16
    assert get(8) is None
    # other dtype, mode, drafts or dims: nothing tuned
    assert _tuned_fields("mamba2_decode", _shape(dtype=torch.float16), 0, 64) is None
    assert _tuned_fields("mamba2_decode", _shape(1), 0, 64) is None
    assert _tuned_fields("mamba2_verify", _shape(16, 20), 4, 64) is None
    assert _tuned_fields("mamba2_decode", _shape(model=get_model("nemotron-nano-4b")), 0, 64) is None


def test_lookup_needs_the_same_device_arch_and_versions(monkeypatch):
    _write_user([_entry(64)])
    shape = _shape()
    assert _tuned_fields("mamba2_decode", shape, 0, 64) is not None
    for other in (dict(device="NVIDIA H100 80GB HBM3"), dict(arch="sm_100a"), dict(package="0.2.0"),
                  dict(cutlass="4.9.0")):
        monkeypatch.setattr(tuning, "current_platform", lambda o=other: tuning.Platform(**{**PLATFORM.__dict__, **o}))
        assert _tuned_fields("mamba2_decode", shape, 0, 64) is None, other
    monkeypatch.setattr(tuning, "current_platform", lambda: None)  # no GPU
    assert _tuned_fields("mamba2_decode", shape, 0, 64) is None


def test_user_file_overrides_shipped_entries(tmp_path):
    tuning.write_entries(tuning.SHIPPED_DIR / "h200.json", [_entry(64, (16, 4, 0)), _entry(256, (16, 4, 0))])
    _write_user([_entry(64, (32, 2, 0))])
    assert tuning.source_files() == [tuning.SHIPPED_DIR / "h200.json", tuning.user_file()]
    assert _tuned_fields("mamba2_decode", _shape(), 0, 64)["rows_per_cta"] == 32
    assert _tuned_fields("mamba2_decode", _shape(), 0, 256)["rows_per_cta"] == 16


def test_env_var_turns_tuned_configs_off(monkeypatch):
    _write_user([_entry(64)])
    monkeypatch.setenv(tuning.ENV_DISABLE, "0")
    assert _tuned_fields("mamba2_decode", _shape(), 0, 64) is None
    monkeypatch.setenv(tuning.ENV_DISABLE, "1")
    assert _tuned_fields("mamba2_decode", _shape(), 0, 64) is not None


def test_default_user_file_is_in_the_compile_cache_folder(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning.ENV_USER_FILE)
    assert tuning.user_file() == tmp_path / "cache" / "tuned.json"


@pytest.mark.parametrize("text", [b"{ not json", b"[" * 100_000])
def test_unreadable_user_file_is_ignored_with_a_warning(text):
    tuning.user_file().write_bytes(text)
    with pytest.warns(RuntimeWarning, match="ignoring .*user.json"):
        assert _tuned_fields("mamba2_decode", _shape(), 0, 64) is None


@pytest.fixture
def compiled(monkeypatch):
    """Configs that the launcher compiles (nothing is compiled)."""
    seen = []
    monkeypatch.setattr(launch, "compiled", lambda kernel, shape, cfg, num_drafts=0: seen.append(cfg) or object())
    return seen


def test_decode_takes_the_tuned_config_of_the_nearest_bucket(compiled):
    cache = Mamba2Cache(2, SUPER.nheads, SUPER.headdim, SUPER.dstate, SUPER.ngroups, window=16, device="meta")
    kernel = lambda batch, config=None: _mamba2_decode(cache, batch, config)  # noqa: E731
    kernel(50)
    assert compiled[-1] == mdefaults.default_mamba2_config(SUPER.headdim, 64, 16)  # nothing tuned yet
    _write_user([_entry(64, (32, 2, 0)), _entry(1024, (64, 8, 0))])
    kernel(50)
    assert compiled[-1] == Mamba2Config(32, 2, 0)
    kernel(200)  # bucket 256: 64 and 1024 both 2 octaves away, the smaller wins
    assert compiled[-1] == Mamba2Config(32, 2, 0)
    kernel(600)  # bucket 1024
    assert compiled[-1] == Mamba2Config(64, 8, 0)
    n = len(compiled)
    kernel(33)  # memoised per bucket: no new lookup or compile
    kernel(600)
    assert len(compiled) == n
    kernel(3)  # bucket 4: nothing within a factor 4
    assert compiled[-1] == mdefaults.default_mamba2_config(SUPER.headdim, 4, 16)
    kernel(50, Mamba2Config(16, 4))  # an explicit config wins
    assert compiled[-1] == Mamba2Config(16, 4)


def test_tuned_config_the_shape_cannot_take_falls_back_to_the_default(compiled):
    cache = Mamba2Cache(2, SUPER.nheads, SUPER.headdim, SUPER.dstate, SUPER.ngroups, window=16, device="meta")
    _write_user([_entry(64, (48, 4, 0)), _entry(256, (32, 2, 0))])  # 48 does not divide headdim 64
    tuning.write_entries(tuning.user_file(), [{**_entry(256), "config": {"rows_per_cta": 32, "num_warps": 2,
                                                                       "min_ctas_per_sm": 0, "stale_field": 1}}])
    launch.reload()
    for batch in (64, 256):
        _mamba2_decode(cache, batch)
        assert compiled[-1] == mdefaults.default_mamba2_config(SUPER.headdim, batch, 16)


def test_tuned_entries_no_kernel_takes_leave_decode_on_the_default(compiled):
    """A tuned file entry whose launch fields no kernel takes (which the config check once met
    with ZeroDivisionError, or passed and compiled) is ignored: decode at its bucket takes the
    default, with a warning naming the entry."""
    cache = Mamba2Cache(2, SUPER.nheads, SUPER.headdim, SUPER.dstate, SUPER.ngroups, window=16, device="meta")
    tuning.user_file().write_text(json.dumps({"format": tuning.FORMAT, "entries": [
        {**_entry(64), **_config(0, 0, 0)}, {**_entry(256), **_config(64, 64, 0)},
        {**_entry(1024), **_config(32, 2, -3)}]}))
    with pytest.warns(RuntimeWarning) as record:
        _mamba2_decode(cache, 50)
    messages = [str(w.message) for w in record]
    assert len(messages) == 3
    for i, field in enumerate(("rows_per_cta 0", "num_warps 64", "min_ctas_per_sm -3")):
        assert f"ignoring entry {i} of {tuning.user_file()}" in messages[i] and field in messages[i]
    assert compiled[-1] == mdefaults.default_mamba2_config(SUPER.headdim, 64, 16)
    for batch, bucket in ((200, 256), (600, 1024)):
        _mamba2_decode(cache, batch)
        assert compiled[-1] == mdefaults.default_mamba2_config(SUPER.headdim, bucket, 16)


def test_tuned_config_whose_check_raises_falls_back_with_a_warning(compiled, monkeypatch):
    """Whatever a kernel check does with a tuned file's values, decode takes the default."""
    cache = Mamba2Cache(2, SUPER.nheads, SUPER.headdim, SUPER.dstate, SUPER.ngroups, window=16, device="meta")
    _write_user([_entry(64, (32, 2, 0))])
    check = Mamba2Config.check

    def raising_check(self, shape):
        if self == Mamba2Config(32, 2, 0):
            raise ZeroDivisionError("integer modulo by zero")
        return check(self, shape)

    monkeypatch.setattr(Mamba2Config, "check", raising_check)
    with pytest.warns(RuntimeWarning, match=r"ignoring the tuned config .*32.*: ZeroDivisionError"):
        _mamba2_decode(cache, 64)
    assert compiled[-1] == mdefaults.default_mamba2_config(SUPER.headdim, 64, 16)


def test_gdn_decode_and_verify_take_tuned_configs(compiled):
    m = get_model("qwen3.5-4b")
    cache = GDNCache(2, m.nheads, m.headdim, m.dstate, m.ngroups, window=16, max_draft=4, device="meta")
    shape = GDNLayer.shape(cache, GDN_STATIC)
    decode = tuning.tune_key("gdn_decode", shape, 0, PLATFORM).fields(64)
    verify = tuning.tune_key("gdn_verify", shape, 4, PLATFORM).fields(64)
    _write_user([{**decode, "config": {"rows_per_cta": 16, "num_warps": 2, "min_ctas_per_sm": 4}},
                 {**verify, "config": {"rows_per_cta": 32, "num_warps": 2, "min_ctas_per_sm": 0}}])
    launch.launcher(GDNLayer.decode_kernel, shape, 0, 64)
    assert compiled[-1] == GDNConfig(16, 2, 4)
    launch.launcher(GDNLayer.verify_kernel, shape, 4, 64)
    assert compiled[-1] == GDNConfig(32, 2, 0)
    launch.launcher(GDNLayer.verify_kernel, shape, 2, 64)
    assert compiled[-1] == gdefaults.default_gdn_verify_config(m.headdim, 64)  # T = 2 not tuned


# ------------------------------------------------------------------------------------- the CLI


def _cli_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        tune.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv,message", [
    ([], "one of the arguments --model --shape is required"),
    (["--model", "nemotron-super", "--shape", "mamba2:4,16,32,1"], "not allowed with"),
    (["--model", "nemotron-mega"], "--model: unknown model 'nemotron-mega'; known:"),
    (["--model", ","], "--model: give at least one model name"),
    (["--shape", "rwkv:1,2,3,4"], "--shape: expected mamba2:H,P,N,G or gdn:HV,V,K,H"),
    (["--shape", "mamba2:4,16,32"], "--shape: mamba2 takes four dims >= 1"),
    (["--shape", "gdn:4,16,x,2"], "--shape: gdn takes four dims >= 1, HV,V,K,H"),
    (["--model", "nemotron-super", "--batch", "100"], "--batch: 100 is not a batch bucket"),
    (["--model", "nemotron-super", "--batch", "2048"], "--batch: 2048 is not a batch bucket"),
    (["--model", "nemotron-super", "--batch", "1,sixty"], "--batch: expected comma-separated integers"),
    (["--model", "nemotron-super", "--modes", "standard,spec"], "--modes: unknown mode 'spec'"),
    (["--model", "nemotron-super", "--modes", ","], "--modes: give at least one of"),
    (["--model", "nemotron-super", "--modes", "verify"], "--modes verify: give the draft counts with --drafts"),
    (["--model", "nemotron-super", "--drafts", "4"], "--drafts: only used by the verify mode"),
    (["--model", "nemotron-super", "--modes", "verify", "--drafts", "17"], "--drafts: draft count 17 outside"),
    (["--model", "nemotron-super", "--modes", "verify", "--window", "8", "--drafts", "12"],
     "--drafts: draft count 12 outside 1..min(16, window 8)"),
    (["--model", "nemotron-super", "--modes", "verify", "--window", "24", "--drafts", "12"],
     "with window + T <= 32"),
    (["--model", "nemotron-super", "--dtypes", "fp32"], "--dtypes: unknown dtype 'fp32'; use bf16, fp16"),
    (["--model", "nemotron-super", "--window", "1"], "--window must be in 2..32"),
    (["--model", "nemotron-super", "--replays", "0"], "--replays must be >= 1"),
    (["--model", "nemotron-super", "--workers", "0"], "--workers must be >= 1"),
    (["--model", "nemotron-super", "--read-copies", "fp4"], "--read-copies: unknown read copy 'fp4'"),
    (["--model", "nemotron-super", "--read-copies", "fp8", "--modes", "conventional"],
     "--read-copies: tunes the standard and verify modes"),
    (["--model", "nemotron-super", "--read-copies-only"], "--read-copies-only: needs --read-copies"),
])
def test_cli_argument_errors(capsys, argv, message):
    assert message in _cli_error(capsys, argv)


def test_cli_targets():
    args = tune.parse_args(["--model", "nemotron-super,qwen3.5-4b", "--modes", "verify,conventional",
                            "--drafts", "8,4", "--window", "12", "--dtypes", "bf16,fp16", "--batch", "256,1,64"])
    assert args.batches == [1, 64, 256]
    labels = [t.label for t in args.targets]
    assert labels[:3] == ["nemotron-super conventional bf16", "nemotron-super verify L12 T4 bf16",
                          "nemotron-super verify L12 T8 bf16"]
    assert len(labels) == 2 * 2 * 3 and len(set(labels)) == len(labels)
    args = tune.parse_args(["--shape", "gdn:8,64,128,2"])
    assert args.batches == list(tuning.BATCH_BUCKETS)
    assert [(t.model, t.mode, t.window) for t in args.targets] == [
        (ModelSpec("gdn:8,64,128,2", "gdn", 8, 64, 128, 2, 1), "conventional", 1),
        (ModelSpec("gdn:8,64,128,2", "gdn", 8, 64, 128, 2, 1), "standard", 16)]


def test_cli_read_copies_only_leaves_out_the_fp32_read_kernels():
    argv = ["--model", "nemotron-super", "--modes", "conventional,standard,verify", "--drafts", "4",
            "--read-copies", "fp8"]
    every = tune.parse_args(argv).targets
    only = tune.parse_args(argv + ["--read-copies-only"]).targets
    assert [t.label for t in only] == [t.label for t in every if t.read_copy]
    assert [t.label for t in only] == ["nemotron-super standard L16 read fp8 bf16",
                                       "nemotron-super verify L16 T4 read fp8 bf16"]


def test_cli_read_copy_targets_are_the_kernels_decode_builds():
    """--read-copies adds standard- and verify-mode targets whose shape, default config and
    candidates are those of a cache with that read copy (GDN: keeping v and beta, re-deriving at a
    flush)."""
    args = tune.parse_args(["--model", "nemotron-super,qwen3.5-122b", "--modes", "standard,verify", "--drafts", "4",
                            "--read-copies", "fp8,nvfp4", "--batch", "256"])
    verify = [t for t in args.targets if t.read_copy and t.mode == "verify"]
    assert [t.label for t in verify] == [f"{m} verify L16 T4 read {r} bf16" for m in ("nemotron-super", "qwen3.5-122b")
                                         for r in ("fp8", "nvfp4")]
    for t in verify:
        assert t.shape().read_copy == t.read_copy and t.shape().capacity == 20
        default = t.default_config(256)
        assert t.check(default) is None and default in t.candidates()
        if t.read_copy == "nvfp4":
            assert default.rows_per_cta == t.model.headdim
            assert t.default_config(1).rows_per_cta == t.model.headdim  # at any batch
        assert t.ideal_bytes(256) < _target(t.model, "verify").ideal_bytes(256)
    extra = [t for t in args.targets if t.read_copy and t.mode == "standard"]
    assert [t.label for t in extra] == [f"{m} standard L16 read {r} bf16" for m in ("nemotron-super", "qwen3.5-122b")
                                        for r in ("fp8", "nvfp4")]
    for t in extra:
        cache_cls = Mamba2Cache if t.model.layer == "mamba2" else GDNCache
        dims = ((t.model.nheads, t.model.headdim, t.model.dstate, t.model.ngroups))
        cache = cache_cls(1, *dims, window=16, device="meta", read_copy=t.read_copy)
        layer = Mamba2Layer if t.model.layer == "mamba2" else GDNLayer
        assert t.shape() == layer.shape(cache, layer.engine_inputs(torch.bfloat16)), t.label
        default = t.default_config(256)
        assert t.check(default) is None and default in t.candidates()
        if t.read_copy == "nvfp4":
            assert default.rows_per_cta == t.model.headdim  # a CTA per head writes the whole-state scale
        assert t.ideal_bytes(256) < _target(t.model, "standard", "bf16").ideal_bytes(256)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_no_gpu_message(capsys):
    assert tune.main(["--model", "nemotron-super", "--batch", "64"]) == 1
    captured = capsys.readouterr()
    assert "no CUDA GPU found" in captured.err and "--compile-only" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert not tuning.user_file().exists()


def _run_cli(args, **env):
    full = dict(os.environ, CUDA_VISIBLE_DEVICES="", **env)
    full.pop("CUTE_DSL_ARCH", None)
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return subprocess.run([sys.executable, "-m", "replayssm_cute.tune", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=300)


def test_cli_without_gpu_exits_non_zero_without_traceback():
    proc = _run_cli(["--model", "nemotron-super"])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "no CUDA GPU found" in proc.stderr and proc.stdout == ""
    proc = _run_cli(["--model", "nemotron-super", "--compile-only"])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and "CUTE_DSL_ARCH" in proc.stderr
    proc = _run_cli(["--model", "nemotron-super", "--batch", "3"])
    assert proc.returncode == 2 and "--batch: 3 is not a batch bucket" in proc.stderr


def test_compile_only_builds_the_candidates(monkeypatch, tmp_path, capsys):
    """A tiny space (two warp counts, no register cap) through the worker processes: every
    candidate of both modes lands in the compile cache, nothing is tuned or written."""
    monkeypatch.setattr(space, "TUNE_NUM_WARPS", (1, 2))
    monkeypatch.setattr(space, "TUNE_MIN_CTAS_PER_SM", (0,))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    argv = ["--shape", "mamba2:2,16,32,1", "--modes", "conventional,standard", "--window", "4", "--batch", "1,64",
            "--compile-only", "--workers", "2"]
    assert tune.main(argv) == 0
    out = capsys.readouterr().out
    # rows 8 and 16 over one or two warps, and the default (16 rows, 4 warps), for the window-1
    # and the window-4 kernel
    assert "2 kernels x 2 batch buckets, 10 candidate launch configs for sm_90a" in out
    assert "10 kernels in the compile cache" in out
    assert "dropped" not in out and "spills" not in out  # every kernel compiled, ptxas reported no spills
    assert len(list((tmp_path / "cache").glob("mamba2_decode-*.o"))) == 10
    assert not tuning.user_file().exists()
    # again: all loaded from the cache, so ptxas did not run
    assert tune.main(argv) == 0
    assert "10 candidates were in the compile cache already" in capsys.readouterr().out


def _tune_in_this_process(target, batches, candidates, replays, rotation_bytes, progress):
    """tune_target without its timing process, so that the tests' monkeypatches hold."""
    return (tune.tune_one(target, b, candidates, replays, rotation_bytes, progress) for b in batches)


def test_tuning_flow_on_a_cpu_pool(monkeypatch, capsys):
    """main() from the candidates to the file and the lookup, without a GPU: CPU pools (decode,
    verify and commit run the float64 reference, so every config gives the same outputs but one
    made to differ), nothing compiled, a made-up timing in which fewer warps are faster."""
    from replayssm_cute.perf import DecodePool

    monkeypatch.setattr(tune, "_target_arch", lambda compile_only: "sm_90a")
    monkeypatch.setattr(tune, "compile_candidates", lambda jobs, workers, arch: ({}, {}, 0))
    monkeypatch.setattr(tune, "tune_target", _tune_in_this_process)
    monkeypatch.setattr(tune.TuneTarget, "pool", lambda self, batch, rotation_bytes: DecodePool(
        self.model, batch, self.window, drafts=self.num_drafts, device="cpu", rotation_bytes=0,
        dtype=self.torch_dtype()))
    monkeypatch.setattr(tune, "time_config", lambda target, pool, config, replays: (
        10.0 + config.num_warps + config.min_ctas_per_sm / 10 - config.rows_per_cta / 100))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    run = tune.OutputCheck.run
    wrong = Mamba2Config(8, 2, 0)
    monkeypatch.setattr(tune.OutputCheck, "run", lambda self, config: [
        t + 1 if config == wrong and t.is_floating_point() else t for t in run(self, config)])

    argv = ["--shape", "mamba2:2,16,32,1", "--modes", "standard,verify", "--window", "4", "--drafts", "2",
            "--batch", "2"]
    assert tune.main(argv) == 0
    out = capsys.readouterr().out
    assert "best config" in out and "TB/s" in out and "speedup" in out
    assert "mamba2:2,16,32,1 standard L4 bf16 b=2 rows8_warps2: rejected, tensor 0: max |difference|" in out
    assert f"merged into {tuning.user_file()}" in out

    standard, verify = sorted(tuning.read_entries(tuning.user_file()), key=lambda e: e["kernel"])
    assert (standard["mode"], standard["batch"], standard["num_drafts"]) == ("standard", 2, 0)
    assert standard["config"] == {"rows_per_cta": 16, "num_warps": 1, "min_ctas_per_sm": 0}
    assert standard["default_config"] == {"rows_per_cta": 16, "num_warps": 4, "min_ctas_per_sm": 4}
    assert standard["time_us"] == pytest.approx(10.84) and standard["default_time_us"] == pytest.approx(14.24)
    assert standard["speedup"] == pytest.approx(14.24 / 10.84, rel=1e-3) and standard["rejected"] == 1
    assert standard["tbps"] > 0 and standard["model"] == "mamba2:2,16,32,1"
    assert (verify["kernel"], verify["mode"], verify["num_drafts"]) == ("mamba2_verify", "verify", 2)
    assert verify["config"]["rows_per_cta"] // verify["config"]["num_warps"] == 16

    # the next decode of that shape at a batch in the bucket takes the winner (main() reloaded)
    seen = []
    monkeypatch.setattr(launch, "compiled", lambda kernel, shape, cfg, num_drafts=0: seen.append(cfg) or object())
    cache = Mamba2Cache(4, 2, 16, 32, 1, window=4, device="meta")
    _mamba2_decode(cache, 2)
    assert seen == [Mamba2Config(16, 1, 0)]


def test_decode_timing_warms_up_with_one_step_and_times_the_whole_window(monkeypatch):
    """time_config of a decode mode captures the pool's whole window (every set at every ring
    position) but warms up with a single decode step: a whole window's thousands of small
    launches at batch 1 would cost seconds of host time per candidate."""
    from replayssm_cute import perf
    from replayssm_cute.perf import DecodePool

    target = tune.TuneTarget(ModelSpec("mamba2:2,16,32,1", "mamba2", 2, 16, 32, 1, 1), "standard", 4, 0, "bf16", "fp8")
    pool = DecodePool(target.model, 2, 4, device="cpu", rotation_bytes=1 << 16, read_copy="fp8")
    assert pool.nsets > 2
    steps = []
    monkeypatch.setattr(pool, "step", lambda ids, config=None: steps.append(int(ids[0])))
    seen = {}

    def fake_time_graph(fn, launches, replays=15, warmup=None):
        warmup()
        seen["warmup"], seen["launches"] = list(steps), launches
        steps.clear()
        fn()
        seen["window"] = list(steps)
        return 1.0

    monkeypatch.setattr(perf, "time_graph", fake_time_graph)
    assert tune.time_config(target, pool, None, replays=3) == 1.0
    assert seen["warmup"] == [0]
    assert seen["launches"] == len(seen["window"]) == 4 * pool.nsets
    assert sorted(seen["window"]) == sorted(int(ids[0]) for ids in pool.sets for _ in range(4))


def test_a_kernel_whose_default_is_dropped_does_not_stop_the_others(monkeypatch, capsys):
    """One kernel's default fails to compile (dropped): that kernel is skipped with a message, the
    others are tuned and written, and the exit status says not everything was tuned."""
    from replayssm_cute.perf import DecodePool

    def fails_the_verify_default(jobs, workers, arch):
        return {(t, c): "ValueError: no registers left" for t, c in jobs
                if t.mode == "verify" and c == t.default_config(2)}, {}, 0

    monkeypatch.setattr(tune, "_target_arch", lambda compile_only: "sm_90a")
    monkeypatch.setattr(tune, "compile_candidates", fails_the_verify_default)
    monkeypatch.setattr(tune, "tune_target", _tune_in_this_process)
    monkeypatch.setattr(tune.TuneTarget, "pool", lambda self, batch, rotation_bytes: DecodePool(
        self.model, batch, self.window, drafts=self.num_drafts, device="cpu", rotation_bytes=0,
        dtype=self.torch_dtype()))
    monkeypatch.setattr(tune, "time_config", lambda target, pool, config, replays: 10.0 + config.num_warps)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    argv = ["--shape", "mamba2:2,16,32,1", "--modes", "standard,verify", "--window", "4", "--drafts", "2",
            "--batch", "2"]
    assert tune.main(argv) == 1
    err = capsys.readouterr().err
    assert "verify L4 T2 bf16: not tuned: its default config is dropped" in err and "no registers left" in err
    assert [e["mode"] for e in tuning.read_entries(tuning.user_file())] == ["standard"]


def test_spilling_candidates_are_listed_and_timed_like_the_others(monkeypatch, capsys):
    """A candidate that spills, and a default that spills, stay in the race: each is listed with
    its spill bytes, and the spilling candidate that times fastest is the one written."""
    from replayssm_cute.perf import DecodePool

    def spills_the_default_and_the_one_warp_configs(jobs, workers, arch):
        return {}, {(t, c): (8, 8, 4) for t, c in jobs if c.num_warps == 1 or c == t.default_config(2)}, 0

    monkeypatch.setattr(tune, "_target_arch", lambda compile_only: "sm_90a")
    monkeypatch.setattr(tune, "compile_candidates", spills_the_default_and_the_one_warp_configs)
    monkeypatch.setattr(tune, "tune_target", _tune_in_this_process)
    monkeypatch.setattr(tune.TuneTarget, "pool", lambda self, batch, rotation_bytes: DecodePool(
        self.model, batch, self.window, device="cpu", rotation_bytes=0, dtype=self.torch_dtype()))
    timed = set()

    def time_config(target, pool, config, replays):
        timed.add(config)
        return 10.0 + config.num_warps + config.rows_per_cta / 100

    monkeypatch.setattr(tune, "time_config", time_config)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    argv = ["--shape", "mamba2:2,16,32,1", "--modes", "standard", "--window", "4", "--batch", "2"]
    assert tune.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("spills 8 bytes (stack frame 8 bytes); timed like the others") >= 2
    (entry,) = tuning.read_entries(tuning.user_file())
    assert entry["config"]["num_warps"] == 1  # a spilling config won, as it timed fastest
    assert any(c.num_warps == 1 for c in timed) and any(c.num_warps > 1 for c in timed)


def test_tuning_a_read_copy_kernel_on_a_cpu_pool(monkeypatch, capsys):
    """--read-copies end to end without a GPU (as above): the read-copy kernel is tuned apart,
    its entry keyed by the read copy, and decode on such a cache picks it up; a plain cache does not."""
    from replayssm_cute.perf import DecodePool

    monkeypatch.setattr(tune, "_target_arch", lambda compile_only: "sm_90a")
    monkeypatch.setattr(tune, "compile_candidates", lambda jobs, workers, arch: ({}, {}, 0))
    monkeypatch.setattr(tune, "tune_target", _tune_in_this_process)
    monkeypatch.setattr(tune.TuneTarget, "pool", lambda self, batch, rotation_bytes: DecodePool(
        self.model, batch, self.window, device="cpu", rotation_bytes=0, dtype=self.torch_dtype(),
        read_copy=self.read_copy))
    monkeypatch.setattr(tune, "time_config", lambda target, pool, config, replays: (
        10.0 + config.num_warps - config.rows_per_cta / 100))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    argv = ["--shape", "mamba2:2,16,32,1", "--modes", "standard", "--read-copies", "fp8", "--window", "4",
            "--batch", "2"]
    assert tune.main(argv) == 0
    assert "standard L4 read fp8 bf16" in capsys.readouterr().out
    entries = tuning.read_entries(tuning.user_file())
    assert len(entries) == 2 and sum("fp8" in json.dumps(e) for e in entries) == 1

    seen = []
    monkeypatch.setattr(launch, "compiled", lambda kernel, shape, cfg, num_drafts=0: seen.append((shape.read_copy, cfg)) or object())
    for read in ("fp8", None):
        cache = Mamba2Cache(4, 2, 16, 32, 1, window=4, device="meta", read_copy=read)
        _mamba2_decode(cache, 2)
    assert seen == [("fp8", Mamba2Config(16, 1, 0)), (None, Mamba2Config(16, 1, 0))]


def test_out_file_that_cannot_take_the_winners_fails_before_tuning(monkeypatch, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    monkeypatch.setattr(tune, "_target_arch", lambda compile_only: "sm_90a")
    monkeypatch.setattr(tune, "compile_candidates", lambda *a: pytest.fail("compiled before checking --out"))
    assert tune.main(["--shape", "mamba2:2,16,32,1", "--batch", "2", "--out", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"--out: {bad}: expected a tuned-config file" in err and "Traceback" not in err


# --------------------------------------------------------------------------- spills and faults

# What CuTe DSL prints with CUTE_DSL_COMPILER_OPT="remarks{ptx}" (shortened): a kernel without
# spills, and one with, whose resource line wraps.
CLEAN_REPORT = ("\x1b[96mremark[ptxas info]:\x1b[0m ptxas output: ptxas info    : 0 bytes gmem\n"
                "ptxas info    : Function properties for kernel_cutlass_kernel_Mamba2Decode_0\n"
                "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
                "ptxas info    : Used 36 registers, used 1 barriers\n\n\n"
                "  --> kernels/mamba2/decode.py:176:0\n"
                "   |\n"
                "> 176 |     @cute.jit\n")
SPILL_REPORT = ("\x1b[96mremark[ptxas]:\x1b[0m ptxas detected register spills\n\n"
                "  --> kernels/mamba2/decode.py:267:15\n"
                "  \x1b[96mremark:\x1b[0m Spilled values are placed in local memory.\n\n"
                "          ptxas output:\n"
                "          ptxas         .     24 bytes stack frame, 20 bytes spill stores, 24 bytes\n"
                "          spill loads\n"
                "          ptxas info    : Used 64 registers, used 1 barriers\n"
                "  \x1b[92msuggestion:\x1b[0m reduce live ranges\n")
WARNING = "kernels/mamba2/decode.py:3: UserWarning: something\n  warnings.warn(w)\n"


def test_ptxas_report_finds_the_spills_and_leaves_the_rest():
    assert tune.ptxas_report(CLEAN_REPORT) == ((0, 0, 0), "")
    assert tune.ptxas_report(WARNING + SPILL_REPORT + CLEAN_REPORT + "done\n") == ((24, 20, 24), WARNING + "done\n")
    assert tune.ptxas_report(WARNING) == (None, WARNING)  # nothing compiled


def test_compile_job_reports_spills_drops_only_failed_compiles_and_restores_stderr(capfd):
    """The report comes on file descriptor 2: a kernel that spills is kept with its report, one
    without a report (loaded from the compile cache) is kept with none, one that fails to compile
    is dropped; whatever else was written there shows, and fd 2 is the same file afterwards, after
    a failed compile too."""
    def job(report, error=None):
        def compile(config):
            os.write(2, (WARNING + report).encode())
            if error is not None:
                raise error
        return SimpleNamespace(compile=compile), Mamba2Config()

    before = os.fstat(2)
    assert tune._compile_job(job(SPILL_REPORT)) == (None, (24, 20, 24))
    assert tune._compile_job(job(CLEAN_REPORT)) == (None, (0, 0, 0))
    assert tune._compile_job(job("")) == (None, None)
    assert tune._compile_job(job("", ValueError("bad tile"))) == ("ValueError: bad tile", None)
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    os.write(2, b"still stderr\n")
    err = capfd.readouterr().err
    assert err.count("UserWarning: something") == 4 and err.endswith("still stderr\n") and "ptxas" not in err


@dataclass(frozen=True)
class _Target:
    """What tune_target asks of a target: a label and the default config of a batch."""

    label: str = "fake"

    def default_config(self, batch):
        return DEFAULT


DEFAULT, WARPS1, WARPS2, ROWS8 = (Mamba2Config(16, 4, 0), Mamba2Config(16, 1, 0), Mamba2Config(16, 2, 0),
                                  Mamba2Config(8, 1, 0))
CONFIGS = [DEFAULT, WARPS1, WARPS2, ROWS8]


def _fake_timing(faults, send, target, batches, candidates, replays, rotation_bytes):
    """tune_target's `work` without a GPU: at each batch the default then the other candidates,
    each named before it runs and a progress step after. At a config of `faults` ({config or
    (batch, config): how}) the process dies ("exit"), or raises a launch's CUDA error ("cuda") or
    another error ("bug")."""
    for b in batches:
        default = target.default_config(b)
        configs = [default] + [c for c in candidates if c != default]
        for c in configs:
            send(("run", (b, c)))
            fault = faults.get((b, c), faults.get(c))
            if fault == "exit":
                os._exit(3)
            if fault in ("cuda", "bug"):
                raise (RuntimeError("CUDA Error Code: 715") if fault == "cuda" else ValueError("a bug"))
            send(("tick", b))
        send(("result", tune.TuneResult(target, b, configs[-1], 1.0, default, 2.0, len(configs), {})))


def _tune_target(faults, batches):
    progress = tune.Progress("tune", len(CONFIGS) * len(batches), io.StringIO())
    work = functools.partial(_fake_timing, faults)
    results = list(tune.tune_target(_Target(), batches, CONFIGS, 5, 0, progress, work))
    return results, progress.done


def test_a_faulting_candidate_is_dropped_and_a_fresh_process_goes_on(capsys):
    results, done = _tune_target({WARPS2: "exit", ROWS8: "cuda"}, [1, 2, 4])
    assert capsys.readouterr().out.splitlines() == [
        "  fake b=1 rows16_warps2: faulted (its process died, exit code 3), dropped",
        "  fake b=1 rows8_warps1: faulted (CUDA Error Code: 715), dropped"]
    assert [(r.batch, r.timed) for r in results] == [(1, 2), (2, 2), (4, 2)]  # the default and WARPS1
    assert done == 12  # each batch's progress steps shown once


def test_a_faulting_default_skips_its_batch(capsys):
    results, done = _tune_target({(2, DEFAULT): "cuda"}, [1, 2, 4])
    assert capsys.readouterr().out.splitlines() == [
        "  fake b=2 rows16_warps4: faulted (CUDA Error Code: 715), the default config: batch skipped"]
    assert [(r.batch, r.timed) for r in results] == [(1, 4), (4, 4)]
    assert done == 12


def test_restarts_are_bounded_and_other_errors_raised(monkeypatch, capsys):
    monkeypatch.setattr(tune, "MAX_RESTARTS", 1)
    results, done = _tune_target({WARPS1: "exit", WARPS2: "exit"}, [1, 2])
    assert capsys.readouterr().out.splitlines() == [
        "  fake b=1 rows16_warps1: faulted (its process died, exit code 3), dropped",
        "  fake b=1 rows16_warps2: faulted (its process died, exit code 3), dropped",
        "  fake: given up after 1 restarts on faults; batches 1, 2 not tuned"]
    assert results == [] and done == 8
    with pytest.raises(RuntimeError, match="fake: timing failed in its process:(.|\n)*ValueError: a bug"):
        _tune_target({WARPS1: "bug"}, [1])


@pytest.mark.parametrize("layer, mode, num_drafts", [("mamba2", "standard", 0), ("mamba2", "verify", 4),
                                                     ("gdn", "standard", 0), ("gdn", "verify", 4)])
def test_output_check_runs_every_config_from_the_same_state(monkeypatch, layer, mode, num_drafts):
    """Two runs of one config give identical outputs: each run restores the cache and its sequence
    table (committed counts, origins, SR counters), so the check compares configs, not starts."""
    from replayssm_cute.perf import DecodePool

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    model = ModelSpec("tiny", layer, 2, 16, 32, 1, 1) if layer == "mamba2" else ModelSpec("tiny", layer, 2, 16, 16, 1, 1)
    target = tune.TuneTarget(model, mode, 8, num_drafts, "bf16")
    monkeypatch.setattr(tune.TuneTarget, "pool", lambda self, batch, rotation_bytes: DecodePool(
        self.model, batch, self.window, drafts=self.num_drafts, device="cpu", rotation_bytes=0,
        dtype=self.torch_dtype()))
    check = tune.OutputCheck(target, 3)
    first, second = check.run(None), check.run(None)
    assert tune.mismatch(second, first) is None
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("name, mode, small, large", [
    ("nemotron-super", "standard", "pipe", "pipe"), ("nemotron-super", "conventional", "pipe", "pipe"),
    ("qwen3.5-122b", "standard", "tile", "pipe"), ("qwen3.5-122b", "conventional", "tile", "tile"),
    ("nemotron-super", "verify", "pipe", "pipe"), ("qwen3.5-122b", "verify", "pipe", "pipe"),
])
def test_each_bucket_is_tuned_on_the_kernel_decode_runs_there(monkeypatch, name, mode, small, large):
    """Where decode runs the pipelined kernel (sm_90a: Mamba-2 standard decode, GDN ReplaySSM from
    batch 8, the verify of both layers with T <= 4 drafts) the tuner times its space (stages, CTAs per SM, rows, groups) next to the tile
    kernels', and at each bucket only the candidates of the kernel the default runs there."""
    from replayssm_cute.layers.common import PIPELINED_ENV

    monkeypatch.delenv(PIPELINED_ENV, raising=False)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    launch.reload()
    t = _target(get_model(name), mode)
    candidates = t.candidates()
    pipelined = t.pipelined_candidates()
    assert bool(pipelined) == ("pipe" in (small, large))
    assert all(c in candidates and t.check(c) is None for c in pipelined)
    for batch, kind in ((1, small), (256, large)):
        picked = t.batch_candidates(candidates, batch)
        assert picked[0] == t.default_config(batch) and len(set(map(type, picked))) == 1
        assert hasattr(picked[0], "stages") == (kind == "pipe")
        # a choice at every bucket (GDN's verify: its whole-head stages fit two ways, one or two consumer groups)
        assert len(picked) == len(pipelined) if kind == "pipe" else len(picked) > 1
        assert len(picked) > 1
    # a class no bucket of the run defaults to is not compiled
    for batches, kind in (([1], small), ([256], large)):
        assert {hasattr(c, "stages") for c in t.candidates(batches=batches)} == {kind == "pipe"}
    assert any(hasattr(c, "stages") for c in candidates) == ("pipe" in (small, large))
    assert any(not hasattr(c, "stages") for c in candidates) == ("tile" in (small, large))
    monkeypatch.setenv(PIPELINED_ENV, "0")  # the tile kernels everywhere: their space only
    launch.reload()
    assert t.pipelined_candidates() == [] and all(not hasattr(c, "stages") for c in t.candidates())


def test_tile_and_pipelined_configs_sort_together():
    """GDN's defaults are tile configs at small buckets and pipelined ones above: the tuner sorts
    them (and its dropped candidates) in one list."""
    from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig

    configs = [GDNPipeConfig(3, 132, 128), GDNConfig(16, 4, 0), GDNPipeConfig(2, 132, 64), GDNConfig(8, 1, 2)]
    ordered = sorted(configs, key=tune.config_order)
    assert ordered == [GDNConfig(8, 1, 2), GDNConfig(16, 4, 0), GDNPipeConfig(2, 132, 64), GDNPipeConfig(3, 132, 128)]


def test_pipelined_entries_parse_and_replace_only_a_pipelined_default(monkeypatch):
    """A tuned pipelined config (a config with "stages") parses with its bounds checked, and a
    decode picks it only where its default is the pipelined kernel: a tile entry never replaces
    a pipelined default, nor a pipelined entry a tile one (REPLAYSSM_CUTE_PIPELINED=0)."""
    from replayssm_cute.kernels.mamba2.pipelined import Mamba2PipeConfig
    from replayssm_cute.layers.common import PIPELINED_ENV

    shape = _shape()
    default_pipe = Mamba2PipeConfig(2, 264)
    tuned = dataclasses.replace(default_pipe, stages=4, ctas=132, mma_fold=True)
    entry = {**_entry(batch=64), "config": dataclasses.asdict(tuned)}
    key, batch, fields = tuning.parse_entry(entry)
    assert batch == 64 and fields == dataclasses.asdict(tuned)
    for bad, words in [(dict(stages=1), "stages 1"), (dict(ctas=0), "ctas 0"), (dict(prefetch=3), "prefetch 3"),
                       (dict(mma_fold=1), "expected a bool"), (dict(stages=True), "expected an int")]:
        with pytest.raises(ValueError, match=words):
            tuning.parse_entry({**entry, "config": {**dataclasses.asdict(tuned), **bad}})
    with pytest.raises(ValueError, match="ctas: missing"):
        tuning.parse_entry({**entry, "config": {"stages": 4, "prefetch": 4}})
    tuning.write_entries(Path(os.environ[tuning.ENV_USER_FILE]), [entry, _entry(batch=256)])
    monkeypatch.delenv(PIPELINED_ENV, raising=False)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    launch.reload()
    kernel = Mamba2Layer.decode_kernel
    assert launch.picked_config(kernel, shape, 64) == (tuned, True)
    config, was_tuned = launch.picked_config(kernel, shape, 256)  # the tile entry: the pipelined default
    assert isinstance(config, Mamba2PipeConfig) and not was_tuned
    monkeypatch.setenv(PIPELINED_ENV, "0")
    launch.reload()
    assert not isinstance(launch.picked_config(kernel, shape, 64)[0], Mamba2PipeConfig)
    assert launch.picked_config(kernel, shape, 256)[1]  # the tile entry serves the tile kernel


def test_entry_without_a_later_field_keeps_the_value_it_was_tuned_with(monkeypatch):
    """A tuned entry written before a config field existed (GDN's pipelined entries before
    heads_per_item and mma_flush) takes that field's class default, the behaviour it was timed
    with, not the analytical default's value (a read copy's default takes two heads an item)."""
    from replayssm_cute.kernels.gdn.pipelined import GDNPipeConfig
    from replayssm_cute.layers.common import PIPELINED_ENV

    model = get_model("qwen3.5-122b")
    cache = GDNCache(1, model.nheads, model.headdim, model.dstate, model.ngroups, window=16, read_copy="fp8",
                     device="meta")
    shape = GDNLayer.shape(cache, GDN_STATIC)
    monkeypatch.delenv(PIPELINED_ENV, raising=False)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    kernel = GDNLayer.decode_kernel
    default, was_tuned = launch.picked_config(kernel, shape, 64)
    assert default.heads_per_item == 2 and default.prefetch == 2
    old = {"stages": 2, "ctas": 132, "rows_per_item": 128, "rows_per_warp": 16, "prefetch": 4, "consumer_groups": 1,
           "min_ctas_per_sm": 0, "mma_dots": False}  # as the shipped file held it before heads_per_item
    key = tuning.tune_key(kernel.name, shape, 0, PLATFORM)
    _write_user([{**key.fields(64), "config": old, "time_us": 80.0}])
    config, was_tuned = launch.picked_config(kernel, shape, 64)
    assert was_tuned and config == GDNPipeConfig(**old) and config.heads_per_item == 1 and config.mma_flush
