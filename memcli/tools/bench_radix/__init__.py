"""`memcli bench-radix`: the radix cache timed against a token-by-token baseline tree."""
