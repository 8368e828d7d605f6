"""Micro-benchmarks of Sluice's core (``python -m bench`` / ``make bench``).

Each prints ``BENCH <name> <value> <unit>`` lines on stdout, measured with
``time.perf_counter`` after a warm-up; progress and context go to stderr.
"""
