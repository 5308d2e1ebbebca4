"""The compiled-kernel cache: keys, memory and disk layers, atomic writes, arch selection.

Everything but the last test runs without a GPU: CuTe DSL compiles, exports and loads `.o` files
with no driver; only calling the kernel needs one.
"""

import multiprocessing as mp
import os
import subprocess
import sys
import warnings

import pytest
import torch

import replayssm_cute
from replayssm_cute.kernels.limits import PDL_ENV
from replayssm_cute.runtime import compile_cache as cc


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Each test gets an empty disk cache, an empty memory cache and fresh warnings."""
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(tmp_path / "cache"))
    monkeypatch.delenv(cc.ENV_DISK_CACHE, raising=False)
    monkeypatch.delenv(PDL_ENV, raising=False)
    if not torch.cuda.is_available():
        monkeypatch.setenv(cc.ENV_ARCH, os.environ.get(cc.ENV_ARCH) or "sm_90a")
    monkeypatch.setattr(cc, "_warned", set())
    cc.clear_memory_cache()
    yield
    cc.clear_memory_cache()


def _cache_files(pattern="*"):
    d = cc.cache_dir()
    return sorted(p.name for p in d.glob(pattern)) if d.exists() else []


def _tiny():
    from tests.tools import _tiny_kernel

    return _tiny_kernel


# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------

KEY = ("bfloat16", 64, 128, True, 0.5, ("nested", 3), None)


def test_key_is_stable_within_and_across_processes():
    p = cc.cache_path("mamba2_decode", KEY)
    assert p == cc.cache_path("mamba2_decode", KEY)
    assert p.parent == cc.cache_dir()
    assert p.name.startswith("mamba2_decode-") and p.suffix == ".o"
    assert len(p.stem.split("-")[-1]) == 64  # sha256 hex
    code = (
        "from replayssm_cute.runtime import compile_cache as cc; "
        f"print(cc.cache_path('mamba2_decode', {KEY!r}))"
    )
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(p)


def test_every_key_component_changes_the_file_name(monkeypatch):
    base = cc.cache_path("mamba2_decode", KEY)
    names = {base.name}

    def add(path):
        assert path.name not in names, path
        names.add(path.name)

    add(cc.cache_path("gdn_decode", KEY))
    for i, alt in [(0, "float16"), (1, 32), (3, False), (4, 0.25), (5, ("nested", 4)), (6, 0)]:
        add(cc.cache_path("mamba2_decode", KEY[:i] + (alt,) + KEY[i + 1 :]))
    add(cc.cache_path("mamba2_decode", KEY + (1,)))
    # Values that compare equal but are different types are different keys.
    assert len({cc.cache_path("k", (v,)).name for v in (1, True, 1.0, "1")}) == 4

    arch_names = set()
    for arch in cc.SUPPORTED_ARCHS:
        monkeypatch.setenv(cc.ENV_ARCH, arch)
        arch_names.add(cc.cache_path("mamba2_decode", KEY).name)
    assert len(arch_names) == len(cc.SUPPORTED_ARCHS)
    monkeypatch.setenv(cc.ENV_ARCH, "sm_90a")
    base = cc.cache_path("mamba2_decode", KEY)

    for attr, value in [
        ("_package_version", "0.1.1"),
        ("cutlass_version", "4.8.2"),
        ("kernel_source_hash", "0" * 64),
    ]:
        with monkeypatch.context() as m:
            m.setattr(cc, attr, lambda value=value: value)
            changed = cc.cache_path("mamba2_decode", KEY)
        assert changed.name != base.name, attr
    assert cc.cache_path("mamba2_decode", KEY) == base
    with monkeypatch.context() as m:  # the launch is compiled into the host code
        m.setenv(PDL_ENV, "0")
        assert cc.launch_mode() == "plain"
        assert cc.cache_path("mamba2_decode", KEY) != base
    assert cc.launch_mode() == "programmatic"
    assert cc.cache_path("mamba2_decode", KEY) == base


def test_source_hash_follows_file_contents_and_names(tmp_path):
    root = tmp_path / "kernels"
    (root / "mamba2" / "__pycache__").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "mamba2" / "decode.py").write_text("A = 1\n")
    h0 = cc._hash_tree([root])
    (root / "mamba2" / "__pycache__" / "decode.cpython-311.py").write_text("junk")
    (root / "mamba2" / "notes.md").write_text("not code")
    assert cc._hash_tree([root]) == h0
    (root / "mamba2" / "decode.py").write_text("A = 2\n")
    h1 = cc._hash_tree([root])
    assert h1 != h0
    (root / "mamba2" / "decode.py").rename(root / "mamba2" / "step.py")
    assert cc._hash_tree([root]) not in (h0, h1)


def test_source_hash_leaves_out_the_default_configs(tmp_path):
    root = tmp_path / "kernels"
    (root / "gdn").mkdir(parents=True)
    (root / "gdn" / "decode.py").write_text("A = 1\n")
    (root / "gdn" / "defaults.py").write_text("ROWS = 64\n")
    h0 = cc._hash_tree([root])
    (root / "gdn" / "defaults.py").write_text("ROWS = 128\n")
    assert cc._hash_tree([root]) == h0
    (root / "gdn" / "config.py").write_text("ROWS = 128\n")
    assert cc._hash_tree([root]) != h0


def test_no_kernel_module_imports_the_default_configs():
    """What lets the source hash leave the defaults out: they cannot reach generated code."""
    import ast

    roots = cc._kernel_roots()
    defaults = [p for r in roots for p in r.rglob("*.py") if p.name in cc.UNHASHED_NAMES]
    assert {p.parent.name for p in defaults} == {"mamba2", "gdn"}
    for root in roots:
        for path in root.rglob("*.py"):
            if path.name in cc.UNHASHED_NAMES:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] + [a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                assert not any(n.split(".")[-1] == "defaults" for n in names), f"{path} imports the defaults"


def test_source_hash_covers_the_package_kernels():
    roots = cc._kernel_roots()
    assert roots, "replayssm_cute.kernels not found"
    assert any((r / "mamba2").is_dir() for r in roots)
    assert len(cc.kernel_source_hash()) == 64


def test_keys_must_be_tensor_free():
    with pytest.raises(TypeError, match="compile-cache keys"):
        cc.cache_path("k", (torch.zeros(2),))
    with pytest.raises(TypeError, match="compile-cache keys"):
        cc.get_compiled("k", ([1, 2],), lambda: pytest.fail("built"))
    with pytest.raises(TypeError, match="must be a tuple"):
        cc.get_compiled("k", [1], lambda: pytest.fail("built"))
    # dtypes are fine
    cc.cache_path("k", (torch.bfloat16, torch.float32))


# ---------------------------------------------------------------------------------------------
# Memory layer and the switch
# ---------------------------------------------------------------------------------------------


class _Counter:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return object()  # no export_to_c: such entries stay in memory only


def test_memory_hit_returns_same_object_without_building(monkeypatch):
    monkeypatch.setenv(cc.ENV_DISK_CACHE, "0")
    build = _Counter()
    a = cc.get_compiled("k", (1, "x"), build)
    b = cc.get_compiled("k", (1, "x"), build)
    assert a is b and build.calls == 1
    c = cc.get_compiled("k", (True, "x"), build)  # True == 1, but a different key
    assert c is not a and build.calls == 2
    n1 = cc.get_compiled("k", (("n", 1),), build)
    n2 = cc.get_compiled("k", (("n", 1.0),), build)  # also inside nested tuples
    assert n1 is not n2 and build.calls == 4
    assert cc.get_compiled("other", (1, "x"), build) is not a and build.calls == 5
    monkeypatch.setenv(PDL_ENV, "0")  # another launch mode: another compiled function
    plain = cc.get_compiled("k", (1, "x"), build)
    assert plain is not a and build.calls == 6
    monkeypatch.delenv(PDL_ENV)
    assert cc.get_compiled("k", (1, "x"), build) is a and build.calls == 6
    cc.clear_memory_cache()
    assert cc.get_compiled("k", (1, "x"), build) is not a and build.calls == 7


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_disk_cache_can_be_turned_off(monkeypatch, value):
    monkeypatch.setenv(cc.ENV_DISK_CACHE, value)
    assert not cc.disk_cache_enabled()
    tk = _tiny()
    built = []
    fn = cc.get_compiled(tk.NAME, tk.KEY, lambda: built.append(1) or tk.build())
    assert fn is not None and built == [1]
    assert not cc.cache_dir().exists() or _cache_files() == []


def test_disk_cache_on_by_default():
    assert cc.disk_cache_enabled()


# ---------------------------------------------------------------------------------------------
# Disk layer with a real kernel (compile + export + load, no GPU needed)
# ---------------------------------------------------------------------------------------------


def test_export_then_load_from_disk():
    tk = _tiny()
    fn = tk.add_one_fn()
    path = cc.cache_path(tk.NAME, tk.KEY)
    assert path.is_file() and path.stat().st_size > 0
    assert path.read_bytes()[:4] == b"\x7fELF"
    assert _cache_files("*.o") == [path.name]
    assert _cache_files("*.tmp") == [] and _cache_files(".*.tmp") == []
    assert cc.get_compiled(tk.NAME, tk.KEY, lambda: pytest.fail("built")) is fn  # memory

    cc.clear_memory_cache()
    loaded = cc.get_compiled(tk.NAME, tk.KEY, lambda: pytest.fail("built on a disk hit"))
    assert callable(loaded) and loaded is not fn
    assert type(loaded).__module__.startswith("tvm_ffi")


def test_corrupt_file_is_rebuilt_with_one_warning(monkeypatch):
    tk = _tiny()
    monkeypatch.setattr(cc, "compile_only_mode", lambda: False)  # as on a GPU machine
    path = cc.cache_path(tk.NAME, tk.KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an object file")
    with pytest.warns(RuntimeWarning, match="could not load"):
        fn = tk.add_one_fn()
    assert fn is not None
    assert path.read_bytes()[:4] == b"\x7fELF"  # replaced by a good entry
    # A second failure in the same process stays quiet.
    cc.clear_memory_cache()
    path.write_bytes(b"garbage again")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tk.add_one_fn()
    assert _cache_files("*.o") == [path.name]


def _fresh_entry_bytes(tmp_path, monkeypatch):
    """The bytes of the tiny kernel's disk entry as an empty cache folder gets them."""
    tk = _tiny()
    with monkeypatch.context() as m:
        m.setenv(cc.ENV_CACHE_DIR, str(tmp_path / "fresh"))
        cc.clear_memory_cache()
        tk.add_one_fn()
        data = cc.cache_path(tk.NAME, tk.KEY).read_bytes()
    cc.clear_memory_cache()
    return data


