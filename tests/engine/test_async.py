"""Async scheduling (LLMEngine._run_ahead): the decode step after a step is launched before that
step's tokens reach the host. The tokens, texts, finish reasons, seeds and block accounting must be
those of the synchronous engine (TILEATTN_ENGINE_ASYNC=0), through the CUDA-graph input plumbing
(an eager stand-in for the graphs on the CPU) and the eager path, offline and streaming, with
stops that only the host can see (EOS / stop ids / stop strings) and aborts while a step is ahead."""

import pytest
import torch

from tileattn.engine import LLMEngine, SamplingParams

from .checkpoints import make_checkpoint
from .test_engine import PROMPTS, _EagerGraph, assert_all_free


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_async")
    make_checkpoint(path, "llama3")
    return str(path)


def make_engine(checkpoint, run_ahead: bool, graphs: bool, **options):
    engine = LLMEngine.from_model(checkpoint, device="cpu", **{"max_model_len": 256, "kv_cache_blocks": 128,
                                                              "block_size": 8, "max_num_seqs": 8, **options})
    engine.async_scheduling = run_ahead
    if graphs:
        runner = engine.runner
        runner.make_static_inputs()
        for size in runner.graph_batch_sizes():
            out = torch.full((size, engine.model_config.hidden_size), float("nan"))
            runner.graphs[size] = (_EagerGraph(runner, size, out), out, size)
    launched = []
    launch = engine.runner.launch_decode_ahead

    def counted(previous, seqs, rows):
        launched.append(len(seqs))
        return launch(previous, seqs, rows)

    engine.runner.launch_decode_ahead = counted
    return engine, launched


def stream(engine, requests, abort_after=None):
    """Drive the step API as the server does; returns {id: (token ids, text, pieces joined,
    finish_reason, stop_reason)} of the requests that finished. abort_after: (step, id)."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    pieces, done, steps = {}, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                pieces[out.request_id, c.index] = pieces.get((out.request_id, c.index), "") + c.new_text
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.text, pieces[out.request_id, c.index], c.finish_reason,
                                         c.stop_reason) for c in out.outputs]
        steps += 1
        if abort_after is not None and steps == abort_after[0]:
            engine.abort_request(abort_after[1])
    return done


def workload(stop_token, stop_text):
    """Greedy and seeded requests of different lengths; some stop where only the host can tell."""
    greedy = dict(temperature=0, ignore_eos=True)
    return [
        ("a", PROMPTS[0], SamplingParams(max_tokens=20, **greedy)),
        ("b", PROMPTS[1], SamplingParams(max_tokens=7, **greedy)),
        ("c", PROMPTS[2], SamplingParams(max_tokens=30, stop_token_ids=[stop_token], **greedy)),
        ("d", PROMPTS[3], SamplingParams(max_tokens=30, stop=[stop_text], **greedy)),
        ("e", PROMPTS[0], SamplingParams(n=2, temperature=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True)),
        ("f", PROMPTS[3], SamplingParams(max_tokens=1, **greedy)),
    ]


@pytest.fixture(scope="module")
def stops(checkpoint):
    """A stop token and a stop string that the synchronous run actually meets mid-answer."""
    engine, _ = make_engine(checkpoint, run_ahead=False, graphs=False)
    done = stream(engine, [("c", PROMPTS[2], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
                           ("d", PROMPTS[3], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))])
    tokens, text = done["c"][0][0], done["d"][0][1]
    assert len(text) > 12, f"the tiny model's answer is too short to cut: {text!r}"
    return tokens[9], text[8:11]


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_run_ahead_matches_synchronous(checkpoint, stops, graphs):
    sync_engine, launched_sync = make_engine(checkpoint, run_ahead=False, graphs=graphs)
    want = stream(sync_engine, workload(*stops))
    engine, launched = make_engine(checkpoint, run_ahead=True, graphs=graphs)
    got = stream(engine, workload(*stops))
    assert not launched_sync
    assert len(launched) >= 15, f"the run-ahead path ran {len(launched)} times"
    for request_id in want:
        assert got[request_id] == want[request_id], f"request {request_id}: async {got[request_id]} != sync"
    reasons = {rid: [c[3] for c in completions] for rid, completions in want.items()}
    assert reasons["c"] == ["stop"] and reasons["d"] == ["stop"] and reasons["a"] == ["length"], reasons
    assert want["d"][0][1] == want["d"][0][2], "streamed pieces do not add up to the text"
    assert_all_free(sync_engine)
    assert_all_free(engine)


def test_offline_generate_matches_synchronous(checkpoint, stops):
    from tileattn.engine import LLM

    results = []
    for run_ahead in (False, True):
        llm = LLM(checkpoint, device="cpu", max_model_len=256, kv_cache_blocks=128, block_size=8)
        llm.engine.async_scheduling = run_ahead
        outs = llm.generate([p for _, p, _ in workload(*stops)], [s for _, _, s in workload(*stops)], use_tqdm=False)
        results.append([[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs])
        assert_all_free(llm.engine)
    assert results[1] == results[0]


def test_abort_while_a_step_is_ahead(checkpoint, stops):
    """Aborting requests between steps, with a step already launched for them: the others get the
    tokens they get alone, nothing leaks."""
    engine, launched = make_engine(checkpoint, run_ahead=True, graphs=True)
    done = stream(engine, workload(*stops), abort_after=(4, "a"))
    assert "a" not in done and launched
    alone, _ = make_engine(checkpoint, run_ahead=False, graphs=True)
    want = stream(alone, [r for r in workload(*stops) if r[0] != "a"])
    assert done == want
    assert_all_free(engine)


def test_running_out_of_blocks_falls_back_to_preemption(checkpoint):
    """A cache too small for every next token: no step is launched ahead without room; the
    synchronous path preempts and the tokens are those of a roomy run."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    requests = [(str(i), p, params) for i, p in enumerate(PROMPTS)]
    roomy, _ = make_engine(checkpoint, run_ahead=False, graphs=True)
    want = stream(roomy, requests)
    tight, launched = make_engine(checkpoint, run_ahead=True, graphs=True, kv_cache_blocks=30, max_model_len=200)
    got = stream(tight, requests)
    assert tight.stats()["num_preemptions"] > 0, "not preempted: the test needs a smaller cache"
    assert got == want and launched
    assert_all_free(tight)
