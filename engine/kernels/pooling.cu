// Max and average pooling, forward and backward, with Caffe's geometry (pooling_layer.cu):
// windows start at (output index * stride - pad); a MAX window is clipped to the image, starts at
// -FLT_MAX and takes a strictly greater value, so the first maximum in row-major order wins and
// a window without pixels keeps -FLT_MAX and index -1; an AVE window's divisor counts the window
// clipped to [start, size + pad), padding cells included, the overshoot past it not.
// Backward is a gather: one thread per input pixel sums over the windows that cover it, so no
// two threads write one cell and no atomics are needed.
#include "common.cuh"

// The range [*first, *last) of output indices whose windows cover input coordinate `at`
// (padded coordinate at + pad) along one axis.
__device__ __forceinline__ void covering_windows(int at, int pad, int kernel, int stride,
                                                 int out_size, int* first, int* last) {
    int padded = at + pad;
    *first = padded < kernel ? 0 : (padded - kernel) / stride + 1;
    int end = padded / stride + 1;
    *last = end < out_size ? end : out_size;
}

// y and mask (N, C, out_h, out_w); mask holds the flat index h * W + w of the window's maximum
// in its input plane (-1 for none); with write_top_mask it is also written, as a float, to
// top_mask (Caffe's optional second top).
extern "C" __global__ void max_pool_forward(
        const real_t* x, real_t* y, int* mask, real_t* top_mask, int write_top_mask,
        long long count, int height, int width, int out_h, int out_w, int kernel_h,
        int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w) {
    GRID_LOOP(index, count) {
        int ow = (int)(index % out_w);
        int oh = (int)((index / out_w) % out_h);
        long long plane = index / ((long long)out_w * out_h);
        int h0 = oh * stride_h - pad_h;
        int w0 = ow * stride_w - pad_w;
        int h1 = h0 + kernel_h < height ? h0 + kernel_h : height;
        int w1 = w0 + kernel_w < width ? w0 + kernel_w : width;
        h0 = h0 > 0 ? h0 : 0;
        w0 = w0 > 0 ? w0 : 0;
        const real_t* src = x + plane * height * width;
        real_t best = -POSEIDON_FLT_MAX;
        int arg = -1;
        for (int h = h0; h < h1; ++h) {
            for (int w = w0; w < w1; ++w) {
                if (src[h * width + w] > best) {
                    best = src[h * width + w];
                    arg = h * width + w;
                }
            }
        }
        y[index] = best;
        mask[index] = arg;
        if (write_top_mask) top_mask[index] = (real_t)arg;
    }
}

// dx (N, C, H, W) = the sum of dy over the windows whose recorded maximum is this pixel.
extern "C" __global__ void max_pool_backward(
        const real_t* dy, const int* mask, real_t* dx, long long count, int height, int width,
        int out_h, int out_w, int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h,
        int pad_w) {
    GRID_LOOP(index, count) {
        int w = (int)(index % width);
        int h = (int)((index / width) % height);
        long long plane = index / ((long long)width * height);
        int ph0, ph1, pw0, pw1;
        covering_windows(h, pad_h, kernel_h, stride_h, out_h, &ph0, &ph1);
        covering_windows(w, pad_w, kernel_w, stride_w, out_w, &pw0, &pw1);
        long long offset = plane * out_h * out_w;
        int self = h * width + w;
        real_t sum = 0;
        for (int ph = ph0; ph < ph1; ++ph) {
            for (int pw = pw0; pw < pw1; ++pw) {
                if (mask[offset + ph * out_w + pw] == self) sum += dy[offset + ph * out_w + pw];
            }
        }
        dx[index] = sum;
    }
}

// Caffe's divisor of one AVE window along one axis: its extent clipped to [start, size + pad).
__device__ __forceinline__ int window_span(int start, int kernel, int size, int pad) {
    int end = start + kernel < size + pad ? start + kernel : size + pad;
    return end - start;
}

extern "C" __global__ void ave_pool_forward(
        const real_t* x, real_t* y, long long count, int height, int width, int out_h, int out_w,
        int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w) {
    GRID_LOOP(index, count) {
        int ow = (int)(index % out_w);
        int oh = (int)((index / out_w) % out_h);
        long long plane = index / ((long long)out_w * out_h);
        int h0 = oh * stride_h - pad_h;
        int w0 = ow * stride_w - pad_w;
        int divisor = window_span(h0, kernel_h, height, pad_h) *
                      window_span(w0, kernel_w, width, pad_w);
        int h1 = h0 + kernel_h < height ? h0 + kernel_h : height;
        int w1 = w0 + kernel_w < width ? w0 + kernel_w : width;
        h0 = h0 > 0 ? h0 : 0;
        w0 = w0 > 0 ? w0 : 0;
        const real_t* src = x + plane * height * width;
        real_t sum = 0;
        for (int h = h0; h < h1; ++h) {
            for (int w = w0; w < w1; ++w) sum += src[h * width + w];
        }
        // a window past the image and its padding (ceil rounding, no pad) has divisor 0 and no
        // pixel: 0, where Caffe would divide 0 by 0
        y[index] = divisor > 0 ? sum / divisor : (real_t)0;
    }
}

// dx (N, C, H, W) = the sum over the windows covering the pixel of dy / the window's divisor.
extern "C" __global__ void ave_pool_backward(
        const real_t* dy, real_t* dx, long long count, int height, int width, int out_h,
        int out_w, int kernel_h, int kernel_w, int stride_h, int stride_w, int pad_h, int pad_w) {
    GRID_LOOP(index, count) {
        int w = (int)(index % width);
        int h = (int)((index / width) % height);
        long long plane = index / ((long long)width * height);
        int ph0, ph1, pw0, pw1;
        covering_windows(h, pad_h, kernel_h, stride_h, out_h, &ph0, &ph1);
        covering_windows(w, pad_w, kernel_w, stride_w, out_w, &pw0, &pw1);
        const real_t* grad = dy + plane * out_h * out_w;
        real_t sum = 0;
        for (int ph = ph0; ph < ph1; ++ph) {
            int span_h = window_span(ph * stride_h - pad_h, kernel_h, height, pad_h);
            for (int pw = pw0; pw < pw1; ++pw) {
                int span_w = window_span(pw * stride_w - pad_w, kernel_w, width, pad_w);
                sum += grad[ph * out_w + pw] / (span_h * span_w);
            }
        }
        dx[index] = sum;
    }
}
