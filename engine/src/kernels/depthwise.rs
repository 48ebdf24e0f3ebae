//! Depthwise convolution (MobileNet's): each input channel convolved with its own
//! `multiplier` filters, direct loops (no im2col, so no workspace), and zero padding
//! around images. Kernel `[kernel_height, kernel_width, channels, multiplier]`; output
//! channel `c * multiplier + j` is channel `c` under filter `j`, as in Keras.

use super::{ImageShape, WindowedShapes};

/// The input pixel a kernel tap reads for an output pixel, `None` in the padding.
fn source_pixel(
    shapes: &WindowedShapes,
    out_y: usize,
    out_x: usize,
    ky: usize,
    kx: usize,
) -> Option<(usize, usize)> {
    let window = shapes.window;
    let y =
        (out_y * window.stride_height as usize + ky).checked_sub(window.padding_top as usize)?;
    let x =
        (out_x * window.stride_width as usize + kx).checked_sub(window.padding_left as usize)?;
    (y < shapes.input.height && x < shapes.input.width).then_some((y, x))
}

/// `output = depthwise(input, kernel) + bias`.
pub fn depthwise_conv2d_forward(
    shapes: &WindowedShapes,
    multiplier: usize,
    input: &[f32],
    kernel: &[f32],
    bias: Option<&[f32]>,
    output: &mut [f32],
) {
    let (input_shape, output_shape) = (shapes.input, shapes.output);
    let channels = input_shape.channels;
    let (kernel_height, kernel_width) = (
        shapes.window.kernel_height as usize,
        shapes.window.kernel_width as usize,
    );
    for sample in 0..output_shape.batch {
        for out_y in 0..output_shape.height {
            for out_x in 0..output_shape.width {
                let base = ((sample * output_shape.height + out_y) * output_shape.width + out_x)
                    * output_shape.channels;
                for out_channel in 0..output_shape.channels {
                    let channel = out_channel / multiplier;
                    let filter = out_channel % multiplier;
                    let mut sum = 0.0f32;
                    for ky in 0..kernel_height {
                        for kx in 0..kernel_width {
                            let Some((y, x)) = source_pixel(shapes, out_y, out_x, ky, kx) else {
                                continue;
                            };
                            let value =
                                input[((sample * input_shape.height + y) * input_shape.width + x)
                                    * channels
                                    + channel];
                            let weight = kernel[((ky * kernel_width + kx) * channels + channel)
                                * multiplier
                                + filter];
                            sum += value * weight;
                        }
                    }
                    if let Some(bias) = bias {
                        sum += bias[out_channel];
                    }
                    output[base + out_channel] = sum;
                }
            }
        }
    }
}

/// The input gradient (overwritten, when asked) and the kernel and bias gradients (added
/// to). The arguments are the kernel's slices, as `conv2d_backward` takes them.
#[allow(clippy::too_many_arguments)]
pub fn depthwise_conv2d_backward(
    shapes: &WindowedShapes,
    multiplier: usize,
    input: &[f32],
    kernel: &[f32],
    output_gradient: &[f32],
    mut input_gradient: Option<&mut [f32]>,
    kernel_gradient: &mut [f32],
    mut bias_gradient: Option<&mut [f32]>,
) {
    let (input_shape, output_shape) = (shapes.input, shapes.output);
    let channels = input_shape.channels;
    let (kernel_height, kernel_width) = (
        shapes.window.kernel_height as usize,
        shapes.window.kernel_width as usize,
    );
    if let Some(dx) = input_gradient.as_deref_mut() {
        dx[..input_shape.elements()].fill(0.0);
    }
    for sample in 0..output_shape.batch {
        for out_y in 0..output_shape.height {
            for out_x in 0..output_shape.width {
                let base = ((sample * output_shape.height + out_y) * output_shape.width + out_x)
                    * output_shape.channels;
                for out_channel in 0..output_shape.channels {
                    let dy = output_gradient[base + out_channel];
                    let channel = out_channel / multiplier;
                    let filter = out_channel % multiplier;
                    if let Some(bias_gradient) = bias_gradient.as_deref_mut() {
                        bias_gradient[out_channel] += dy;
                    }
                    for ky in 0..kernel_height {
                        for kx in 0..kernel_width {
                            let Some((y, x)) = source_pixel(shapes, out_y, out_x, ky, kx) else {
                                continue;
                            };
                            let input_index =
                                ((sample * input_shape.height + y) * input_shape.width + x)
                                    * channels
                                    + channel;
                            let kernel_index = ((ky * kernel_width + kx) * channels + channel)
                                * multiplier
                                + filter;
                            kernel_gradient[kernel_index] += input[input_index] * dy;
                            if let Some(dx) = input_gradient.as_deref_mut() {
                                dx[input_index] += kernel[kernel_index] * dy;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// `output` is `input` with `top`/`left` rows and columns of zeros before it (and the
/// rest of `output`'s size after).
pub fn zero_padding_forward(
    input: ImageShape,
    output: ImageShape,
    top: usize,
    left: usize,
    values: &[f32],
    padded: &mut [f32],
) {
    padded[..output.elements()].fill(0.0);
    let row = input.width * input.channels;
    for sample in 0..input.batch {
        for y in 0..input.height {
            let from = (sample * input.height + y) * row;
            let to = ((sample * output.height + y + top) * output.width + left) * output.channels;
            padded[to..to + row].copy_from_slice(&values[from..from + row]);
        }
    }
}

/// The gradient of zero padding: the output gradient cropped back to the input.
pub fn zero_padding_backward(
    input: ImageShape,
    output: ImageShape,
    top: usize,
    left: usize,
    output_gradient: &[f32],
    input_gradient: &mut [f32],
) {
    let row = input.width * input.channels;
    for sample in 0..input.batch {
        for y in 0..input.height {
            let to = (sample * input.height + y) * row;
            let from = ((sample * output.height + y + top) * output.width + left) * output.channels;
            input_gradient[to..to + row].copy_from_slice(&output_gradient[from..from + row]);
        }
    }
}
