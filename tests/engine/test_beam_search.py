"""LLM.beam_search against transformers' beam search (float32, CPU), with EOS an ordinary token on
both sides so every answer has max_tokens tokens: the same best answers, in the same order, with the
same scores; EOS-ended answers set aside; bad arguments refused."""

import pytest
import torch

from tileattn.engine import LLM

from .checkpoints import make_checkpoint

PROMPTS = [[0, 5, 9, 17, 33, 40, 2, 7], [0, 300, 301, 302] * 3]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("beam")
    hf = make_checkpoint(path, "llama3")
    return LLM(str(path), device="cpu", max_model_len=128, kv_cache_blocks=64, block_size=8), hf


@pytest.mark.parametrize("beam_width", [1, 3, 5])
def test_beams_match_transformers(model, beam_width):
    llm, hf = model
    hf.generation_config.eos_token_id = None  # EOS is an ordinary token: every beam runs 6 tokens
    ours = llm.beam_search(PROMPTS, beam_width, max_tokens=6, ignore_eos=True)
    for prompt, answers in zip(PROMPTS, ours):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), num_beams=beam_width, num_return_sequences=beam_width,
                              max_new_tokens=6, do_sample=False, length_penalty=1.0, pad_token_id=1,
                              output_scores=True, return_dict_in_generate=True)
        want = [row[len(prompt):].tolist() for row in out.sequences]
        assert [a.token_ids for a in answers] == want
        if beam_width > 1:  # transformers' beam scores: the sum of log-probabilities / length
            assert torch.allclose(torch.tensor([a.score for a in answers]), out.sequences_scores.float(), atol=1e-4)
        assert all(len(a.token_ids) == 6 and not a.finished for a in answers)
        assert answers == sorted(answers, key=lambda a: -a.score)


def test_eos_sets_answers_aside(model):
    llm, _ = model
    eos = next(iter(llm.engine.eos_token_ids))
    answers = llm.beam_search(PROMPTS[:1], 5, max_tokens=12)[0]
    assert all(a.finished == (a.token_ids[-1] == eos) for a in answers)
    assert all(eos not in a.token_ids[:-1] for a in answers)


def test_bad_arguments(model):
    llm, _ = model
    for width in (0, 11, 2.0):
        with pytest.raises(ValueError, match="beam_width"):
            llm.beam_search(PROMPTS, width, 4)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search(PROMPTS, 2, 0)
    for bad in ("1", float("nan"), None):
        with pytest.raises(ValueError, match="length_penalty"):
            llm.beam_search(PROMPTS, 2, 4, length_penalty=bad)
    with pytest.raises(ValueError, match="ignore_eos"):
        llm.beam_search(PROMPTS, 2, 4, ignore_eos="yes")
    assert not llm.engine.has_unfinished_requests()
