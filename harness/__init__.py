"""What the tests and the benchmarks share: loopback servers and processes, receivers, fake engines, simulated
fleets, the scenarios a test asserts and a bench measures. Imported as ``harness.NAME`` from the repository root;
it imports neither ``tests`` nor ``bench``, and the wheel does not ship it."""
