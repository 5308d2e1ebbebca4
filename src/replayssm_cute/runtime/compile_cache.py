"""Compiled-kernel cache: memory first, then `.o` files on disk, then compile.

`cute.compile` keeps nothing between calls, and one compile costs seconds. A kernel's entry point
asks `get_compiled(name, key, build)`: `key` holds only what changes the generated code (dtypes as
strings or classes, shapes that are compile-time constants, flags), never tensors; `build()`
compiles from fake tensors with `options=compile_options()` and returns the TVM-FFI function.

Disk entries are `<name>-<sha256>.o` under `$REPLAYSSM_CUTE_CACHE_DIR` (default
`~/.cache/replayssm_cute`), written by the compiled function's `export_to_c` and read back with
`cute.runtime.load_module(path, enable_tvm_ffi=True)`. The hash covers the caller's key, the target
arch, the launch mode (programmatic or plain, `$REPLAYSSM_CUTE_PDL`: the launch is part of the
compiled host code), this package's version, the CuTe DSL version and the text of every `.py` file under
`replayssm_cute/kernels`, so an edited kernel never loads a stale binary; all but the layers'
`defaults.py` (the analytical launch-config choices: no kernel module imports them, and the
config chosen is in the key), so that a change of a default keeps every compiled kernel. Files
appear atomically (temp file in the same folder, then `os.replace`), and one compile per key
runs at a time across processes (an `fcntl` lock beside the file), so concurrent processes never
see a partial file.
Each file ends with the sha256 of its object code (`_HASH_TAG`, then the hex digest), checked
before every load: a file changed on disk (a flipped byte in the embedded cubin still loads), cut
short, or written without the hash is rebuilt and replaced, never trusted.

`REPLAYSSM_CUTE_DISK_CACHE=0` turns the disk layer off. Any disk failure (unwritable folder,
corrupt file) falls back to compiling, with one warning per process.

Calling convention: call the returned function with positional arguments only. A function loaded
from disk is a plain `tvm_ffi.Function`; the one fresh from `cute.compile` also takes keywords, so
keyword calls would work on a miss and fail on a hit.

Checked on CuTe DSL 4.8.1 without a GPU: compile (with `--gpu-arch`), export, load_module and the
function lookup all work with no driver; only calling the function needs a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterable

from ..kernels.limits import programmatic_launch

ENV_CACHE_DIR = "REPLAYSSM_CUTE_CACHE_DIR"
ENV_DISK_CACHE = "REPLAYSSM_CUTE_DISK_CACHE"
ENV_ARCH = "CUTE_DSL_ARCH"

SUPPORTED_ARCHS = ("sm_90a", "sm_100a", "sm_103a")
_CAPABILITY_TO_ARCH = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}

# Bump when the key layout changes. (Entries written before the content hash keep their names:
# they fail the hash check and are rebuilt in place.)
_FORMAT = "replayssm_cute-compile-cache-v1"
# Ends every disk entry, followed by the sha256 (hex) of the object code before it; the object
# loader reads ELF sections by offset and ignores these trailing bytes.
_HASH_TAG = b"\nreplayssm_cute-sha256:"

_memory: dict = {}
# cute.compile is not thread-safe; a miss (compile, export, load) runs under this lock.
_miss_lock = threading.RLock()
_warned: set = set()


# ---------------------------------------------------------------------------------------------
# Target and mode
# ---------------------------------------------------------------------------------------------


def target_arch() -> str:
    """The arch we compile for: `$CUTE_DSL_ARCH` if set, else the current CUDA device's."""
    arch = os.environ.get(ENV_ARCH)
    if arch:
        if arch not in SUPPORTED_ARCHS:
            raise RuntimeError(
                f"{ENV_ARCH}={arch!r} is not supported; use one of {', '.join(SUPPORTED_ARCHS)}"
            )
        return arch
    capability = _device_capability()
    if capability is None:
        raise RuntimeError(
            f"no CUDA GPU is visible and {ENV_ARCH} is unset: set {ENV_ARCH} to one of "
            f"{', '.join(SUPPORTED_ARCHS)} to compile without a GPU"
        )
    arch = _CAPABILITY_TO_ARCH.get(capability)
    if arch is None:
        raise RuntimeError(
            f"unsupported GPU (compute capability {capability[0]}.{capability[1]}); "
            f"supported: {', '.join(f'{a}.{b}' for a, b in _CAPABILITY_TO_ARCH)} "
            f"({', '.join(SUPPORTED_ARCHS)})"
        )
    return arch


