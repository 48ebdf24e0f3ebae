//! Pooling layers, forward and backward: max pool, average pool and global average pool,
//! on NHWC images.
//!
//! Padding semantics (the same as TensorFlow's "same" pooling): padded positions never
//! take part. A max pool's padding never wins (it is not a zero that could beat negative
//! inputs), and an average pool divides by the number of window positions that lie inside
//! the input, not by the full window size.
//!
//! Max pool backward keeps no argmax buffer: it recomputes, from the saved input and
//! output, which position produced each maximum (the first one in the window, in
//! row-major order, equal to the output), so the only memory it needs is what the plan
//! already keeps.

use super::conv::ResolvedWindow;
use super::{ImageShape, WindowedShapes};

fn check_pool_lengths(window: &ResolvedWindow, input_like: usize, output_like: usize) {
    assert_eq!(
        window.input_channels, window.output_channels,
        "pool: input and output channels differ"
    );
    assert_eq!(
        input_like,
        window.batch * window.input_per_sample(),
        "pool: input length"
    );
    assert_eq!(
        output_like,
        window.batch * window.output_per_sample(),
        "pool: output length"
    );
}

/// Calls `visit(sample, output_row, output_column, valid_rows, valid_columns)` for every
/// output pixel, with the kernel offsets of its window that lie inside the input.
fn for_each_window(
    window: &ResolvedWindow,
    mut visit: impl FnMut(usize, usize, usize, std::ops::Range<usize>, std::ops::Range<usize>),
) {
    for sample in 0..window.batch {
        for output_row in 0..window.output_height {
            let valid_rows = window.valid_rows(output_row);
            for output_column in 0..window.output_width {
                let valid_columns = window.valid_columns(output_column);
                visit(
                    sample,
                    output_row,
                    output_column,
                    valid_rows.clone(),
                    valid_columns,
                );
            }
        }
    }
}

/// Offset of the first channel of an input pixel.
fn input_pixel_offset(window: &ResolvedWindow, sample: usize, row: usize, column: usize) -> usize {
    ((sample * window.input_height + row) * window.input_width + column) * window.input_channels
}

/// Offset of the first channel of an output pixel.
fn output_pixel_offset(window: &ResolvedWindow, sample: usize, row: usize, column: usize) -> usize {
    ((sample * window.output_height + row) * window.output_width + column) * window.output_channels
}

/// Max pool forward: each output is the largest input in its window (padding excluded);
/// a NaN in the window makes the output NaN. A window entirely in padding, which
/// validated geometries never produce, gives 0.
///
/// # Panics
///
/// When a slice's length does not match `shapes` (a caller bug).
pub fn max_pool_forward(shapes: &WindowedShapes, input: &[f32], output: &mut [f32]) {
    let window = ResolvedWindow::new(shapes);
    check_pool_lengths(&window, input.len(), output.len());
    let channels = window.input_channels;
    for_each_window(
        &window,
        |sample, output_row, output_column, rows, columns| {
            let output_start = output_pixel_offset(&window, sample, output_row, output_column);
            let maxima = &mut output[output_start..][..channels];
            if rows.is_empty() || columns.is_empty() {
                maxima.fill(0.0);
                return;
            }
            maxima.fill(f32::NEG_INFINITY);
            // Channels innermost: contiguous in NHWC, so this loop vectorizes.
            for kernel_row in rows {
                let input_row = window.input_row(output_row, kernel_row);
                for kernel_column in columns.clone() {
                    let input_column = window.input_column(output_column, kernel_column);
                    let input_start = input_pixel_offset(&window, sample, input_row, input_column);
                    for (maximum, &value) in
                        maxima.iter_mut().zip(&input[input_start..][..channels])
                    {
                        // Unlike `f32::max`, a NaN wins and then stays: a diverging model
                        // should show NaN downstream, not have it silently dropped here.
                        if value > *maximum || value.is_nan() {
                            *maximum = value;
                        }
                    }
                }
            }
        },
    );
}

