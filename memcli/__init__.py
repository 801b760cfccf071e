"""memcli: build, exercise and inspect the KV-cache memory stack of an LLM serving engine."""

__version__ = "0.1.0"
