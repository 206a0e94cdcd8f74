// im2col and col2im in the engine's channels-last column layout (engine/layers/im2col.py): a
// chunk of samples and output rows becomes (samples, rows, out_w, group, kernel_h, kernel_w,
// channels / group), one row of the GEMM's left matrix per output cell. Both read and write the
// NCHW blob itself, so no padded channels-last copy of the input is made first: a cell in the
// padding reads as zero.
#include "common.cuh"

// col (samples, rows, out_w, group, kernel_h, kernel_w, channels / group) from x (samples,
// channels, height, width), output rows first_row .. first_row + rows. With channel_major the
// last three axes are (channels / group, kernel_h, kernel_w) instead: Caffe's order of a
// weight's numbers, so the GEMM takes the weight blob as it is, and the weight gradient comes
// out in the blob's own layout.
extern "C" __global__ void im2col_nhwc(
        const real_t* x, real_t* col, long long count, int channels, int height, int width,
        int first_row, int rows, int out_w, int group, int kernel_h, int kernel_w, int stride_h,
        int stride_w, int pad_h, int pad_w, int dilation_h, int dilation_w, int channel_major) {
    int per_group = channels / group;
    GRID_LOOP(index, count) {
        long long t = index;
        int cg, i, j;
        if (channel_major) {
            j = (int)(t % kernel_w); t /= kernel_w;
            i = (int)(t % kernel_h); t /= kernel_h;
            cg = (int)(t % per_group); t /= per_group;
        } else {
            cg = (int)(t % per_group); t /= per_group;
            j = (int)(t % kernel_w); t /= kernel_w;
            i = (int)(t % kernel_h); t /= kernel_h;
        }
        int g = (int)(t % group); t /= group;
        int ow = (int)(t % out_w); t /= out_w;
        int r = (int)(t % rows);
        long long n = t / rows;
        int h = (first_row + r) * stride_h - pad_h + i * dilation_h;
        int w = ow * stride_w - pad_w + j * dilation_w;
        real_t value = 0;
        if (h >= 0 && h < height && w >= 0 && w < width) {
            value = x[((n * channels + g * per_group + cg) * height + h) * width + w];
        }
        col[index] = value;
    }
}

// dx (samples, channels, height, width) = the sum of the column entries that read each pixel
// (the adjoint of im2col_nhwc over all output rows), from columns laid out group first,
// (group, samples, out_h, out_w, kernel_h, kernel_w, channels / group): the GEMM's output when
// the input gradient is made as top gradient x weight per group (channel_major: the last
// three axes (channels / group, kernel_h, kernel_w), as im2col_nhwc's). One thread per pixel
// gathers from the kernel offsets whose window cell lands on it, so there is no scatter and no
// atomic.
extern "C" __global__ void col2im_nhwc(
        const real_t* col, real_t* dx, long long count, int channels, int height, int width,
        int out_h, int out_w, int group, int kernel_h, int kernel_w, int stride_h, int stride_w,
        int pad_h, int pad_w, int dilation_h, int dilation_w, int channel_major) {
    int per_group = channels / group;
    long long cells = count / ((long long)channels * height * width) * out_h * out_w;
    GRID_LOOP(index, count) {
        int w = (int)(index % width);
        int h = (int)((index / width) % height);
        int c = (int)((index / ((long long)width * height)) % channels);
        long long n = index / ((long long)width * height * channels);
        int g = c / per_group, cg = c % per_group;
        real_t sum = 0;
        for (int i = 0; i < kernel_h; ++i) {
            int hs = h + pad_h - i * dilation_h;
            if (hs < 0 || hs % stride_h) continue;
            int oh = hs / stride_h;
            if (oh >= out_h) continue;
            for (int j = 0; j < kernel_w; ++j) {
                int ws = w + pad_w - j * dilation_w;
                if (ws < 0 || ws % stride_w) continue;
                int ow = ws / stride_w;
                if (ow >= out_w) continue;
                long long cell = g * cells + (n * out_h + oh) * out_w + ow;
                sum += channel_major
                    ? col[((cell * per_group + cg) * kernel_h + i) * kernel_w + j]
                    : col[((cell * kernel_h + i) * kernel_w + j) * per_group + cg];
            }
        }
        dx[index] = sum;
    }
}