/// Max pool backward: each output's gradient goes to the first input position of its
/// window (row-major) whose value equals the output; ties therefore give everything to
/// the first. If no input equals the output (the output buffer was rounded differently,
/// say), the first largest input gets it; an all-NaN window passes no gradient.
/// `input_gradient` is overwritten.
///
/// # Panics
///
/// When a slice's length does not match `shapes` (a caller bug).
pub fn max_pool_backward(
    shapes: &WindowedShapes,
    input: &[f32],
    output: &[f32],
    output_gradient: &[f32],
    input_gradient: &mut [f32],
) {
    let window = ResolvedWindow::new(shapes);
    check_pool_lengths(&window, input.len(), output.len());
    check_pool_lengths(&window, input_gradient.len(), output_gradient.len());
    let channels = window.input_channels;
    input_gradient.fill(0.0);
    // Which channels of the current output pixel have found their winner; reused across
    // pixels. Scanning positions in the outer loop and channels in the inner one keeps
    // memory access contiguous (NHWC) and stops as soon as every channel is routed.
    let mut routed = vec![false; channels];
    for_each_window(
        &window,
        |sample, output_row, output_column, rows, columns| {
            let output_start = output_pixel_offset(&window, sample, output_row, output_column);
            let maxima = &output[output_start..][..channels];
            let gradients = &output_gradient[output_start..][..channels];
            let input_start_of = |kernel_row: usize, kernel_column: usize| {
                let input_row = window.input_row(output_row, kernel_row);
                let input_column = window.input_column(output_column, kernel_column);
                input_pixel_offset(&window, sample, input_row, input_column)
            };
            routed.fill(false);
            let mut unrouted = channels;
            'positions: for kernel_row in rows.clone() {
                for kernel_column in columns.clone() {
                    let input_start = input_start_of(kernel_row, kernel_column);
                    let values = &input[input_start..][..channels];
                    let destination = &mut input_gradient[input_start..][..channels];
                    for channel in 0..channels {
                        if !routed[channel] && values[channel] == maxima[channel] {
                            destination[channel] += gradients[channel];
                            routed[channel] = true;
                            unrouted -= 1;
                        }
                    }
                    if unrouted == 0 {
                        break 'positions;
                    }
                }
            }
            if unrouted == 0 {
                return;
            }
            // Rare: no input equals the output. Recompute the first maximum (`>` never
            // picks NaN, so an all-NaN window routes nowhere).
            for channel in (0..channels).filter(|&channel| !routed[channel]) {
                let mut best: Option<usize> = None;
                for kernel_row in rows.clone() {
                    for kernel_column in columns.clone() {
                        let index = input_start_of(kernel_row, kernel_column) + channel;
                        let better = match best {
                            None => !input[index].is_nan(),
                            Some(best) => input[index] > input[best],
                        };
                        if better {
                            best = Some(index);
                        }
                    }
                }
                if let Some(index) = best {
                    input_gradient[index] += gradients[channel];
                }
            }
        },
    );
}

/// Average pool forward: each output is the mean of the inputs of its window that lie
/// inside the image (padding is not counted). A window entirely in padding gives 0.
///
/// # Panics
///
/// When a slice's length does not match `shapes` (a caller bug).
pub fn avg_pool_forward(shapes: &WindowedShapes, input: &[f32], output: &mut [f32]) {
    let window = ResolvedWindow::new(shapes);
    check_pool_lengths(&window, input.len(), output.len());
    let channels = window.input_channels;
    for_each_window(
        &window,
        |sample, output_row, output_column, rows, columns| {
            let output_start = output_pixel_offset(&window, sample, output_row, output_column);
            let sums = &mut output[output_start..][..channels];
            sums.fill(0.0);
            let count = rows.len() * columns.len();
            if count == 0 {
                return;
            }
            for kernel_row in rows {
                let input_row = window.input_row(output_row, kernel_row);
                for kernel_column in columns.clone() {
                    let input_column = window.input_column(output_column, kernel_column);
                    let input_start = input_pixel_offset(&window, sample, input_row, input_column);
                    for (sum, value) in sums.iter_mut().zip(&input[input_start..][..channels]) {
                        *sum += value;
                    }
                }
            }
            let scale = 1.0 / count as f32;
            sums.iter_mut().for_each(|sum| *sum *= scale);
        },
    );
}

/// Average pool backward: each output's gradient is shared equally among the inputs of
/// its window inside the image. `input_gradient` is overwritten.
///
/// # Panics
///
/// When a slice's length does not match `shapes` (a caller bug).
pub fn avg_pool_backward(
    shapes: &WindowedShapes,
    output_gradient: &[f32],
    input_gradient: &mut [f32],
) {
    let window = ResolvedWindow::new(shapes);
    check_pool_lengths(&window, input_gradient.len(), output_gradient.len());
    let channels = window.input_channels;
    input_gradient.fill(0.0);
    for_each_window(
        &window,
        |sample, output_row, output_column, rows, columns| {
            let count = rows.len() * columns.len();
            if count == 0 {
                return;
            }
            let scale = 1.0 / count as f32;
            let output_start = output_pixel_offset(&window, sample, output_row, output_column);
            let gradients = &output_gradient[output_start..][..channels];
            for kernel_row in rows {
                let input_row = window.input_row(output_row, kernel_row);
                for kernel_column in columns.clone() {
                    let input_column = window.input_column(output_column, kernel_column);
                    let input_start = input_pixel_offset(&window, sample, input_row, input_column);
                    for (destination, gradient) in input_gradient[input_start..][..channels]
                        .iter_mut()
                        .zip(gradients)
                    {
                        *destination += gradient * scale;
                    }
                }
            }
        },
    );
}

