"""CPU checks of the paged kernel's latency options' host side (docs/attention_paged.md, "Latency at
short contexts"): TILEATTN_PAGED_UNSPLIT_TILES parsing and its default ("auto"), the API flag's
check."""

from __future__ import annotations

import pytest
import torch

from tileattn import api_paged
from tileattn.kernels import attention_paged_sm80 as paged


@pytest.fixture(autouse=True)
def fresh_unsplit_setting():
    """Each test reads TILEATTN_PAGED_UNSPLIT_TILES as a new process would, and leaves no value
    cached for the tests after it."""
    paged._unsplit_setting.cache_clear()
    yield
    paged._unsplit_setting.cache_clear()


@pytest.mark.parametrize("value,expected", [(None, "auto"), ("", "auto"), ("0", 0), ("2", 2), (" 4 ", 4), ("auto", "auto"),
                                            ("1073741824", 1 << 30)])
def test_parse_unsplit_tiles(value, expected):
    assert paged.parse_unsplit_tiles(value) == expected


@pytest.mark.parametrize("value", ["-1", "1.5", "two", "2e3", "+3", "AUTO"])
def test_parse_unsplit_tiles_rejects(value):
    with pytest.raises(ValueError, match="TILEATTN_PAGED_UNSPLIT_TILES must be a non-negative int or 'auto'"):
        paged.parse_unsplit_tiles(value)


@pytest.mark.parametrize("value,expected", [(None, 2), ("0", 0), ("3", 3), ("auto", 2)])
def test_default_unsplit_tiles_reads_the_environment_once(monkeypatch, value, expected):
    """Unset or "auto": the config's stages - 1 (2 for the d = 128 decode tile's 3 stages); 0: the
    split-per-tile rule. Read at the first call; a later change is not seen."""
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
    monkeypatch.setenv(paged.UNSPLIT_TILES_ENV, "-2")
    with pytest.raises(ValueError, match="TILEATTN_PAGED_UNSPLIT_TILES"):
        paged.default_unsplit_tiles(paged.CONFIGS[128][0])


@pytest.mark.parametrize("flag", [1, 0, None, "yes"])
def test_attention_paged_flag_must_be_a_bool(flag):
    """Checked before anything else (CPU tensors report it too)."""
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    cu, lens = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match="prior_kernel_writes_only_new_keys must be a bool"):
        api_paged.attention_paged(q, cache, cache, table, cu, lens, 1, 1, prior_kernel_writes_only_new_keys=flag)
