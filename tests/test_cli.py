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


@pytest.mark.parametrize("bench, argv, needle", [
    ("attention", ["--seq", "0"], "--seq: must be >= 1, got 0"),
    ("attention", ["--batch", "-2"], "--batch: must be >= 1"),
    ("attention", ["--reps", "two"], "--reps: not an int"),
    ("attention", ["--head-dim", "48"], "--head-dim: invalid choice: 48"),
    ("attention", ["--rounds", "0"], "--rounds: must be >= 1"),
    ("overhead", ["--calls", "0"], "--calls: must be >= 1"),
    ("startup", ["--runs", "0"], "--runs: must be >= 1"),
    ("layers", ["--reps", "0"], "--reps: must be >= 1"),
    ("variants", ["--reps", "0"], "--reps: must be >= 1"),
    ("variants", ["--rounds", "-1"], "--rounds: must be >= 1"),
    ("varlen", ["--kv-heads", "3"], "--kv-heads 3 must divide --heads 32"),
    ("varlen", ["--min-len", "10", "--max-len", "5"], "--min-len 10 is above --max-len 5"),
    ("varlen", ["--head-dim", "48"], "--head-dim: invalid choice: 48"),
    ("varlen", ["--seqs", "0"], "--seqs: must be >= 1"),
    ("decode", ["--memory-gb", "0"], "--memory-gb must be a finite number > 0, got 0.0"),
    ("decode", ["--memory-gb", "nan"], "--memory-gb must be a finite number > 0, got nan"),
])
def test_benchmark_options_are_refused_before_the_gpu(bench, argv, needle, capsys, monkeypatch):
    # An option no run can use is an argparse error (status 2) before anything needs a GPU: without a GPU
    # here, a check made later would surface as the missing-GPU line instead.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", bench, *argv])
    assert exit_info.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--family", "no_such_family"], "nothing to compile for --family 'no_such_family'; families: "),
    (["--family", "kv_cache", "--arch", "sm_100"], "nothing to compile for --family 'kv_cache' and --arch sm_100"),
])
def test_check_filters_that_match_nothing_fail(argv, needle, capsys):
    # `tileattn check` compiling nothing would print 0/0 and pass: a typo in --family must not read as green.
    assert cli.main(["check", *argv]) == 2
    assert needle in capsys.readouterr().err
