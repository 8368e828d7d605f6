"""Live against simulated: the gateway on simworkers against the simulator on one scripted
workload (``python -m experiments.parity``; tests/support/parity.py does the runs)."""
