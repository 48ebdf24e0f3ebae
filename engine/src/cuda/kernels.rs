//! The NVRTC kernels of the CUDA backend, as CUDA C source compiled once per process.
//!
//! Each kernel is a line-by-line translation of the cpu kernel it stands for
//! (`crate::kernels::*`), with the same formulas in the same order and the same f64
//! accumulations, so the two backends agree to rounding. The module is compiled with
//! `--fmad=false`: Rust never contracts `a * b + c` into a fused multiply-add, and the
//! optimizer updates must round the same way on both backends.
//!
//! Buffers of any element type are read and written through `load_element` /
//! `store_element` with the type code of [`element_type_code`]: half values are converted
//! with PTX `cvt` instructions (round to nearest even, as the `half` crate does) and
//! bfloat16 with integer rounding, so the source needs no CUDA headers and compiles with
//! any NVRTC. The launches of the general-purpose ones (casts, column sums) that several
//! layer files share are here too.

use carve_core::plan::{BufferId, ElementType};

use super::device::{KernelArgument, LaunchShape};
use super::{CudaBackend, DeviceBuffer, GradientTarget, pointer, type_code};
use crate::error::EngineError;

// The launches of the general-purpose kernels other files share.
impl CudaBackend {
    /// `destination = source`, rounding to the destination's type.
    pub(super) fn convert(
        &self,
        source: BufferId,
        destination: BufferId,
    ) -> Result<(), EngineError> {
        let from = self.buffer(source)?;
        let to = self.buffer(destination)?;
        let elements = from.elements.min(to.elements);
        self.convert_elements(
            from.address,
            from.element_type,
            to.address,
            to.element_type,
            elements,
        )
    }

    pub(super) fn convert_elements(
        &self,
        source: u64,
        source_type: ElementType,
        destination: u64,
        destination_type: ElementType,
        elements: u64,
    ) -> Result<(), EngineError> {
        self.launch(
            "convert_elements",
            LaunchShape::Elements(elements),
            &[
                pointer(source),
                type_code(source_type),
                pointer(destination),
                type_code(destination_type),
                KernelArgument::I64(elements as i64),
            ],
        )
    }

    /// `target (+)= column sums of source[rows, columns]`.
    pub(super) fn column_sums(
        &self,
        source: DeviceBuffer,
        rows: u64,
        columns: u64,
        target: GradientTarget,
    ) -> Result<(), EngineError> {
        self.launch(
            "column_sums",
            LaunchShape::Blocks(columns.div_ceil(COLUMNS_PER_SUM_BLOCK)),
            &[
                pointer(source.address),
                type_code(source.element_type),
                KernelArgument::I64(rows as i64),
                KernelArgument::I64(columns as i64),
                pointer(target.address),
                type_code(target.element_type),
                KernelArgument::I32(i32::from(target.accumulate)),
            ],
        )
    }
}

/// The code a kernel receives for a buffer's element type.
pub fn element_type_code(element_type: ElementType) -> i32 {
    match element_type {
        ElementType::F32 => 0,
        ElementType::F16 => 1,
        ElementType::Bf16 => 2,
        ElementType::I32 => 3,
        ElementType::U8 => 4,
    }
}

/// Threads per block of every 1-D launch; the reduction kernels assume exactly this.
pub const THREADS_PER_BLOCK: u32 = 256;
/// The columns one block of `column_sums` adds up (a warp's width).
pub const COLUMNS_PER_SUM_BLOCK: u64 = 32;

/// Words of the host-visible result area ("mailbox") the loss and overflow kernels write:
/// loss sum (f64 bits), correct predictions, the first sample with a bad label (stored as
/// its bitwise complement, 0 when none), unused, overflow flag.
pub const MAILBOX_WORDS: usize = 5;
pub const MAILBOX_LOSS_SUM: usize = 0;
pub const MAILBOX_CORRECT: usize = 1;
pub const MAILBOX_BAD_LABEL_SAMPLE: usize = 2;
pub const MAILBOX_OVERFLOW: usize = 4;

