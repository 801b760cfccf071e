"""Checks that drive the whole stack through the scheduler (above `sched` in the layering)."""
