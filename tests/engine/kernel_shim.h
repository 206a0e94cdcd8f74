// Lets the CUDA kernel sources compile as plain C++ for the host (tests/engine/kernel_host.py): the
// CUDA qualifiers vanish and the thread coordinates are globals that the generated launch
// wrappers set while they walk the grid, one (block, thread) at a time. The kernels use no shared
// memory, barriers or atomics, so running their threads one after another is a faithful run.
#include <math.h>
#include <string.h>

#define __global__
#define __device__
#define __forceinline__ inline

struct shim_dim3 { unsigned int x, y, z; };
static shim_dim3 blockIdx, threadIdx, blockDim, gridDim;

static inline float __int_as_float(int bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}