/// Global average pool forward: `output[n, c]` = mean of `input[n, .., .., c]`; the output
/// is `batch x channels`.
///
/// # Panics
///
/// When a slice's length does not match `input` (a caller bug).
pub fn global_avg_pool_forward(input: ImageShape, input_data: &[f32], output: &mut [f32]) {
    let scale = global_avg_pool_scale(input, input_data.len(), output.len(), "");
    let channels = input.channels;
    if channels == 0 {
        return;
    }
    for sample in 0..input.batch {
        let sample_output = &mut output[sample * channels..][..channels];
        let sample_input = &input_data[sample * input.per_sample()..][..input.per_sample()];
        sample_output.fill(0.0);
        // Channels innermost: contiguous in NHWC, so the sums vectorize.
        for pixel in sample_input.chunks_exact(channels) {
            for (sum, value) in sample_output.iter_mut().zip(pixel) {
                *sum += value;
            }
        }
        sample_output.iter_mut().for_each(|sum| *sum *= scale);
    }
}

/// Checks a global average pool's slice lengths (the input's or its gradient's, the
/// output's or its gradient's: `which` says) and returns the scale of a channel's sum,
/// `1 / (height * width)` (0 for an empty image).
fn global_avg_pool_scale(
    input: ImageShape,
    input_length: usize,
    output_length: usize,
    which: &str,
) -> f32 {
    assert_eq!(
        input_length,
        input.elements(),
        "global avg pool: input{which} length"
    );
    assert_eq!(
        output_length,
        input.batch * input.channels,
        "global avg pool: output{which} length"
    );
    let pixels = input.height * input.width;
    if pixels == 0 {
        0.0
    } else {
        1.0 / pixels as f32
    }
}

