"""The runtime: from an op call's kernel Shape to a launched kernel.

* ``launch``: ``Kernel`` (one GPU kernel of a layer: its analytical default config, check and
  compile function), the launcher memoised per (kernel, Shape, T, batch bucket, config), the
  sequence-table kernels, the active platform, ``reload``;
* ``tuning``: the tuned-config files (format, locations, lookup), read by ``launch``;
* ``compile_cache``: compiled kernels in memory and on disk, keyed by what changes the code.

Imports go one way, launch -> tuning -> compile_cache; nothing here imports the ops or the layer
adapters (replayssm_cute.layers hold the Kernels and map a cache to its Shape). Importing the
runtime imports no cutlass; the first compile does.
"""
