//! 2-D convolution, forward and backward, as explicit GEMM over an im2col matrix.
//!
//! Layout of the im2col matrix: one row per output pixel (sample, output row, output
//! column, in NHWC order) and one column per kernel tap in `[kernel_height, kernel_width,
//! in_channels]` order, which is exactly the row order of the kernel
//! `[kernel_height, kernel_width, in_channels, filters]` seen as a
//! `(kernel_height*kernel_width*in_channels) x filters` matrix. So for any run of output
//! rows:
//! - forward: `output_rows = im2col_rows * kernel` (the product lands directly in NHWC);
//! - backward: `kernel_gradient += im2col_rows^T * output_gradient_rows`, and
//!   `input_gradient += col2im(output_gradient_rows * kernel^T)`.
//!
//! Memory: the plan hands the convolution a workspace of at least a whole number of
//! samples' im2col (`carve_core`'s `workspace_elements`, with headroom for cuDNN), or
//! nothing. The kernels work through the batch in chunks of as many output rows as the
//! workspace holds, so memory use stays what the estimator predicted. Without a
//! workspace they fall back to a direct path that builds the im2col of a single output
//! row at a time in a small scratch (`kernel_height*kernel_width*in_channels*output_width`
//! elements, a sliver of one sample's im2col, which the plan does not count); 1x1
//! stride-1 unpadded convolutions need no im2col at all: the input already is that
//! matrix.

use super::WindowedShapes;
use super::gemm::gemm;

/// The dimensions of a windowed operation as `usize`, checked for consistency once.
/// Shared by the convolution and pooling kernels.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ResolvedWindow {
    pub batch: usize,
    pub input_height: usize,
    pub input_width: usize,
    pub input_channels: usize,
    pub output_height: usize,
    pub output_width: usize,
    pub output_channels: usize,
    pub kernel_height: usize,
    pub kernel_width: usize,
    pub stride_height: usize,
    pub stride_width: usize,
    pub padding_top: usize,
    pub padding_left: usize,
}

fn to_usize(value: u64) -> usize {
    usize::try_from(value).expect("window geometry fits in memory")
}

impl ResolvedWindow {
    /// # Panics
    ///
    /// When the output size does not follow from the input and the window, or a stride
    /// or kernel dimension is zero: shapes come from validation, so that is a caller bug.
    pub(crate) fn new(shapes: &WindowedShapes) -> Self {
        let window = &shapes.window;
        let resolved = Self {
            batch: shapes.input.batch,
            input_height: shapes.input.height,
            input_width: shapes.input.width,
            input_channels: shapes.input.channels,
            output_height: shapes.output.height,
            output_width: shapes.output.width,
            output_channels: shapes.output.channels,
            kernel_height: to_usize(window.kernel_height),
            kernel_width: to_usize(window.kernel_width),
            stride_height: to_usize(window.stride_height),
            stride_width: to_usize(window.stride_width),
            padding_top: to_usize(window.padding_top),
            padding_left: to_usize(window.padding_left),
        };
        assert_eq!(
            shapes.output.batch, shapes.input.batch,
            "windowed op: input and output batch differ"
        );
        assert!(
            resolved.kernel_height > 0
                && resolved.kernel_width > 0
                && resolved.stride_height > 0
                && resolved.stride_width > 0,
            "windowed op: zero kernel or stride"
        );
        let expected_output = |input: usize, before: u64, after: u64, kernel: usize, stride| {
            (input + to_usize(before) + to_usize(after))
                .checked_sub(kernel)
                .map(|room| room / stride + 1)
        };
        assert_eq!(
            Some(resolved.output_height),
            expected_output(
                resolved.input_height,
                window.padding_top,
                window.padding_bottom,
                resolved.kernel_height,
                resolved.stride_height
            ),
            "windowed op: output height does not follow from the window"
        );
        assert_eq!(
            Some(resolved.output_width),
            expected_output(
                resolved.input_width,
                window.padding_left,
                window.padding_right,
                resolved.kernel_width,
                resolved.stride_width
            ),
            "windowed op: output width does not follow from the window"
        );
        resolved
    }