/// Every kernel the module defines, so the backend can load them all up front and a
/// missing one is an error at start, not in the middle of a step.
pub const KERNEL_NAMES: &[&str] = &[
    "convert_elements",
    "add_into_f32",
    "add_bias_rows",
    "column_sums",
    "activation_forward",
    "activation_backward",
    "dropout_forward",
    "dropout_backward",
    "softmax_cross_entropy_forward",
    "softmax_cross_entropy_backward",
    "mse_forward",
    "mse_backward",
    "check_finite",
    "sgd_update",
    "adam_update",
    "conv_forward_direct",
    "conv_backward_data_direct",
    "conv_backward_filter_direct",
    "pad_images",
    "crop_images",
    "pool_forward_direct",
    "pool_backward_direct",
    "global_avg_pool_forward",
    "global_avg_pool_backward",
    "add_elements",
    "concat_rows",
    "depthwise_forward_direct",
    "depthwise_backward_data_direct",
    "depthwise_backward_filter_direct",
];

/// The CUDA C source of every kernel.
pub const KERNEL_SOURCE: &str = r#"
typedef long long i64;
typedef unsigned long long u64;

__device__ __forceinline__ float f16_to_f32(unsigned short h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ unsigned short f32_to_f16(float f) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
}
__device__ __forceinline__ float bf16_to_f32(unsigned short b) {
    return __uint_as_float(((unsigned int)b) << 16);
}
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    unsigned int rounding = 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)((u + rounding) >> 16);
}
__device__ __forceinline__ float load_element(const void* p, int t, i64 i) {
    switch (t) {
        case 0: return ((const float*)p)[i];
        case 1: return f16_to_f32(((const unsigned short*)p)[i]);
        case 2: return bf16_to_f32(((const unsigned short*)p)[i]);
        case 3: return (float)((const int*)p)[i];
        default: return (float)((const unsigned char*)p)[i];
    }
}
__device__ __forceinline__ void store_element(void* p, int t, i64 i, float v) {
    switch (t) {
        case 0: ((float*)p)[i] = v; break;
        case 1: ((unsigned short*)p)[i] = f32_to_f16(v); break;
        case 2: ((unsigned short*)p)[i] = f32_to_bf16(v); break;
        case 3: ((int*)p)[i] = (int)v; break;
        default: ((unsigned char*)p)[i] = (unsigned char)v; break;
    }
}
#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)
// The direct convolution, depthwise and pooling kernels' geometry (device.rs mirrors it).
struct ConvGeometry { i64 n, h, w, c, oh, ow, f, kh, kw, sh, sw, pt, pl; };

extern "C" __global__ void convert_elements(const void* src, int src_t, void* dst, int dst_t, i64 n) {
    GRID_STRIDE(i, n) { store_element(dst, dst_t, i, load_element(src, src_t, i)); }
}

