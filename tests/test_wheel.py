"""The package as users install it: a wheel built from this checkout, run from outside the repository.

`tileattn check` must work from an installed wheel: the registry may not depend on the repository's
layout (the labs register their own kernels), and every .cu/.cuh file a registered family needs
must be package data.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys
import tileattn
from tileattn.kernels import families
fams = families()
print(json.dumps({"file": tileattn.__file__,
                  "families": {n: [str(f.path), f.path.exists()] for n, f in fams.items()}}))
"""


def _wheel(tmp_path_factory) -> Path:
    """The wheel of this checkout, built once per test run. Under pytest-xdist every worker that runs
    this module's tests needs it, and two `pip wheel` builds of one checkout at once collide in its
    build/ directory (`File exists: build/bdist...`, seen in a fresh clone's `make test`): the first
    worker builds it into the run's shared temporary directory under a lock, the others reuse it."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's dir, not older runs'
    dist = shared / "tileattn-wheel"
    with open(shared / "tileattn-wheel.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not list(dist.glob("tileattn-*.whl")):
            build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                                    "-w", str(dist), str(ROOT)], capture_output=True, text=True, timeout=600)
            assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = dist.glob("tileattn-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(site dir with the wheel's files, a cwd outside the repository)."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = _wheel(tmp_path_factory)
    site = tmp / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    return site, cwd


def _run(site, cwd, *args, timeout=600):
    env = dict(os.environ, PYTHONPATH=str(site), TILEATTN_CACHE=str(cwd / "cache"))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_wheel_registry_is_self_contained(installed):
    site, cwd = installed
    out = _run(site, cwd, "-c", CHILD)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["file"].startswith(str(site)), f"imported {info['file']}, not the wheel"
    fams = info["families"]
    assert "attention_fwd_sm80" in fams and "attention_bwd_sm80" in fams
    assert not {"vector_add", "gemm_tc", "reduction", "transpose"} & set(fams), "labs leaked into the package"
    missing = {name: path for name, (path, exists) in fams.items() if not exists}
    assert not missing, f"sources missing from the wheel: {missing}"
    assert (site / "tileattn" / "runtime" / "host_launch.cpp").exists(), "the compiled path's source is not in the wheel"


def test_installed_wheel_passes_tileattn_check(installed):
    site, cwd = installed
    # One small family keeps CI fast; the registry-wide file check is the test above.
    out = _run(site, cwd, "-m", "tileattn.cli", "check", "--family", "kv_cache", "--arch", "sm_90a")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "failed" in out.stdout and " 0 failed" in out.stdout
