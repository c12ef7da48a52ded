"""CUDA's launch-grid limits, the same on every architecture tileattn runs on (sm_80 and sm_90): the
API and the plans check a call against them first, so an oversized batch or head count gets a clear
error naming its sizes instead of the driver's CUDA_ERROR_INVALID_VALUE at launch."""

MAX_GRID_X = 2**31 - 1  # blocks along x
MAX_GRID_YZ = 65535  # blocks along y and along z
