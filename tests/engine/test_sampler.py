"""The batched sampler checked statistically against the distributions it should draw from."""

from types import SimpleNamespace

import pytest
import torch

from tileattn.engine import SamplingParams
from tileattn.engine.sampler import (Sampler, apply_allowed_tokens, apply_bans, apply_logit_bias, apply_penalties,
                                     apply_top_k_top_p, argmax_rows)

DRAWS = 4000


def fake_seq(params, prompt=(), output=(), index=0, bad_words_token_ids=()):
    tokens = list(prompt) + list(output)
    return SimpleNamespace(params=params, index=index, generator=None, matcher=None, token_ids=tokens,
                           num_prompt_tokens=len(prompt), output_token_ids=list(output),
                           num_output_tokens=len(output),
                           request=SimpleNamespace(bad_words_token_ids=bad_words_token_ids))


def frequencies(logits_row, params, draws=DRAWS):
    """Empirical distribution of DRAWS samples of one row (drawn as one batch of DRAWS rows)."""
    seqs = [fake_seq(params) for _ in range(draws)]
    tokens, _ = Sampler()(logits_row.expand(draws, -1).clone(), seqs)
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.shape[-1]).double() / draws


def expected(logits_row, keep):
    probs = torch.zeros_like(logits_row, dtype=torch.float64)
    probs[keep] = logits_row[keep].double().softmax(-1)
    return probs


def assert_close_distribution(freq, probs, what):
    # 5 standard errors of a binomial proportion per token
    tol = 5 * (probs * (1 - probs) / DRAWS).sqrt() + 1e-9
    bad = ((freq - probs).abs() > tol).nonzero().flatten().tolist()
    assert not bad, f"{what}: tokens {bad} drawn with frequency {freq[bad].tolist()} vs probability {probs[bad].tolist()}"


LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])  # probs ~ .40 .25 .15 .09 ...


def test_temperature_one_matches_softmax():
    torch.manual_seed(0)
    freq = frequencies(LOGITS, SamplingParams(temperature=1.0))
    assert_close_distribution(freq, expected(LOGITS, torch.ones(8, dtype=torch.bool)), "softmax")


def test_temperature_scales_logits():
    torch.manual_seed(1)
    freq = frequencies(LOGITS, SamplingParams(temperature=0.5))
    assert_close_distribution(freq, expected(LOGITS / 0.5, torch.ones(8, dtype=torch.bool)), "T=0.5")


def test_top_k_keeps_k_most_likely_renormalised():
    torch.manual_seed(2)
    freq = frequencies(LOGITS, SamplingParams(top_k=3))
    keep = torch.tensor([True, True, True] + [False] * 5)
    assert freq[3:].sum() == 0
    assert_close_distribution(freq, expected(LOGITS, keep), "top_k=3")


def test_top_p_keeps_smallest_set_reaching_p():
    torch.manual_seed(3)
    probs = LOGITS.softmax(-1)  # cumulative .40, .65, .80, ...: top_p 0.7 keeps 3 tokens
    assert probs[:2].sum() < 0.7 < probs[:3].sum()
    freq = frequencies(LOGITS, SamplingParams(top_p=0.7))
    keep = torch.tensor([True, True, True] + [False] * 5)
    assert freq[3:].sum() == 0
    assert_close_distribution(freq, expected(LOGITS, keep), "top_p=0.7")


def test_min_p_drops_unlikely_tokens():
    torch.manual_seed(4)
    probs = LOGITS.softmax(-1)
    keep = probs >= 0.3 * probs.max()  # tokens 0, 1, 2
    freq = frequencies(LOGITS, SamplingParams(min_p=0.3))
    assert freq[~keep].sum() == 0
    assert_close_distribution(freq, expected(LOGITS, keep), "min_p=0.3")


def test_mixed_batch_rows_keep_their_own_settings():
    logits = LOGITS.expand(4, -1).clone()
    seqs = [fake_seq(SamplingParams(temperature=0)), fake_seq(SamplingParams(top_k=1)),
            fake_seq(SamplingParams(top_k=2, top_p=0.5)), fake_seq(SamplingParams(temperature=0, top_k=5))]
    for _ in range(20):
        tokens, _ = Sampler()(logits.clone(), seqs)
        assert tokens[0] == 0 and tokens[1] == 0 and tokens[3] == 0
        assert tokens[2] == 0  # top_k 2 -> (.62, .38) renormalised; top_p .5 keeps only token 0


