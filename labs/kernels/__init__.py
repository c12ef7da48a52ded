"""The labs' kernel families (labs/csrc/*.cu): registered with tileattn's registry on import.

The tileattn package knows nothing about this repository's layout; the labs register their own
families here, by absolute path. `tileattn check --with labs.kernels` audits them with the rest.
"""

from pathlib import Path

from tileattn.kernels import register

LABS_CSRC = Path(__file__).resolve().parent.parent / "csrc"

from . import gemm, reduction, transpose, vector_add  # noqa: E402  (they need LABS_CSRC)

register(*gemm.FAMILIES, *reduction.FAMILIES, *transpose.FAMILIES, *vector_add.FAMILIES)
