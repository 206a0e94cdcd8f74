// The epilogue of a convolution's or inner product's GEMM: bias added and, where a ReLU follows,
// the ReLU applied in the same pass, instead of a bias add and a ReLU pass (and for convolution
// a transposing copy) each reading and writing the whole output.
#include "common.cuh"

__device__ __forceinline__ real_t rectify(real_t v, int relu, real_t negative_slope) {
    return (relu && v <= 0) ? v * negative_slope : v;
}

// out (NCHW, from the chunk's first sample) = gemm (group, cells, per_group) + bias, where the
// chunk's cells are samples x cells_per_sample output cells starting at cell_offset of each
// sample's plane (the GEMM's row-major layout written straight into NCHW).
extern "C" __global__ void bias_relu_nchw(
        const real_t* gemm, const real_t* bias, int has_bias, real_t* out, long long count,
        int group, int per_group, long long cells_per_sample, long long plane,
        long long cell_offset, int relu, real_t negative_slope) {
    long long cells = count / ((long long)group * per_group);
    GRID_LOOP(index, count) {
        long long q = index % cells_per_sample;
        long long t = index / cells_per_sample;
        int o = (int)(t % per_group); t /= per_group;
        int g = (int)(t % group);
        long long n = t / group;
        real_t v = gemm[((long long)g * cells + n * cells_per_sample + q) * per_group + o];
        if (has_bias) v += bias[g * per_group + o];
        out[((n * group + g) * per_group + o) * plane + cell_offset + q] =
            rectify(v, relu, negative_slope);
    }
}

// y (rows, width) += bias per column, then the ReLU, in place (an inner product's output).
extern "C" __global__ void bias_relu_rows(
        real_t* y, const real_t* bias, int has_bias, long long count, int width, int relu,
        real_t negative_slope) {
    GRID_LOOP(index, count) {
        real_t v = y[index];
        if (has_bias) v += bias[index % width];
        y[index] = rectify(v, relu, negative_slope);
    }
}
