// Shared by every kernel source: the element type, Caffe's float limits and the grid-stride loop.
//
// The loader (engine/kernels/__init__.py) pastes this file in place of its #include line, so the
// runtime compiler (NVRTC) needs no include path; nvcc and the host build of the tests find it
// beside the sources. No standard header is included: NVRTC ships none.
#ifndef POSEIDON_KERNELS_COMMON
#define POSEIDON_KERNELS_COMMON

// One source serves float and double blobs: the loader builds a module per element type.
#ifndef real_t
#define real_t float
#endif

// Caffe starts a max pooling window at -FLT_MAX and clamps log's argument to FLT_MIN, in float
// whatever the blob's type; spelled out because NVRTC has no <cfloat>.
#define POSEIDON_FLT_MAX 3.402823466e+38F
#define POSEIDON_FLT_MIN 1.175494351e-38F

// Each thread walks the index range in steps of the whole grid, so any launch size covers any
// count: the loader caps the grid, and the host build of the tests runs a small odd grid.
// A quiet NaN of the element type (NVRTC has no NAN macro either).
__device__ __forceinline__ real_t quiet_nan() { return (real_t)__int_as_float(0x7fc00000); }

#define GRID_LOOP(i, n)                                                            \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (long long)blockDim.x * gridDim.x)

#endif
