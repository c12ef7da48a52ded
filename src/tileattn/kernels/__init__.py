"""The registry of kernel families: every .cu file, the instantiations we build, and for which arch.

Each module in this package describes one family (or one lab's families) in a module-level
`FAMILIES` tuple; `tileattn check` compiles every instantiation of every family for each of its
archs. Lab sources live in the repository's labs/csrc/ (not package data): families whose source
is missing (an installed wheel without the repository) are reported, not compiled.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

PACKAGE_CSRC = Path(__file__).resolve().parent.parent / "csrc"
LABS_CSRC = Path(__file__).resolve().parents[3] / "labs" / "csrc"


class UnknownKernelError(KeyError):
    """A family or instantiation that the registry does not list."""


@dataclass(frozen=True)
class Family:
    """One .cu file and the template instantiations (NVRTC name expressions) built from it.

    source: "attention_fwd_sm80.cu" (package csrc/) or "labs/vector_add.cu" (repository labs/csrc/).
    broken: instantiations that are deliberately wrong lab versions; `check` reports them but
    does not fail on their resource use.
    """

    name: str
    source: str
    instantiations: tuple[str, ...]
    archs: tuple[str, ...] = ("sm_90a", "sm_80")
    broken: frozenset[str] = field(default_factory=frozenset)

    @property
    def path(self) -> Path:
        if self.source.startswith("labs/"):
            return LABS_CSRC / self.source.removeprefix("labs/")
        return PACKAGE_CSRC / self.source

    def require(self, expression: str) -> str:
        if expression not in self.instantiations:
            raise UnknownKernelError(
                f"{expression!r} is not a registered instantiation of kernel family {self.name!r} "
                f"({len(self.instantiations)} registered; see tileattn.kernels.{self.name})"
            )
        return expression


@lru_cache(maxsize=None)
def families() -> dict[str, Family]:
    """All registered families by name, gathered from this package's modules."""
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for fam in getattr(module, "FAMILIES", ()):
            if fam.name in found:
                raise RuntimeError(f"kernel family {fam.name!r} is registered twice")
            found[fam.name] = fam
    return found


def family(name: str) -> Family:
    try:
        return families()[name]
    except KeyError:
        raise UnknownKernelError(f"unknown kernel family {name!r}; registered: {sorted(families())}") from None


def load(family_name: str, expression: str):
    """Compile-or-fetch and load one registered instantiation on the current GPU."""
    from ..runtime import load_kernel

    fam = family(family_name)
    return load_kernel(fam.path, fam.require(expression))
