"""`memcli check-page-size`: page-size agreement of every component and the paged invariants under a workload."""

# Defaults shown in --help live here, so that --help imports no torch or numpy.
DEFAULT_STEPS = 3000
TRACE_DEFAULT_REQUESTS = 200
