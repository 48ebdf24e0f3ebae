//! The batch norm kernels of the cuda backend (NVRTC source appended to
//! `kernels::KERNEL_SOURCE`, whose helpers it uses).
//!
//! Activations are NHWC, so a channel's values are `channels` apart. The coalesced
//! kernels give each block 32 neighbouring channels and a chunk of rows: a warp reads 32
//! neighbouring values of one row, and every SM has work even with 64 channels. Per-chunk
//! f64 sums go to the device's reduction scratch (`Device::scratch`, outside the
//! slice like the result area); the last block of a channel group to finish (an atomic
//! counter, reset by that block) adds the chunks in a fixed order, so results do not
//! depend on scheduling, and writes the statistics (forward) or the parameter gradients
//! and two per-channel means (backward). A second, elementwise kernel then writes the
//! output or the input gradient with the formulas of the cpu kernel, in f32 as it does.
//!
//! The forward's sums are shifted by the channel's first value (`sum (x - shift)` and its
//! square), so the variance does not cancel away when the mean is large against it.

/// Kernel names defined by [`BATCH_NORM_KERNEL_SOURCE`].
pub const BATCH_NORM_KERNEL_NAMES: &[&str] = &[
    "batch_norm_training_forward",
    "batch_norm_backward",
    "batch_norm_inference_forward",
    "batch_norm_forward_sums",
    "batch_norm_forward_apply",
    "batch_norm_backward_sums",
    "batch_norm_backward_apply",
];

/// Channels a coalesced block covers (a warp's width).
pub const CHANNELS_PER_GROUP: u64 = 32;
/// Channel groups the scratch has a completion counter for.
pub const SCRATCH_COUNTERS: u64 = 4096;
/// Where the per-channel backward means start in the scratch (after the counters).
pub const SCRATCH_MEANS_OFFSET: u64 = SCRATCH_COUNTERS * 4;
/// The most channels the coalesced kernels take (their means fill 128 KiB).
pub const MAX_COALESCED_CHANNELS: u64 = 16 * 1024;
/// Where the per-chunk sums start in the scratch.
pub const SCRATCH_PARTIALS_OFFSET: u64 = SCRATCH_MEANS_OFFSET + MAX_COALESCED_CHANNELS * 2 * 4;
/// Bytes of one chunk's sums for one channel: two f64.
pub const PARTIAL_BYTES: u64 = 16;
/// Blocks the coalesced sums aim for (several per SM on any current GPU).
const TARGET_BLOCKS: u64 = 1024;
/// The fewest rows a chunk gets (8 rows per thread).
const MIN_ROWS_PER_CHUNK: u64 = 64;

/// How the coalesced kernels split `rows x channels` with `scratch_bytes` of scratch:
/// `None` when the channels are more than the scratch can hold (the per-channel kernels
/// run instead).
pub fn coalesced_chunks(rows: u64, channels: u64, scratch_bytes: u64) -> Option<u64> {
    let groups = channels.div_ceil(CHANNELS_PER_GROUP);
    if rows == 0 || channels == 0 || channels > MAX_COALESCED_CHANNELS || groups > SCRATCH_COUNTERS
    {
        return None;
    }
    let room = scratch_bytes.checked_sub(SCRATCH_PARTIALS_OFFSET)? / (PARTIAL_BYTES * channels);
    let wanted = (TARGET_BLOCKS / groups).clamp(1, rows.div_ceil(MIN_ROWS_PER_CHUNK).max(1));
    let chunks = wanted.min(room).min(rows);
    (chunks > 0).then_some(chunks)
}

