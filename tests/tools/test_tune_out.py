"""`python -m replayssm_cute.tune --out`: a file the winners cannot be written to or merged into
is a usage error (exit 2, one line naming --out) before anything is compiled or timed (CPU)."""

import os
import subprocess
import sys

import pytest

from replayssm_cute import tune
from replayssm_cute.runtime import tuning

from tests.helpers import ROOT

ARGV = ["--shape", "mamba2:2,16,32,1", "--batch", "2"]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.ENV_USER_FILE, str(tmp_path / "user.json"))
    monkeypatch.setenv("REPLAYSSM_CUTE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tune, "_target_arch", lambda compile_only: "sm_90a")
    monkeypatch.setattr(tune, "compile_candidates", lambda *a: pytest.fail("compiled before checking --out"))


def _bad_outs(tmp_path):
    afile = tmp_path / "afile.json"
    afile.write_text('{"format": "something else"}')
    return [(tmp_path, f"--out: {tmp_path} is a folder, expected a file path"),
            (afile / "tuned.json", f"--out: cannot create {afile / 'tuned.json'}: {afile} is a file, not a folder"),
            (afile, f"--out: {afile}: expected a tuned-config file")]


def test_bad_out_fails_before_tuning(tmp_path, capsys):
    for out, message in _bad_outs(tmp_path):
        assert tune.main(ARGV + ["--out", str(out)]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"python -m replayssm_cute.tune: error: {message}"), lines


def test_bad_default_out_fails_before_tuning(tmp_path, monkeypatch, capsys):
    """The user file, when --out is not given, is checked the same way."""
    monkeypatch.setenv(tuning.ENV_USER_FILE, str(tmp_path))
    assert tune.main(ARGV) == 2
    assert f"--out: {tmp_path} is a folder, expected a file path" in capsys.readouterr().err


def test_bad_out_from_the_command_line(tmp_path):
    """--compile-only with an arch and no GPU: the bad --out stops it before any compile."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", CUTE_DSL_ARCH="sm_90a",
               REPLAYSSM_CUTE_CACHE_DIR=str(tmp_path / "c"), PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    cmd = [sys.executable, "-m", "replayssm_cute.tune", *ARGV, "--compile-only", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"python -m replayssm_cute.tune: error: --out: {tmp_path} is a folder, expected a file path"]
    assert proc.stdout == "" and not (tmp_path / "c").exists()
