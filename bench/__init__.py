"""The benchmarks: a package, run from the repository root as ``python -m bench.NAME``."""