/// The CUDA C source of the batch norm kernels.
pub const BATCH_NORM_KERNEL_SOURCE: &str = r#"
#define BN_LANES 32
#define BN_ROW_LANES 8
// This block's chunk of rows and its 32 channels: block b is chunk b / groups of group
// b % groups; thread (row_lane, lane) takes channel group * 32 + lane, every 8th row.
struct BnTile { i64 group, chunk, channel, begin, end; int lane, row_lane; };
__device__ BnTile bn_tile(i64 rows, i64 channels, i64 chunks) {
    BnTile tile;
    i64 groups = (channels + BN_LANES - 1) / BN_LANES;
    tile.group = blockIdx.x % groups; tile.chunk = blockIdx.x / groups;
    tile.lane = threadIdx.x % BN_LANES; tile.row_lane = threadIdx.x / BN_LANES;
    tile.channel = tile.group * BN_LANES + tile.lane;
    i64 per_chunk = (rows + chunks - 1) / chunks;
    tile.begin = tile.chunk * per_chunk;
    tile.end = tile.begin + per_chunk < rows ? tile.begin + per_chunk : rows;
    return tile;
}
// Adds the 8 row lanes' (a, b) of each channel, stores the chunk's sums and tells whether
// this block is the group's last to finish (then every chunk's sums are visible to it).
__device__ bool bn_store_partials(BnTile tile, double a, double b, i64 channels, double* partials, unsigned int* counters, i64 chunks) {
    __shared__ double first[BN_ROW_LANES][BN_LANES];
    __shared__ double second[BN_ROW_LANES][BN_LANES];
    __shared__ bool last;
    first[tile.row_lane][tile.lane] = a; second[tile.row_lane][tile.lane] = b;
    __syncthreads();
    if (tile.row_lane == 0 && tile.channel < channels) {
        for (int k = 1; k < BN_ROW_LANES; ++k) { a += first[k][tile.lane]; b += second[k][tile.lane]; }
        partials[(tile.chunk * channels + tile.channel) * 2] = a;
        partials[(tile.chunk * channels + tile.channel) * 2 + 1] = b;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[tile.group], 1u) == (unsigned int)(chunks - 1);
    __syncthreads();
    return last;
}
// In the group's last block: every chunk's sums of each of its channels, added in chunk
// order (row lanes take every 8th chunk, then lane sums are added in lane order). The
// totals are valid in row lane 0; the counter is reset for the next launch.
__device__ void bn_total(BnTile tile, i64 channels, i64 chunks, const double* partials, unsigned int* counters, double* a, double* b) {
    __shared__ double first[BN_ROW_LANES][BN_LANES];
    __shared__ double second[BN_ROW_LANES][BN_LANES];
    double x = 0.0, y = 0.0;
    if (tile.channel < channels) {
        for (i64 k = tile.row_lane; k < chunks; k += BN_ROW_LANES) {
            const volatile double* pair = partials + (k * channels + tile.channel) * 2;
            x += pair[0]; y += pair[1];
        }
    }
    first[tile.row_lane][tile.lane] = x; second[tile.row_lane][tile.lane] = y;
    __syncthreads();
    if (tile.row_lane == 0) {
        for (int k = 1; k < BN_ROW_LANES; ++k) { x += first[k][tile.lane]; y += second[k][tile.lane]; }
        *a = x; *b = y;
        if (threadIdx.x == 0) counters[tile.group] = 0u;
    }
}
extern "C" __global__ void batch_norm_forward_sums(const void* x, int t, i64 rows, i64 channels, i64 chunks,
        double* partials, unsigned int* counters, float* statistics,
        float* running_mean, float* running_variance, int update_running, double momentum, double epsilon) {
    BnTile tile = bn_tile(rows, channels, chunks);
    double a = 0.0, b = 0.0, shift = 0.0;
    if (tile.channel < channels) {
        shift = (double)load_element(x, t, tile.channel);
        const i64 step = BN_ROW_LANES * channels, end = tile.end * channels;
        for (i64 i = (tile.begin + tile.row_lane) * channels + tile.channel; i < end; i += step) {
            double d = (double)load_element(x, t, i) - shift;
            a += d; b += d * d;
        }
    }
    if (!bn_store_partials(tile, a, b, channels, partials, counters, chunks)) return;
    bn_total(tile, channels, chunks, partials, counters, &a, &b);
    if (tile.row_lane != 0 || tile.channel >= channels) return;
    double row_count = (double)rows;
    double shifted_mean = a / row_count;
    double mean = shift + shifted_mean;
    double squared_deviations = b - a * shifted_mean;
    if (squared_deviations < 0.0) squared_deviations = 0.0;
    i64 c = tile.channel;
    statistics[c] = (float)mean;
    statistics[channels + c] = (float)(1.0 / sqrt(squared_deviations / row_count + epsilon));
    if (update_running) {
        double divisor = rows > 1 ? (double)(rows - 1) : 1.0;
        running_mean[c] = (float)(momentum * (double)running_mean[c] + (1.0 - momentum) * mean);
        running_variance[c] = (float)(momentum * (double)running_variance[c] + (1.0 - momentum) * (squared_deviations / divisor));
    }
}
// The elementwise passes walk the grid stride without dividing: a 64-bit `i % channels`
// per element cost more than the memory traffic.
#define CHANNEL_STRIDE(i, c, n, channels) \
    i64 first_##i = (i64)blockIdx.x * blockDim.x + threadIdx.x, stride_##i = (i64)blockDim.x * gridDim.x; \
    i64 c = first_##i % (channels); const i64 step_##c = stride_##i % (channels); \
    for (i64 i = first_##i; i < (n); i += stride_##i, c = c + step_##c >= (channels) ? c + step_##c - (channels) : c + step_##c)
extern "C" __global__ void batch_norm_forward_apply(const void* x, void* y, int t, i64 elements, i64 channels,
        const void* gamma, const void* beta, int parameter_t, const float* statistics) {
    CHANNEL_STRIDE(i, c, elements, channels) {
        float g = load_element(gamma, parameter_t, c), b = load_element(beta, parameter_t, c);
        store_element(y, t, i, g * ((load_element(x, t, i) - statistics[c]) * statistics[channels + c]) + b);
    }
}
// Parameter gradients as `batch_norm_backward`; `means` gets the mean gradient and the
// mean of gradient x normalized per channel, for `batch_norm_backward_apply`.
extern "C" __global__ void batch_norm_backward_sums(const void* x, const void* dy, int t, i64 rows, i64 channels, i64 chunks,
        const float* statistics, double* partials, unsigned int* counters, float* means,
        void* gamma_gradient, void* beta_gradient, int gradient_t, int accumulate) {
    BnTile tile = bn_tile(rows, channels, chunks);
    double a = 0.0, b = 0.0;
    if (tile.channel < channels) {
        float mean = statistics[tile.channel], inverse_std = statistics[channels + tile.channel];
        const i64 step = BN_ROW_LANES * channels, end = tile.end * channels;
        for (i64 i = (tile.begin + tile.row_lane) * channels + tile.channel; i < end; i += step) {
            float normalized = (load_element(x, t, i) - mean) * inverse_std;
            double g = (double)load_element(dy, t, i);
            a += g; b += g * (double)normalized;
        }
    }
    if (!bn_store_partials(tile, a, b, channels, partials, counters, chunks)) return;
    bn_total(tile, channels, chunks, partials, counters, &a, &b);
    if (tile.row_lane != 0 || tile.channel >= channels) return;
    i64 c = tile.channel;
    means[c] = (float)(a / (double)rows);
    means[channels + c] = (float)(b / (double)rows);
    float gamma_before = accumulate ? load_element(gamma_gradient, gradient_t, c) : 0.0f;
    float beta_before = accumulate ? load_element(beta_gradient, gradient_t, c) : 0.0f;
    store_element(gamma_gradient, gradient_t, c, gamma_before + (float)b);
    store_element(beta_gradient, gradient_t, c, beta_before + (float)a);
}
extern "C" __global__ void batch_norm_backward_apply(const void* x, const void* dy, void* dx, int t, i64 elements, i64 channels,
        const void* gamma, int parameter_t, const float* statistics, const float* means) {
    CHANNEL_STRIDE(i, c, elements, channels) {
        float mean = statistics[c], inverse_std = statistics[channels + c];
        float normalized = (load_element(x, t, i) - mean) * inverse_std;
        float coefficient = load_element(gamma, parameter_t, c) * inverse_std;
        store_element(dx, t, i, coefficient * (load_element(dy, t, i) - means[c] - normalized * means[channels + c]));
    }
}
// The first wave's kernels: one block per channel, f64 sums in two passes as the cpu
// kernel. Kept for channels the coalesced kernels' scratch cannot hold and as the
// `legacy-batch-norm` baseline.
extern "C" __global__ void batch_norm_training_forward(const void* x, void* y, int t, i64 rows, i64 channels,
        const void* gamma, const void* beta, int parameter_t, float* statistics,
        float* running_mean, float* running_variance, int update_running, double momentum, double epsilon) {
    __shared__ double shared[256];
    i64 c = blockIdx.x;
    if (c >= channels) return;
    double sum = 0.0;
    for (i64 r = threadIdx.x; r < rows; r += blockDim.x) sum += (double)load_element(x, t, r * channels + c);
    double row_count = rows > 0 ? (double)rows : 1.0;
    double mean = block_sum(sum, shared) / row_count;
    double squares = 0.0;
    for (i64 r = threadIdx.x; r < rows; r += blockDim.x) {
        double d = (double)load_element(x, t, r * channels + c) - mean; squares += d * d;
    }
    double squared_deviations = block_sum(squares, shared);
    float saved_mean = (float)mean;
    float saved_inverse_std = (float)(1.0 / sqrt(squared_deviations / row_count + epsilon));
    if (threadIdx.x == 0) {
        statistics[c] = saved_mean;
        statistics[channels + c] = saved_inverse_std;
        if (update_running && rows > 0) {
            double divisor = rows > 1 ? (double)(rows - 1) : 1.0;
            running_mean[c] = (float)(momentum * (double)running_mean[c] + (1.0 - momentum) * mean);
            running_variance[c] = (float)(momentum * (double)running_variance[c] + (1.0 - momentum) * (squared_deviations / divisor));
        }
    }
    float g = load_element(gamma, parameter_t, c), b = load_element(beta, parameter_t, c);
    for (i64 r = threadIdx.x; r < rows; r += blockDim.x) {
        i64 i = r * channels + c;
        store_element(y, t, i, g * ((load_element(x, t, i) - saved_mean) * saved_inverse_std) + b);
    }
}
// Parameter gradients go to `gamma_gradient` / `beta_gradient` (element type
// gradient_t): added to fp32 gradients, or written to the half scratch.
extern "C" __global__ void batch_norm_backward(const void* x, const void* dy, void* dx, int t, i64 rows, i64 channels,
        const void* gamma, int parameter_t, const float* statistics,
        void* gamma_gradient, void* beta_gradient, int gradient_t, int accumulate) {
    __shared__ double shared[256];
    i64 c = blockIdx.x;
    if (c >= channels || rows == 0) return;
    float mean = statistics[c], inverse_std = statistics[channels + c];
    double sum_gradient = 0.0, sum_gradient_normalized = 0.0;
    for (i64 r = threadIdx.x; r < rows; r += blockDim.x) {
        i64 i = r * channels + c;
        float normalized = (load_element(x, t, i) - mean) * inverse_std;
        double g = (double)load_element(dy, t, i);
        sum_gradient += g; sum_gradient_normalized += g * (double)normalized;
    }
    sum_gradient = block_sum(sum_gradient, shared);
    sum_gradient_normalized = block_sum(sum_gradient_normalized, shared);
    float mean_gradient = (float)(sum_gradient / (double)rows);
    float mean_gradient_normalized = (float)(sum_gradient_normalized / (double)rows);
    float coefficient = load_element(gamma, parameter_t, c) * inverse_std;
    if (dx != 0) {
        for (i64 r = threadIdx.x; r < rows; r += blockDim.x) {
            i64 i = r * channels + c;
            float normalized = (load_element(x, t, i) - mean) * inverse_std;
            store_element(dx, t, i, coefficient * (load_element(dy, t, i) - mean_gradient - normalized * mean_gradient_normalized));
        }
    }
    if (threadIdx.x == 0) {
        float gamma_before = accumulate ? load_element(gamma_gradient, gradient_t, c) : 0.0f;
        float beta_before = accumulate ? load_element(beta_gradient, gradient_t, c) : 0.0f;
        store_element(gamma_gradient, gradient_t, c, gamma_before + (float)sum_gradient_normalized);
        store_element(beta_gradient, gradient_t, c, beta_before + (float)sum_gradient);
    }
}
extern "C" __global__ void batch_norm_inference_forward(const void* x, void* y, int t, i64 rows, i64 channels,
        const void* gamma, const void* beta, int parameter_t, const float* running_mean, const float* running_variance, double epsilon) {
    GRID_STRIDE(i, rows * channels) {
        i64 c = i % channels;
        float inverse_std = (float)(1.0 / sqrt((double)running_variance[c] + epsilon));
        store_element(y, t, i, load_element(gamma, parameter_t, c) * ((load_element(x, t, i) - running_mean[c]) * inverse_std) + load_element(beta, parameter_t, c));
    }
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_fill_the_gpu_fit_the_scratch_and_refuse_what_it_cannot_hold() {
        let two_mib = 2 << 20;
        // resnet-cifar's first block at batch 128: 2 groups of 32 channels, 512 chunks.
        assert_eq!(coalesced_chunks(128 * 32 * 32, 64, two_mib), Some(512));
        // Few rows: never an empty chunk, never fewer than 64 rows per chunk but one.
        assert_eq!(coalesced_chunks(32, 128, two_mib), Some(1));
        assert_eq!(coalesced_chunks(1000, 64, two_mib), Some(16));
        // Many channels: as many chunks as the scratch holds.
        let chunks = coalesced_chunks(1 << 20, 2048, two_mib).unwrap();
        assert!(SCRATCH_PARTIALS_OFFSET + chunks * PARTIAL_BYTES * 2048 <= two_mib);
        assert_eq!(
            coalesced_chunks(1 << 20, MAX_COALESCED_CHANNELS + 1, two_mib),
            None
        );
        assert_eq!(coalesced_chunks(0, 64, two_mib), None);
        assert_eq!(coalesced_chunks(64, 64, SCRATCH_PARTIALS_OFFSET), None);
    }
}
