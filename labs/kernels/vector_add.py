"""Vector add (labs/csrc/vector_add.cu): the first kernel through the runtime."""

from tileattn.kernels import Family

from . import LABS_CSRC

VEC4_UNROLL = 4  # float4 loads in flight per thread and operand (see the .cu header)

FAMILIES = (
    Family(
        name="vector_add",
        source=LABS_CSRC / "vector_add.cu",
        instantiations=("vector_add_scalar", f"vector_add_vec4<{VEC4_UNROLL}>", "vector_add_vec4<1>"),
    ),
)
