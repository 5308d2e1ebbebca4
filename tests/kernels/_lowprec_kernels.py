"""Compile the decode and verify kernels' low-precision and two-precision variants for one target
(compile-only checks): run as a script with CUTE_DSL_ARCH set; each variant's PTX goes to
``<label>.ptx`` in the working directory. Small heads and a short window keep the builds quick; the
variants cover every state path: light entry tiles (fp16 / fp8, a read copy or the checkpoint
itself), whole-head nvfp4 writers, SR checkpoints, GDN re-derivation and folding, window 1, the
verify kernels' decoded entry tiles and flushes into every copy, and the sequence table's plan and
commit that advance the SR counter.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from replayssm_cute.runtime.compile_cache import compile_options  # noqa: E402
from replayssm_cute.kernels.table import TableShape, compile_commit, compile_plan  # noqa: E402
from replayssm_cute.kernels.gdn.config import GDNConfig, GDNShape  # noqa: E402
from replayssm_cute.kernels.gdn.decode import compile_decode as compile_gdn  # noqa: E402
from replayssm_cute.kernels.gdn.verify import compile_verify as compile_gdn_verify  # noqa: E402
from replayssm_cute.kernels.mamba2.config import Mamba2Config, Mamba2Shape  # noqa: E402
from replayssm_cute.kernels.mamba2.decode import compile_decode as compile_mamba2  # noqa: E402
from replayssm_cute.kernels.mamba2.verify import compile_verify as compile_mamba2_verify  # noqa: E402

MAMBA2 = [  # (checkpoint_format, read_copy, window)
    ("fp32", "fp16", 4), ("fp16", "fp8", 4), ("fp8", None, 4), ("fp32", "nvfp4", 4), ("nvfp4", None, 4),
    ("fp8", None, 1), ("nvfp4", None, 1),
]
GDN = [  # (checkpoint_format, read_copy, window, rederive)
    ("fp32", "fp8", 4, True), ("fp32", "fp16", 4, False), ("fp16", "nvfp4", 4, True), ("fp16", None, 4, False),
    ("nvfp4", None, 1, False),
]
MAMBA2_VERIFY = [("fp32", "fp16"), ("fp16", "fp8"), ("fp8", None), ("fp32", "nvfp4")]  # (checkpoint, read)
GDN_VERIFY = [("fp32", "fp8", True), ("fp16", "nvfp4", True), ("fp8", "fp16", False), ("fp32", None, True)]
DRAFTS = 2


def variants():
    """(label, build(options)) of every variant."""
    out = []
    for ckpt, read, L in MAMBA2:
        shape = Mamba2Shape(4, 64, 128, 1, L, L, checkpoint_format=ckpt, read_copy=read)
        config = Mamba2Config(64, 4) if "nvfp4" in (ckpt, read) else Mamba2Config(16, 4)
        out.append((f"mamba2_{ckpt}_{read}_L{L}", lambda o, s=shape, c=config: compile_mamba2(s, c, o)))
    for ckpt, read, L, rederive in GDN:
        keep = L > 1 and (read is not None or rederive)
        shape = GDNShape(4, 64, 128, 2, L, L, keep_v_beta=keep, checkpoint_format=ckpt, read_copy=read,
                         rederive=rederive)
        config = GDNConfig(64, 4) if "nvfp4" in (ckpt, read) else GDNConfig(16, 4)
        fold = "rederive" if rederive else "fold"
        out.append((f"gdn_{ckpt}_{read}_L{L}_{fold}", lambda o, s=shape, c=config: compile_gdn(s, c, o)))
    cap = 4 + DRAFTS
    for ckpt, read in MAMBA2_VERIFY:
        shape = Mamba2Shape(4, 64, 128, 1, 4, cap, checkpoint_format=ckpt, read_copy=read)
        config = Mamba2Config(64, 4) if "nvfp4" in (ckpt, read) else Mamba2Config(32, 2)
        out.append((f"mamba2verify_{ckpt}_{read}_L4",
                    lambda o, s=shape, c=config: compile_mamba2_verify(s, c, DRAFTS, o)))
    for ckpt, read, rederive in GDN_VERIFY:
        shape = GDNShape(4, 64, 128, 2, 4, cap, keep_v_beta=True, checkpoint_format=ckpt, read_copy=read,
                         rederive=rederive)
        config = GDNConfig(64, 4) if "nvfp4" in (ckpt, read) else GDNConfig(32, 2)
        fold = "rederive" if rederive else "fold"
        out.append((f"gdnverify_{ckpt}_{read}_L4_{fold}",
                    lambda o, s=shape, c=config: compile_gdn_verify(s, c, DRAFTS, o)))
    out.append(("commit_fp16_None_sr", lambda o: compile_commit(TableShape(4, cap, DRAFTS), o)))
    out.append(("plan_fp16_None_sr", lambda o: compile_plan(TableShape(4, cap), o)))
    return out


if __name__ == "__main__":
    os.makedirs("dump", exist_ok=True)  # --keep-ptx writes a copy there
    for label, build in variants():
        ptx = build(compile_options("--keep-ptx", "--dump-dir dump")).__ptx__
        with open(f"{label}.ptx", "w") as f:
            f.write(ptx)
        print(label, "compiled", flush=True)
