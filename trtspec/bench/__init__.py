"""Measurements: in-process and served benchmarks, the analytic bound, plots, peers."""
