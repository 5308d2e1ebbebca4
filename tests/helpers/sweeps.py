"""What the CPU tests of the sweeps/ scripts share: loading a script as a module, running it in a
subprocess, tiny model shapes for CPU pools."""

import importlib.util
import os
import subprocess
import sys

from replayssm_cute.models import ModelSpec

from tests.helpers import ROOT

TINY = {"gdn": ModelSpec("tiny-gdn", "gdn", 4, 16, 32, 2, 1),
        "mamba2": ModelSpec("tiny-mamba2", "mamba2", 4, 16, 32, 2, 1)}


def load(name: str):
    """sweeps/<name>.py as a module (its main() not run)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "sweeps" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name: str, args, timeout: int = 600, **env):
    """`python sweeps/<name>.py *args` from the repository root, CUTE_DSL_ARCH unset unless `env`
    sets it; the CompletedProcess with text stdout and stderr."""
    full = dict(os.environ, PYTHONUNBUFFERED="1")
    full.pop("CUTE_DSL_ARCH", None)
    full.update(env)
    return subprocess.run([sys.executable, str(ROOT / "sweeps" / f"{name}.py"), *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=timeout)


def assert_usage_errors(name: str, cases):
    """Each (args, message) of `cases`: the script exits 2 with `message` on stderr."""
    for args, msg in cases:
        proc = run(name, args, CUDA_VISIBLE_DEVICES="")
        assert proc.returncode == 2 and msg in proc.stderr, (args, proc.stderr)


def assert_needs_gpu_or_arch(name: str):
    """Without a GPU the script says so (and points at --compile-only), and --compile-only asks for
    CUTE_DSL_ARCH; both exit 1 without a traceback."""
    proc = run(name, ["--quick"], CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"{name}: no CUDA GPU found" in proc.stderr and "needs one" in proc.stderr
    assert "--compile-only" in proc.stderr and proc.stdout == ""
    proc = run(name, ["--compile-only", "--quick"], CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"{name}:" in proc.stderr and "CUTE_DSL_ARCH" in proc.stderr
