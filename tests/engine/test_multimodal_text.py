"""Multimodal checkpoints run as their language model (text in, text out): Gemma 3 (4B and up:
Gemma3ForConditionalGeneration), Mistral Small 3.1/3.2 (Mistral3ForConditionalGeneration), Qwen2.5-VL
and Qwen3-VL (their multimodal rotary is plain rotary on text), tiny random ones written by transformers, against transformers' own multimodal model on text-only input
(float32, logits within 1e-5); the vision tower's tensors are skipped, the processor's chat template read."""

import json

import pytest
import torch

from tileattn.engine import LLMEngine
from tileattn.engine.loader import read_model_config

from .checkpoints import engine_logits, rel_error, save_tokenizer
from .test_models import PROMPT

TEXT = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, pad_token_id=None, bos_token_id=0,
            eos_token_id=1)


def save_scaled(hf, path):
    """hf with its matrices drawn as checkpoints.make_checkpoint draws them (logits far from uniform),
    saved to path with the tests' tokenizer; returns it in eval mode."""
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.normal_(0, 1.2 / TEXT["hidden_size"] ** 0.5)
    hf.save_pretrained(path)
    save_tokenizer(path)
    return hf.eval()


def gemma3(path):
    import transformers

    config = transformers.Gemma3Config(
        text_config={**TEXT, "sliding_window": 8, "query_pre_attn_scalar": 24},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=383, boi_token_index=381, eoi_token_index=382)
    return transformers.Gemma3ForConditionalGeneration(config)


def mistral3(path):
    import transformers

    config = transformers.Mistral3Config(
        text_config={**TEXT, "model_type": "mistral", "sliding_window": None},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14, head_dim=16),
        image_token_index=383, spatial_merge_size=1, vision_feature_layer=-1)
    return transformers.Mistral3ForConditionalGeneration(config)


def qwen_vl(version):
    def make(path):
        import transformers

        # the t / h / w rotary sections sized for head_dim 16 (8 frequencies)
        text = {**TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                **({"head_dim": 16} if version == "3" else {})}
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
        config = getattr(transformers, f"Qwen{version}VLConfig")(text_config=text, vision_config=vision)
        return getattr(transformers, f"Qwen{version}VLForConditionalGeneration")(config)

    return make


@pytest.mark.parametrize("make,text_arch", [(gemma3, "Gemma3ForCausalLM"), (mistral3, "MistralForCausalLM"),
                                            (qwen_vl("2_5_"), "Qwen2ForCausalLM"), (qwen_vl("3"), "Qwen3ForCausalLM")],
                         ids=["gemma3-4b-form", "mistral-small-3.1-form", "qwen2.5-vl", "qwen3-vl"])
def test_language_model_of_a_multimodal_checkpoint(tmp_path, make, text_arch):
    torch.manual_seed(0)
    hf = save_scaled(make(tmp_path), tmp_path)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = read_model_config(str(tmp_path))
    assert cfg.architecture == text_arch and cfg.extra["text_of"] == type(hf).__name__
    engine = LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=128, kv_cache_blocks=16)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0].float()
    err = rel_error(engine_logits(engine, PROMPT), ref)
    assert err < 1e-5, f"{text_arch} inside {type(hf).__name__}: logits relative error {err:.2e}"
    assert engine.tokenizer.chat_template == template


def test_other_multimodal_text_models_are_refused():
    from tileattn.engine.loader import model_config_from_hf

    with pytest.raises(ValueError, match="unsupported architecture"):
        model_config_from_hf({"architectures": ["Mistral3ForConditionalGeneration"],
                              "text_config": {**TEXT, "model_type": "ministral9"}})


@pytest.mark.parametrize("released_layout", [False, True], ids=["transformers-layout", "released-layout"])
def test_qwen3_vl_moe_language_model_with_stacked_experts(tmp_path, released_layout):
    """Qwen3-VL-MoE keeps every expert of a layer in one tensor: gate_up_proj [E, 2 ffn, hidden] and
    down_proj [E, hidden, ffn] as transformers writes them, or transposed as the released checkpoints
    store them ([E, hidden, 2 ffn], [E, ffn, hidden]); both load to transformers' logits (its router
    always renormalises)."""
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    text = {**TEXT, "moe_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14)
    hf = save_scaled(transformers.Qwen3VLMoeForConditionalGeneration(
        transformers.Qwen3VLMoeConfig(text_config=text, vision_config=vision)), tmp_path)
    if released_layout:
        tensors = load_file(tmp_path / "model.safetensors")
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    cfg = read_model_config(str(tmp_path))
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.extra["moe"]["renormalize"]
    engine = LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=128, kv_cache_blocks=16)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([PROMPT])).logits[0].float()
    err = rel_error(engine_logits(engine, PROMPT), ref)
    assert err < 1e-5, f"Qwen3-VL-MoE's language model: logits relative error {err:.2e}"
