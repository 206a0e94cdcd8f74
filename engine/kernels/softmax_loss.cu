// SoftmaxWithLoss: the softmax over the class axis and the multinomial logistic loss, as Caffe's
// softmax_loss_layer.cu defines them. Scores are viewed as outer x classes x inner; a position is
// one (outer, inner) pair and holds one label, a class index stored as a float and truncated.
//
// Forward is three launches: softmax_loss_forward (one thread per position: the softmax down
// its class column, its loss and whether it counts), a sum over the positions (the caller's
// reduction), and softmax_loss_normalize (one thread: divides by Caffe's normalizer and keeps it
// on the device for backward). Nothing is read back to the host.
#include "common.cuh"

// position_terms is (3, positions): row 0 the position's -log p(label) (0 when ignored), row 1
// 1 where the position counts (not ignore_label), row 2 1 where the label is no class index.
extern "C" __global__ void softmax_loss_forward(
        const real_t* scores, const real_t* labels, real_t* prob, real_t* position_terms,
        long long positions, int classes, int inner, int has_ignore, int ignore_label) {
    GRID_LOOP(p, positions) {
        long long o = p / inner;
        long long i = p % inner;
        const real_t* column = scores + o * classes * inner + i;
        real_t* out = prob + o * classes * inner + i;
        real_t top = column[0];
        for (int c = 1; c < classes; ++c) top = column[c * inner] > top ? column[c * inner] : top;
        real_t total = 0;
        for (int c = 0; c < classes; ++c) {
            real_t e = exp(column[c * inner] - top);
            out[c * inner] = e;
            total += e;
        }
        for (int c = 0; c < classes; ++c) out[c * inner] /= total;
        int label = (int)labels[p];
        real_t loss = 0, counts = 0, bad = 0;
        if (!(has_ignore && label == ignore_label)) {
            if (label < 0 || label >= classes) {
                bad = 1;
            } else {
                real_t picked = out[label * inner];
                loss = -log(picked > (real_t)POSEIDON_FLT_MIN ? picked : (real_t)POSEIDON_FLT_MIN);
                counts = 1;
            }
        }
        position_terms[p] = loss;
        position_terms[positions + p] = counts;
        position_terms[2 * positions + p] = bad;
    }
}

// sums: the three rows of position_terms summed. loss[0] = the summed loss / Caffe's normalizer
// (NaN when a label was no class index, so a bad label cannot pass as a number); normalizer[0]
// keeps the divisor for backward. mode: LossParameter.NormalizationMode (FULL 0, VALID 1,
// BATCH_SIZE 2, NONE 3); VALID without ignore_label counts every position, as Caffe does.
extern "C" __global__ void softmax_loss_normalize(
        const real_t* sums, real_t* loss, real_t* normalizer, int mode, int has_ignore,
        long long outer, long long positions) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    real_t n;
    if (mode == 0) n = (real_t)positions;
    else if (mode == 1) n = has_ignore ? sums[1] : (real_t)positions;
    else if (mode == 2) n = (real_t)outer;
    else n = 1;
    n = n > 1 ? n : 1;
    normalizer[0] = n;
    loss[0] = sums[2] > 0 ? quiet_nan() : sums[0] / n;
}

// dx (outer, classes, inner) = (prob - onehot(label)) * loss_weight / normalizer, 0 at ignored
// positions; loss_weight is the top's diff, read on the device.
extern "C" __global__ void softmax_loss_backward(
        const real_t* prob, const real_t* labels, const real_t* loss_weight,
        const real_t* normalizer, real_t* dx, long long count, int classes, int inner,
        int has_ignore, int ignore_label) {
    real_t scale = loss_weight[0] / normalizer[0];
    GRID_LOOP(index, count) {
        long long i = index % inner;
        int c = (int)((index / inner) % classes);
        long long o = index / ((long long)inner * classes);
        int label = (int)labels[o * inner + i];
        if ((has_ignore && label == ignore_label) || label < 0 || label >= classes) {
            dx[index] = 0;
        } else {
            dx[index] = (prob[index] - (c == label ? (real_t)1 : (real_t)0)) * scale;
        }
    }
}
