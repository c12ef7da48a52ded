"""Model families the engine runs: Llama and its relatives (llama.py), Gemma 2 and 3 (gemma.py),
the mixture-of-experts models Mixtral, Qwen2-MoE and Qwen3-MoE (moe.py)."""

from .gemma import GEMMA_ARCHITECTURES, GemmaForCausalLM
from .llama import LLAMA_ARCHITECTURES, LlamaForCausalLM
from .moe import MOE_ARCHITECTURES, MoEForCausalLM

SUPPORTED_ARCHITECTURES = (*LLAMA_ARCHITECTURES, *GEMMA_ARCHITECTURES, *MOE_ARCHITECTURES)


def model_class(architecture: str):
    """The model class that runs ``architecture`` (one of SUPPORTED_ARCHITECTURES)."""
    if architecture in GEMMA_ARCHITECTURES:
        return GemmaForCausalLM
    return MoEForCausalLM if architecture in MOE_ARCHITECTURES else LlamaForCausalLM


__all__ = ["SUPPORTED_ARCHITECTURES", "GemmaForCausalLM", "LlamaForCausalLM", "MoEForCausalLM", "model_class"]
