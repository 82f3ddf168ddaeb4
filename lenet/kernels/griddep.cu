// Prepended to every module of this package (lenet/kernels/__init__.py, PRELUDE).
//
// griddep_entry() is the first statement of every kernel that lenet.kernels.launch.Launch starts with
// programmatic dependent launch (Note [programmatic launch] in lenet/kernels/launch.py): it lets the
// next kernel of the stream be scheduled now (its blocks then wait in their own griddep_entry), and
// waits until the kernel before this one has finished and its writes are visible. Nothing of the
// kernel runs before that wait, so it reads and writes as after a plain launch. Before sm_90 (no
// griddepcontrol) it is empty, and Launch launches plainly.
__device__ __forceinline__ void griddep_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
