"""Helpers the test tiers, the benchmarks and the experiments share (imported as ``tests.support.*``)."""