// Depthwise convolution: g.f = g.c * multiplier outputs, kernel [kh, kw, c, multiplier]
// (HWIO, not KRSC: it is not a conv kernel for the layout conversion).
extern "C" __global__ void depthwise_forward_direct(const void* x, const void* kernel, const void* bias, void* y, int t, ConvGeometry g) {
    i64 m = g.f / g.c;
    GRID_STRIDE(i, g.n * g.oh * g.ow * g.f) {
        i64 f = i % g.f, ox = (i / g.f) % g.ow, oy = (i / (g.f * g.ow)) % g.oh, s = i / (g.f * g.ow * g.oh);
        i64 c = f / m, j = f % m;
        float sum = 0.0f;
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 iy = oy * g.sh + ky - g.pt; if (iy < 0 || iy >= g.h) continue;
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 ix = ox * g.sw + kx - g.pl; if (ix < 0 || ix >= g.w) continue;
                sum = sum + load_element(x, t, ((s * g.h + iy) * g.w + ix) * g.c + c) * load_element(kernel, t, ((ky * g.kw + kx) * g.c + c) * m + j);
            }
        }
        if (bias != 0) sum = sum + load_element(bias, t, f);
        store_element(y, t, i, sum);
    }
}
extern "C" __global__ void depthwise_backward_data_direct(const void* dy, const void* kernel, void* dx, int t, ConvGeometry g) {
    i64 m = g.f / g.c;
    GRID_STRIDE(i, g.n * g.h * g.w * g.c) {
        i64 c = i % g.c, ix = (i / g.c) % g.w, iy = (i / (g.c * g.w)) % g.h, s = i / (g.c * g.w * g.h);
        float sum = 0.0f;
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 ny = iy + g.pt - ky; if (ny < 0 || ny % g.sh != 0) continue; i64 oy = ny / g.sh; if (oy >= g.oh) continue;
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 nx = ix + g.pl - kx; if (nx < 0 || nx % g.sw != 0) continue; i64 ox = nx / g.sw; if (ox >= g.ow) continue;
                for (i64 j = 0; j < m; ++j)
                    sum = sum + load_element(dy, t, ((s * g.oh + oy) * g.ow + ox) * g.f + c * m + j) * load_element(kernel, t, ((ky * g.kw + kx) * g.c + c) * m + j);
            }
        }
        store_element(dx, t, i, sum);
    }
}
extern "C" __global__ void depthwise_backward_filter_direct(const void* x, const void* dy, int t, void* dw, int dw_t, int accumulate, ConvGeometry g) {
    i64 m = g.f / g.c;
    GRID_STRIDE(i, g.kh * g.kw * g.c * m) {
        i64 j = i % m, c = (i / m) % g.c, kx = (i / (m * g.c)) % g.kw, ky = i / (m * g.c * g.kw);
        float sum = 0.0f;
        for (i64 s = 0; s < g.n; ++s)
            for (i64 oy = 0; oy < g.oh; ++oy) {
                i64 iy = oy * g.sh + ky - g.pt; if (iy < 0 || iy >= g.h) continue;
                for (i64 ox = 0; ox < g.ow; ++ox) {
                    i64 ix = ox * g.sw + kx - g.pl; if (ix < 0 || ix >= g.w) continue;
                    sum = sum + load_element(x, t, ((s * g.h + iy) * g.w + ix) * g.c + c) * load_element(dy, t, ((s * g.oh + oy) * g.ow + ox) * g.f + c * m + j);
                }
            }
        float before = accumulate ? load_element(dw, dw_t, i) : 0.0f;
        store_element(dw, dw_t, i, before + sum);
    }
}
extern "C" __global__ void add_elements(const void* a, const void* b, void* dst, int t, i64 n) {
    GRID_STRIDE(i, n) { store_element(dst, t, i, load_element(a, t, i) + load_element(b, t, i)); }
}
extern "C" __global__ void concat_rows(const void* src, void* dst, int t, i64 rows, i64 width, i64 total, i64 offset, int split) {
    GRID_STRIDE(i, rows * width) {
        i64 joined = (i / width) * total + offset + i % width;
        if (split) store_element(dst, t, i, load_element(src, t, joined));
        else store_element(dst, t, joined, load_element(src, t, i));
    }
}
extern "C" __global__ void add_into_f32(float* dst, const void* src, int src_t, i64 n) {
    GRID_STRIDE(i, n) { dst[i] = dst[i] + load_element(src, src_t, i); }
}

extern "C" __global__ void add_bias_rows(void* out, int out_t, const void* bias, int bias_t, i64 rows, i64 columns) {
    GRID_STRIDE(i, rows * columns) {
        store_element(out, out_t, i, load_element(out, out_t, i) + load_element(bias, bias_t, i % columns));
    }
}

// dst[c] (+)= sum over rows of src[r, c], in f32. A block takes 32 columns: a warp reads
// 32 neighbouring columns of one row (coalesced) and the block's warps split the rows,
// so a conv bias gradient over n*h*w rows is not one thread walking them all.
extern "C" __global__ void column_sums(const void* src, int src_t, i64 rows, i64 columns, void* dst, int dst_t, int accumulate) {
    __shared__ float partial[32][33];
    int column_lane = threadIdx.x % 32, row_lane = threadIdx.x / 32, row_lanes = blockDim.x / 32;
    i64 c = (i64)blockIdx.x * 32 + column_lane;
    float sum = 0.0f;
    if (c < columns) for (i64 r = row_lane; r < rows; r += row_lanes) sum = sum + load_element(src, src_t, r * columns + c);
    partial[row_lane][column_lane] = sum;
    __syncthreads();
    if (row_lane == 0 && c < columns) {
        float total = 0.0f;
        for (int lane = 0; lane < row_lanes; ++lane) total = total + partial[lane][column_lane];
        float before = accumulate ? load_element(dst, dst_t, c) : 0.0f;
        store_element(dst, dst_t, c, before + total);
    }
}

