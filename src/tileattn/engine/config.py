"""EngineConfig (what the user sets) and ModelConfig (what the checkpoint says).

ModelConfig is the one description of a Llama-family model the rest of the engine reads; the
loader fills it from an HF config.json (transformers 4 or 5 field names) or from GGUF metadata.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(value, name: str = "dtype") -> torch.dtype | None:
    """None / "auto" -> None; a torch.dtype or one of _DTYPES' names -> that dtype.

    Raises ValueError naming ``name`` for anything else (int dtypes, unknown strings).
    """
    if value is None or value == "auto":
        return None
    if isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {value}")
        return value
    if isinstance(value, str) and value.lower() in _DTYPES:
        return _DTYPES[value.lower()]
    raise ValueError(f"{name} must be 'auto', float32, bfloat16 or float16, got {value!r}")


@dataclass
class EngineConfig:
    """Engine options (contract B). ``model`` is an HF checkpoint directory or a .gguf file.

    max_model_len: None -> the model's context length (on CPU, capped by what the KV cache holds).
    max_num_seqs: sequences in one step (also the largest CUDA-graph batch).
    max_num_batched_tokens: token budget of one step (decodes + prefill chunks).
    block_size: tokens per KV-cache block.
    gpu_memory_utilization: fraction of the GPU's total memory the engine may use in all
        (weights + activations + KV cache); the KV cache gets what is left.
    dtype: compute dtype; None/"auto" -> the checkpoint's (bf16/fp16) on CUDA, float32 on CPU.
    enforce_eager: no CUDA graphs.
    device: "cuda", "cuda:1", "cpu"; None -> cuda when available.
    tensor_parallel_size: ranks of tensor parallelism (one process and GPU each; gloo ranks on CPU);
        see docs/tensor_parallel.md.
    kv_cache_blocks: an explicit block count (the default on CPU is a 256 MiB cache).
    num_speculative_tokens: k > 0 drafts per decode step by prompt lookup (speculative.py; greedy and
        sampled requests whose tokens depend on their logits rows alone);
        0: off.
    max_loras: LoRA adapter slots (lora.py; LLMEngine.add_lora); 0: none. One GPU; steps with adapter
        tokens run eagerly (the CUDA graphs serve the others).
    max_lora_rank: the largest adapter rank the slots take.
    scheduling_policy: "fcfs" (arrival order) or "priority" (add_request's priority, lower first,
        then arrival; the lowest priority is preempted first; scheduler.py).
    Raises ValueError naming the bad field (see validate()).
    """

    model: str
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    dtype: object = None
    enforce_eager: bool = False
    device: str | None = None
    tensor_parallel_size: int = 1
    kv_cache_blocks: int | None = None
    num_speculative_tokens: int = 0
    max_loras: int = 0
    max_lora_rank: int = 16
    scheduling_policy: str = "fcfs"

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def positive(name):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a checkpoint path, got {self.model!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size", "max_lora_rank"):
            positive(name)
        if not isinstance(self.max_loras, int) or isinstance(self.max_loras, bool) or self.max_loras < 0:
            raise ValueError(f"max_loras must be an int >= 0, got {self.max_loras!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.max_loras and self.tensor_parallel_size > 1:
            raise ValueError("max_loras > 0 is not served with tensor_parallel_size > 1")
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.kv_cache_blocks is not None:
            positive("kv_cache_blocks")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an int in [0, 16], got {k!r}")
        fraction = self.gpu_memory_utilization
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0.0 < fraction <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {fraction!r}")
        self.dtype = parse_dtype(self.dtype)
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError) as exc:  # TypeError: not a str, int or torch.device
                raise ValueError(f"device {self.device!r} is not a torch device: {exc}") from None


@dataclass
class ModelConfig:
    """A Llama-family model. head_dim is explicit (Qwen3 sets it apart from hidden / heads)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None   # {"rope_type": "llama3" | "linear", ...} or None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False             # Qwen2/2.5 always; Llama when attention_bias
    o_bias: bool = False               # Llama attention_bias
    mlp_bias: bool = False
    qk_norm: bool = False              # Qwen3: RMSNorm over head_dim on q and k before rotary
    sliding_window: int | None = None  # Mistral v0.1: a query sees itself and the W - 1 keys before
    torch_dtype: torch.dtype | None = None
    extra: dict = field(default_factory=dict)

    def validate(self) -> None:
        """Raises ValueError when the numbers cannot describe a working model."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config: {name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_key_value_heads ({self.num_kv_heads}) must divide "
                             f"num_attention_heads ({self.num_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for rotary, got {self.head_dim}")
