//! The merges of graph models: `add` (element-wise sum of equal shapes) and `concat`
//! (inputs side by side along the last axis: channels of NHWC images, features of flat
//! vectors), forward and backward, plus the in-place gradient sum of a tensor read by
//! several layers.

/// `output = sum of inputs`, element-wise over `output.len()` elements.
pub fn add_forward(inputs: &[&[f32]], output: &mut [f32]) {
    output.copy_from_slice(&inputs[0][..output.len()]);
    for input in &inputs[1..] {
        for (value, addend) in output.iter_mut().zip(*input) {
            *value += addend;
        }
    }
}

/// `into += from`, the in-place sum of a second reader's gradient.
pub fn accumulate(from: &[f32], into: &mut [f32]) {
    for (value, addend) in into.iter_mut().zip(from) {
        *value += addend;
    }
}

/// Joins `inputs` along the last axis: `positions` rows (samples times pixels), input `k`
/// contributing `widths[k]` values per row.
pub fn concat_forward(positions: usize, widths: &[usize], inputs: &[&[f32]], output: &mut [f32]) {
    let total: usize = widths.iter().sum();
    for position in 0..positions {
        let mut offset = position * total;
        for (input, width) in inputs.iter().zip(widths) {
            output[offset..offset + width]
                .copy_from_slice(&input[position * width..(position + 1) * width]);
            offset += width;
        }
    }
}

/// Splits the output gradient back into each input's slice of the last axis.
pub fn concat_backward(
    positions: usize,
    widths: &[usize],
    output_gradient: &[f32],
    input_gradients: &mut [&mut [f32]],
) {
    let total: usize = widths.iter().sum();
    for position in 0..positions {
        let mut offset = position * total;
        for (gradient, width) in input_gradients.iter_mut().zip(widths) {
            gradient[position * width..(position + 1) * width]
                .copy_from_slice(&output_gradient[offset..offset + width]);
            offset += width;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn concat_interleaves_rows_and_backward_splits_them() {
        let a = [1.0, 2.0, 3.0, 4.0];
        let b = [10.0, 20.0];
        let mut joined = [0.0; 6];
        concat_forward(2, &[2, 1], &[&a, &b], &mut joined);
        assert_eq!(joined, [1.0, 2.0, 10.0, 3.0, 4.0, 20.0]);
        let mut da = [0.0; 4];
        let mut db = [0.0; 2];
        concat_backward(2, &[2, 1], &joined, &mut [&mut da, &mut db]);
        assert_eq!(da, a);
        assert_eq!(db, b);
    }

    #[test]
    fn add_sums_every_input() {
        let mut output = [0.0; 2];
        add_forward(&[&[1.0, 2.0], &[3.0, 4.0], &[5.0, 6.0]], &mut output);
        assert_eq!(output, [9.0, 12.0]);
        accumulate(&[1.0, 1.0], &mut output);
        assert_eq!(output, [10.0, 13.0]);
    }
}