// Activation kinds: 0 relu, 1 leaky relu, 2 gelu, 3 sigmoid, 4 tanh.
__device__ float sigmoid_of(float x) {
    if (x >= 0.0f) return 1.0f / (1.0f + expf(-x));
    float e = expf(x); return e / (1.0f + e);
}
__device__ double standard_normal_cdf(double x) { return 0.5 * erfc(-x * 0.70710678118654752440); }
extern "C" __global__ void activation_forward(int kind, float alpha, const void* x, void* y, int t, i64 n) {
    GRID_STRIDE(i, n) {
        float v = load_element(x, t, i), r;
        switch (kind) {
            case 0: r = v < 0.0f ? 0.0f : v; break;
            case 1: r = v > 0.0f ? v : alpha * v; break;
            case 2: { double d = (double)v; r = (float)(d * standard_normal_cdf(d)); break; }
            case 3: r = sigmoid_of(v); break;
            case 5: r = v < 0.0f ? 0.0f : v; r = r > 6.0f ? 6.0f : r; break;
            default: r = tanhf(v); break;
        }
        store_element(y, t, i, r);
    }
}
// `saved` is the output for relu, relu6, sigmoid and tanh and the input for leaky relu and gelu.
extern "C" __global__ void activation_backward(int kind, float alpha, const void* saved, const void* dy, void* dx, int t, i64 n) {
    GRID_STRIDE(i, n) {
        float s = load_element(saved, t, i), g = load_element(dy, t, i), r;
        switch (kind) {
            case 0: r = s > 0.0f ? g : 0.0f; break;
            case 1: r = s > 0.0f ? g : alpha * g; break;
            case 2: {
                double d = (double)s;
                double density = exp(-0.5 * d * d) / sqrt(2.0 * 3.14159265358979323846);
                r = g * (float)(standard_normal_cdf(d) + d * density); break;
            }
            case 3: r = g * s * (1.0f - s); break;
            case 5: r = (s > 0.0f && s < 6.0f) ? g : 0.0f; break;
            default: r = g * (1.0f - s * s); break;
        }
        store_element(dx, t, i, r);
    }
}

// SplitMix64, positional: draw i of a stream is mix(state0 + (i + 1) * golden), exactly
// what `Rng::next_f32` returns for the i-th call.
__device__ u64 splitmix_mix(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
extern "C" __global__ void dropout_forward(const void* x, void* y, int t, unsigned char* mask, i64 n, float rate, float keep_scale, u64 state0, int identity) {
    GRID_STRIDE(i, n) {
        float v = load_element(x, t, i);
        if (identity) { mask[i] = 1; store_element(y, t, i, v); continue; }
        u64 draw = splitmix_mix(state0 + (u64)(i + 1) * 0x9e3779b97f4a7c15ull);
        float uniform = (float)(draw >> 40) / 16777216.0f;
        int keep = uniform >= rate;
        mask[i] = (unsigned char)keep;
        store_element(y, t, i, v * (keep ? keep_scale : 0.0f));
    }
}
extern "C" __global__ void dropout_backward(const unsigned char* mask, const void* dy, void* dx, int t, i64 n, float keep_scale) {
    GRID_STRIDE(i, n) { store_element(dx, t, i, load_element(dy, t, i) * (mask[i] ? keep_scale : 0.0f)); }
}

// The f64 sum of `value` over the block (every thread gets it); `shared` holds one
// double per thread.
__device__ double block_sum(double value, double* shared) {
    shared[threadIdx.x] = value;
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) shared[threadIdx.x] += shared[threadIdx.x + half];
        __syncthreads();
    }
    double total = shared[0];
    __syncthreads();
    return total;
}

