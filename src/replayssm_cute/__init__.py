from pathlib import Path as _Path

# Source checkout (PYTHONPATH=src): kernels/ sits at the repository root, not in this folder, so
# let `replayssm_cute.kernels` resolve to ./kernels. An installed wheel ships it as a subpackage.
if (
    not (_Path(__file__).parent / "kernels").exists()
    and (_Path(__file__).parents[2] / "kernels" / "__init__.py").exists()
):
    __path__.append(str(_Path(__file__).parents[2]))

from .version import __version__  # noqa: E402
from .api import commit, decode, snapshot_verify, verify  # noqa: E402
from .cache import GDNCache, Mamba2Cache  # noqa: E402
from .lifecycle import fork_slots, materialize_states, reset_slots  # noqa: E402
from .table import SequenceTable, StepPlan  # noqa: E402

__all__ = ["commit", "decode", "snapshot_verify", "verify", "GDNCache", "Mamba2Cache", "SequenceTable", "StepPlan",
           "reset_slots", "fork_slots", "materialize_states", "__version__"]
