"""The float64 references (Mamba-2, Gated DeltaNet, speculative verify) and the low-precision
formats (replayssm_cute.quant), CPU."""
