"""The `tileattn` command's error reporting (tileattn/cli.py), on the CPU."""

from __future__ import annotations

import pytest
import torch

from tileattn import cli


@pytest.mark.parametrize("bench", sorted(set(cli.BENCHES) - {"engine", "serve"}))
def test_a_benchmark_without_a_gpu_says_so_in_one_line(bench, capsys, monkeypatch):
    # The kernel benchmarks need a GPU; without one they end with the NoGPUError's message on stderr and
    # status 1, not a traceback. (engine and serve run the engine, which has a CPU path.)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["bench", bench]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"tileattn bench {bench}: ") and "need an NVIDIA GPU" in err[0], err


def test_other_errors_keep_their_traceback(monkeypatch):
    # Only the missing GPU is reported as a user's setting; any other exception is a bug and propagates.
    monkeypatch.setitem(cli.BENCHES, "attention", ("tests.test_cli", "_raise_bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["bench", "attention"])


def _raise_bug(argv):
    raise RuntimeError("a bug")