def test_entry_with_a_flipped_byte_is_rebuilt_not_loaded(tmp_path, monkeypatch):
    """A flipped byte (one inside the embedded cubin still loads as an object file): the content
    hash stored with the entry catches it, and the entry is replaced by a fresh build, with one
    warning (also in compile-only mode: no missing driver explains a changed file)."""
    tk = _tiny()
    fresh = _fresh_entry_bytes(tmp_path, monkeypatch)
    tk.add_one_fn()
    path = cc.cache_path(tk.NAME, tk.KEY)
    assert path.read_bytes() == fresh
    bad = bytearray(fresh)
    bad[len(bad) // 2] ^= 0x01
    path.write_bytes(bytes(bad))
    cc.clear_memory_cache()
    built = []
    with pytest.warns(RuntimeWarning, match="could not load .*content hash"):
        fn = cc.get_compiled(tk.NAME, tk.KEY, lambda: built.append(1) or tk.build())
    assert built == [1] and fn is not None
    assert path.read_bytes() == fresh  # atomically replaced by what a fresh build writes
    assert _cache_files("*.o") == [path.name] and _cache_files(".*.tmp") == []
    cc.clear_memory_cache()
    assert cc.get_compiled(tk.NAME, tk.KEY, lambda: pytest.fail("built a good entry")) is not None
    # warned once per process
    path.write_bytes(bytes(bad))
    cc.clear_memory_cache()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tk.add_one_fn()
    assert path.read_bytes() == fresh


def test_entry_without_a_content_hash_is_rebuilt(tmp_path, monkeypatch):
    """A bare object file, as written before entries carried their hash, is not trusted."""
    tk = _tiny()
    fresh = _fresh_entry_bytes(tmp_path, monkeypatch)
    path = cc.cache_path(tk.NAME, tk.KEY)
    path.parent.mkdir(parents=True)
    tk.build().export_to_c(str(path), function_name=cc._symbol(tk.NAME, cc._digest(tk.NAME, tk.KEY)))
    built = []
    with pytest.warns(RuntimeWarning, match="could not load .*no content hash"):
        cc.get_compiled(tk.NAME, tk.KEY, lambda: built.append(1) or tk.build())
    assert built == [1] and path.read_bytes() == fresh


def test_failed_export_leaves_no_file_and_warns_once():
    class NoExport:
        def export_to_c(self, path, function_name=None):
            with open(path, "wb") as f:
                f.write(b"half a fil")
            raise RuntimeError("disk full")

    with pytest.warns(RuntimeWarning, match="could not write"):
        a = cc.get_compiled("broken", (1,), NoExport)
    assert isinstance(a, NoExport)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cc.get_compiled("broken", (2,), NoExport)
    assert [n for n in _cache_files() if not n.endswith(".lock")] == []


def test_unusable_cache_dir_falls_back_to_building(tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(blocker / "sub"))
    build = _Counter()
    with pytest.warns(RuntimeWarning, match="cannot use"):
        cc.get_compiled("k", (1,), build)
    assert build.calls == 1


def test_racing_processes_share_one_valid_file(tmp_path, monkeypatch):
    tk = _tiny()
    cache = tmp_path / "race"
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [ctx.Process(target=tk.race_worker, args=(cache, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    outs = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert all(o[0] == "ok" for o in outs), outs
    assert sorted(o[2] for o in outs) == [0, 1], outs  # one compiled, the other loaded its file

    files = sorted(p.name for p in cache.iterdir())
    objects = [n for n in files if n.endswith(".o")]
    assert len(objects) == 1, files
    assert [n for n in files if n.endswith(".tmp")] == [], files
    # The survivor is a complete object that loads.
    monkeypatch.setenv(cc.ENV_CACHE_DIR, str(cache))
    fn = cc.get_compiled(tk.NAME, tk.KEY, lambda: pytest.fail("built"))
    assert callable(fn)


# ---------------------------------------------------------------------------------------------
# Arch and mode
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a", "sm_103a"])
def test_target_arch_from_env(monkeypatch, arch):
    monkeypatch.setenv(cc.ENV_ARCH, arch)
    assert cc.target_arch() == arch
    assert f"--gpu-arch {arch}" in cc.compile_options()
    assert "--enable-tvm-ffi" in cc.compile_options()


def test_target_arch_rejects_unknown_env(monkeypatch):
    monkeypatch.setenv(cc.ENV_ARCH, "sm_80")
    with pytest.raises(RuntimeError, match="not supported"):
        cc.target_arch()


@pytest.mark.parametrize(
    "capability, arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((10, 3), "sm_103a")]
)
def test_target_arch_from_device(monkeypatch, capability, arch):
    monkeypatch.delenv(cc.ENV_ARCH, raising=False)
    monkeypatch.setattr(cc, "_device_capability", lambda: capability)
    assert cc.target_arch() == arch


def test_target_arch_unsupported_device(monkeypatch):
    monkeypatch.delenv(cc.ENV_ARCH, raising=False)
    monkeypatch.setattr(cc, "_device_capability", lambda: (8, 0))
    with pytest.raises(RuntimeError, match="unsupported GPU"):
        cc.target_arch()


def test_target_arch_without_gpu_or_env_is_a_clear_error(monkeypatch):
    monkeypatch.delenv(cc.ENV_ARCH, raising=False)
    monkeypatch.setattr(cc, "_device_capability", lambda: None)
    with pytest.raises(RuntimeError, match="no CUDA GPU.*CUTE_DSL_ARCH"):
        cc.target_arch()
    with pytest.raises(RuntimeError, match="CUTE_DSL_ARCH"):
        cc.get_compiled("k", (1,), lambda: pytest.fail("built"))


def test_compile_only_mode_follows_torch():
    assert cc.compile_only_mode() == (not torch.cuda.is_available())


def test_version():
    assert replayssm_cute.__version__ == "0.1.0"


# ---------------------------------------------------------------------------------------------
# GPU: load from disk and run
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_disk_entry_runs_on_gpu():
    tk = _tiny()
    fresh = tk.add_one_fn()  # compiled here, exported
    x = torch.zeros(1000, device="cuda")
    fresh(x)
    torch.cuda.synchronize()
    assert torch.equal(x, torch.ones_like(x))

    cc.clear_memory_cache()
    loaded = cc.get_compiled(tk.NAME, tk.KEY, lambda: pytest.fail("built on a disk hit"))
    assert loaded is not fresh
    y = torch.arange(300, dtype=torch.float32, device="cuda")  # another length
    loaded(y)
    loaded(x)
    torch.cuda.synchronize()
    assert torch.equal(y, torch.arange(300, dtype=torch.float32, device="cuda") + 1)
    assert torch.equal(x, torch.full_like(x, 2.0))

    # On a side stream: the kernel must follow torch's current stream (TVM-FFI env stream).
    s = torch.cuda.Stream()
    z = torch.zeros(4096, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        for _ in range(5):
            loaded(z)
    s.synchronize()
    assert torch.equal(z, torch.full_like(z, 5.0))
