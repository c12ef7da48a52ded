"""scripts/profile_attention.py's kernel-name patterns (CPU only): each direction's tileattn pattern
names the dense kernel of both families the dispatcher can run (the forward's named only the sm_80
kernel until session 28, so on the H200 it profiled no tileattn kernel at all)."""

import importlib.util
import re
from pathlib import Path

import pytest

from tileattn.kernels import attention_bwd_sm80, attention_bwd_sm90, attention_fwd_sm80, attention_fwd_sm90

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "profile_attention.py"
spec = importlib.util.spec_from_file_location("profile_attention", SCRIPT)
profile = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile)

# The dense kernels a plain forward / backward launches, per family (sm_80 and sm_90a GPUs).
DENSE = {
    "forward": [(attention_fwd_sm80, "tileattn::attention_fwd_sm80"), (attention_fwd_sm90, "tileattn::attention_fwd_sm90")],
    "backward": [(attention_bwd_sm80, "tileattn::bwd::attn_bwd_main_kernel"),
                 (attention_bwd_sm90, "tileattn::attention_bwd_sm90")],
}


@pytest.mark.parametrize("direction", sorted(DENSE))
def test_tileattn_pattern_names_both_families(direction):
    pattern = profile.KERNELS[direction][0]
    for module, name in DENSE[direction]:
        assert any(e.startswith(name + "<") for e in module.INSTANTIATIONS), name  # the name is real
        assert re.search(pattern, name), (direction, pattern, name)
    peers = profile.KERNELS[direction][1:]
    for module, name in DENSE[direction]:
        assert not any(re.search(p, name) for p in peers), "a peer's pattern must not catch tileattn's kernel"


@pytest.mark.parametrize("flags", [("--softcap-op", "--dropout-op"), ("--alibi-op", "--dropout-op"),
                                   ("--softcap-op", "--alibi-op")])
def test_one_variant_per_profile(flags, tmp_path, monkeypatch, capsys):
    """Two variant-op modes at once are refused before ncu is looked for (or anything runs)."""
    monkeypatch.setattr("sys.argv", ["profile_attention.py", "--out", str(tmp_path), *flags])
    monkeypatch.setattr(profile.shutil, "which", lambda name: pytest.fail("ncu looked up before the flag check"))
    with pytest.raises(SystemExit) as exc:
        profile.main()
    assert exc.value.code == 2
    assert "one variant per profile" in capsys.readouterr().err