@functools.lru_cache(maxsize=None)
def _device_capability() -> tuple[int, int] | None:
    """Compute capability of the current CUDA device, or None without one (memoised)."""
    if not _cuda_available():
        return None
    import torch

    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    return bool(torch.cuda.is_available())


def compile_only_mode() -> bool:
    """True when no CUDA device is available: we compile and export, but cannot run kernels.

    In this mode a disk hit is still loaded: on CuTe DSL 4.8.1 `load_module` and the function
    lookup need no driver (only calling the function does). A failed load is then not warned
    about, since nothing is lost: the entry is rebuilt and re-exported.
    """
    return not _cuda_available()


def launch_mode() -> str:
    """How the kernels compiled now launch: "programmatic" (the default) or "plain"
    (``REPLAYSSM_CUTE_PDL=0``)."""
    return "programmatic" if programmatic_launch() else "plain"


def compile_options(*extra: str) -> str:
    """`cute.compile` options that match the cache key: TVM-FFI on, `--gpu-arch target_arch()`.

    Passing the arch explicitly matters because CuTe DSL reads `$CUTE_DSL_ARCH` once, when
    `cutlass` is first imported; without `--gpu-arch` the binary could target another arch than
    the one in the key.
    """
    return " ".join(("--enable-tvm-ffi", f"--gpu-arch {target_arch()}") + tuple(extra))


# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------


def _canon(value) -> str:
    """Type-tagged text of a key, so that 1, 1.0 and True differ; rejects tensors and the like."""
    t = type(value)
    if t is bool:
        return "b" + repr(value)
    if t is int:
        return "i" + repr(value)
    if t is float:
        return "f" + repr(value)
    if t is str:
        return "s" + repr(value)
    if value is None:
        return "n"
    if t is tuple:
        return "(" + ",".join(_canon(v) for v in value) + ")"
    if isinstance(value, type):  # a dtype class such as cutlass.Float32
        return "c" + repr(f"{value.__module__}.{value.__qualname__}")
    if t.__module__ == "torch" and t.__name__ == "dtype":
        return "t" + repr(str(value))
    raise TypeError(
        f"compile-cache keys hold str, int, bool, float, None, tuples, dtype classes and "
        f"torch dtypes only; got {t.__module__}.{t.__qualname__}"
    )


def _type_sig(key: tuple) -> tuple:
    """The key's element types, nested tuples spelled out (True == 1 as dict keys)."""
    return tuple([_type_sig(v) if type(v) is tuple else type(v) for v in key])


def _package_version() -> str:
    from ..version import __version__

    return __version__


@functools.lru_cache(maxsize=None)
def cutlass_version() -> str:
    import cutlass

    return str(cutlass.__version__)


# Files under the kernel roots that generate no code: the analytical default configs, which no
# kernel module imports (tests/tools/test_compile_cache.py checks that).
UNHASHED_NAMES = ("defaults.py",)


def _hash_tree(roots: Iterable[Path]) -> str:
    """sha256 over the relative paths and contents of every .py file under `roots` but those
    named in UNHASHED_NAMES."""
    h = hashlib.sha256()
    for root in roots:
        root = Path(root)
        files = sorted(
            p for p in root.rglob("*.py")
            if "__pycache__" not in p.relative_to(root).parts and p.name not in UNHASHED_NAMES
        )
        for p in files:
            rel = p.relative_to(root).as_posix().encode()
            data = p.read_bytes()
            h.update(len(rel).to_bytes(8, "little") + rel)
            h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def _kernel_roots() -> list[Path]:
    """Folders of `replayssm_cute.kernels`, found without importing it."""
    try:
        spec = importlib.util.find_spec("..kernels", __package__)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    return [Path(p) for p in spec.submodule_search_locations]


@functools.lru_cache(maxsize=None)
def kernel_source_hash() -> str:
    """Hash of every .py under replayssm_cute/kernels (memoised for the process)."""
    return _hash_tree(_kernel_roots())


def full_key(name: str, key: tuple) -> tuple:
    """Everything the compiled code depends on, as a tuple of strings."""
    return (
        _FORMAT,
        name,
        _canon(key),
        target_arch(),
        launch_mode(),
        _package_version(),
        cutlass_version(),
        kernel_source_hash(),
    )


def _digest(name: str, key: tuple) -> str:
    return hashlib.sha256(repr(full_key(name, key)).encode()).hexdigest()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name) or "kernel"


def cache_dir() -> Path:
    d = os.environ.get(ENV_CACHE_DIR)
    return Path(d).expanduser() if d else Path.home() / ".cache" / "replayssm_cute"