    /// The input rows (or columns) a window position covers that lie inside the input:
    /// the kernel offsets `first..last` with `output_index * stride + offset - padding`
    /// in `0..input_size`. Padding positions are left out.
    pub(crate) fn valid_kernel_offsets(
        output_index: usize,
        stride: usize,
        padding: usize,
        kernel: usize,
        input_size: usize,
    ) -> std::ops::Range<usize> {
        let start = output_index * stride;
        // Offsets below `padding - start` fall in the leading padding.
        let first = padding.saturating_sub(start).min(kernel);
        // Offsets at or past `input_size + padding - start` fall in the trailing padding.
        let last = (input_size + padding).saturating_sub(start).min(kernel);
        first..last.max(first)
    }

    /// Offsets valid vertically for output row `output_row`.
    pub(crate) fn valid_rows(&self, output_row: usize) -> std::ops::Range<usize> {
        Self::valid_kernel_offsets(
            output_row,
            self.stride_height,
            self.padding_top,
            self.kernel_height,
            self.input_height,
        )
    }

    /// Offsets valid horizontally for output column `output_column`.
    pub(crate) fn valid_columns(&self, output_column: usize) -> std::ops::Range<usize> {
        Self::valid_kernel_offsets(
            output_column,
            self.stride_width,
            self.padding_left,
            self.kernel_width,
            self.input_width,
        )
    }

    /// Input row of kernel offset `kernel_row` at output row `output_row`; only meaningful
    /// for offsets in `valid_rows(output_row)`.
    pub(crate) fn input_row(&self, output_row: usize, kernel_row: usize) -> usize {
        output_row * self.stride_height + kernel_row - self.padding_top
    }

    /// Input column of kernel offset `kernel_column` at output column `output_column`;
    /// only meaningful for offsets in `valid_columns(output_column)`.
    pub(crate) fn input_column(&self, output_column: usize, kernel_column: usize) -> usize {
        output_column * self.stride_width + kernel_column - self.padding_left
    }

    pub(crate) fn input_per_sample(&self) -> usize {
        self.input_height * self.input_width * self.input_channels
    }

    pub(crate) fn output_per_sample(&self) -> usize {
        self.output_height * self.output_width * self.output_channels
    }

    /// Width of the im2col matrix: one column per kernel tap.
    fn patch_length(&self) -> usize {
        self.kernel_height * self.kernel_width * self.input_channels
    }

    /// im2col elements of one output row.
    fn im2col_row_elements(&self) -> usize {
        self.patch_length() * self.output_width
    }

    /// Total output rows of the batch (sample-major), the unit the kernels chunk by.
    fn total_output_rows(&self) -> usize {
        self.batch * self.output_height
    }
}

/// Writes the im2col rows of output rows `first_row..first_row + row_count` (counted over
/// the whole batch: row `r` is output row `r % output_height` of sample
/// `r / output_height`) into `columns`, which holds exactly those rows.
fn im2col_rows(window: &ResolvedWindow, input: &[f32], first_row: usize, columns: &mut [f32]) {
    let channels = window.input_channels;
    let patch_length = window.patch_length();
    let tap_row_length = window.kernel_width * channels;
    for (local_row, row_columns) in columns
        .chunks_exact_mut(window.im2col_row_elements())
        .enumerate()
    {
        let global_row = first_row + local_row;
        let sample = global_row / window.output_height;
        let output_row = global_row % window.output_height;
        let sample_input =
            &input[sample * window.input_per_sample()..][..window.input_per_sample()];
        let valid_rows = window.valid_rows(output_row);
        for (output_column, patch) in row_columns.chunks_exact_mut(patch_length).enumerate() {
            let valid_columns = window.valid_columns(output_column);
            for (kernel_row, patch_row) in patch.chunks_exact_mut(tap_row_length).enumerate() {
                if !valid_rows.contains(&kernel_row) || valid_columns.is_empty() {
                    patch_row.fill(0.0);
                    continue;
                }
                let input_row = window.input_row(output_row, kernel_row);
                let first_input_column = window.input_column(output_column, valid_columns.start);
                // The valid taps of one kernel row are adjacent input pixels, hence one
                // contiguous copy; padding taps on either side are zeros.
                let source_start = (input_row * window.input_width + first_input_column) * channels;
                let copy_length = valid_columns.len() * channels;
                let (leading, rest) = patch_row.split_at_mut(valid_columns.start * channels);
                let (copied, trailing) = rest.split_at_mut(copy_length);
                leading.fill(0.0);
                copied.copy_from_slice(&sample_input[source_start..source_start + copy_length]);
                trailing.fill(0.0);
            }
        }
    }
}

