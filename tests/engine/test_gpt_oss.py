"""gpt-oss's released checkpoint form: MXFP4 experts (``*_blocks`` and ``*_scales``), dequantized at load.

dequantize_mxfp4 against transformers' own MXFP4 unpacking, and the engine on a tiny gpt-oss whose
experts were quantized and written in the released layout against transformers running the
dequantized weights (float32, logits within 1e-5). The model itself against transformers is in
test_models.py (ARCHITECTURES["gpt-oss"]); quantized checkpoints of other kinds are refused by name.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tileattn.engine import LLMEngine
from tileattn.engine.loader import model_config_from_hf
from tileattn.engine.models.gpt_oss import _FP4_VALUES, dequantize_mxfp4

from .checkpoints import engine_logits, make_checkpoint, rel_error
from .test_models import PROMPT


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w float [..., K] (K a multiple of 32) -> (blocks uint8 [..., K / 32, 16], scales uint8 [..., K / 32]):
    per group of 32 the power of two that brings its largest magnitude within 6, each value rounded to
    the nearest FP4 E2M1 value, two per byte (the first in the low nibble)."""
    groups = w.reshape(*w.shape[:-1], -1, 32).float()  # [..., G, 32]
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)).clamp(-127, 127)  # [..., G]
    table = torch.tensor(_FP4_VALUES)
    codes = (groups / torch.exp2(exponent).unsqueeze(-1)).unsqueeze(-1).sub(table).abs().argmin(-1)  # [..., G, 32]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # [..., G, 16]
    return blocks, (exponent + 127).to(torch.uint8)


def test_dequantize_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), generator=gen, dtype=torch.uint8)  # [E, out, in / 32, 16]
    scales = torch.randint(110, 140, (3, 8, 4), generator=gen, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)  # [E, out, in]
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # theirs: [E, in, out]
    assert torch.equal(ours, ref)
    w = torch.randn(2, 4, 64, generator=gen)
    again = dequantize_mxfp4(*quantize_mxfp4(w))
    assert rel_error(again, w) < 0.15  # 3 bits of magnitude: a coarse but faithful copy
    with pytest.raises(ValueError, match="do not pair"):
        dequantize_mxfp4(blocks, scales[..., :3])


def test_mxfp4_checkpoint_matches_its_dequantized_weights(tmp_path):
    hf = make_checkpoint(tmp_path, "gpt-oss")
    tensors = load_file(tmp_path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        weight = tensors.pop(name).transpose(1, 2)  # [E, out, in]: the released files' row order
        blocks, scales = quantize_mxfp4(weight)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        layer, projection = int(name.split(".")[2]), name.rsplit(".", 1)[1]
        with torch.no_grad():  # the oracle runs the weights the file holds
            getattr(hf.model.layers[layer].mlp.experts, projection).copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=128, kv_cache_blocks=16)
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    err = rel_error(engine_logits(engine, PROMPT), ref)
    assert err < 1e-5, f"MXFP4 gpt-oss: logits relative error {err:.2e} (bound 1e-5)"


def test_mxfp4_half_pair_and_other_quantizations_refused(tmp_path):
    make_checkpoint(tmp_path, "gpt-oss")
    tensors = load_file(tmp_path / "model.safetensors")
    weight = tensors.pop("model.layers.0.mlp.experts.down_proj").transpose(1, 2)
    tensors["model.layers.0.mlp.experts.down_proj_blocks"] = quantize_mxfp4(weight)[0]  # its scales left out
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj_blocks without its MXFP4 pair"):
        LLMEngine.from_model(str(tmp_path), device="cpu", max_model_len=64, kv_cache_blocks=8)
    config = json.loads((tmp_path / "config.json").read_text())
    for method in ("awq", "gptq", "fp8"):
        with pytest.raises(ValueError, match=f"quant_method '{method}'"):
            model_config_from_hf({**config, "quantization_config": {"quant_method": method}})
    llama = {**config, "architectures": ["LlamaForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(ValueError, match="quantized checkpoints are not supported"):
        model_config_from_hf(llama)