def cache_path(name: str, key: tuple) -> Path:
    """The disk entry for (name, key): `<cache_dir>/<name>-<sha256 of the full key>.o`."""
    return cache_dir() / f"{_safe(name)}-{_digest(name, key)}.o"


def _symbol(name: str, digest: str) -> str:
    # The exported function is `__tvm_ffi_<symbol>`; unique per entry, a C identifier.
    return f"replayssm_{_safe(name)}_{digest[:16]}"


def disk_cache_enabled() -> bool:
    return os.environ.get(ENV_DISK_CACHE, "1").strip().lower() not in ("0", "false", "no", "off")


# ---------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------


def clear_memory_cache() -> None:
    """Forget every compiled function held in memory (disk entries stay)."""
    with _miss_lock:
        _memory.clear()


def get_compiled(name: str, key: tuple, build: Callable[[], object]) -> object:
    """The compiled function for (name, key): from memory, else disk, else `build()`.

    The memory layer is keyed by (name, key, the key's element types, the launch mode) and assumes the target
    arch stays fixed for the process; after changing `$CUTE_DSL_ARCH` mid-process (say, in a
    precompile loop over archs), call `clear_memory_cache()`.
    """
    if type(key) is not tuple:
        raise TypeError(f"compile-cache key must be a tuple, got {type(key).__name__}")
    # Element types join the memory key because 1 == 1.0 == True as dict keys.
    sig = tuple(map(type, key))
    if tuple in sig:
        sig = _type_sig(key)
    mkey = (name, key, sig, launch_mode())
    try:
        fn = _memory.get(mkey)
    except TypeError:  # unhashable: say what keys may hold
        _canon(key)
        raise
    if fn is not None:
        return fn
    with _miss_lock:
        fn = _memory.get(mkey)
        if fn is None:
            fn = _get_uncached(name, key, build)
            _memory[mkey] = fn
        return fn


def _get_uncached(name: str, key: tuple, build: Callable[[], object]) -> object:
    digest = _digest(name, key)  # validates the key and resolves the arch before any work
    if not disk_cache_enabled():
        return build()
    directory = cache_dir()
    path = directory / f"{_safe(name)}-{digest}.o"
    symbol = _symbol(name, digest)
    with contextlib.ExitStack() as stack:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            # Held through the compile: a second process waits, then loads the new file.
            stack.enter_context(_file_lock(path.with_name(path.name + ".lock")))
        except OSError as e:
            _warn_once("dir", f"compile cache: cannot use {directory} ({e}); compiling without it")
            return build()
        if path.exists():
            try:
                return _load(path, symbol)
            except _ContentError as e:  # not what was written: no missing driver explains it
                _warn_once("content", f"compile cache: could not load {path} ({e}); recompiling")
            except Exception as e:  # unloadable object, missing driver, ...
                if not compile_only_mode():
                    _warn_once("load", f"compile cache: could not load {path} ({e}); recompiling")
        fn = build()
        try:
            _export(fn, path, symbol)
        except Exception as e:
            _warn_once("export", f"compile cache: could not write {path} ({e})")
        return fn


class _ContentError(Exception):
    """A disk entry whose object code does not match its stored hash, or that has none."""


def _check_content(path: Path) -> None:
    body, tag, digest = path.read_bytes().rpartition(_HASH_TAG)  # the digest holds no tag: the last is ours
    if not tag:
        raise _ContentError("no content hash: cut short, or written before entries carried one")
    if hashlib.sha256(body).hexdigest().encode() != digest:
        raise _ContentError("content hash mismatch: the file changed after it was written")


def _load(path: Path, symbol: str) -> object:
    from cutlass.cute.runtime import load_module

    _check_content(path)
    module = load_module(str(path), enable_tvm_ffi=True)
    return module[symbol]  # ExternalBinaryModule looks up `__tvm_ffi_<symbol>`


def _export(fn: object, path: Path, symbol: str) -> None:
    """Write `fn` to `path` atomically: export into a temp file beside it, then rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        # TVM-FFI functions (4.8.1): export_to_c(object_file_path, function_name, *,
        # enable_pic=True, export_only_tvm_ffi_symbols=False). The format comes from the path's
        # extension and defaults to an ELF object for anything but .ll / .bc.
        fn.export_to_c(tmp, function_name=symbol)
        with open(tmp, "r+b") as f:
            digest = hashlib.sha256(f.read()).hexdigest().encode()
            f.write(_HASH_TAG + digest)
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(lock_path: Path):
    import fcntl

    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _warn_once(what: str, message: str) -> None:
    if what in _warned:
        return
    _warned.add(what)
    warnings.warn(message, RuntimeWarning, stacklevel=4)
