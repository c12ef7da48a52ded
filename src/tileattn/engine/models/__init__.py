"""Model families the engine runs: Llama and its relatives (llama.py), Gemma 2 and 3 (gemma.py),
the mixture-of-experts models Mixtral, Qwen2-MoE and Qwen3-MoE (moe.py), gpt-oss (gpt_oss.py), OLMo 2
and 3 (olmo.py), GLM-4 (glm.py)."""

from .gemma import GEMMA_ARCHITECTURES, GemmaForCausalLM
from .glm import GLM_ARCHITECTURES, GlmForCausalLM
from .gpt_oss import GPT_OSS_ARCHITECTURES, GptOssForCausalLM
from .llama import LLAMA_ARCHITECTURES, LlamaForCausalLM
from .moe import MOE_ARCHITECTURES, MoEForCausalLM
from .olmo import OLMO_ARCHITECTURES, OlmoForCausalLM

SUPPORTED_ARCHITECTURES = (*LLAMA_ARCHITECTURES, *GEMMA_ARCHITECTURES, *MOE_ARCHITECTURES, *GPT_OSS_ARCHITECTURES,
                           *OLMO_ARCHITECTURES, *GLM_ARCHITECTURES)
_CLASSES = {**dict.fromkeys(GEMMA_ARCHITECTURES, GemmaForCausalLM), **dict.fromkeys(MOE_ARCHITECTURES, MoEForCausalLM),
            **dict.fromkeys(GPT_OSS_ARCHITECTURES, GptOssForCausalLM), **dict.fromkeys(OLMO_ARCHITECTURES, OlmoForCausalLM),
            **dict.fromkeys(GLM_ARCHITECTURES, GlmForCausalLM)}


def model_class(architecture: str):
    """The model class that runs ``architecture`` (one of SUPPORTED_ARCHITECTURES)."""
    return _CLASSES.get(architecture, LlamaForCausalLM)


__all__ = ["SUPPORTED_ARCHITECTURES", "GemmaForCausalLM", "GlmForCausalLM", "GptOssForCausalLM", "LlamaForCausalLM",
           "MoEForCausalLM", "OlmoForCausalLM", "model_class"]