/// The reverse of `im2col_rows`: adds each im2col entry of the given output rows back onto
/// the input position it was copied from (padding entries are dropped). Overlapping
/// windows sum, which is what the input gradient needs.
fn col2im_rows_add(
    window: &ResolvedWindow,
    columns: &[f32],
    first_row: usize,
    input_gradient: &mut [f32],
) {
    let channels = window.input_channels;
    let patch_length = window.patch_length();
    let tap_row_length = window.kernel_width * channels;
    let input_per_sample = window.input_per_sample();
    for (local_row, row_columns) in columns
        .chunks_exact(window.im2col_row_elements())
        .enumerate()
    {
        let global_row = first_row + local_row;
        let sample = global_row / window.output_height;
        let output_row = global_row % window.output_height;
        let sample_gradient = &mut input_gradient[sample * input_per_sample..][..input_per_sample];
        let valid_rows = window.valid_rows(output_row);
        for (output_column, patch) in row_columns.chunks_exact(patch_length).enumerate() {
            let valid_columns = window.valid_columns(output_column);
            if valid_columns.is_empty() {
                continue;
            }
            let first_input_column = window.input_column(output_column, valid_columns.start);
            let added_length = valid_columns.len() * channels;
            for kernel_row in valid_rows.clone() {
                let input_row = window.input_row(output_row, kernel_row);
                let destination_start =
                    (input_row * window.input_width + first_input_column) * channels;
                let source_start = kernel_row * tap_row_length + valid_columns.start * channels;
                let destination = &mut sample_gradient[destination_start..][..added_length];
                let source = &patch[source_start..][..added_length];
                for (gradient, contribution) in destination.iter_mut().zip(source) {
                    *gradient += contribution;
                }
            }
        }
    }
}

/// How many output rows each chunk covers and where the im2col of a chunk lives.
enum ColumnBuffer<'a> {
    /// The plan's workspace, holding `rows_per_chunk` output rows' im2col.
    Workspace(&'a mut [f32]),
    /// Direct path: one output row's im2col in a small scratch of our own.
    RowScratch(Vec<f32>),
}

impl ColumnBuffer<'_> {
    fn new<'a>(window: &ResolvedWindow, workspace: &'a mut [f32]) -> (ColumnBuffer<'a>, usize) {
        let row_elements = window.im2col_row_elements();
        // Chunks are runs of output rows; a workspace sized for `s` whole samples holds
        // exactly `s * output_height` rows. Capped at the batch so no time is spent on an
        // oversized buffer.
        let rows_that_fit = workspace
            .len()
            .checked_div(row_elements)
            .unwrap_or(0)
            .min(window.total_output_rows());
        if rows_that_fit == 0 {
            // Direct path: the plan found no room for an im2col. The scratch is a single
            // output row's im2col, far below what the plan would have reserved for one
            // sample, so memory stays (essentially) inside the slice.
            (ColumnBuffer::RowScratch(vec![0.0; row_elements]), 1)
        } else {
            (
                ColumnBuffer::Workspace(&mut workspace[..rows_that_fit * row_elements]),
                rows_that_fit,
            )
        }
    }

    fn slice(&mut self) -> &mut [f32] {
        match self {
            ColumnBuffer::Workspace(slice) => slice,
            ColumnBuffer::RowScratch(vector) => vector,
        }
    }
}

fn check_lengths(
    window: &ResolvedWindow,
    input: &[f32],
    kernel: &[f32],
    output_like: &[f32],
    bias_like: Option<&[f32]>,
) {
    assert_eq!(
        input.len(),
        window.batch * window.input_per_sample(),
        "conv2d: input length"
    );
    assert_eq!(
        kernel.len(),
        window.patch_length() * window.output_channels,
        "conv2d: kernel length"
    );
    assert_eq!(
        output_like.len(),
        window.batch * window.output_per_sample(),
        "conv2d: output length"
    );
    if let Some(bias) = bias_like {
        assert_eq!(bias.len(), window.output_channels, "conv2d: bias length");
    }
}

