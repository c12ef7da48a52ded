"""Tiny random-init checkpoints of each supported architecture, written by transformers (fp32)
with a small byte-level BPE tokenizer trained by `tokenizers`, plus helpers shared by the tests."""

from __future__ import annotations

import torch

TEXT = ("the quick brown fox jumps over the lazy dog. hello world! paged attention keeps keys and "
        "values in blocks; caf\u00e9 na\u00efve \u00fcber \u20ac5 \U0001f600 ")

# Per architecture: the transformers config class and the options that exercise what differs.
ARCHITECTURES = {
    # Llama 3.x: llama3 rope scaling, untied embeddings, GQA 4/2
    "llama3": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 64})),
    # Llama 2 style: default rope, MHA, attention + MLP biases (attention_bias / mlp_bias)
    "llama2": ("LlamaConfig", dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True)),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    # Mistral v0.1: sliding-window attention, a window far shorter than the tests' prompts
    "mistral-window": ("MistralConfig", dict(sliding_window=12)),
    # Qwen2: q/k/v bias, tied embeddings
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    # Qwen3: q/k RMSNorm, head_dim (24) != hidden / heads (16), tied embeddings
    "qwen3": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True)),
    # SmolLM3: a NoPE layer (no rotary) every second layer here (every fourth in the released model)
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2, pad_token_id=None)),
    # Granite: embedding, attention (the scale), residual and logits multipliers far from 1
    "granite": ("GraniteConfig", dict(embedding_multiplier=3.0, attention_multiplier=0.1, residual_multiplier=0.5,
                                      logits_scaling=2.0)),
    # Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj tensors, 12 of 16 head dims rotating, longrope
    # with its short factors (the original context is the whole one here; test_models checks the long
    # factors and the attention factor on a model whose original context is 32)
    # (make_checkpoint sizes the factor lists for the head dim)
    "phi3": ("Phi3Config", dict(pad_token_id=None, partial_rotary_factor=0.75, original_max_position_embeddings=512,
                                rope_scaling={"rope_type": "longrope"})),
    # gpt-oss: attention sinks (drawn large enough to bite), a window on every other layer, q/k/v/o biases,
    # 4 biased experts top-2 with the clamped SwiGLU, YaRN past a 16-position original context
    "gpt-oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8, head_dim=16,
                                     intermediate_size=32, pad_token_id=None,
                                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                                      "original_max_position_embeddings": 16})),
    # OLMo 2: branch outputs normalised before the residual adds, q/k RMSNorm over the whole projection
    "olmo2": ("Olmo2Config", dict(pad_token_id=None)),
    # OLMo 3: OLMo 2's layers with a window of 8 on two layers of three, YaRN on the full layer only
    "olmo3": ("Olmo3Config", dict(pad_token_id=None, num_hidden_layers=3, sliding_window=8,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                                      "original_max_position_embeddings": 16,
                                                                      "rope_theta": 10000.0}})),
    # GLM-4: four norms per layer, interleaved rotary on half of each head's dims, fused gate_up_proj,
    # q/k/v biases
    "glm4": ("Glm4Config", dict(pad_token_id=None, head_dim=16, attention_bias=True)),
    # Seed-OSS: q/k/v biases and, separately, an o_proj bias
    "seed-oss": ("SeedOssConfig", dict(pad_token_id=None, head_dim=16, attention_bias=True, attention_out_bias=True)),
    # ERNIE 4.5 (dense): biases on every projection, interleaved rotary over the whole head
    "ernie4.5": ("Ernie4_5Config", dict(pad_token_id=None, head_dim=16, use_bias=True)),
    # EXAONE 4.0: OLMo's post-branch norms with per-head q/k norms, windows of 8 on three layers of four and no
    # rotary on the fourth
    "exaone4": ("Exaone4Config", dict(pad_token_id=None, head_dim=16, num_hidden_layers=4, sliding_window=8,
                                      sliding_window_pattern=4)),
    # Gemma 2: sandwich norms with (1 + w), GELU-tanh MLP, scaled embeddings, a window on every other
    # layer far shorter than the prompts, attention and final logit caps low enough to bite
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8, attn_logit_softcapping=3.0,
                                    final_logit_softcapping=5.0, query_pre_attn_scalar=24)),
    # Gemma 3 (text): Gemma 2's layers with q/k norms, no caps, sliding layers with their own rope base
    # (10^4 against the full layers' 10^6 with linear scaling), one full layer in three
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8, num_hidden_layers=3, query_pre_attn_scalar=24,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                            "rope_theta": 1000000.0}})),
    # Mixtral: every layer sparse, 4 experts, top-2 renormalised; w1/w3/w2 expert names
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    # Qwen2-MoE: q/k/v biases, 8 experts top-2 not renormalised, a gated shared expert, layer 1 dense
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    # Qwen3-MoE: q/k norms, head_dim 24, 8 experts top-3 renormalised (norm_topk_prob)
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                         norm_topk_prob=True, head_dim=24)),
}


