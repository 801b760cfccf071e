"""`memcli reference diff`: memcli's scheduler against the engine's own loop (SGLang 0.5.5's, 0.5.23's), step by step."""
