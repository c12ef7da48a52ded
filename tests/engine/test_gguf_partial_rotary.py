"""GGUF files whose {arch}.rope.dimension_count is below the head dim (partial rotary) beyond Phi-3.

Before 2026-12 only phi3 read the key: a qwen2 / qwen3 file rotating part of each head ran with
full rotary (other logits, no error), and a llama file too. Now qwen2 / qwen3 (NEOX rotary in
llama.cpp: the first dimension_count dims rotate in halves, as Phi-3's partial rotary in transformers)
run it as the engine runs the same checkpoint's config.json with that rotary_dim, and the
other architectures refuse the file by its metadata, naming the key and both counts.
"""

import pytest

from tileattn.engine import LLMEngine, loader
from tileattn.engine.loader import model_config_from_gguf, read_model_config

from .checkpoints import engine_logits, make_checkpoint, rel_error
from .gguf_files import write_gguf
from .test_models import PROMPT

pytest.importorskip("gguf")


def _rotating(count):
    def edit(w, tensors):
        w.add_rope_dimension_count(count)
    return edit


@pytest.mark.parametrize("arch,head_dim", [("qwen2", 16), ("qwen3", 24)])
def test_partial_rotary_gguf_runs_as_its_hf_config(tmp_path, monkeypatch, arch, head_dim):
    """Oracle: the same checkpoint's config.json run with rotary_dim = the file's count (the partial
    rotary path test_models checks against transformers' Phi-3). transformers' Qwen2 / Qwen3 ignore
    partial_rotary_factor, so the engine's config.json path does too; the oracle's rotary_dim is
    given to it here."""
    make_checkpoint(tmp_path, arch)
    path = write_gguf(tmp_path, tmp_path / "model.gguf", arch, edit=_rotating(head_dim // 2))
    extra_options = loader._extra_options
    monkeypatch.setattr(loader, "_extra_options", lambda *a: {**extra_options(*a), "rotary_dim": head_dim // 2})
    ours, ref = read_model_config(path), read_model_config(str(tmp_path))
    assert ours.extra == ref.extra == {"rotary_dim": head_dim // 2}
    gguf_engine, hf_engine = (LLMEngine.from_model(p, device="cpu", max_model_len=128, kv_cache_blocks=16)
                              for p in (path, str(tmp_path)))
    err = rel_error(engine_logits(gguf_engine, PROMPT), engine_logits(hf_engine, PROMPT))
    assert err < 1e-5, f"{arch} GGUF rotating {head_dim // 2} of {head_dim} dims: {err:.2e} vs the config.json engine"


@pytest.mark.parametrize("arch,gguf_arch,head_dim", [("mixtral", "llama", 16), ("qwen3-moe", "qwen3moe", 24)])
def test_partial_rotary_gguf_refused_where_unsupported(tmp_path, arch, gguf_arch, head_dim):
    """Refused from the metadata (read_model_config reads no weight), the key and both counts named."""
    make_checkpoint(tmp_path, arch)
    path = write_gguf(tmp_path, tmp_path / "model.gguf", arch, edit=_rotating(8))
    message = f"{gguf_arch}.rope.dimension_count=8 is less than the head dim {head_dim}"
    with pytest.raises(ValueError, match=message):
        read_model_config(path)
    with pytest.raises(ValueError, match=message):
        LLMEngine.from_model(path, device="cpu", max_model_len=64, kv_cache_blocks=8)


def test_rotary_dimension_count_bounds():
    base = {"general.architecture": "qwen2", "qwen2.embedding_length": 64, "qwen2.attention.head_count": 4,
            "qwen2.block_count": 1, "qwen2.feed_forward_length": 96}
    shapes = {"token_embd.weight": (384, 64)}
    assert model_config_from_gguf({**base, "qwen2.rope.dimension_count": 16}, set(shapes), shapes).extra == {}
    for count in (13, 18, -2):
        with pytest.raises(ValueError, match=r"qwen2.rope.dimension_count=-?\d+: rotary needs an even count"):
            model_config_from_gguf({**base, "qwen2.rope.dimension_count": count}, set(shapes), shapes)
