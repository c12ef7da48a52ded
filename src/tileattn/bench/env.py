"""The environment every benchmark record carries: GPU, driver, versions, date, command."""

from __future__ import annotations

import datetime as _dt
import platform
import shlex
import subprocess
import sys
from importlib import metadata


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def _git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the checkout this package runs from. A copy of a working tree without its
    .git (the GPU machine's) gets them from $TILEATTN_GIT_COMMIT / $TILEATTN_GIT_DIRTY, set by the
    command that sent it; (None, None) when neither is known."""
    import os
    from pathlib import Path

    if os.environ.get("TILEATTN_GIT_COMMIT"):
        return os.environ["TILEATTN_GIT_COMMIT"], os.environ.get("TILEATTN_GIT_DIRTY", "1") != "0"

    root = Path(__file__).resolve().parents[3]
    try:
        # Only a checkout whose top is this package's root (src/tileattn/bench/env.py) names its code:
        # an installed copy (site-packages/tileattn/...) under some other checkout, e.g. a wheel in a
        # venv inside a repository, would otherwise record that checkout's commit and dirty flag.
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=20)
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root:
            return None, None
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=20)
        if commit.returncode != 0:
            return None, None
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=20)
        return commit.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None, None


def environment() -> dict:
    """A dict of facts about this machine and process (no GPU needed; GPU fields are None then)."""
    import torch

    env = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": None,
        "git_dirty": None,
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
        "triton": _version("triton"),
        "cuda_core": _version("cuda-core"),
        "cuda_bindings": _version("cuda-bindings"),
        "gpu": None,
        "compute_capability": None,
        "sm_count": None,
        "driver": None,
        "l2_flush": None,
    }
    env["git_commit"], env["git_dirty"] = _git_state()
    from .harness import flush_mode

    env["l2_flush"] = flush_mode()
    try:
        from ..runtime import nvrtc_version

        env["nvrtc"] = "%d.%d" % nvrtc_version()
    except Exception as exc:  # NVRTC missing is a fact worth recording, not a crash
        env["nvrtc"] = f"unavailable ({exc.__class__.__name__})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(
            gpu=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            driver=_driver_version(),
        )
    return env
