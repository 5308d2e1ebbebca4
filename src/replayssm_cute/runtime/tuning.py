"""Tuned launch configs: the cache file format, where the files live, and the lookup that decode
and verify make when the caller passes no ``config`` (through replayssm_cute.runtime.launch).

A tuned-config file is JSON (``python -m replayssm_cute.tune`` writes it)::

    {"format": "replayssm_cute-tuned-v1",
     "entries": [
       {"device": "NVIDIA H200", "arch": "sm_90a", "package": "0.1.0", "cutlass": "4.8.1",
        "kernel": "mamba2_decode",
        "shape": {"nheads": 128, "headdim": 64, "dstate": 128, "ngroups": 8},
        "dtype": "bf16", "mode": "standard", "window": 16, "num_drafts": 0, "state": "fp32", "batch": 64,
        "config": {"rows_per_cta": 64, "num_warps": 4, "min_ctas_per_sm": 0},   # a tile kernel's
        # or a pipelined decode's: {"stages": 4, "ctas": 264, "prefetch": 4, ...} (its config class's fields)
        "time_us": 87.4, "tbps": 3.41, "default_config": {...}, "default_time_us": 88.1,
        "speedup": 1.008, "candidates": 41, "model": "nemotron-super", "tuned_at": "..."}]}

An entry's key is everything from "device" to "batch" (``KEY_FIELDS``); the rest records what
the tuner measured. ``kernel`` is mamba2_decode, gdn_decode, mamba2_verify or gdn_verify;
``shape`` the layer dims as the kernel shape names them; ``dtype`` the activation dtype (the
other inputs' dtypes move a few bytes per row and do not change the best tiling); ``mode`` is
conventional (window 1), standard (ReplaySSM decode at ``window``) or verify (``num_drafts`` T
drafts at ``window``); ``state`` the state copies (``state_of``: "fp32", or the checkpoint format
with "+" the read copy and "+rederive" for GDN re-deriving at a flush; "fp32" when absent, as
in files written before it); ``batch`` a bucket, a power of two up to 1024. A decode entry's config
is the tile kernel's or, where decode runs the pipelined kernel by default (or under
``REPLAYSSM_CUTE_PIPELINED=1``), the pipelined one's: an entry serves a bucket only when its config
is of the class of the default it replaces (``launch``), so the tile entries tuned before the
pipelines serve only where the tile kernels do. The ring capacity and the
optional inputs (D, z, dt_bias, pad sentinel, ...) are not part of the key: a tuned config is
checked against the exact kernel shape before use.

Files, read once per process (``launch.reload`` reads them again), later ones overriding earlier ones
entry by entry (an entry that does not parse, or whose launch fields no kernel takes, is skipped
with a warning naming the file, the entry and why; a file that is not a tuned-config file is
skipped whole): the shipped defaults, ``replayssm_cute/tuned/*.json`` (H200 measurements), then
the user file, ``$REPLAYSSM_CUTE_TUNED_FILE`` or else ``tuned.json`` in the compile-cache folder
(``$REPLAYSSM_CUTE_CACHE_DIR``, default ``~/.cache/replayssm_cute``). ``REPLAYSSM_CUTE_TUNED=0``
turns tuned configs off: every call takes the analytical default.

Lookup (``tuned_fields``): a batch's bucket is the power of two at or above it (1024 above
1024); the entry used is the one of the platform's device, arch and versions (``launch.active_platform``),
kernel, layer dims, dtype and mode at the tuned bucket nearest that bucket (on a log scale, at
most ``MAX_BUCKET_RATIO`` away, ties to the smaller). Without one, or when the kernel shape does
not take the tuned config, the analytical default. runtime.launch memoises the outcome per
kernel, shape and bucket, so it costs nothing per call.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from ..kernels.config_space import LAUNCH_FIELDS, launch_check, pipelined_launch_check

FORMAT = "replayssm_cute-tuned-v1"
ENV_DISABLE = "REPLAYSSM_CUTE_TUNED"
ENV_USER_FILE = "REPLAYSSM_CUTE_TUNED_FILE"
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "tuned"

MAX_BATCH_BUCKET = 1024
BATCH_BUCKETS = tuple(1 << i for i in range(MAX_BATCH_BUCKET.bit_length()))  # 1, 2, 4, ..., 1024
MAX_BUCKET_RATIO = 4  # a tuned bucket further than this from the batch's says little about it

MODES = ("conventional", "standard", "verify")
KERNELS = ("mamba2_decode", "gdn_decode", "mamba2_verify", "gdn_verify")
# The layer dims of each layer type, as its kernel shape names them.
LAYER_DIMS = {
    "mamba2": ("nheads", "headdim", "dstate", "ngroups"),
    "gdn": ("num_v_heads", "head_v_dim", "head_k_dim", "num_k_heads"),
}
DTYPE_NAMES = {"BFloat16": "bf16", "Float16": "fp16", "Float32": "fp32"}  # cutlass class -> key
KEY_FIELDS = ("device", "arch", "package", "cutlass", "kernel", "shape", "dtype", "mode", "window",
              "num_drafts", "state", "batch")
PLAIN_STATE = "fp32"

_table: Optional[Dict["TuneKey", Dict[int, dict]]] = None
_warned: set = set()


@dataclass(frozen=True)
class Platform:
    """What a tuned config was measured on: the GPU, the arch compiled for, the package and
    CuTe DSL versions."""

    device: str
    arch: str
    package: str
    cutlass: str


@dataclass(frozen=True)
class TuneKey:
    """An entry's key less its batch bucket: the entries of one key form the bucket table that
    the lookup searches. ``shape`` holds (name, value) pairs of the layer dims."""

    device: str
    arch: str
    package: str
    cutlass: str
    kernel: str
    shape: Tuple[Tuple[str, int], ...]
    dtype: str
    mode: str
    window: int
    num_drafts: int
    state: str = PLAIN_STATE

    def fields(self, batch: int) -> dict:
        """The key fields of an entry at `batch`, in file order."""
        out = {f: getattr(self, f) for f in KEY_FIELDS if f != "batch"}
        out["shape"] = dict(self.shape)
        out["batch"] = batch
        return out


def batch_bucket(batch: int) -> int:
    """The bucket of a batch size: the power of two at or above it, 1024 above 1024."""
    return min(MAX_BATCH_BUCKET, 1 << max(0, batch - 1).bit_length())


def nearest_bucket(tuned: Iterable[int], bucket: int) -> Optional[int]:
    """The tuned bucket nearest `bucket` on a log scale (ties to the smaller), or None when the
    nearest is more than MAX_BUCKET_RATIO away."""
    tuned = list(tuned)
    if not tuned:
        return None
    log = bucket.bit_length()
    best = min(tuned, key=lambda b: (abs(b.bit_length() - log), b))
    return best if max(best, bucket) <= MAX_BUCKET_RATIO * min(best, bucket) else None


def mode_of(kernel: str, window: int) -> str:
    """conventional, standard or verify: what `kernel` does on a cache of `window`."""
    if kernel.endswith("_verify"):
        return "verify"
    return "conventional" if window == 1 else "standard"


def state_of(shape) -> str:
    """The state copies of a kernel shape as a key: the checkpoint format, "+" the read copy if
    any, "+rederive" for GDN corrections re-derived at a flush ("fp32" for the plain cache)."""
    state = getattr(shape, "checkpoint_format", PLAIN_STATE)
    if getattr(shape, "read_copy", None) is not None:
        state += "+" + shape.read_copy
    if getattr(shape, "rederive", False):
        state += "+rederive"
    return state


def tune_key(kernel: str, shape, num_drafts: int, platform: Platform) -> TuneKey:
    """The key of `kernel` (one of KERNELS) on its kernel shape (a Mamba2Shape or GDNShape) with
    T = `num_drafts` drafts (0 for decode), measured on `platform`."""
    layer = kernel.split("_")[0]
    dims = tuple((name, int(getattr(shape, name))) for name in LAYER_DIMS[layer])
    dtype = DTYPE_NAMES[shape.act_dtype.__name__]
    return TuneKey(platform.device, platform.arch, platform.package, platform.cutlass, kernel, dims, dtype,
                   mode_of(kernel, shape.window), int(shape.window), int(num_drafts), state_of(shape))


@functools.lru_cache(maxsize=None)
def current_platform() -> Optional[Platform]:
    """The platform of this process (its current CUDA device), or None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    from ..version import __version__
    from .compile_cache import cutlass_version, target_arch

    return Platform(torch.cuda.get_device_name(), target_arch(), __version__, cutlass_version())


