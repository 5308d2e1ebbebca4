"""Registry of model layer shapes (docs/design.md section 7): what precompile, demo and sweeps use.

Shapes are per GPU without tensor parallelism; pass ``tp`` to get a shard's heads and groups.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layer: str  # "mamba2" or "gdn"
    nheads: int  # Mamba-2 heads H, or GDN value heads HV
    headdim: int  # Mamba-2 P, or GDN V
    dstate: int  # Mamba-2 N, or GDN K
    ngroups: int  # Mamba-2 groups G, or GDN key heads H
    num_layers: int  # SSM layers

    def shard(self, tp: int = 1) -> "ModelSpec":
        if tp < 1 or self.nheads % tp or self.ngroups % tp:
            raise ValueError(f"tp={tp} does not split {self.name}'s {self.nheads} heads and "
                             f"{self.ngroups} groups evenly")
        return ModelSpec(self.name, self.layer, self.nheads // tp, self.headdim, self.dstate,
                         self.ngroups // tp, self.num_layers)


MODELS = {m.name: m for m in [
    ModelSpec("nemotron-nano-4b", "mamba2", 96, 80, 128, 8, 21),
    ModelSpec("nemotron-super", "mamba2", 128, 64, 128, 8, 40),
    ModelSpec("nemotron-h-8b", "mamba2", 128, 64, 128, 8, 24),
    ModelSpec("nemotron-nano-9b-v2", "mamba2", 128, 80, 128, 8, 27),
    ModelSpec("qwen3.5-4b", "gdn", 32, 128, 128, 16, 24),
    ModelSpec("qwen3.5-122b", "gdn", 64, 128, 128, 16, 36),
    ModelSpec("qwen3-next-80b", "gdn", 32, 128, 128, 16, 36),
]}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None
