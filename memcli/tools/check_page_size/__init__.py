"""`memcli check-page-size`: page-size agreement of every component and the paged invariants under a workload."""
