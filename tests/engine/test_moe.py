"""Mixture-of-experts pieces on the CPU: routed_experts (grouped GEMM and per-expert paths) against a
float64 per-token loop, the router's renormalisation, checkpoints missing or misplacing expert
weights, config errors, tensor-parallel divisibility. The whole models against transformers are in
test_models.py (ARCHITECTURES mixtral, qwen2-moe, qwen3-moe) and test_tensor_parallel.py."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tileattn.engine import LLMEngine
from tileattn.engine.distributed import check_tensor_parallel
from tileattn.engine.layers import SparseMoE, routed_experts
from tileattn.engine.loader import load_model, model_config_from_hf

from .checkpoints import make_checkpoint


def reference_experts(x, gate_up, down, weights, experts):
    """The definition, token by token, in float64."""
    x, gate_up, down, weights = x.double(), gate_up.double(), down.double(), weights.double()
    ffn = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            h = gate_up[e] @ x[t]
            out[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(h[:ffn]) * h[ffn:]))
    return out


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per_expert"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k", [(1, 1), (1, 4), (7, 2), (33, 3), (129, 2)])
def test_routed_experts_against_float64(grouped, dtype, tokens, k):
    gen = torch.Generator().manual_seed(tokens * 10 + k)
    num_experts, hidden, ffn = 8, 64, 24
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * ffn, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, ffn, generator=gen) / ffn ** 0.5).to(dtype)
    # distinct experts per token, skewed so that some experts get no token at all
    scores = torch.rand(tokens, num_experts, generator=gen) * torch.linspace(1, 4, num_experts)
    experts = scores.topk(k, dim=-1).indices
    weights = torch.rand(tokens, k, generator=gen)
    out = routed_experts(x, gate_up, down, weights, experts, grouped=grouped)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    ref = reference_experts(x, gate_up, down, weights, experts)
    err = float((out.double() - ref).norm() / ref.norm())
    bound = 1e-6 if dtype == torch.float32 else 2e-2
    assert err < bound, f"relative error {err:.2e} (bound {bound:.0e})"


def test_routed_experts_with_every_token_on_one_expert_and_none():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=gen)
    gate_up, down = torch.randn(4, 16, 16, generator=gen), torch.randn(4, 16, 8, generator=gen)
    experts = torch.full((5, 1), 2)
    weights = torch.ones(5, 1)
    ref = reference_experts(x, gate_up, down, weights, experts)
    for grouped in (True, False):
        out = routed_experts(x, gate_up, down, weights, experts, grouped=grouped)
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-6
    empty = routed_experts(x[:0], gate_up, down, weights[:0], experts[:0])
    assert empty.shape == (0, 16)


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_takes_the_top_k_probabilities(renormalize):
    from tileattn.engine.distributed import TensorParallel

    torch.manual_seed(0)
    moe = SparseMoE(16, 6, 8, 2, renormalize, torch.float32, TensorParallel())
    for p in moe.parameters():
        p.data.normal_(0, 0.5)
    x = torch.randn(9, 16)
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    weights, experts = probs.topk(2, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    ref = reference_experts(x, moe.experts_gate_up, moe.experts_down, weights, experts)
    assert float((moe(x).double() - ref).norm() / ref.norm()) < 1e-6


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-moe")
    make_checkpoint(path, "qwen2-moe")
    return path


def _edited_copy(src, dst, edit):
    """Copy checkpoint ``src`` to ``dst`` with its tensors passed through edit(dict) first."""
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_missing_expert_weight_is_named(qwen2_moe, tmp_path):
    _edited_copy(qwen2_moe, tmp_path, lambda t: t.pop("model.layers.0.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts_gate_up\[5\.up\]"):
        LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=64, kv_cache_blocks=8)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.experts.8.up_proj.weight",   # expert 8 of 8
                                  "model.layers.1.mlp.experts.0.up_proj.weight",   # layer 1 is dense
                                  "model.layers.0.mlp.experts.0.fc_proj.weight"])
def test_expert_weight_without_a_place_is_refused(qwen2_moe, tmp_path, name):
    def add(tensors):
        tensors[name] = tensors["model.layers.0.mlp.experts.0.up_proj.weight"].clone()

    _edited_copy(qwen2_moe, tmp_path, add)
    with pytest.raises(ValueError, match="has no place"):
        LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=64, kv_cache_blocks=8)


def test_expert_weight_of_the_wrong_shape_is_refused(qwen2_moe, tmp_path):
    def transpose(tensors):
        name = "model.layers.0.mlp.experts.3.down_proj.weight"
        tensors[name] = tensors[name].T.contiguous()

    _edited_copy(qwen2_moe, tmp_path, transpose)
    with pytest.raises(ValueError, match=r"experts\.3\.down_proj\.weight has shape \(32, 64\)"):
        LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=64, kv_cache_blocks=8)


def test_moe_config_read_and_errors(qwen2_moe):
    cfg = json.loads((qwen2_moe / "config.json").read_text())
    moe = model_config_from_hf(cfg).extra["moe"]
    assert moe == {"num_experts": 8, "top_k": 2, "expert_ffn": 32, "renormalize": False,
                   "sparse_layers": [True, False], "shared_ffn": 48}
    for change, message in (({"num_experts_per_tok": 9}, "exceeds the 8 experts"),
                            ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
                            ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
                            ({"moe_intermediate_size": None}, "expert ffn size")):
        with pytest.raises(ValueError, match=message):
            model_config_from_hf({**cfg, **change})
    mixtral = model_config_from_hf({**cfg, "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                                    "num_experts": None}).extra["moe"]
    assert mixtral["renormalize"] and mixtral["sparse_layers"] == [True, True] and mixtral["expert_ffn"] == 96
    assert mixtral["shared_ffn"] == 0 and mixtral["num_experts"] == 4


def test_tensor_parallel_checks_the_expert_sizes(qwen2_moe):
    cfg = model_config_from_hf(json.loads((qwen2_moe / "config.json").read_text()))
    check_tensor_parallel(cfg, 2)
    cfg.extra["moe"]["expert_ffn"] = 33
    with pytest.raises(ValueError, match=r"the experts' ffn size \(33\) is not divisible"):
        check_tensor_parallel(cfg, 2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graphs_only_where_the_experts_need_no_host_sync(qwen2_moe, dtype):
    """On CUDA torch's grouped GEMM takes bfloat16 only; other dtypes size the per-expert GEMMs on
    the host, so the engine must not capture them (the model says so)."""
    model = load_model(str(qwen2_moe), "cpu", dtype=dtype, max_model_len=64).model
    grouped = hasattr(torch.nn.functional, "grouped_mm")
    assert model.cuda_graphs_supported() is (grouped and dtype == "bfloat16")
