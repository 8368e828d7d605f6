"""Sluice's functional core: pure, deterministic, no I/O and no clock.

Every entry point takes observations and ``now`` and returns decisions as data. The live
gateway (``controller``) and the simulator (``sim``) drive the same objects.
"""
