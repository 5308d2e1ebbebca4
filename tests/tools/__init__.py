"""The tools around the kernels: autotuner and tuned-config files, precompile CLI, compiled-kernel
cache, demo."""
