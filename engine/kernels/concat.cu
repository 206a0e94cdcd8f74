// Concat and Slice: one bottom's block of the concatenated blob, copied in either direction.
// The blob is viewed as outer x (axis * inner): a part of `part_width` = its axis size * inner
// numbers a row sits at column `offset` of rows `full_width` wide.
#include "common.cuh"

// to_whole: part -> whole (Concat forward, Slice backward); else whole -> part.
extern "C" __global__ void concat_copy(
        real_t* part, real_t* whole, long long count, long long part_width,
        long long full_width, long long offset, int to_whole) {
    GRID_LOOP(i, count) {
        long long at = (i / part_width) * full_width + offset + i % part_width;
        if (to_whole) whole[at] = part[i];
        else part[i] = whole[at];
    }
}
