"""vLLM 0.33's v1 scheduler over memcli's block manager (`memcli.mem_cache.block_manager`):
the engine `vllm-0.33` (`memcli.engines.vllm_033`) builds it."""
