"""Benchmarks behind `plait bench <what>` (see plait/commands/bench.py)."""
