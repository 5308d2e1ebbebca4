"""The small CPU caches and arguments the API tests share (tests/api/): a Mamba-2 and a GDN cache
with random checkpoints and records and mixed cursors, their decode / verify arguments, bit snapshots
of a cache, and verify's rejection check."""

import pytest
import torch

from replayssm_cute import GDNCache, Mamba2Cache, verify

from tests.helpers.inputs import gen

# Mamba-2: heads, head dim, state dim, groups; the window
H, P, N, G, L = 4, 16, 32, 2, 4
SLOTS = 6
ACT = torch.bfloat16
B_ROWS = 3
# cursors per slot: slot 3 flushes (h + 1 == L), the others append a record.
CURSORS = [0, 1, 2, 3, 1, 2]
SLOT_IDS = [3, 1, 5]

CACHE_TENSORS = ("checkpoint", "ring_x", "ring_B", "ring_dt", "cursor", "origin")
GDN_TENSORS = ("checkpoint", "ring_u", "ring_k", "ring_g", "ring_v", "ring_beta", "cursor", "origin")

HV, V, K, KH = 4, 16, 32, 2  # value heads, V, K, key heads (2 value heads per key head)


def mamba2_cache(pad_slot_id=-1, dtype=ACT, seed=0):
    """A CPU cache with random checkpoints and ring records and mixed cursors."""
    c = Mamba2Cache(SLOTS, H, P, N, G, window=L, dtype=dtype, pad_slot_id=pad_slot_id)
    g = gen(seed)
    c.checkpoint.copy_(torch.randn(c.checkpoint.shape, generator=g))
    c.ring_x.copy_(torch.randn(c.ring_x.shape, generator=g).to(dtype))
    c.ring_B.copy_(torch.randn(c.ring_B.shape, generator=g).to(dtype))
    c.ring_dt.copy_(0.05 + 0.2 * torch.rand(c.ring_dt.shape, generator=g))
    c.cursor.copy_(torch.tensor(CURSORS, dtype=torch.int32))
    c.origin.copy_(torch.randint(0, c.capacity, (SLOTS,), generator=g, dtype=torch.int32))
    return c


def tensor_names(c):
    return GDN_TENSORS if isinstance(c, GDNCache) else CACHE_TENSORS


def clone_cache(c):
    if isinstance(c, GDNCache):
        d = GDNCache(c.num_slots, c.num_v_heads, c.head_v_dim, c.head_k_dim, c.num_k_heads,
                     window=c.window, max_draft=c.max_draft, dtype=c.dtype, pad_slot_id=c.pad_slot_id,
                     keep_v_beta=c.keep_v_beta)
    else:
        d = Mamba2Cache(c.num_slots, c.nheads, c.headdim, c.dstate, c.ngroups, window=c.window,
                        max_draft=c.max_draft, dtype=c.dtype, pad_slot_id=c.pad_slot_id)
    for n in tensor_names(c):
        if getattr(c, n) is not None:
            getattr(d, n).copy_(getattr(c, n))
    if c.table.pending is not None:  # a verify awaiting its commit: the clone awaits it too
        d.table.pending = d.table.last_plan = c.table.pending._replace(table=d.table)
    return d