def test_seeded_rows_reproducible_and_independent_of_batch():
    logits = torch.randn(64)
    def draw(batch_others):
        seq = fake_seq(SamplingParams(seed=1234))
        others = [fake_seq(SamplingParams()) for _ in range(batch_others)]
        out = []
        for _ in range(10):
            tokens, _ = Sampler()(logits.expand(1 + batch_others, -1).clone(), [seq] + others)
            out.append(tokens[0])
        return out
    assert draw(0) == draw(5), "a seeded request's tokens depend on its batch neighbours"
    other = fake_seq(SamplingParams(seed=99))
    diff = [Sampler()(logits[None].clone(), [other])[0][0] for _ in range(10)]
    assert diff != draw(0)


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    seq = fake_seq(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
                   prompt=[0], output=[1, 1, 2])
    out = apply_penalties(logits, [seq])[0]
    # token 0: in prompt only -> 2 / 2; token 1: output twice -> -1 * 2 - 0.25 * 2 - 0.5;
    # token 2: output once -> 0.5 / 2 - 0.25 - 0.5; token 3: untouched
    assert torch.allclose(out, torch.tensor([1.0, -3.0, -0.5, 0.0]))


def test_logit_bias_shifts_the_distribution_and_greedy():
    torch.manual_seed(4)
    bias = {0: -100.0, 5: 2.5}
    freq = frequencies(LOGITS, SamplingParams(logit_bias=bias))
    biased = LOGITS.clone()
    biased[0] -= 100.0
    biased[5] += 2.5
    assert_close_distribution(freq, expected(biased, torch.ones(8, dtype=torch.bool)), "logit_bias")
    # greedy rows: the argmax of the biased logits, in a batch with an unbiased row
    seqs = [fake_seq(SamplingParams(temperature=0, logit_bias={0: -100.0})), fake_seq(SamplingParams(temperature=0)),
            fake_seq(SamplingParams(temperature=0, logit_bias={7: 100.0}))]
    tokens, logprobs = Sampler()(LOGITS.expand(3, -1).clone(), seqs)
    assert tokens == [1, 0, 7]
    # bias is added before the penalties, and only to its own row
    out = apply_penalties(apply_logit_bias(LOGITS.expand(2, -1).clone(), seqs[:2]), seqs[:2])
    assert out[0, 0] == LOGITS[0] - 100 and torch.equal(out[1], LOGITS)


