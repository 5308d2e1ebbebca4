"""One adapter per layer type: what the host does differently for each (argument checks, CPU
references, the kernel Shape of a call, its kernels and their argument lists; see
``mamba2.Mamba2Layer``), looked up by layer name (``models.ModelSpec.layer``) or by cache. A new
layer type is one module here, registered in ``LAYERS``, plus its kernels."""

from __future__ import annotations

from .gdn import GDNLayer
from .mamba2 import Mamba2Layer

LAYERS = {"mamba2": Mamba2Layer, "gdn": GDNLayer}
# What an op's 'cache' argument must be, for its TypeError.
EXPECTED_CACHE = " or ".join(f"a {layer.cache_type.__name__}" for layer in LAYERS.values())


def layer_of(cache):
    """The adapter of `cache`'s layer type, or None when it is no layer's cache."""
    for layer in LAYERS.values():
        if isinstance(cache, layer.cache_type):
            return layer
    return None


def model_cache(model, slots: int, window: int, device, max_draft: int = 0, dtype=None, read_copy=None,
                pad_slot_id: int = -1, table=None):
    """A cache of one layer of `model` (a models.ModelSpec, whose nheads, headdim, dstate,
    ngroups are the cache's dims in order for every layer type) with `slots` slots at `window`,
    ring room for `max_draft` drafts, activations `dtype` (default bf16); `read_copy` adds that
    read copy next to an fp32 checkpoint (the cache's defaults otherwise); `table` the model's
    SequenceTable (default: the cache's own)."""
    import torch

    formats = {} if read_copy is None else dict(checkpoint_format="fp32", read_copy=read_copy)
    return LAYERS[model.layer].cache_type(slots, model.nheads, model.headdim, model.dstate, model.ngroups,
                                          window=window, max_draft=max_draft, dtype=dtype or torch.bfloat16,
                                          device=device, pad_slot_id=pad_slot_id, table=table, **formats)
