"""The test suite: a package imported as ``tests.NAME`` from the repository root; what it shares with the benches is in
the ``harness`` package."""
