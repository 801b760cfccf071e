"""`memcli replay`: continuous batching over a trace; hit rates, allocation, eviction, integrity."""

# Defaults shown in --help live here, so that --help imports no torch or numpy.
ARRIVALS = ("timestamp", "burst", "sequential")
