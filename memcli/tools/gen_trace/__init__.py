"""`memcli gen-trace`: summary and rendering of a written synthetic trace."""
