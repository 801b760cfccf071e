"""Trace replay: the runner, its metrics, capacity sweeps and plots."""