/// Global average pool backward: every pixel of a channel receives `1 / (height * width)`
/// of that channel's output gradient. `input_gradient` is overwritten.
///
/// # Panics
///
/// When a slice's length does not match `input` (a caller bug).
pub fn global_avg_pool_backward(
    input: ImageShape,
    output_gradient: &[f32],
    input_gradient: &mut [f32],
) {
    let scale = global_avg_pool_scale(
        input,
        input_gradient.len(),
        output_gradient.len(),
        " gradient",
    );
    let channels = input.channels;
    if channels == 0 {
        return;
    }
    for sample in 0..input.batch {
        let sample_gradient = &output_gradient[sample * channels..][..channels];
        let sample_input_gradient =
            &mut input_gradient[sample * input.per_sample()..][..input.per_sample()];
        for pixel in sample_input_gradient.chunks_exact_mut(channels) {
            for (destination, gradient) in pixel.iter_mut().zip(sample_gradient) {
                *destination = gradient * scale;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_core::model::WindowGeometry;

    fn shapes(
        input: (usize, usize, usize),
        output: (usize, usize),
        kernel: (u64, u64),
        stride: u64,
        padding: [u64; 4],
    ) -> WindowedShapes {
        WindowedShapes {
            input: ImageShape {
                batch: 1,
                height: input.0,
                width: input.1,
                channels: input.2,
            },
            output: ImageShape {
                batch: 1,
                height: output.0,
                width: output.1,
                channels: input.2,
            },
            window: WindowGeometry {
                kernel_height: kernel.0,
                kernel_width: kernel.1,
                stride_height: stride,
                stride_width: stride,
                padding_top: padding[0],
                padding_bottom: padding[1],
                padding_left: padding[2],
                padding_right: padding[3],
            },
        }
    }

    #[test]
    fn max_pool_two_by_two_stride_two() {
        let shapes = shapes((4, 4, 1), (2, 2), (2, 2), 2, [0; 4]);
        #[rustfmt::skip]
        let input = [
            1.0, 5.0, -1.0, -2.0,
            3.0, 2.0, -3.0, -4.0,
            0.0, 0.0, 7.0, 8.0,
            0.0, 9.0, 6.0, 5.0,
        ];
        let mut output = [0.0; 4];
        max_pool_forward(&shapes, &input, &mut output);
        assert_eq!(output, [5.0, -1.0, 9.0, 8.0]);
        let mut input_gradient = [f32::NAN; 16];
        max_pool_backward(
            &shapes,
            &input,
            &output,
            &[1.0, 2.0, 3.0, 4.0],
            &mut input_gradient,
        );
        #[rustfmt::skip]
        let expected = [
            0.0, 1.0, 2.0, 0.0,
            0.0, 0.0, 0.0, 0.0,
            0.0, 0.0, 0.0, 4.0,
            0.0, 3.0, 0.0, 0.0,
        ];
        assert_eq!(input_gradient, expected);
    }

    #[test]
    fn max_pool_tie_goes_to_the_first_position() {
        let shapes = shapes((2, 2, 1), (1, 1), (2, 2), 2, [0; 4]);
        let input = [1.0, 4.0, 4.0, 4.0];
        let mut output = [0.0];
        max_pool_forward(&shapes, &input, &mut output);
        assert_eq!(output, [4.0]);
        let mut input_gradient = [0.0; 4];
        max_pool_backward(&shapes, &input, &output, &[2.5], &mut input_gradient);
        assert_eq!(input_gradient, [0.0, 2.5, 0.0, 0.0]);
    }

    #[test]
    fn max_pool_padding_never_wins() {
        // All-negative input, 3x3 window with padding 1: a zero pad would win if counted.
        let shapes = shapes((2, 2, 1), (2, 2), (3, 3), 1, [1, 1, 1, 1]);
        let input = [-4.0, -3.0, -2.0, -1.0];
        let mut output = [0.0; 4];
        max_pool_forward(&shapes, &input, &mut output);
        assert_eq!(output, [-1.0; 4]);
        let mut input_gradient = [0.0; 4];
        max_pool_backward(&shapes, &input, &output, &[1.0; 4], &mut input_gradient);
        assert_eq!(input_gradient, [0.0, 0.0, 0.0, 4.0]);
    }

    #[test]
    fn max_pool_channels_are_independent() {
        // One 1x2 window over two pixels of two channels each: (1, 7) and (3, 2).
        let shapes = shapes((1, 2, 2), (1, 1), (1, 2), 1, [0; 4]);
        let input = [1.0, 7.0, 3.0, 2.0];
        let mut output = [0.0; 2];
        max_pool_forward(&shapes, &input, &mut output);
        assert_eq!(output, [3.0, 7.0]);
        let mut input_gradient = [0.0; 4];
        max_pool_backward(&shapes, &input, &output, &[1.0, 2.0], &mut input_gradient);
        assert_eq!(input_gradient, [0.0, 2.0, 1.0, 0.0]);
    }

    #[test]
    fn max_pool_backward_falls_back_when_output_was_rounded() {
        let shapes = shapes((1, 2, 1), (1, 1), (1, 2), 1, [0; 4]);
        let input = [1.0, 2.0001];
        let mut input_gradient = [0.0; 2];
        max_pool_backward(&shapes, &input, &[2.0], &[1.0], &mut input_gradient);
        assert_eq!(input_gradient, [0.0, 1.0]);
    }

    #[test]
    fn avg_pool_same_padding_counts_only_inside_positions() {
        // 3x3 input, 3x3 window, stride 1, padding 1 all round ("same").
        let shapes = shapes((3, 3, 1), (3, 3), (3, 3), 1, [1, 1, 1, 1]);
        let input = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0];
        let mut output = [0.0; 9];
        avg_pool_forward(&shapes, &input, &mut output);
        // Corner (0, 0): mean of 1, 2, 4, 5 over 4 positions, not 9.
        assert_eq!(output[0], 3.0);
        // Edge (0, 1): mean of 1..6 over 6 positions.
        assert_eq!(output[1], 3.5);
        // Centre: all nine.
        assert_eq!(output[4], 5.0);
        assert_eq!(output[8], 7.0);

        let mut output_gradient = [0.0; 9];
        output_gradient[0] = 4.0;
        let mut input_gradient = [f32::NAN; 9];
        avg_pool_backward(&shapes, &output_gradient, &mut input_gradient);
        assert_eq!(
            input_gradient,
            [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        );
    }

    #[test]
    fn avg_pool_asymmetric_padding() {
        // 2x2 window, stride 2 on a 3x3 input, "same": padding 0 top/left, 1 bottom/right.
        let shapes = shapes((3, 3, 1), (2, 2), (2, 2), 2, [0, 1, 0, 1]);
        let input = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0];
        let mut output = [0.0; 4];
        avg_pool_forward(&shapes, &input, &mut output);
        assert_eq!(output, [3.0, 4.5, 7.5, 9.0]);
    }

    #[test]
    fn global_avg_pool_two_samples_two_channels() {
        let shape = ImageShape {
            batch: 2,
            height: 1,
            width: 2,
            channels: 2,
        };
        let input = [1.0, 10.0, 3.0, 20.0, -1.0, 0.0, -3.0, 4.0];
        let mut output = [0.0; 4];
        global_avg_pool_forward(shape, &input, &mut output);
        assert_eq!(output, [2.0, 15.0, -2.0, 2.0]);
        let mut input_gradient = [f32::NAN; 8];
        global_avg_pool_backward(shape, &[2.0, 4.0, 6.0, 8.0], &mut input_gradient);
        assert_eq!(input_gradient, [1.0, 2.0, 1.0, 2.0, 3.0, 4.0, 3.0, 4.0]);
    }
}
