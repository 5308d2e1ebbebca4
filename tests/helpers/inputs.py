"""Random inputs shared by the CPU tests: seeded, never exactly zero, fp32-representable."""

import torch

F64 = torch.float64


def gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def randn(g, *shape):
    """Random, never exactly zero, fp32-representable values returned as float64."""
    t = torch.randn(*shape, generator=g, dtype=torch.float32)
    t = torch.where(t == 0, torch.full_like(t, 0.5), t)
    return t.to(F64)


def uniform(g, lo, hi, *shape):
    return (lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=torch.float32)).to(F64)
