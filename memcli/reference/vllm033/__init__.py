"""vLLM 0.33.0's own KV-cache manager and v1 scheduler, loaded from its wheel at test time, to
check memcli's `vllm-0.33` engine against (nothing of vLLM is stored in this repository)."""
