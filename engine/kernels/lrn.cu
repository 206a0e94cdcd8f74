// LRN across channels (lrn_layer.cu): scale = k + alpha / size * (sum of x^2 over the channels
// c - (size-1)/2 .. c + (size-1)/2, zeros outside), y = x * scale^-beta. One thread per element
// sums its own window (size is small, 5 in Caffe's models), where Caffe keeps a running sum down
// the channels: the same numbers without the running sum's rounding drift, and a thread per
// element instead of one per pixel column.
#include "common.cuh"

// The channels of element `index`'s window, as [*first, *last), and its channel and the index
// of channel 0 at its pixel.
__device__ __forceinline__ void channel_window(long long index, int channels, long long plane,
                                              int size, int* channel, long long* base,
                                              int* first, int* last) {
    long long pixel = index % plane;
    *channel = (int)((index / plane) % channels);
    *base = (index / (plane * channels)) * plane * channels + pixel;
    int half = (size - 1) / 2;
    *first = *channel - half > 0 ? *channel - half : 0;
    *last = *channel + half + 1 < channels ? *channel + half + 1 : channels;
}

// scale and y (N, C, H, W); scale is kept for backward.
extern "C" __global__ void lrn_forward(
        const real_t* x, real_t* scale, real_t* y, long long count, int channels,
        long long plane, int size, real_t alpha_over_size, real_t k, real_t beta) {
    GRID_LOOP(index, count) {
        int c, first, last;
        long long base;
        channel_window(index, channels, plane, size, &c, &base, &first, &last);
        real_t sum = 0;
        for (int d = first; d < last; ++d) {
            real_t v = x[base + d * plane];
            sum += v * v;
        }
        real_t s = k + alpha_over_size * sum;
        scale[index] = s;
        y[index] = x[index] * pow(s, -beta);
    }
}

// dx = dy * scale^-beta - 2 alpha beta / size * x * (sum over the window of dy * y / scale);
// the window is symmetric, so the channels whose window holds c are c's own window.
extern "C" __global__ void lrn_backward(
        const real_t* x, const real_t* y, const real_t* scale, const real_t* dy, real_t* dx,
        long long count, int channels, long long plane, int size, real_t ratio, real_t beta) {
    GRID_LOOP(index, count) {
        int c, first, last;
        long long base;
        channel_window(index, channels, plane, size, &c, &base, &first, &last);
        real_t sum = 0;
        for (int d = first; d < last; ++d) {
            long long at = base + d * plane;
            sum += dy[at] * y[at] / scale[at];
        }
        dx[index] = dy[index] * pow(scale[index], -beta) - ratio * x[index] * sum;
    }
}
