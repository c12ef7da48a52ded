"""Model families the engine runs (one so far: Llama and its relatives)."""

from .llama import SUPPORTED_ARCHITECTURES, LlamaForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaForCausalLM"]
