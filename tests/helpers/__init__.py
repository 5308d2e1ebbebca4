"""Helpers shared by the tests, imported as ``tests.helpers.<module>`` (the repository root is on
sys.path: pytest's ``pythonpath``):

* ``inputs``: seeded random inputs for the CPU tests;
* ``numerics``: relative errors, rounding checks, the SR bits' hash;
* ``cache_checks``: checks shared by the Mamba-2 and GDN cache tests;
* ``api_cases``: the small CPU caches and arguments of the API tests (tests/api/);
* ``sweeps``: loading and running the sweeps/ scripts.

``ROOT`` is the repository root; ``repo_pythonpath`` makes a child Python import this checkout.
"""

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def repo_pythonpath(env) -> str:
    """A PYTHONPATH for a child process with environment `env`: src/ and the repository root, then
    `env`'s own PYTHONPATH if it has one."""
    return os.pathsep.join([str(ROOT / "src"), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