def bits(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def snapshot(c):
    return {n: bits(getattr(c, n)) for n in tensor_names(c) if getattr(c, n) is not None}


def assert_cache_bits(c, snap):
    now = snapshot(c)
    assert now.keys() == snap.keys()
    for n in snap:
        assert torch.equal(now[n], snap[n]), f"cache.{n} was written"


def assert_same_cache(c1, c2):
    assert_cache_bits(c1, snapshot(c2))


def noncontig(t, order):
    """Same shape and values as t, inner dims not packed (a permuted copy)."""
    return t.permute(*order).contiguous().permute(*[order.index(i) for i in range(t.dim())])


def meta(t):
    """An empty tensor of t's shape and dtype on the meta device."""
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def gdn_cache(pad_slot_id=-1, dtype=ACT, seed=0, keep_v_beta=True, max_draft=0):
    """A CPU GDN cache with random checkpoints and records (v / beta kept, so every ring tensor
    exists and is checked) and the mixed cursors of the Mamba-2 cache above."""
    c = GDNCache(SLOTS, HV, V, K, KH, window=L, max_draft=max_draft, dtype=dtype, pad_slot_id=pad_slot_id,
                 keep_v_beta=keep_v_beta)
    g = gen(seed)
    c.checkpoint.copy_(torch.randn(c.checkpoint.shape, generator=g))
    c.ring_u.copy_(torch.randn(c.ring_u.shape, generator=g).half())
    keys = torch.randn(c.ring_k.shape, generator=g)
    c.ring_k.copy_((keys / keys.norm(dim=-1, keepdim=True)).to(dtype))
    c.ring_g.copy_(-(0.01 + 0.5 * torch.rand(c.ring_g.shape, generator=g)))
    if keep_v_beta:
        c.ring_v.copy_(torch.randn(c.ring_v.shape, generator=g).to(dtype))
        c.ring_beta.copy_(torch.rand(c.ring_beta.shape, generator=g))
    c.cursor.copy_(torch.tensor(CURSORS, dtype=torch.int32))
    c.origin.copy_(torch.randint(0, c.capacity, (SLOTS,), generator=g, dtype=torch.int32))
    return c


def gdn_inputs(b=B_ROWS, slots=SLOT_IDS, dtype=ACT, seed=1):
    g = gen(seed)
    return dict(
        q=torch.randn(b, KH, K, generator=g).to(dtype),
        k=torch.randn(b, KH, K, generator=g).to(dtype),
        v=torch.randn(b, HV, V, generator=g).to(dtype),
        a=torch.randn(b, HV, generator=g).to(dtype),
        b=torch.randn(b, HV, generator=g).to(dtype),
        A_log=torch.log(1.0 + 7.0 * torch.rand(HV, generator=g)),
        dt_bias=-4.0 + 2.0 * torch.rand(HV, generator=g),
        slot_ids=torch.tensor(slots, dtype=torch.int32),
    )


# ----------------------------------------------------------------------------- speculative verify

SPEC_DRAFT = 3  # the spec cache's max_draft
SPEC_T = 2
# slot 3 holds window records (left by a commit): any T flushes; slot 5: h + T = 5 > L flushes;
# slot 1: h + T = 3 <= L appends.
SPEC_CURSORS = [0, 1, 2, L, 1, 3]
GDN_TOKENS = ("q", "k", "v", "a", "b")


def spec_cache(pad_slot_id=-1, dtype=ACT, seed=0, window=L, max_draft=SPEC_DRAFT):
    c = Mamba2Cache(SLOTS, H, P, N, G, window=window, max_draft=max_draft, dtype=dtype,
                    pad_slot_id=pad_slot_id)
    g = gen(seed)
    c.checkpoint.copy_(torch.randn(c.checkpoint.shape, generator=g))
    c.ring_x.copy_(torch.randn(c.ring_x.shape, generator=g).to(dtype))
    c.ring_B.copy_(torch.randn(c.ring_B.shape, generator=g).to(dtype))
    c.ring_dt.copy_(0.05 + 0.2 * torch.rand(c.ring_dt.shape, generator=g))
    c.cursor.copy_(torch.tensor([min(h, window) for h in SPEC_CURSORS], dtype=torch.int32))
    c.origin.copy_(torch.randint(0, c.capacity, (SLOTS,), generator=g, dtype=torch.int32))
    return c


def spec_inputs(T=SPEC_T, b=B_ROWS, slots=SLOT_IDS, dtype=ACT, seed=1):
    g = gen(seed)
    return dict(
        x=torch.randn(b, T, H, P, generator=g).to(dtype),
        dt=(torch.randn(b, T, H, generator=g) - 1.0).to(dtype),
        A=-(0.5 + torch.rand(H, generator=g)),
        B=torch.randn(b, T, G, N, generator=g).to(dtype),
        C=torch.randn(b, T, G, N, generator=g).to(dtype),
        slot_ids=torch.tensor(slots, dtype=torch.int32),
        D=torch.randn(H, generator=g),
        z=torch.randn(b, T, H, P, generator=g).to(dtype),
        dt_bias=0.1 * torch.randn(H, generator=g),
        dt_softplus=True,
    )


def gdn_spec_inputs(T=SPEC_T, slots=SLOT_IDS, seed=1):
    """GDN verify arguments, tokens laid out (b, T, ...)."""
    bsz = len(slots)
    args = gdn_inputs(b=bsz * T, slots=slots * T, seed=seed)
    return {**args, **{n: args[n].unflatten(0, (bsz, T)) for n in GDN_TOKENS},
            "slot_ids": torch.tensor(slots, dtype=torch.int32)}


def pending(cache):
    return getattr(cache, "pending_drafts", None)


def assert_verify_rejected(name, args, cache, out=None):
    """verify raises ValueError naming `name`; no cache tensor, no out element, no pending
    commit changes."""
    snap = snapshot(cache)
    was_pending = pending(cache)
    if out is None:
        out = torch.full((B_ROWS, SPEC_T, H, P), 7.0, dtype=ACT)
    before = bits(out) if out.device.type == "cpu" else None
    with pytest.raises(ValueError) as e:
        verify(cache, **args, out=out)
    assert f"'{name}'" in str(e.value), str(e.value)
    assert_cache_bits(cache, snap)
    assert pending(cache) == was_pending
    if before is not None:
        assert torch.equal(bits(out), before), "out was written"
    return str(e.value)