// One block of 256 threads: each thread takes whole rows, the sums are combined in a
// fixed order, so the result does not depend on scheduling.
extern "C" __global__ void softmax_cross_entropy_forward(const void* logits, int t, const int* labels, float* probabilities,
        i64 batch, i64 classes, u64* mailbox, void* loss_value, int loss_t) {
    __shared__ double shared[256];
    double total = 0.0, correct = 0.0;
    for (i64 s = threadIdx.x; s < batch; s += blockDim.x) {
        int label = labels[s];
        if (label < 0 || (i64)label >= classes) {
            // The largest of ~s is the first bad sample, whatever the thread order.
            atomicMax(&mailbox[2], ~(u64)s);
            continue;
        }
        const i64 base = s * classes;
        float maximum = __int_as_float(0xff800000);
        // As the cpu fold: a NaN logit never becomes the maximum, it poisons the sum below.
        for (i64 k = 0; k < classes; ++k) { float v = load_element(logits, t, base + k); if (v > maximum) maximum = v; }
        double m = (double)maximum, sum = 0.0;
        for (i64 k = 0; k < classes; ++k) {
            double e = exp((double)load_element(logits, t, base + k) - m);
            probabilities[base + k] = (float)e; sum += e;
        }
        double inverse_sum = 1.0 / sum;
        for (i64 k = 0; k < classes; ++k) probabilities[base + k] = (float)((double)probabilities[base + k] * inverse_sum);
        total += log(sum) - ((double)load_element(logits, t, base + label) - m);
        i64 best = 0; float best_score = probabilities[base];
        for (i64 k = 1; k < classes; ++k) {
            float score = probabilities[base + k];
            if (score > best_score || (best_score != best_score && score == score)) { best = k; best_score = score; }
        }
        if (best_score == best_score && best == (i64)label) correct += 1.0;
    }
    total = block_sum(total, shared);
    correct = block_sum(correct, shared);
    if (threadIdx.x == 0) {
        mailbox[0] = (u64)__double_as_longlong(total);
        mailbox[1] = (u64)correct;
        store_element(loss_value, loss_t, 0, (float)(total / (double)(batch > 0 ? batch : 1)));
    }
}
extern "C" __global__ void softmax_cross_entropy_backward(const float* probabilities, const int* labels, i64 batch, i64 classes,
        float scale, void* gradient, int gradient_t) {
    GRID_STRIDE(i, batch * classes) {
        i64 s = i / classes, k = i % classes;
        float one_hot = (labels[s] == (int)k) ? 1.0f : 0.0f;
        store_element(gradient, gradient_t, i, (probabilities[i] - one_hot) * scale);
    }
}
extern "C" __global__ void mse_forward(const void* output, int t, const float* targets, i64 elements, i64 per_sample,
        i64 batch, u64* mailbox, void* loss_value, int loss_t) {
    __shared__ double shared[256];
    double sum = 0.0;
    for (i64 i = threadIdx.x; i < elements; i += blockDim.x) {
        double e = (double)load_element(output, t, i) - (double)targets[i]; sum += e * e;
    }
    sum = block_sum(sum, shared);
    if (threadIdx.x == 0) {
        double loss_sum = per_sample > 0 ? sum / (double)per_sample : 0.0;
        mailbox[0] = (u64)__double_as_longlong(loss_sum);
        store_element(loss_value, loss_t, 0, (float)(loss_sum / (double)(batch > 0 ? batch : 1)));
    }
}
extern "C" __global__ void mse_backward(const void* output, int t, const float* targets, i64 elements, float factor,
        void* gradient, int gradient_t) {
    GRID_STRIDE(i, elements) { store_element(gradient, gradient_t, i, (load_element(output, t, i) - targets[i]) * factor); }
}

extern "C" __global__ void check_finite(const void* values, int t, i64 n, u64* mailbox) {
    // Exponent all ones: infinity or NaN.
    GRID_STRIDE(i, n) { if ((__float_as_uint(load_element(values, t, i)) & 0x7f800000u) == 0x7f800000u) mailbox[4] = 1ull; }
}

