"""Benchmarks that drive the real memory stack: `bench-one-batch` (static batches)."""
