"""Model families the engine runs: Llama and its relatives (llama.py), Gemma 2 (gemma2.py)."""

from .gemma2 import Gemma2ForCausalLM
from .llama import LLAMA_ARCHITECTURES, LlamaForCausalLM

SUPPORTED_ARCHITECTURES = (*LLAMA_ARCHITECTURES, "Gemma2ForCausalLM")


def model_class(architecture: str):
    """The model class that runs ``architecture`` (one of SUPPORTED_ARCHITECTURES)."""
    return Gemma2ForCausalLM if architecture == "Gemma2ForCausalLM" else LlamaForCausalLM


__all__ = ["SUPPORTED_ARCHITECTURES", "Gemma2ForCausalLM", "LlamaForCausalLM", "model_class"]