// The optimizers also write the updated weight into `weights` (the compute-precision
// copy under mixed precision, element type weights_t; null otherwise) and zero the
// gradient for the next step: one launch per tensor instead of three.
extern "C" __global__ void sgd_update(float* w, float* gradients, float* velocity, void* weights, int weights_t, i64 n, float learning_rate,
        float momentum, float weight_decay, int nesterov, float gradient_scale) {
    GRID_STRIDE(i, n) {
        float gradient = gradients[i] * gradient_scale + weight_decay * w[i];
        gradients[i] = 0.0f;
        float updated;
        if (velocity == 0) {
            updated = w[i] - learning_rate * gradient;
        } else {
            float v = momentum * velocity[i] + gradient;
            velocity[i] = v;
            float step = nesterov ? gradient + momentum * v : v;
            updated = w[i] - learning_rate * step;
        }
        w[i] = updated;
        if (weights != 0) store_element(weights, weights_t, i, updated);
    }
}
extern "C" __global__ void adam_update(float* w, float* gradients, float* first, float* second, void* weights, int weights_t, i64 n,
        float beta1, float beta2, float one_minus_beta1, float one_minus_beta2, float epsilon, float step_size,
        float bias_correction2_sqrt, float l2_decay, float decoupled_decay_factor, float gradient_scale) {
    GRID_STRIDE(i, n) {
        float gradient = gradients[i] * gradient_scale + l2_decay * w[i];
        gradients[i] = 0.0f;
        float weight = w[i] * decoupled_decay_factor;
        float m = beta1 * first[i] + one_minus_beta1 * gradient;
        float v = beta2 * second[i] + one_minus_beta2 * gradient * gradient;
        first[i] = m; second[i] = v;
        float denominator = sqrtf(v) / bias_correction2_sqrt + epsilon;
        float updated = weight - step_size * m / denominator;
        w[i] = updated;
        if (weights != 0) store_element(weights, weights_t, i, updated);
    }
}

// Direct convolution for the geometries cuDNN's symmetric padding cannot express (TF
// "same" with an odd total padding). Kernels are KRSC: [filters][kh][kw][in_channels].
extern "C" __global__ void conv_forward_direct(const void* x, const void* kernel, const void* bias, void* y, int t, ConvGeometry g) {
    GRID_STRIDE(i, g.n * g.oh * g.ow * g.f) {
        i64 f = i % g.f, ox = (i / g.f) % g.ow, oy = (i / (g.f * g.ow)) % g.oh, s = i / (g.f * g.ow * g.oh);
        float sum = 0.0f;
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 iy = oy * g.sh + ky - g.pt; if (iy < 0 || iy >= g.h) continue;
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 ix = ox * g.sw + kx - g.pl; if (ix < 0 || ix >= g.w) continue;
                for (i64 c = 0; c < g.c; ++c)
                    sum = sum + load_element(x, t, ((s * g.h + iy) * g.w + ix) * g.c + c) * load_element(kernel, t, ((f * g.kh + ky) * g.kw + kx) * g.c + c);
            }
        }
        if (bias != 0) sum = sum + load_element(bias, t, f);
        store_element(y, t, i, sum);
    }
}
extern "C" __global__ void conv_backward_data_direct(const void* dy, const void* kernel, void* dx, int t, ConvGeometry g) {
    GRID_STRIDE(i, g.n * g.h * g.w * g.c) {
        i64 c = i % g.c, ix = (i / g.c) % g.w, iy = (i / (g.c * g.w)) % g.h, s = i / (g.c * g.w * g.h);
        float sum = 0.0f;
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 ny = iy + g.pt - ky; if (ny < 0 || ny % g.sh != 0) continue; i64 oy = ny / g.sh; if (oy >= g.oh) continue;
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 nx = ix + g.pl - kx; if (nx < 0 || nx % g.sw != 0) continue; i64 ox = nx / g.sw; if (ox >= g.ow) continue;
                for (i64 f = 0; f < g.f; ++f)
                    sum = sum + load_element(dy, t, ((s * g.oh + oy) * g.ow + ox) * g.f + f) * load_element(kernel, t, ((f * g.kh + ky) * g.kw + kx) * g.c + c);
            }
        }
        store_element(dx, t, i, sum);
    }
}
extern "C" __global__ void conv_backward_filter_direct(const void* x, const void* dy, int t, void* dw, int dw_t, int accumulate, ConvGeometry g) {
    GRID_STRIDE(i, g.f * g.kh * g.kw * g.c) {
        i64 c = i % g.c, kx = (i / g.c) % g.kw, ky = (i / (g.c * g.kw)) % g.kh, f = i / (g.c * g.kw * g.kh);
        float sum = 0.0f;
        for (i64 s = 0; s < g.n; ++s)
            for (i64 oy = 0; oy < g.oh; ++oy) {
                i64 iy = oy * g.sh + ky - g.pt; if (iy < 0 || iy >= g.h) continue;
                for (i64 ox = 0; ox < g.ow; ++ox) {
                    i64 ix = ox * g.sw + kx - g.pl; if (ix < 0 || ix >= g.w) continue;
                    sum = sum + load_element(x, t, ((s * g.h + iy) * g.w + ix) * g.c + c) * load_element(dy, t, ((s * g.oh + oy) * g.ow + ox) * g.f + f);
                }
            }
        float before = accumulate ? load_element(dw, dw_t, i) : 0.0f;
        store_element(dw, dw_t, i, before + sum);
    }
}

