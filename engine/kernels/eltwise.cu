// Eltwise (eltwise_layer.cu) over up to four bottoms a launch, passed as separate pointers so no
// pointer table has to be copied to the device; a layer with more bottoms launches again with
// `accumulate` set, folding the next four into y.
#include "common.cuh"

// y = sum of coefficient * bottom over the `used` bottoms given (plus y itself with accumulate).
extern "C" __global__ void eltwise_sum(
        real_t* y, const real_t* x0, const real_t* x1, const real_t* x2, const real_t* x3,
        real_t c0, real_t c1, real_t c2, real_t c3, int used, int accumulate, long long count) {
    GRID_LOOP(i, count) {
        real_t v = accumulate ? y[i] + c0 * x0[i] : c0 * x0[i];
        if (used > 1) v += c1 * x1[i];
        if (used > 2) v += c2 * x2[i];
        if (used > 3) v += c3 * x3[i];
        y[i] = v;
    }
}

// y = the product of the `used` bottoms given (times y itself with accumulate).
extern "C" __global__ void eltwise_prod(
        real_t* y, const real_t* x0, const real_t* x1, const real_t* x2, const real_t* x3,
        int used, int accumulate, long long count) {
    GRID_LOOP(i, count) {
        real_t v = accumulate ? y[i] * x0[i] : x0[i];
        if (used > 1) v *= x1[i];
        if (used > 2) v *= x2[i];
        if (used > 3) v *= x3[i];
        y[i] = v;
    }
}

// y = the maximum, mask = the index of the bottom that holds it, Caffe's ties: of the first two
// bottoms the second wins a tie; a later bottom wins only when strictly greater. x0 is bottom
// `first`; with accumulate y and mask already hold the maximum of the earlier bottoms.
extern "C" __global__ void eltwise_max(
        real_t* y, int* mask, const real_t* x0, const real_t* x1, const real_t* x2,
        const real_t* x3, int used, int first, int accumulate, long long count) {
    const real_t* xs[4] = {x0, x1, x2, x3};
    GRID_LOOP(i, count) {
        real_t best;
        int arg, k = 0;
        if (accumulate) {
            best = y[i];
            arg = mask[i];
        } else {
            best = x0[i];
            arg = first;
            k = 1;
        }
        for (; k < used; ++k) {
            real_t v = xs[k][i];
            int bottom = first + k;
            if (v > best || (bottom == 1 && v == best)) {
                best = v;
                arg = bottom;
            }
        }
        y[i] = best;
        mask[i] = arg;
    }
}

// dx = dy * coefficient (SUM), dy where the mask names this bottom (MAX), or dy times the
// product of the `used` other bottoms given (PROD; times dx itself with accumulate).
extern "C" __global__ void eltwise_sum_backward(
        const real_t* dy, real_t* dx, real_t coefficient, long long count) {
    GRID_LOOP(i, count) dx[i] = dy[i] * coefficient;
}

extern "C" __global__ void eltwise_max_backward(
        const real_t* dy, const int* mask, real_t* dx, int bottom, long long count) {
    GRID_LOOP(i, count) dx[i] = mask[i] == bottom ? dy[i] : (real_t)0;
}

extern "C" __global__ void eltwise_prod_backward(
        const real_t* dy, real_t* dx, const real_t* x0, const real_t* x1, const real_t* x2,
        const real_t* x3, int used, int accumulate, long long count) {
    GRID_LOOP(i, count) {
        real_t v = (accumulate ? dx[i] : dy[i]) * x0[i];
        if (used > 1) v *= x1[i];
        if (used > 2) v *= x2[i];
        if (used > 3) v *= x3[i];
        dx[i] = v;
    }
}
