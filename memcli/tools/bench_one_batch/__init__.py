"""`memcli bench-one-batch`: static batches through the real stack, timed phase by phase."""