// The padded copies that let cuDNN run a convolution with asymmetric padding: images
// [n][h][w][c] placed at row pt, column pl of [n][ph][pw][c] zeros (rows or columns past
// ph, pw are never inside a window), and the gradient cropped back out of such a copy.
extern "C" __global__ void pad_images(const void* src, void* dst, int t, i64 n, i64 h, i64 w, i64 c, i64 ph, i64 pw, i64 pt, i64 pl) {
    GRID_STRIDE(i, n * ph * pw * c) {
        i64 ch = i % c, px = (i / c) % pw, py = (i / (c * pw)) % ph, s = i / (c * pw * ph);
        i64 iy = py - pt, ix = px - pl;
        float v = (iy >= 0 && iy < h && ix >= 0 && ix < w) ? load_element(src, t, ((s * h + iy) * w + ix) * c + ch) : 0.0f;
        store_element(dst, t, i, v);
    }
}
extern "C" __global__ void crop_images(const void* src, void* dst, int t, i64 n, i64 h, i64 w, i64 c, i64 ph, i64 pw, i64 pt, i64 pl) {
    GRID_STRIDE(i, n * h * w * c) {
        i64 ch = i % c, ix = (i / c) % w, iy = (i / (c * w)) % h, s = i / (c * w * h);
        i64 py = iy + pt, px = ix + pl;
        float v = (py < ph && px < pw) ? load_element(src, t, ((s * ph + py) * pw + px) * c + ch) : 0.0f;
        store_element(dst, t, i, v);
    }
}

