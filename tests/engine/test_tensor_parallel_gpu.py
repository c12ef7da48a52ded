"""Tensor parallelism on 2 GPUs: NCCL, bf16, tileattn's paged kernels, CUDA-graph decode with the
all-reduces captured in the graphs (the CPU tests in test_tensor_parallel.py cover the same layout
with gloo in fp32).

Oracle and bounds as tests/gpu/test_engine.py: transformers' fp32 forward of the tiny Llama 3
checkpoint (head_dim 64, GQA 4/2 -> one KV head per rank); bf16 logits within 3e-2 relative; runs
that differ in their bf16 reductions (TP=2 against TP=1: two partial sums per row-parallel GEMM)
must give the same tokens or first differ only at an fp32 near-tie (assert_same_or_tie); the
graph path must give the eager TP=2 path's tokens bitwise (same kernels, same NCCL reductions).
One process group per process: every TP engine is shut down before the next starts.
"""

import contextlib
import os

import pytest
import torch

from tests.engine.checkpoints import engine_logits, make_checkpoint, rel_error
from tests.engine.test_tensor_parallel import kill_worker_mid_run
from tests.gpu.test_engine import GREEDY, PROMPTS, assert_same_or_tie, check_every_projection_on_gemv, force_gemv
from tileattn.engine import LLM
from tileattn.engine.distributed import MULTICAST_OFF, TensorParallelError

pytestmark = pytest.mark.gpu

OPTIONS = dict(device="cuda", dtype="bfloat16", max_model_len=256, kv_cache_blocks=128, max_num_seqs=8)


@pytest.fixture(autouse=True)
def _two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, torch sees {torch.cuda.device_count()}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_tp_gpu")
    hf = make_checkpoint(path, "llama3", kernel_head_dims=True)
    return str(path), hf


@contextlib.contextmanager
def tp_llm(path, **options):
    llm = LLM(path, tensor_parallel_size=2, **{**OPTIONS, **options})
    try:
        yield llm
    finally:
        llm.shutdown()


def _greedy(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], f"blocks leaked: {stats}"
    return [o.outputs[0].token_ids for o in outs]


def test_nccl_bf16_matches_single_gpu_and_graphs_match_eager(llama):
    path, hf = llama
    single = LLM(path, enforce_eager=True, **OPTIONS)
    single_tokens = _greedy(single)
    with tp_llm(path, enforce_eager=True) as eager:
        for key, value in MULTICAST_OFF.items():
            assert os.environ.get(key) == value, f"{key}={os.environ.get(key)}"
        assert eager.engine.runner.kv_cache.shape[-2] == 1, "each rank should hold 1 of the 2 KV heads"
        ours = engine_logits(eager.engine, PROMPTS[1]).cpu()
        with torch.no_grad():
            ref = hf(torch.tensor([PROMPTS[1]])).logits[0].float()
        err = rel_error(ours, ref)
        assert err < 3e-2, f"TP=2 bf16 logits relative error {err:.2e} vs transformers fp32 (bound 3e-2)"
        eager_tokens = _greedy(eager)
        assert_same_or_tie(llama, eager, eager_tokens, single_tokens, "TP=2 against TP=1")
    with tp_llm(path) as graphed:
        assert graphed.engine.runner.graphs, "no CUDA graphs were captured at TP=2"
        graph_tokens = _greedy(graphed)
    assert graph_tokens == eager_tokens, f"TP=2 graph {graph_tokens}\nTP=2 eager {eager_tokens}"


def test_gemv_projections_at_tp2(llama, monkeypatch):
    """Both ranks' projections of up to 8 rows on tileattn's GEMV kernel (forced on: here through
    the dispatch override, in the spawned worker by TILEATTN_GEMV_MAX_ROWS, read at its import),
    the row-parallel o and down projections (SiLU * up inside down's launch) all-reduced after it:
    an 8-token prompt's logits (every projection at M = 8) against transformers fp32, and CUDA-graph
    greedy decode equal to transformers' fp32 greedy tokens or first differing at a near-tie."""
    path, hf = llama
    gemv_launches = force_gemv(monkeypatch)  # rank 0's launches
    monkeypatch.setenv("TILEATTN_GEMV_MAX_ROWS", "8")
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                            pad_token_id=1)[0, len(p):].tolist() for p in PROMPTS]
    with tp_llm(path) as llm:
        assert llm.engine.runner.graphs, "no CUDA graphs were captured at TP=2"
        gemv_launches.clear()  # the graph captures' launches
        prompt = PROMPTS[0][:8]
        ours = engine_logits(llm.engine, prompt).cpu()
        check_every_projection_on_gemv("TP=2 rank 0", gemv_launches, llm.engine.runner.model)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        err = rel_error(ours, ref)
        assert err < 3e-2, f"TP=2 GEMV bf16 logits relative error {err:.2e} vs transformers fp32 (bound 3e-2)"
        assert_same_or_tie(llama, llm, _greedy(llm), want, "TP=2 GEMV against transformers fp32 greedy")


def test_worker_killed_under_nccl_is_a_clear_error(llama):
    path, _ = llama
    with tp_llm(path) as llm:
        (pid,) = llm.engine.workers.pids
        kill_worker_mid_run(llm.engine, pid, PROMPTS * 4, bound_s=30)
        with pytest.raises(TensorParallelError, match="worker rank 1"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
