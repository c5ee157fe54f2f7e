"""The test suite: a package, so that its helpers are imported as ``tests.NAME`` from the repository root."""