def save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant: "
                          "{% if enable_thinking is defined and not enable_thinking %}no thinking: {% endif %}{% endif %}")
    fast.save_pretrained(path)


def add_think_tokens(path) -> None:
    """Give the tokenizer saved at ``path`` Qwen3's "<think>" and "</think>" as added tokens (one
    token each, not special: the text keeps them), as reasoning models' tokenizers have them."""
    import os

    from tokenizers import AddedToken, Tokenizer

    file = os.path.join(path, "tokenizer.json")
    tok = Tokenizer.from_file(file)
    tok.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<think>", "</think>")])
    tok.save(file)


def make_checkpoint(path, arch: str, seed: int = 0, kernel_head_dims: bool = False, overrides: dict | None = None):
    """Write a tiny checkpoint of ``arch`` (a key of ARCHITECTURES) to ``path``; returns the
    transformers model (fp32, eval) for use as the oracle. kernel_head_dims: head_dim 64 (128 for
    Qwen3's explicit one), sizes tileattn's CUDA paged kernels support; else 16 (24).
    overrides: config fields replacing the defaults (e.g. num_key_value_heads)."""
    import transformers

    class_name, options = ARCHITECTURES[arch]
    fields = dict(vocab_size=384, hidden_size=256 if kernel_head_dims else 64,
                  intermediate_size=384 if kernel_head_dims else 96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1)
    if kernel_head_dims and "head_dim" in options:
        options = {**options, "head_dim": 128}
    options = {**options, **(overrides or {})}
    if (options.get("rope_scaling") or {}).get("rope_type") == "longrope":  # one factor per rotating frequency
        head_dim = options.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"]
        half = int(head_dim * options.get("partial_rotary_factor", 1.0)) // 2
        options["rope_scaling"] = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                   "long_factor": [2.0 + 0.3 * i for i in range(half)]}
    config = getattr(transformers, class_name)(**{**fields, **options})
    torch.manual_seed(seed)
    # eager attention: the form that honours every option (transformers 5.17's default for Gemma 2 was sdpa,
    # which drops attn_logit_softcapping: the oracle then differed from Gemma 2 by 0.41 relative)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    # Larger weights than the default init (0.15 at hidden 64, activations of unit scale at any
    # width): logits far from uniform, so greedy choices are not near-ties.
    std = 1.2 / config.hidden_size ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices and stacked experts
                p.normal_(0, std)
            elif name.endswith(("sinks", "_proj_bias", "router.bias")):  # gpt-oss's, zero or tiny by default
                p.normal_(0, 1.0)
    model.save_pretrained(path)
    save_tokenizer(path)
    return model.eval()


def engine_logits(engine, token_ids, lora: str | None = None) -> torch.Tensor:
    """float32 logits [T, vocab] of the engine's model (with LoRA adapter ``lora``) over a whole
    prompt, through the paged cache and the same input preparation the engine's steps use (and,
    tensor parallel, the same broadcast to the workers)."""
    from tileattn.engine.sampling_params import SamplingParams
    from tileattn.engine.sequence import Request

    slot = 0 if lora is None else engine.runner.lora.slot(lora)
    seq = Request("logits", token_ids, SamplingParams(), lora_slot=slot).seqs[0]
    assert engine.block_manager.ensure_slots(seq, len(token_ids))
    try:
        return engine.runner.all_logits([(seq, len(token_ids))])
    finally:
        engine.block_manager.free(seq)


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())
