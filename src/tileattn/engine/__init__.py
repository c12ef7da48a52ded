"""tileattn.engine: an LLM inference engine on tileattn's attention kernels (contract B).

    from tileattn.engine import LLM, SamplingParams
    llm = LLM("smollm2")            # an HF directory, a .gguf file, or "smollm2" (the embedded model)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    print(out[0].outputs[0].text)

See docs/engine.md for the design, docs/tensor_parallel.md for tensor_parallel_size.
"""

from .config import EngineConfig
from .distributed import TensorParallelError
from .llm import LLM, LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import PoolingParams, SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "PoolingParams", "RequestOutput", "SamplingParams",
           "TensorParallelError"]
