"""Transpose (labs/csrc/transpose.cu): naive, tiled, padded tiled, vectorized; fp32 and bf16.

bf16 travels as its raw 16 bits (`unsigned short`): a transpose moves bytes and never computes.
"""

from tileattn.kernels import Family

from . import LABS_CSRC

VERSIONS = ("transpose_naive", "transpose_tiled", "transpose_padded", "transpose_vec4")
ELEMENT_TYPES = {"fp32": "float", "bf16": "unsigned short"}


def expression(kernel: str, dtype: str) -> str:
    """NVRTC name expression, e.g. expression('transpose_padded', 'bf16') -> 'transpose_padded<unsigned short>'."""
    return f"{kernel}<{ELEMENT_TYPES[dtype]}>"


FAMILIES = (
    Family(
        name="transpose",
        source=LABS_CSRC / "transpose.cu",
        instantiations=tuple(expression(k, d) for d in ELEMENT_TYPES for k in VERSIONS),
    ),
)
