"""`memcli replay`: continuous batching over a trace; hit rates, allocation, eviction, integrity."""
