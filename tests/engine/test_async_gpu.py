"""Async scheduling on a CUDA engine (bf16, tileattn's kernels, CUDA graphs): the steps run ahead
(pinned token copies, device-side input ids, the staged one-copy graph inputs) give the synchronous
engine's tokens bitwise when the batches are the same (ignore_eos, no stops: every step of both
runs has the same sequences, so the same graphs and kernels), seeds included; stops and aborts
leave no block behind. The CPU tests (test_async.py) cover the bookkeeping token-exactly."""

import pytest

from tests.engine.checkpoints import make_checkpoint
from tileattn.engine import LLM, LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[0, 5, 9, 17, 33, 40, 2, 7], [0] + list(range(20, 120)), [0, 300, 301, 302] * 10, [0, 11]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_async_gpu")
    make_checkpoint(path, "llama3", kernel_head_dims=True)
    return str(path)


def _run(path, run_ahead, params, **options):
    llm = LLM(path, device="cuda", dtype="bfloat16", **{"max_model_len": 256, "max_num_seqs": 8,
                                                         "kv_cache_blocks": 64, **options})
    llm.engine.async_scheduling = run_ahead
    launched = []
    launch = llm.engine.runner.launch_decode_ahead
    llm.engine.runner.launch_decode_ahead = lambda *a: launched.append(1) or launch(*a)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], f"blocks leaked: {stats}"
    return [[c.token_ids for c in o.outputs] for o in outs], len(launched), llm


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_run_ahead_matches_synchronous_bitwise(path, enforce_eager):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (32, 32, 32, 32)]
    want, ahead_sync, _ = _run(path, False, params, enforce_eager=enforce_eager)
    got, ahead, llm = _run(path, True, params, enforce_eager=enforce_eager)
    assert ahead_sync == 0 and ahead >= 25, f"steps run ahead: {ahead} (sync run: {ahead_sync})"
    assert enforce_eager or llm.engine.runner.graphs, "no CUDA graphs were captured"
    assert got == want, f"async {got}\nsync  {want}"


def test_run_ahead_seeded_sampling_reproducible(path):
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=24, ignore_eos=True)
    want, _, _ = _run(path, False, params)
    got, ahead, _ = _run(path, True, params)
    assert ahead > 0 and got == want, f"async {got}\nsync  {want}"


def test_run_ahead_stops_and_aborts_free_every_block(path):
    """Stops only the host sees (a stop id met mid-answer) and an abort with a step ahead in flight."""
    want, _, _ = _run(path, False, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stop_id = want[0][0][5]
    engine = LLMEngine.from_model(path, device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=8,
                                  kv_cache_blocks=64)
    assert engine.async_scheduling
    engine.add_request("stop", PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                          stop_token_ids=[stop_id]))
    for i, prompt in enumerate(PROMPTS[1:]):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        steps += 1
        if steps == 6:
            engine.abort_request("r2")
    assert done["stop"].finish_reason == "stop" and done["stop"].token_ids[-1] == stop_id
    assert done["stop"].token_ids == want[0][0][:done["stop"].token_ids.index(stop_id) + 1]
    assert "r2" not in done and set(done) == {"stop", "r0", "r1"}
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], f"blocks leaked: {stats}"
