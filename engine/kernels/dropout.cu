// Dropout with a counter-based generator: element i of a draw keeps its unit when
// hash(seed, iteration, i) >> 40 (24 random bits) >= threshold, threshold = ceil(ratio * 2^24).
// The mask is a pure function of (seed, iteration, index), so backward recomputes it instead of
// storing it, there is no generator state (no cuRAND) and the launch can be captured in a graph;
// engine/kernels/counter_rng.py is the same generator in numpy, bit for bit.
#include "common.cuh"

typedef unsigned long long u64;

// splitmix64's finaliser (Steele, Lea, Flood 2014): a bijection of 64-bit words whose outputs for
// consecutive inputs pass the usual statistical batteries.
__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// The stream of one (seed, iteration): its key, then element i is mix64(key + (i + 1) * gamma).
__device__ __forceinline__ u64 stream_key(u64 seed, u64 iteration) {
    return mix64(seed ^ mix64(iteration + 0x9E3779B97F4A7C15ULL));
}

__device__ __forceinline__ int keeps(u64 key, long long i, unsigned int threshold) {
    u64 bits = mix64(key + (u64)(i + 1) * 0x9E3779B97F4A7C15ULL);
    return (unsigned int)(bits >> 40) >= threshold;
}

// y = x * scale where kept, 0 elsewhere (y may be x).
// draw = {seed, iteration} in device memory, not kernel arguments: a launch captured in a CUDA
// graph then reads the values written before each replay instead of repeating the captured ones.
extern "C" __global__ void dropout_forward(
        const real_t* x, real_t* y, long long count, const u64* draw,
        unsigned int threshold, real_t scale) {
    u64 key = stream_key(draw[0], draw[1]);
    GRID_LOOP(i, count) y[i] = keeps(key, i, threshold) ? x[i] * scale : (real_t)0;
}

// dx = dy * scale where the forward of the same (seed, iteration) kept the unit (dx may be dy).
extern "C" __global__ void dropout_backward(
        const real_t* dy, real_t* dx, long long count, const u64* draw,
        unsigned int threshold, real_t scale) {
    u64 key = stream_key(draw[0], draw[1]);
    GRID_LOOP(i, count) dx[i] = keeps(key, i, threshold) ? dy[i] * scale : (real_t)0;
}
