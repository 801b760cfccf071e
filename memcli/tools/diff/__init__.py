"""`memcli diff`: two step logs (or two configs on one trace) compared step by step."""
