"""CPU checks of the paged kernel's latency switches' host side (docs/attention_paged.md, "Latency at
short contexts"): TILEATTN_PAGED_UNSPLIT_TILES and TILEATTN_PAGED_PREWAIT parsing, the API flag's
check, and that both stay off unless asked for."""

from __future__ import annotations

import pytest
import torch

from tileattn import api_paged
from tileattn.engine import layers
from tileattn.kernels import attention_paged_sm80 as paged


@pytest.mark.parametrize("value,expected", [(None, 0), ("", 0), ("0", 0), ("2", 2), (" 4 ", 4), ("auto", "auto"),
                                            ("1073741824", 1 << 30)])
def test_parse_unsplit_tiles(value, expected):
    assert paged.parse_unsplit_tiles(value) == expected


@pytest.mark.parametrize("value", ["-1", "1.5", "two", "2e3", "+3", "AUTO"])
def test_parse_unsplit_tiles_rejects(value):
    with pytest.raises(ValueError, match="TILEATTN_PAGED_UNSPLIT_TILES must be a non-negative int or 'auto'"):
        paged.parse_unsplit_tiles(value)


@pytest.mark.parametrize("value,expected", [(None, 0), ("3", 3), ("auto", 2)])
def test_default_unsplit_tiles_reads_the_environment_once(monkeypatch, value, expected):
    """Unset: 0 (today's rule, the default until measured); "auto": the config's stages - 1 (2 for
    the d = 128 decode tile's 3 stages). Read at the first call; a later change is not seen."""
    monkeypatch.setattr(paged, "_unsplit_env", [])
    if value is None:
        monkeypatch.delenv(paged.UNSPLIT_TILES_ENV, raising=False)
    else:
        monkeypatch.setenv(paged.UNSPLIT_TILES_ENV, value)
    decode = paged.CONFIGS[128][0]
    assert decode.stages == 3
    assert paged.default_unsplit_tiles(decode) == expected
    monkeypatch.setenv(paged.UNSPLIT_TILES_ENV, "7")
    assert paged.default_unsplit_tiles(decode) == expected, "the variable is read once per process"


def test_default_unsplit_tiles_bad_environment(monkeypatch):
    monkeypatch.setattr(paged, "_unsplit_env", [])
    monkeypatch.setenv(paged.UNSPLIT_TILES_ENV, "-2")
    with pytest.raises(ValueError, match="TILEATTN_PAGED_UNSPLIT_TILES"):
        paged.default_unsplit_tiles(paged.CONFIGS[128][0])


@pytest.mark.parametrize("value,expected", [(None, False), ("0", False), ("1", True), (" 1", True)])
def test_paged_prewait(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(layers.PREWAIT_ENV, raising=False)
    else:
        monkeypatch.setenv(layers.PREWAIT_ENV, value)
    assert layers.paged_prewait() is expected


@pytest.mark.parametrize("value", ["2", "yes", "true", "-1"])
def test_paged_prewait_rejects(monkeypatch, value):
    monkeypatch.setenv(layers.PREWAIT_ENV, value)
    with pytest.raises(ValueError, match="TILEATTN_PAGED_PREWAIT must be 0 or 1"):
        layers.paged_prewait()


def test_cpu_ops_ignore_prewait(monkeypatch):
    """The reference ops (CPU engine) take no promise: TILEATTN_PAGED_PREWAIT changes nothing there."""
    from tileattn import reference

    monkeypatch.setenv(layers.PREWAIT_ENV, "1")
    assert layers.paged_attention_ops(torch.device("cpu"))[0] is reference.attention_paged


@pytest.mark.parametrize("flag", [1, 0, None, "yes"])
def test_attention_paged_flag_must_be_a_bool(flag):
    """Checked before anything else (CPU tensors report it too)."""
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    cu, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match="prior_kernel_writes_only_new_keys must be a bool"):
        api_paged.attention_paged(q, cache, cache, table, cu, lens, 1, 1, prior_kernel_writes_only_new_keys=flag)
