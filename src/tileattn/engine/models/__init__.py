"""Model families the engine runs: Llama and its relatives (llama.py), Gemma 2 and 3 (gemma.py)."""

from .gemma import GEMMA_ARCHITECTURES, GemmaForCausalLM
from .llama import LLAMA_ARCHITECTURES, LlamaForCausalLM

SUPPORTED_ARCHITECTURES = (*LLAMA_ARCHITECTURES, *GEMMA_ARCHITECTURES)


def model_class(architecture: str):
    """The model class that runs ``architecture`` (one of SUPPORTED_ARCHITECTURES)."""
    return GemmaForCausalLM if architecture in GEMMA_ARCHITECTURES else LlamaForCausalLM


__all__ = ["SUPPORTED_ARCHITECTURES", "GemmaForCausalLM", "LlamaForCausalLM", "model_class"]
