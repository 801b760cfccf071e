"""One home per command: what it runs, its result types and its rendering (`report.py`)."""
