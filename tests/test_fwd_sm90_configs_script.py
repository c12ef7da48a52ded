"""scripts/fwd_sm90_configs.py's --config parsing (CPU only): the inverse of Sm90Config's str, and
clear errors for anything else."""

import importlib.util
from pathlib import Path

import pytest

from tileattn.kernels import attention_fwd_sm90 as af

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fwd_sm90_configs.py"
spec = importlib.util.spec_from_file_location("fwd_sm90_configs", SCRIPT)
configs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(configs)


@pytest.mark.parametrize("cfg", sorted({c for (d, causal) in af.DEFAULTS for c in af.configs_for(d, causal, True)}))
def test_parse_config_inverts_str(cfg):
    assert configs.parse_config(str(cfg)) == cfg


@pytest.mark.parametrize("text", ["64x128/s2", "192x128/s2/pp", "128x128", "128x128/s2/fast", "128x128/s2/persistent/pp", "x/y"])
def test_parse_config_refuses_other_spellings(text):
    with pytest.raises(SystemExit, match="--config"):
        configs.parse_config(text)
