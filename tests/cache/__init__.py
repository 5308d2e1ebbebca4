"""Mamba2Cache, GDNCache and the low-precision caches: layout, prefill, the cache-level reference
steps (CPU)."""
