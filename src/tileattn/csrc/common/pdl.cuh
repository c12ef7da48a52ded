// Programmatic dependent launch (PDL), device side. A kernel launched with the
// PROGRAMMATIC_STREAM_SERIALIZATION attribute (LaunchPlan(pdl=True), TILEATTN_PDL=1) may start
// while the kernel before it on the stream is still running: its blocks get scheduled and run
// their prologue early, but none of the previous kernel's writes is guaranteed visible until
// griddepcontrol.wait returns (it waits for that kernel's completion and memory flush). So an
// opting-in kernel calls pdl_wait() before its first global load or store, and nothing it touches
// can race with its predecessor. Launched without the attribute (the default), the wait returns
// at once: the same kernel serves both launches.
//
// pdl_release_dependents() lets the NEXT kernel, if it was launched with the attribute, be
// scheduled before this one finishes (once every block of this grid has called it or exited);
// that kernel's own wait still waits for this grid's completion, so where it is called changes
// only how early the next grid's blocks are resident, never what they read.
//
// Both are sm_90 instructions; on older arches (and in host passes) they compile to nothing.
#pragma once

namespace tileattn {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");  // "memory": no load is hoisted above it
#endif
}

__device__ __forceinline__ void pdl_release_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace tileattn