// Pooling for asymmetric padding; the same rules as the cpu kernels: padding never
// takes part, a max pool's gradient goes to the first maximum in row-major order.
// mode 0: max, 1: average.
extern "C" __global__ void pool_forward_direct(const void* x, void* y, int t, int mode, ConvGeometry g) {
    GRID_STRIDE(i, g.n * g.oh * g.ow * g.c) {
        i64 c = i % g.c, ox = (i / g.c) % g.ow, oy = (i / (g.c * g.ow)) % g.oh, s = i / (g.c * g.ow * g.oh);
        float best = 0.0f, sum = 0.0f; int found = 0; i64 count = 0;
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 iy = oy * g.sh + ky - g.pt; if (iy < 0 || iy >= g.h) continue;
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 ix = ox * g.sw + kx - g.pl; if (ix < 0 || ix >= g.w) continue;
                float v = load_element(x, t, ((s * g.h + iy) * g.w + ix) * g.c + c);
                // Once a NaN is seen the output stays NaN.
                if (!found) best = v; else if (best == best && (v > best || v != v)) best = v;
                found = 1; sum = sum + v; ++count;
            }
        }
        float r = mode == 0 ? (found ? best : 0.0f) : (count > 0 ? sum * (1.0f / (float)count) : 0.0f);
        store_element(y, t, i, r);
    }
}
extern "C" __global__ void pool_backward_direct(const void* x, const void* y, const void* dy, void* dx, int t, int mode, ConvGeometry g) {
    GRID_STRIDE(i, g.n * g.h * g.w * g.c) {
        i64 c = i % g.c, ix = (i / g.c) % g.w, iy = (i / (g.c * g.w)) % g.h, s = i / (g.c * g.w * g.h);
        float sum = 0.0f;
        for (i64 ky = 0; ky < g.kh; ++ky) {
            i64 ny = iy + g.pt - ky; if (ny < 0 || ny % g.sh != 0) continue; i64 oy = ny / g.sh; if (oy >= g.oh) continue;
            for (i64 kx = 0; kx < g.kw; ++kx) {
                i64 nx = ix + g.pl - kx; if (nx < 0 || nx % g.sw != 0) continue; i64 ox = nx / g.sw; if (ox >= g.ow) continue;
                i64 o = ((s * g.oh + oy) * g.ow + ox) * g.c + c;
                i64 first_row = oy * g.sh - g.pt, first_column = ox * g.sw - g.pl;
                i64 row_begin = first_row < 0 ? 0 : first_row, row_end = first_row + g.kh < g.h ? first_row + g.kh : g.h;
                i64 column_begin = first_column < 0 ? 0 : first_column, column_end = first_column + g.kw < g.w ? first_column + g.kw : g.w;
                if (mode == 1) {
                    i64 count = (row_end - row_begin) * (column_end - column_begin);
                    if (count > 0) sum = sum + load_element(dy, t, o) * (1.0f / (float)count);
                    continue;
                }
                float maximum = load_element(y, t, o);
                // The first input of the window equal to the output receives the gradient.
                i64 winner_row = -1, winner_column = -1;
                for (i64 r = row_begin; r < row_end && winner_row < 0; ++r)
                    for (i64 q = column_begin; q < column_end; ++q)
                        if (load_element(x, t, ((s * g.h + r) * g.w + q) * g.c + c) == maximum) { winner_row = r; winner_column = q; break; }
                if (winner_row == iy && winner_column == ix) sum = sum + load_element(dy, t, o);
            }
        }
        store_element(dx, t, i, sum);
    }
}
extern "C" __global__ void global_avg_pool_forward(const void* x, void* y, int t, i64 batch, i64 pixels, i64 channels) {
    GRID_STRIDE(i, batch * channels) {
        i64 s = i / channels, c = i % channels;
        float sum = 0.0f;
        for (i64 p = 0; p < pixels; ++p) sum = sum + load_element(x, t, (s * pixels + p) * channels + c);
        store_element(y, t, i, sum * (pixels > 0 ? 1.0f / (float)pixels : 0.0f));
    }
}
extern "C" __global__ void global_avg_pool_backward(const void* dy, void* dx, int t, i64 batch, i64 pixels, i64 channels) {
    GRID_STRIDE(i, batch * pixels * channels) {
        i64 c = i % channels, s = i / (pixels * channels);
        store_element(dx, t, i, load_element(dy, t, s * channels + c) * (1.0f / (float)pixels));
    }
}
"#;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::batch_norm_kernels::{BATCH_NORM_KERNEL_NAMES, BATCH_NORM_KERNEL_SOURCE};

    #[test]
    fn every_listed_kernel_is_defined_once_in_the_source() {
        let source = format!("{KERNEL_SOURCE}{BATCH_NORM_KERNEL_SOURCE}");
        let names: Vec<&str> = KERNEL_NAMES
            .iter()
            .chain(BATCH_NORM_KERNEL_NAMES)
            .copied()
            .collect();
        for name in &names {
            let definition = format!("__global__ void {name}(");
            assert_eq!(
                source.matches(&definition).count(),
                1,
                "kernel {name} must be defined exactly once"
            );
        }
        assert_eq!(
            source.matches("__global__").count(),
            names.len(),
            "every kernel in the source is listed"
        );
    }

    /// NVRTC compiles the source top to bottom: a struct used before its definition is a
    /// compile error that only a machine with NVRTC would see.
    #[test]
    fn every_struct_is_defined_before_it_is_used() {
        for definition in KERNEL_SOURCE.match_indices("struct ") {
            let name: String = KERNEL_SOURCE[definition.0 + "struct ".len()..]
                .chars()
                .take_while(|character| character.is_alphanumeric() || *character == '_')
                .collect();
            let first_use = KERNEL_SOURCE
                .match_indices(name.as_str())
                .map(|(index, _)| index)
                .find(|index| {
                    let before = KERNEL_SOURCE[..*index].chars().last();
                    !before.is_some_and(|character| character.is_alphanumeric() || character == '_')
                })
                .expect("the name is in the source");
            assert_eq!(
                first_use,
                definition.0 + "struct ".len(),
                "struct {name} is used before its definition"
            );
        }
    }

    #[test]
    fn element_type_codes_match_the_source_switch() {
        assert_eq!(element_type_code(ElementType::F32), 0);
        assert_eq!(element_type_code(ElementType::F16), 1);
        assert_eq!(element_type_code(ElementType::Bf16), 2);
        assert_eq!(element_type_code(ElementType::I32), 3);
        assert_eq!(element_type_code(ElementType::U8), 4);
    }
}
