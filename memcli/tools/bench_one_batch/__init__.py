"""`memcli bench-one-batch`: static batches through the real stack, timed phase by phase.

`run.py` (the entry, `run_bench_one_batch`), `results.py`, `report.py`; `rounds.py` runs the
rounds over the cases, `runner.py` one case's stack calls, `host_tier_bench.py` the host
tier's copies, `sglang_side.py` SGLang's own memory path beside memcli's; `blocks.py` the
static batch of an engine whose memory is a block manager (vLLM's), `vllm_side.py` vLLM's own
`KVCacheManager` beside it.
"""

import os

# Defaults shown in --help live here, so that --help imports no torch or numpy. They fit the
# built-in config (16,384-token pool, 64 request rows) and run in a few seconds on a CPU.
# SGLang's own defaults (bs 1, input 1024, output 16) fit too.
TREE_CACHES = ("none", "chunk", "radix", "hiradix")
DEFAULT_BATCH_SIZES = (1, 8)
DEFAULT_INPUT_LEN = 512
DEFAULT_OUTPUT_LEN = 16
DEFAULT_REPEAT = {"cuda": 10, "cpu": 5}
DEFAULT_ROUNDS = 7
VLLM_COMPARE = "vllm-0.33"  # vLLM's real KVCacheManager, beside memcli's vllm-0.33 engine
SGLANG_0523_COMPARE = "sglang-0.5.23"  # SGLang 0.5.23's allocation.py, loaded in this process
COMPARE_CHOICES = ("sglang-0.5.5", VLLM_COMPARE, SGLANG_0523_COMPARE)


def interpret_without_cuda() -> None:
    """SGLang's Triton kernels run in the interpreter on a machine without CUDA. Triton
    settles that when the first kernel is decorated, so this runs before the stack (and any
    kernel) is imported: before `memcli.tools.bench_one_batch.run`."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
