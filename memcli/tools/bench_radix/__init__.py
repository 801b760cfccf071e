"""`memcli bench-radix`: the radix cache timed against a token-by-token baseline tree."""

# Defaults shown in --help live here, so that --help imports no torch or numpy.
DEFAULT_CAPACITY_TOKENS = 2_000_000