def user_file() -> Path:
    """The user's tuned-config file: $REPLAYSSM_CUTE_TUNED_FILE, else tuned.json in the compile
    cache folder."""
    path = os.environ.get(ENV_USER_FILE)
    if path:
        return Path(path).expanduser()
    from .compile_cache import cache_dir

    return cache_dir() / "tuned.json"


def tuned_enabled() -> bool:
    return os.environ.get(ENV_DISABLE, "1").strip().lower() not in ("0", "false", "no", "off")


def source_files() -> List[Path]:
    """The files the lookup reads, lowest precedence first: shipped defaults, then the user file."""
    return sorted(SHIPPED_DIR.glob("*.json")) + [user_file()]


# ------------------------------------------------------------------------------------- the file


def _warn_once(message: str) -> None:
    """A RuntimeWarning, once per process: the lookup reads the files again after every reload."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _int_field(entry: dict, name: str) -> int:
    value = entry.get(name)
    if type(value) is not int:
        raise ValueError(f"entry field {name!r}: expected an int, got {value!r}")
    return value


def parse_entry(entry) -> Tuple[TuneKey, int, dict]:
    """(key, batch bucket, config fields) of one file entry; ValueError naming the field at
    fault when it is not one."""
    if not isinstance(entry, dict):
        raise ValueError(f"entry: expected an object, got {type(entry).__name__}")
    for name in ("device", "arch", "package", "cutlass", "kernel", "dtype", "mode"):
        if not isinstance(entry.get(name), str):
            raise ValueError(f"entry field {name!r}: expected a string, got {entry.get(name)!r}")
    kernel = entry["kernel"]
    if kernel not in KERNELS:
        raise ValueError(f"entry field 'kernel': expected one of {', '.join(KERNELS)}, got {kernel!r}")
    dim_names = LAYER_DIMS[kernel.split("_")[0]]
    shape = entry.get("shape")
    if not isinstance(shape, dict) or set(shape) != set(dim_names) or any(type(v) is not int for v in shape.values()):
        raise ValueError(f"entry field 'shape': expected integer {', '.join(dim_names)}, got {shape!r}")
    window, num_drafts, batch = (_int_field(entry, n) for n in ("window", "num_drafts", "batch"))
    if entry["mode"] != mode_of(kernel, window):
        raise ValueError(f"entry field 'mode': {kernel} at window {window} is {mode_of(kernel, window)!r}, "
                         f"got {entry['mode']!r}")
    if batch not in BATCH_BUCKETS:
        raise ValueError(f"entry field 'batch': expected a power of two up to {MAX_BATCH_BUCKET}, got {batch}")
    config = entry.get("config")
    if not isinstance(config, dict):
        raise ValueError(f"entry field 'config': expected an object of launch parameters, got {config!r}")
    if "stages" in config:  # a pipelined decode's config
        reason = pipelined_launch_check(config)
    else:
        if any(type(v) is not int for v in config.values()):
            raise ValueError(f"entry field 'config': expected an object of integer launch parameters, got {config!r}")
        if not set(LAUNCH_FIELDS) <= set(config):
            raise ValueError(f"entry field 'config': expected integer {', '.join(LAUNCH_FIELDS)}, got {config!r}")
        reason = launch_check(*(config[name] for name in LAUNCH_FIELDS))
    if reason is not None:  # no kernel takes it: every decode at its bucket would fail
        raise ValueError(f"entry field 'config': {reason}")
    state = entry.get("state", PLAIN_STATE)
    if not isinstance(state, str):
        raise ValueError(f"entry field 'state': expected a string, got {state!r}")
    key = TuneKey(entry["device"], entry["arch"], entry["package"], entry["cutlass"], kernel,
                  tuple((n, shape[n]) for n in dim_names), entry["dtype"], entry["mode"], window, num_drafts, state)
    return key, batch, dict(config)


def read_entries(path: Path) -> List[dict]:
    """The good entries of the tuned-config file at `path` ([] if it does not exist), each bad
    one left out with a warning naming the file, its index and the field at fault; ValueError
    naming the file and what is wrong when it is not a tuned-config file at all."""
    try:
        text = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or nested deeper than the parser goes
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), list):
        raise ValueError(f"{path}: expected a tuned-config file, an object with \"format\": {FORMAT!r} and "
                         f"a list of \"entries\"")
    entries = []
    for i, entry in enumerate(data["entries"]):
        try:
            parse_entry(entry)
        except ValueError as e:
            _warn_once(f"tuned configs: ignoring entry {i} of {path}: {e}")
            continue
        entries.append(entry)
    return entries


def _entry_id(entry: dict) -> tuple:
    key, batch, _ = parse_entry(entry)
    return key, batch


def write_entries(path: Path, entries: Iterable[dict]) -> List[dict]:
    """Merge `entries` into the file at `path` (created with its folder if need be; an entry
    with the key of one already there replaces it; its bad entries are dropped, with
    ``read_entries``' warnings) and write it atomically, sorted by key; returns every entry now
    in the file. ValueError if one of `entries` is bad."""
    path = Path(path)
    merged = {_entry_id(e): e for e in read_entries(path)}
    merged.update({_entry_id(e): e for e in entries})
    ordered = [merged[k] for k in sorted(merged, key=lambda k: (repr(k[0]), k[1]))]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "entries": ordered}, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return ordered


# ----------------------------------------------------------------------------------- the lookup


def _load_table() -> Dict[TuneKey, Dict[int, dict]]:
    """key -> {bucket: config fields} over source_files(); a file that cannot be read is skipped,
    and so is each bad entry of one that can, with one warning each (decode must not fail over a
    cache file)."""
    table: Dict[TuneKey, Dict[int, dict]] = {}
    for path in source_files():
        try:
            entries = read_entries(path)
        except (OSError, ValueError) as e:
            _warn_once(f"tuned configs: ignoring {path}: {e}")
            continue
        for entry in entries:
            key, batch, config = parse_entry(entry)
            table.setdefault(key, {})[batch] = config
    return table


def forget_table() -> None:
    """Read the tuned-config files again on the next lookup."""
    global _table
    _table = None


def _loaded_table() -> Dict[TuneKey, Dict[int, dict]]:
    global _table
    if _table is None:
        _table = _load_table()
    return _table


def tuned_devices() -> List[str]:
    """The devices the tuned-config files hold entries for, sorted."""
    return sorted({key.device for key in _loaded_table()})


def tuned_fields(kernel: str, shape, num_drafts: int, bucket: int, platform: Optional[Platform]) -> Optional[dict]:
    """The tuned launch-config fields for `kernel` on `shape` with `num_drafts` drafts at batch
    bucket `bucket` on `platform` (see the module docstring), or None: tuning turned off, no
    platform (no GPU), or nothing tuned near that bucket."""
    if not tuned_enabled():
        return None
    if platform is None:
        return None
    buckets = _loaded_table().get(tune_key(kernel, shape, num_drafts, platform))
    if not buckets:
        return None
    nearest = nearest_bucket(buckets, bucket)
    return None if nearest is None else dict(buckets[nearest])