def test_logit_bias_is_checked():
    for bad in ({-1: 1.0}, {True: 1.0}, {3: 101.0}, {3: "x"}, [(3, 1.0)]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    assert SamplingParams(logit_bias={3: 1}).logit_bias == {3: 1.0}


def test_top_k_top_p_masks_are_exact():
    row = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    out = apply_top_k_top_p(row, [2], [1.0])
    assert torch.isinf(out[0, [1, 3]]).all() and torch.isfinite(out[0, [0, 2]]).all()


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = torch.randn(3, 16)
    seqs = [fake_seq(SamplingParams(temperature=0, logprobs=3)) for _ in range(2)] + [fake_seq(SamplingParams(temperature=0))]
    tokens, logprobs = Sampler()(logits.clone(), seqs)
    ref = logits.log_softmax(-1)
    assert logprobs[2] is None
    for row in range(2):
        top = ref[row].topk(3)
        assert set(logprobs[row]) == set(top.indices.tolist())
        for token, value in logprobs[row].items():
            assert value == pytest.approx(ref[row, token].item(), abs=1e-6)


@pytest.mark.parametrize("vocab", [1, 63, 64 * 7, 1000, 128256, 151936])
def test_argmax_rows_is_torch_argmax(vocab):
    """The two-pass argmax returns torch's answer: random rows, rows of ties (the first maximum),
    a row of -inf, rows with NaN (NaN is the maximum), the maximum in the last / first entry."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen)
    x[1] = 0.0  # all tied: index 0
    x[2] = float("-inf")
    x[3, vocab // 2] = float("nan")
    x[4, -1] = 100.0
    x[5, 0] = 100.0
    if vocab > 3:
        x[1, vocab // 3:] = 1.0  # ties at the top across groups: the first one
        x[3, 1] = float("nan")
    assert argmax_rows(x).tolist() == x.argmax(dim=-1).tolist()
    assert argmax_rows(x.bfloat16()).tolist() == x.bfloat16().argmax(dim=-1).tolist()


def test_min_tokens_bans_stop_ids_and_eos_until_reached():
    eos, stop = 0, 3  # LOGITS' argmax is token 0; a +10 bias makes token 3 the argmax
    sampler = Sampler(eos_token_ids=(eos,))
    rows = [  # (params, output tokens so far, what greedy must pick)
        (SamplingParams(temperature=0, min_tokens=2, max_tokens=8), (5,), 1),           # EOS banned: the runner-up
        (SamplingParams(temperature=0, min_tokens=2, max_tokens=8), (5, 6), 0),         # reached: EOS allowed
        (SamplingParams(temperature=0, min_tokens=2, max_tokens=8, ignore_eos=True), (), 0),  # EOS not a stop here
        (SamplingParams(temperature=0, min_tokens=3, max_tokens=8, stop_token_ids=[stop], logit_bias={stop: 10.0},
                        ignore_eos=True), (1, 2), 0),                                   # stop id banned, EOS kept
        (SamplingParams(temperature=0, min_tokens=3, max_tokens=8, stop_token_ids=[stop], logit_bias={stop: 10.0}),
         (1, 2), 1),                                                                    # both banned
        (SamplingParams(temperature=0, min_tokens=3, max_tokens=8, stop_token_ids=[stop], logit_bias={stop: 10.0}),
         (1, 2, 4), stop),                                                              # reached
    ]
    seqs = [fake_seq(p, prompt=(7,), output=out) for p, out, _ in rows]
    tokens, _ = sampler(LOGITS.expand(len(rows), -1).clone(), seqs)
    assert tokens == [want for _, _, want in rows]
    # sampled rows never draw a banned token; the other rows' logits are untouched
    torch.manual_seed(4)
    params = SamplingParams(temperature=1.0, min_tokens=1, max_tokens=4, stop_token_ids=[1, 2])
    draws = [fake_seq(params) for _ in range(DRAWS)]
    tokens, _ = sampler(LOGITS.expand(DRAWS, -1).clone(), draws)
    assert not {0, 1, 2} & set(tokens)
    kept = torch.tensor([False, False, False] + [True] * 5)
    freq = torch.bincount(torch.tensor(tokens), minlength=8).double() / DRAWS
    assert_close_distribution(freq, expected(LOGITS, kept), "min_tokens")
    plain = [fake_seq(SamplingParams(min_tokens=2, max_tokens=4), output=(1, 2))]
    logits = LOGITS.expand(1, -1).clone()
    assert apply_bans(logits, plain, (eos,)) is logits


def test_min_tokens_is_checked():
    for bad in (-1, 1.5, True, 9):
        with pytest.raises(ValueError, match="min_tokens"):
            SamplingParams(min_tokens=bad, max_tokens=8)


def test_allowed_token_ids_restrict_the_rows_that_have_them():
    seqs = [fake_seq(SamplingParams(temperature=0, allowed_token_ids=[2, 5])), fake_seq(SamplingParams(temperature=0)),
            fake_seq(SamplingParams(temperature=0, allowed_token_ids=[7]))]
    tokens, _ = Sampler()(LOGITS.expand(3, -1).clone(), seqs)
    assert tokens == [2, 0, 7]
    out = apply_allowed_tokens(LOGITS.expand(3, -1).clone(), seqs)
    assert torch.equal(out[1], LOGITS) and torch.equal(out[0, [2, 5]], LOGITS[[2, 5]])
    assert out[0].isinf().sum() == 6 and out[2].isinf().sum() == 7
    torch.manual_seed(5)
    freq = frequencies(LOGITS, SamplingParams(allowed_token_ids=[1, 3, 4]))
    keep = torch.zeros(8, dtype=torch.bool)
    keep[[1, 3, 4]] = True
    assert_close_distribution(freq, expected(LOGITS, keep), "allowed_token_ids")
    for bad in ([], [-1], [1.0], "1"):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output=1)


def test_bad_words_ban_the_token_that_would_complete_one():
    params = SamplingParams(temperature=0, bad_words=["w"])  # the words' token ids are the engine's to make
    words = ((0,), (4, 2, 1))  # a one-token word (the argmax) and a three-token one
    rows = [((), 1), ((4,), 1), ((4, 2), 2)]  # output so far -> greedy pick: 0 always banned, 1 after 4 2
    seqs = [fake_seq(params, prompt=(4, 2), output=out, bad_words_token_ids=words) for out, _ in rows]
    tokens, _ = Sampler()(LOGITS.expand(len(rows), -1).clone(), seqs)
    assert tokens == [1, 1, 2]  # the prompt's 4 2 does not count: only the output is matched
    for bad in (["  "], [""], "w", [3]):
        with pytest.raises(ValueError, match="bad_words"):
            SamplingParams(bad_words=bad)


def test_extreme_floats_are_rejected_or_sampled_sanely():
    """Values that made a row NaN (and, with a grammar, killed the engine) : inf (1e999 is a valid JSON
    number) is an error for every float field; a repetition penalty outside float32's normal range
    too; a tiny temperature samples the argmax (not token 0 of a NaN row); a top_p that rounds to 0
    in float32 keeps the most likely token."""
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        with pytest.raises(ValueError, match=f"{name} must be a finite number"):
            SamplingParams(**{name: float("inf")})
    for bad in (1e-50, 1e39):
        with pytest.raises(ValueError, match="repetition_penalty must be > 0 and within float32"):
            SamplingParams(repetition_penalty=bad)
    row = LOGITS * 30  # logits / 1e-40 overflowed float32 before the row max was subtracted
    for params in (SamplingParams(temperature=1e-40), SamplingParams(temperature=1.0, top_p=1e-50)):
        tokens, _ = Sampler()(row.expand(16, -1).clone(), [fake_seq(params) for _ in range(16)])
        assert tokens == [0] * 16 and torch.argmax(row) == 0, params
    tokens, _ = Sampler()((LOGITS.flip(0) * 30).expand(4, -1).clone(), [fake_seq(SamplingParams(temperature=1e-40))] * 4)
    assert tokens == [7] * 4, "the argmax, not token 0 of a NaN row"
