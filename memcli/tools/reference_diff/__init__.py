"""`memcli reference diff`: memcli's scheduler against SGLang 0.5.5's own loop, step by step."""