/// Convolution forward: `output = conv(input, kernel) + bias`, NHWC, `shapes.output.channels`
/// filters. `workspace` is the plan's im2col buffer (any length; empty selects the direct
/// path). The output is overwritten.
///
/// # Panics
///
/// When a slice's length does not match `shapes` (a caller bug).
pub fn conv2d_forward(
    shapes: &WindowedShapes,
    input: &[f32],
    kernel: &[f32],
    bias: Option<&[f32]>,
    output: &mut [f32],
    workspace: &mut [f32],
) {
    let window = ResolvedWindow::new(shapes);
    check_lengths(&window, input, kernel, output, bias);
    let filters = window.output_channels;
    let patch_length = window.patch_length();

    // Start from the bias (or nothing) and let the GEMM accumulate onto it: one pass over
    // the output fewer than adding the bias afterwards.
    let beta = match bias {
        Some(bias) => {
            for pixel in output.chunks_exact_mut(filters) {
                pixel.copy_from_slice(bias);
            }
            1.0
        }
        None => 0.0,
    };

    // A pointwise window's NHWC input is already the im2col matrix (and the plan gives it
    // no workspace).
    if shapes.window.is_pointwise() {
        let pixels = window.batch * window.input_height * window.input_width;
        gemm(
            pixels,
            patch_length,
            filters,
            input,
            false,
            kernel,
            false,
            output,
            1.0,
            beta,
        );
        return;
    }

    let (mut buffer, rows_per_chunk) = ColumnBuffer::new(&window, workspace);
    let total_rows = window.total_output_rows();
    let output_row_elements = window.output_width * filters;
    let mut first_row = 0;
    while first_row < total_rows {
        let row_count = rows_per_chunk.min(total_rows - first_row);
        let columns = &mut buffer.slice()[..row_count * window.im2col_row_elements()];
        im2col_rows(&window, input, first_row, columns);
        let output_chunk =
            &mut output[first_row * output_row_elements..][..row_count * output_row_elements];
        gemm(
            row_count * window.output_width,
            patch_length,
            filters,
            columns,
            false,
            kernel,
            false,
            output_chunk,
            1.0,
            beta,
        );
        first_row += row_count;
    }
}

