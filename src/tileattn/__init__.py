"""tileattn: fused attention kernels in CUDA C++, compiled at run time, driven from PyTorch."""

__version__ = "0.1.0"
