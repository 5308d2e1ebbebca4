"""The package version, in a module of its own so that the runtime (compile-cache keys, tuned-config
platforms) reads it without importing the package, whose ``__init__`` imports the ops."""

__version__ = "0.1.0"
