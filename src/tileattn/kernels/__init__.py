"""The registry of kernel families: every .cu file, the instantiations we build, and for which archs.

Each module in this package describes one family, named like its .cu file (attention_fwd_sm80.py
for csrc/attention_fwd_sm80.cu), in a module-level `FAMILIES` tuple. Code outside the package (the
repository's labs) adds its own families with `register`. `tileattn check` compiles every
instantiation of every family for each of its archs; the tuning candidates (`Family.tuning`) only
with `tileattn check --tuning` and in `tileattn bench attention --tune`.

`tileattn.kernels.dispatch` picks the family and tile configuration for a call.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE_CSRC = Path(__file__).resolve().parent.parent / "csrc"


class UnknownKernelError(KeyError):
    """A family or instantiation that the registry does not list."""


@dataclass(frozen=True)
class Family:
    """One .cu file and the template instantiations (NVRTC name expressions) built from it.

    source: a file name in the package's csrc/ ("attention_fwd_sm80.cu"), or an absolute path for
    families registered from outside the package.
    instantiations: what the dispatcher and the launchers use; compiled by `tileattn check`.
    tuning: extra candidates timed by the tuning benchmarks; compiled only when asked.
    broken: instantiations that are deliberately wrong lab versions; `check` reports them but
    does not fail on their resource use.
    """

    name: str
    source: str | Path
    instantiations: tuple[str, ...]
    archs: tuple[str, ...] = ("sm_90a", "sm_80")
    broken: frozenset[str] = field(default_factory=frozenset)
    tuning: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        source = Path(self.source)
        return source if source.is_absolute() else PACKAGE_CSRC / source

    def require(self, expression: str) -> str:
        if expression not in self.instantiations and expression not in self.tuning:
            raise UnknownKernelError(
                f"{expression!r} is not a registered instantiation of kernel family {self.name!r} "
                f"({len(self.instantiations)} registered, {len(self.tuning)} tuning candidates)"
            )
        return expression


_registered: dict[str, Family] = {}
_package_families: dict[str, Family] | None = None


def register(*fams: Family) -> None:
    """Add families from outside the package (e.g. the repository's labs). Registering the same
    family object again is a no-op; another family under a taken name is an error."""
    for fam in fams:
        if not isinstance(fam, Family):
            raise TypeError(f"register() takes Family objects, got {type(fam).__name__}")
        taken = _registered.get(fam.name) or _package().get(fam.name)
        if taken is not None and taken != fam:
            raise ValueError(f"kernel family {fam.name!r} is registered twice")
        _registered[fam.name] = fam


def _package() -> dict[str, Family]:
    global _package_families
    if _package_families is None:
        found: dict[str, Family] = {}
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if info.name == "dispatch":
                continue
            module = importlib.import_module(f"{__name__}.{info.name}")
            for fam in getattr(module, "FAMILIES", ()):
                if fam.name in found:
                    raise RuntimeError(f"kernel family {fam.name!r} is registered twice")
                found[fam.name] = fam
        _package_families = found
    return _package_families


def families() -> dict[str, Family]:
    """All families by name: the package's own, then the registered ones."""
    return {**_package(), **_registered}


def family(name: str) -> Family:
    fam = _registered.get(name) or _package().get(name)
    if fam is None:
        raise UnknownKernelError(f"unknown kernel family {name!r}; registered: {sorted(families())}")
    return fam


def load(family_name: str, expression: str, device_index: int | None = None):
    """Compile-or-fetch and load one registered instantiation (only that one) on a device."""
    from ..runtime import load_kernel

    fam = family(family_name)
    return load_kernel(fam.path, fam.require(expression), device_index=device_index)
