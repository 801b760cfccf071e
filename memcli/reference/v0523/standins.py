"""The eight SGLang 0.5.23 modules the reference loader replaces, and why.

Each stand-in defines what the memory path asks of its module; any other name is a
placeholder class (a base class, an annotation, an `except` target) that raises
`StandInUsed` when called, so a new dependency on the memory path shows at once.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

from memcli.reference.standins import StandInUsed


class StandIn(NamedTuple):
    reason: str
    build: Callable[[Path], dict]


def _never(name: str) -> Callable[..., Any]:
    def call(*args, **kwargs):
        raise StandInUsed(f"{name} is a stand-in of the memcli 0.5.23 reference loader")
    call.__name__ = name
    return call


def _const(value: Any) -> Callable[..., Any]:
    return lambda *args, **kwargs: value


def _model_config(root: Path) -> dict:
    import enum

    class AttentionArch(enum.Enum):
        MLA = enum.auto()
        MHA = enum.auto()

    names = ("is_deepseek_dsa", "is_deepseek_v4", "is_deepseek_v3", "is_qwen3_next", "is_qwen3_5",
             "is_mimo_v2", "is_minimax_m3", "is_gemma4")
    out = {name: _const(False) for name in names}
    out.update(AttentionArch=AttentionArch, ModelConfig=type("ModelConfig", (), {}),
               get_dsa_mtp_topk_width=_const(0), get_mimo_v2_swa_config=_const(None))
    return out


def _hybrid_arch(root: Path) -> dict:
    return {"mambaish_config": _const(None), "hybrid_gdn_config": _const(None), "hybrid_kda_config": _const(None)}


def _radix_attention(root: Path) -> dict:
    import enum

    class AttentionType(enum.Enum):
        DECODER = "decoder"
        ENCODER_ONLY = "encoder_only"

    return {"RadixAttention": type("RadixAttention", (), {}), "AttentionType": AttentionType}


def _dsa_utils(root: Path) -> dict:
    names = ("aiter_can_use_preshuffle_paged_mqa", "is_dsa_enable_prefill_cp", "dsa_use_prefill_cp",
             "is_graph_dsa_split_op_surface", "is_dsa_prefill_cp_interleave")
    return {**{name: _const(False) for name in names}, "compute_dsa_seqlens": _never("compute_dsa_seqlens")}


def _metrics(root: Path) -> dict:
    return {}


def _grammar(root: Path) -> dict:
    return {"BaseGrammarObject": type("BaseGrammarObject", (), {}), "GrammarMask": type("GrammarMask", (), {})}


class SamplingBatchInfo:
    """Only the batch size, through `filter_batch` and `merge_batch` (no sampling on the memory path)."""

    def __init__(self, size: int = 0):
        self.size = size
        # no penalties: prepare_for_decode and retraction ask only `is_required`
        self.penalizer_orchestrator = SimpleNamespace(is_required=False)

    @classmethod
    def from_schedule_batch(cls, batch: Any, vocab_size: int) -> "SamplingBatchInfo":
        return cls(len(batch.reqs))

    def filter_batch(self, keep_indices: Any, keep_indices_device: Any = None) -> None:
        self.size = len(keep_indices)

    def merge_batch(self, other: "SamplingBatchInfo") -> None:
        self.size += other.size

    def __len__(self) -> int:
        return self.size


def _sampling_batch_info(root: Path) -> dict:
    return {"SamplingBatchInfo": SamplingBatchInfo}


def _decode_mixin(root: Path) -> dict:
    return {"ScheduleBatchDisaggregationDecodeMixin": type("ScheduleBatchDisaggregationDecodeMixin", (), {})}


STANDINS: dict[str, StandIn] = {
    "sglang.srt.configs.model_config": StandIn("imports transformers and every model architecture", _model_config),
    "sglang.srt.configs.hybrid_arch": StandIn("imports every hybrid model config; no hybrid model here", _hybrid_arch),
    "sglang.srt.layers.radix_attention": StandIn("model layer (forward context, CUDA-graph runners); an annotation only",
                                                 _radix_attention),
    "sglang.srt.layers.attention.dsa.utils": StandIn("DSA kernels and dp-attention; no DSA model here", _dsa_utils),
    "sglang.srt.observability.metrics_collector": StandIn("Prometheus collectors; metrics are off", _metrics),
    "sglang.srt.constrained.base_grammar_backend": StandIn("reasoning parser and OpenAI protocol; no grammar", _grammar),
    "sglang.srt.sampling.sampling_batch_info": StandIn("imports dill at top level; only the batch size is kept",
                                                       _sampling_batch_info),
    "sglang.srt.disaggregation.decode_schedule_batch_mixin": StandIn("PD transfer engines; an empty mixin",
                                                                     _decode_mixin),
}
