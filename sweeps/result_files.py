"""Where the sweeps write their results, one rule for all of them: by default a new file per
device and day, sweeps/results/<stem>_<device>_<YYYY-MM-DD>.csv (<stem>_..._quick.csv with
--quick), so that no default run overwrites the results committed there (a second run on the
same device and day replaces the first's); an output path that cannot be written is a usage
error before any work starts."""

import datetime
import re
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from replayssm_cute.precompile import path_error  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def device_tag(name: Optional[str]) -> str:
    """A short lowercase name of the device for file names: "NVIDIA H200" -> "h200", "NVIDIA H100
    80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100", "NVIDIA GeForce RTX 4090" ->
    "rtx4090"; None (no GPU) -> "cpu"; "gpu" if nothing is left."""
    if name is None:
        return "cpu"
    words = [w for w in re.split(r"[\s_-]+", name) if w and w.lower() not in ("nvidia", "geforce", "tesla", "quadro")]
    if words and words[0].lower() in ("rtx", "gtx") and len(words) > 1:
        words = [words[0] + words[1]] + words[2:]
    return (re.sub(r"[^a-z0-9]", "", words[0].lower()) if words else "") or "gpu"


def gpu_name() -> Optional[str]:
    """torch.cuda.get_device_name() of the current GPU, or None without one."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def default_out(stem: str, device: str, quick: bool = False, day: Optional[datetime.date] = None) -> Path:
    """sweeps/results/<stem>_<device>_<day, default today>.csv, with --quick ..._quick.csv."""
    day = day or datetime.date.today()
    return RESULTS / f"{stem}_{device}_{day.isoformat()}{'_quick' if quick else ''}.csv"


def check_out(ap, flag: str, path) -> None:
    """Exit with a usage error naming `flag` (ap.error) when no file can be written at `path`."""
    reason = path_error(path)
    if reason is not None:
        ap.error(f"{flag}: {reason}")