/// Convolution backward.
///
/// - `kernel_gradient += im2col(input)^T * output_gradient` (added to);
/// - `bias_gradient += output_gradient` summed over batch, height and width (added to);
/// - `input_gradient = col2im(output_gradient * kernel^T)` (overwritten), skipped when
///   `None` (the first layer needs no input gradient).
///
/// `workspace` as for [`conv2d_forward`].
///
/// # Panics
///
/// When a slice's length does not match `shapes` (a caller bug).
#[allow(clippy::too_many_arguments)]
pub fn conv2d_backward(
    shapes: &WindowedShapes,
    input: &[f32],
    kernel: &[f32],
    output_gradient: &[f32],
    mut input_gradient: Option<&mut [f32]>,
    kernel_gradient: &mut [f32],
    bias_gradient: Option<&mut [f32]>,
    workspace: &mut [f32],
) {
    let window = ResolvedWindow::new(shapes);
    check_lengths(
        &window,
        input,
        kernel,
        output_gradient,
        bias_gradient.as_deref(),
    );
    assert_eq!(
        kernel_gradient.len(),
        kernel.len(),
        "conv2d: kernel gradient length"
    );
    if let Some(input_gradient) = input_gradient.as_deref() {
        assert_eq!(
            input_gradient.len(),
            input.len(),
            "conv2d: input gradient length"
        );
    }
    let filters = window.output_channels;
    let patch_length = window.patch_length();

    if let Some(bias_gradient) = bias_gradient {
        for pixel in output_gradient.chunks_exact(filters) {
            for (gradient, contribution) in bias_gradient.iter_mut().zip(pixel) {
                *gradient += contribution;
            }
        }
    }

    // A pointwise window's NHWC input is already the im2col matrix (and the plan gives it
    // no workspace).
    if shapes.window.is_pointwise() {
        let pixels = window.batch * window.input_height * window.input_width;
        gemm(
            patch_length,
            pixels,
            filters,
            input,
            true,
            output_gradient,
            false,
            kernel_gradient,
            1.0,
            1.0,
        );
        if let Some(input_gradient) = input_gradient {
            gemm(
                pixels,
                filters,
                patch_length,
                output_gradient,
                false,
                kernel,
                true,
                input_gradient,
                1.0,
                0.0,
            );
        }
        return;
    }

    // Chunks add their col2im onto the input gradient (windows overlap across chunks), so
    // it starts from zero.
    if let Some(input_gradient) = input_gradient.as_deref_mut() {
        input_gradient.fill(0.0);
    }
    let (mut buffer, rows_per_chunk) = ColumnBuffer::new(&window, workspace);
    let total_rows = window.total_output_rows();
    let output_row_elements = window.output_width * filters;
    let mut first_row = 0;
    while first_row < total_rows {
        let row_count = rows_per_chunk.min(total_rows - first_row);
        let pixel_count = row_count * window.output_width;
        let columns = &mut buffer.slice()[..row_count * window.im2col_row_elements()];
        let gradient_chunk =
            &output_gradient[first_row * output_row_elements..][..row_count * output_row_elements];

        im2col_rows(&window, input, first_row, columns);
        gemm(
            patch_length,
            pixel_count,
            filters,
            columns,
            true,
            gradient_chunk,
            false,
            kernel_gradient,
            1.0,
            1.0,
        );

        if let Some(input_gradient) = input_gradient.as_deref_mut() {
            // The im2col is no longer needed: reuse its buffer for the gradient with
            // respect to it, then scatter that back onto the input.
            gemm(
                pixel_count,
                filters,
                patch_length,
                gradient_chunk,
                false,
                kernel,
                true,
                columns,
                1.0,
                0.0,
            );
            col2im_rows_add(&window, columns, first_row, input_gradient);
        }
        first_row += row_count;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::ImageShape;
    use carve_core::model::WindowGeometry;

    fn geometry(kernel: (u64, u64), stride: (u64, u64), padding: [u64; 4]) -> WindowGeometry {
        WindowGeometry {
            kernel_height: kernel.0,
            kernel_width: kernel.1,
            stride_height: stride.0,
            stride_width: stride.1,
            padding_top: padding[0],
            padding_bottom: padding[1],
            padding_left: padding[2],
            padding_right: padding[3],
        }
    }

    fn image(batch: usize, height: usize, width: usize, channels: usize) -> ImageShape {
        ImageShape {
            batch,
            height,
            width,
            channels,
        }
    }

    /// Every workspace size the plan could hand over for this convolution.
    fn workspace_sizes(shapes: &WindowedShapes) -> Vec<usize> {
        let window = shapes.window;
        let per_sample = (shapes.input.channels as u64
            * window.kernel_height
            * window.kernel_width
            * shapes.output.height as u64
            * shapes.output.width as u64) as usize;
        vec![0, per_sample, per_sample * shapes.input.batch]
    }

    #[test]
    fn one_channel_three_by_three_with_two_by_two_kernel() {
        // input      kernel
        // 1 2 3      1 0
        // 4 5 6      0 -1
        // 7 8 9
        // output(i, j) = x(i, j) - x(i+1, j+1) = -4 everywhere, plus bias 0.5.
        let shapes = WindowedShapes {
            input: image(1, 3, 3, 1),
            output: image(1, 2, 2, 1),
            window: geometry((2, 2), (1, 1), [0; 4]),
        };
        let input = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0];
        let kernel = [1.0, 0.0, 0.0, -1.0];
        for workspace_size in workspace_sizes(&shapes) {
            let mut workspace = vec![f32::NAN; workspace_size];
            let mut output = [f32::NAN; 4];
            conv2d_forward(
                &shapes,
                &input,
                &kernel,
                Some(&[0.5]),
                &mut output,
                &mut workspace,
            );
            assert_eq!(output, [-3.5; 4]);

            // dL/dY = [1 2; 3 4].
            let output_gradient = [1.0, 2.0, 3.0, 4.0];
            let mut input_gradient = [f32::NAN; 9];
            let mut kernel_gradient = [0.0; 4];
            let mut bias_gradient = [0.0];
            conv2d_backward(
                &shapes,
                &input,
                &kernel,
                &output_gradient,
                Some(&mut input_gradient),
                &mut kernel_gradient,
                Some(&mut bias_gradient),
                &mut workspace,
            );
            assert_eq!(bias_gradient, [10.0]);
            // dK(a, b) = sum_ij dY(i, j) * x(i + a, j + b).
            assert_eq!(
                kernel_gradient,
                [
                    1.0 + 4.0 + 12.0 + 20.0,
                    2.0 + 6.0 + 15.0 + 24.0,
                    4.0 + 10.0 + 21.0 + 32.0,
                    5.0 + 12.0 + 24.0 + 36.0
                ]
            );
            // dX(p, q) = dY(p, q) * 1 - dY(p - 1, q - 1).
            assert_eq!(
                input_gradient,
                [1.0, 2.0, 0.0, 3.0, 4.0 - 1.0, -2.0, 0.0, -3.0, -4.0]
            );
        }
    }

    #[test]
    fn asymmetric_same_padding_with_even_kernel() {
        // 2x2 kernel of ones on a 2x2 input, "same": padding 0 top/left, 1 bottom/right.
        let shapes = WindowedShapes {
            input: image(1, 2, 2, 1),
            output: image(1, 2, 2, 1),
            window: geometry((2, 2), (1, 1), [0, 1, 0, 1]),
        };
        let input = [1.0, 2.0, 3.0, 4.0];
        let kernel = [1.0; 4];
        for workspace_size in workspace_sizes(&shapes) {
            let mut workspace = vec![0.0; workspace_size];
            let mut output = [0.0; 4];
            conv2d_forward(&shapes, &input, &kernel, None, &mut output, &mut workspace);
            assert_eq!(output, [10.0, 6.0, 7.0, 4.0]);

            let mut input_gradient = [0.0; 4];
            let mut kernel_gradient = [0.0; 4];
            conv2d_backward(
                &shapes,
                &input,
                &kernel,
                &[1.0; 4],
                Some(&mut input_gradient),
                &mut kernel_gradient,
                None,
                &mut workspace,
            );
            // Pixel (p, q) is seen by outputs (i, j) with i <= p, j <= q.
            assert_eq!(input_gradient, [1.0, 2.0, 2.0, 4.0]);
            // Tap (a, b) sees the inputs x(i+a, j+b) inside the image.
            assert_eq!(kernel_gradient, [10.0, 6.0, 7.0, 4.0]);
        }
    }

    #[test]
    fn pointwise_convolution_mixes_channels() {
        let shapes = WindowedShapes {
            input: image(1, 1, 2, 2),
            output: image(1, 1, 2, 1),
            window: geometry((1, 1), (1, 1), [0; 4]),
        };
        let input = [1.0, 2.0, 3.0, 4.0];
        let kernel = [10.0, 1.0];
        let mut output = [0.0; 2];
        conv2d_forward(&shapes, &input, &kernel, None, &mut output, &mut []);
        assert_eq!(output, [12.0, 34.0]);
        let mut input_gradient = [f32::NAN; 4];
        let mut kernel_gradient = [1.0, 1.0];
        conv2d_backward(
            &shapes,
            &input,
            &kernel,
            &[1.0, 2.0],
            Some(&mut input_gradient),
            &mut kernel_gradient,
            None,
            &mut [],
        );
        assert_eq!(input_gradient, [10.0, 1.0, 20.0, 2.0]);
        assert_eq!(kernel_gradient, [1.0 + 7.0, 1.0 + 10.0]);
    }

    #[test]
    fn valid_kernel_offsets_exclude_padding() {
        // Kernel 3, padding 1, input 4, stride 1.
        assert_eq!(ResolvedWindow::valid_kernel_offsets(0, 1, 1, 3, 4), 1..3);
        assert_eq!(ResolvedWindow::valid_kernel_offsets(1, 1, 1, 3, 4), 0..3);
        assert_eq!(ResolvedWindow::valid_kernel_offsets(3, 1, 1, 3, 4), 0..2);
        // Stride 2 past the end of the input: empty.
        assert_eq!(ResolvedWindow::valid_kernel_offsets(3, 2, 0, 1, 4), 0..0);
    }
}
