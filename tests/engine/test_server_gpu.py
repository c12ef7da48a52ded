"""`tileattn serve` on a CUDA engine (bf16, tileattn's paged-attention kernels, CUDA-graph decode)
driven from the server's engine thread: concurrent streams through `tileattn bench serve`, a chat
request, a cancelled stream, metrics, and a clean shutdown.

Token-exact comparisons between batched and lone requests are left to the CPU tests: in bf16 the
GEMMs and graphs of different batch sizes round differently, so greedy near-ties may flip.
Needs fastapi and uvicorn on the GPU machine (bring their wheels); the HTTP client here is httpx.
"""

import json

import pytest

from tests.engine.test_server import MODEL, ServerThread, make_checkpoint

pytestmark = pytest.mark.gpu


def _httpx():
    try:
        import httpx
    except ImportError:
        import httpx2 as httpx
    return httpx


def test_serve_on_cuda_engine(tmp_path):
    for name in ("fastapi", "uvicorn", "prometheus_client"):
        pytest.importorskip(name)
    httpx = _httpx()
    from tileattn.engine import LLMEngine
    from tileattn.engine.bench_serve import bench_serve_main
    from tileattn.engine.server import create_app

    path = make_checkpoint(str(tmp_path / "ckpt"), kernel_head_dims=True)
    engine = LLMEngine.from_model(path, device="cuda", dtype="bfloat16", max_model_len=256, max_num_seqs=32,
                                  kv_cache_blocks=256, block_size=16)
    app = create_app(engine, MODEL, max_queue_depth=64)
    with ServerThread(app) as s:
        out = tmp_path / "bench.json"
        rc = bench_serve_main(["--base-url", s.url, "--num-prompts", "48", "--random-input-len", "40",
                               "--random-output-len", "24", "--tokenizer", path, "--request-rate", "200", "inf",
                               "--max-concurrency", "32", "--ignore-eos", "--extra-body",
                               '{"return_token_ids": true}', "--result-json", str(out)])
        runs = json.loads(out.read_text())["runs"]
        for r in runs:
            assert (r["completed"], r["failed"], r["total_output_tokens"]) == (48, 0, 48 * 24), r
            assert r["output_tokens_from_usage"] and r["ttft_ms"]["median"] > 0, r
        assert rc == 0

        with httpx.Client(base_url=s.url, timeout=60) as client:
            r = client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 8, r.json()

            with client.stream("POST", "/v1/completions", json={
                    "model": MODEL, "prompt": "the quick brown fox", "max_tokens": 200, "stream": True,
                    "ignore_eos": True, "return_token_ids": True}) as stream:
                events = 0
                for line in stream.iter_lines():
                    events += line.startswith("data:")
                    if events == 2:
                        break
            assert events == 2
        stats = s.wait_idle(timeout=10)  # the cancelled stream's blocks are free again

        status, body = s.http("GET", "/metrics")
        assert status == 200 and s.http("GET", "/health")[0] == 200
        line = next(x for x in body.decode().splitlines() if x.startswith("tileattn:generation_tokens_total"))
        assert float(line.split()[-1]) >= 2 * 48 * 24 + 8, line
        engine_loop = s.state.engine_loop
    assert not engine_loop.running, "engine thread still running after shutdown"
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert not engine.has_unfinished_requests(), "requests left in the engine after shutdown"
