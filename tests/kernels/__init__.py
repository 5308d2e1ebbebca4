"""The kernels: compile-only builds for every target (CPU), launch-config checks, the probe kernels
of the device quantisers and state io, and the GPU tests against the references (marked gpu)."""
