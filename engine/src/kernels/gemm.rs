//! General matrix multiply on row-major f32 slices: the one hot loop that convolutions
//! (through im2col) and dense layers are built on.
//!
//! This is a thin, length-checked wrapper over `matrixmultiply::sgemm`, which is a raw
//! pointer API. Keeping the pointer arithmetic here, behind checks, lets every other
//! kernel stay in safe Rust. Parallelism comes from matrixmultiply's `threading` feature
//! (its thread count follows `MATMUL_NUM_THREADS`, by default the physical cores).

// The workspace denies `unsafe_code`; this module is the single, audited exception.
// Soundness of the one `unsafe` block below rests on these facts, all checked first:
// - the lengths of `a`, `b` and `c` are asserted to be exactly m*k, k*n and m*n, and the
//   strides handed to sgemm are derived from m, k and n so that the largest offset it
//   reads or writes is `rows*cols - 1` of the matching slice (see `Operand::strides`);
// - m, k and n are all nonzero when sgemm is called (the degenerate cases are handled in
//   safe code), so no offset arithmetic happens on a dangling empty-slice pointer;
// - `c` is a `&mut` borrow, so it cannot alias `a` or `b`;
// - the slices' lengths bound every offset by `isize::MAX`, so the `isize` strides
//   cannot overflow.
#![allow(unsafe_code)]

/// How a stored row-major matrix is read as an operand of the product.
struct Operand {
    /// Rows of the operand as it enters the product (after the optional transpose).
    rows: usize,
    /// Columns of the operand as it enters the product.
    columns: usize,
    transposed: bool,
}

impl Operand {
    /// Row and column strides, in elements, of the operand as used in the product.
    ///
    /// Untransposed, the storage is `rows x columns` row-major: (columns, 1). Transposed,
    /// the storage is `columns x rows` row-major, so element (i, j) of the operand is
    /// stored at `j * rows + i`: (1, rows). Either way the largest offset touched is
    /// `(rows - 1) * row_stride + (columns - 1) * column_stride = rows * columns - 1`.
    fn strides(&self) -> (isize, isize) {
        let as_stride = |value: usize| isize::try_from(value).expect("slice length fits isize");
        if self.transposed {
            (1, as_stride(self.rows))
        } else {
            (as_stride(self.columns), 1)
        }
    }
}

/// `C = alpha * op(A) * op(B) + beta * C`, all row-major, with `op(A)` of `m x k` and
/// `op(B)` of `k x n`; `C` is `m x n`.
///
/// With `transpose_a`, `a` holds the `k x m` matrix whose transpose is used (likewise
/// `b` holds `n x k` with `transpose_b`). When `beta == 0`, `C` is not read, so it may
/// hold garbage (even NaN) on entry. Any of m, k, n may be zero; with `k == 0` the
/// product is empty and `C` becomes `beta * C`.
///
/// # Panics
///
/// When a slice's length is not exactly its matrix's element count (`m*k`, `k*n`, `m*n`).
/// That is a bug in the calling kernel, never a consequence of user input: shapes are
/// validated long before a kernel runs.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    transpose_a: bool,
    b: &[f32],
    transpose_b: bool,
    c: &mut [f32],
    alpha: f32,
    beta: f32,
) {
    assert_eq!(
        Some(a.len()),
        m.checked_mul(k),
        "gemm: A has {} elements, expected {m}x{k}",
        a.len()
    );
    assert_eq!(
        Some(b.len()),
        k.checked_mul(n),
        "gemm: B has {} elements, expected {k}x{n}",
        b.len()
    );
    assert_eq!(
        Some(c.len()),
        m.checked_mul(n),
        "gemm: C has {} elements, expected {m}x{n}",
        c.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 || alpha == 0.0 {
        // Nothing to multiply: C = beta * C, where beta == 0 must clear garbage (NaN)
        // rather than multiply it.
        if beta == 0.0 {
            c.fill(0.0);
        } else if beta != 1.0 {
            c.iter_mut().for_each(|value| *value *= beta);
        }
        return;
    }

    let (row_stride_a, column_stride_a) = Operand {
        rows: m,
        columns: k,
        transposed: transpose_a,
    }
    .strides();
    let (row_stride_b, column_stride_b) = Operand {
        rows: k,
        columns: n,
        transposed: transpose_b,
    }
    .strides();
    let (row_stride_c, column_stride_c) = Operand {
        rows: m,
        columns: n,
        transposed: false,
    }
    .strides();

    // SAFETY: see the module comment: lengths were asserted equal to m*k, k*n and m*n
    // above, the strides come from `Operand::strides` for exactly those shapes, so every
    // offset sgemm computes stays inside its slice; m, k, n > 0 here; `c` is exclusively
    // borrowed and so disjoint from `a` and `b`. sgemm does not read C when beta == 0.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            alpha,
            a.as_ptr(),
            row_stride_a,
            column_stride_a,
            b.as_ptr(),
            row_stride_b,
            column_stride_b,
            beta,
            c.as_mut_ptr(),
            row_stride_c,
            column_stride_c,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::gemm;

    /// Straightforward triple loop, in f64, as the reference.
    #[allow(clippy::too_many_arguments)]
    fn reference_gemm(
        m: usize,
        k: usize,
        n: usize,
        a: &[f32],
        transpose_a: bool,
        b: &[f32],
        transpose_b: bool,
        c: &[f32],
        alpha: f32,
        beta: f32,
    ) -> Vec<f32> {
        let a_at = |i: usize, p: usize| {
            if transpose_a {
                a[p * m + i]
            } else {
                a[i * k + p]
            }
        };
        let b_at = |p: usize, j: usize| {
            if transpose_b {
                b[j * k + p]
            } else {
                b[p * n + j]
            }
        };
        let mut result = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut sum = 0.0f64;
                for p in 0..k {
                    sum += f64::from(a_at(i, p)) * f64::from(b_at(p, j));
                }
                let previous = if beta == 0.0 {
                    0.0
                } else {
                    f64::from(beta) * f64::from(c[i * n + j])
                };
                result[i * n + j] = (f64::from(alpha) * sum + previous) as f32;
            }
        }
        result
    }

    /// Deterministic, varied values without a random number generator.
    fn values(count: usize, seed: u32) -> Vec<f32> {
        (0..count)
            .map(|index| {
                let mixed = (index as u32)
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(seed * 97);
                (mixed % 1000) as f32 / 250.0 - 2.0
            })
            .collect()
    }

    #[test]
    fn every_transpose_combination_matches_the_reference() {
        let (m, k, n) = (5, 7, 3);
        for transpose_a in [false, true] {
            for transpose_b in [false, true] {
                for (alpha, beta) in [(1.0, 0.0), (0.5, 1.0), (-2.0, 0.25)] {
                    let a = values(m * k, 1);
                    let b = values(k * n, 2);
                    let initial_c = values(m * n, 3);
                    let mut c = initial_c.clone();
                    gemm(
                        m,
                        k,
                        n,
                        &a,
                        transpose_a,
                        &b,
                        transpose_b,
                        &mut c,
                        alpha,
                        beta,
                    );
                    let expected = reference_gemm(
                        m,
                        k,
                        n,
                        &a,
                        transpose_a,
                        &b,
                        transpose_b,
                        &initial_c,
                        alpha,
                        beta,
                    );
                    for (got, want) in c.iter().zip(&expected) {
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "transpose_a={transpose_a} transpose_b={transpose_b}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn hand_computed_two_by_two() {
        // [1 2; 3 4] * [5 6; 7 8] = [19 22; 43 50], with A stored as written and
        // transposed ([1 3; 2 4]^T = [1 2; 3 4]).
        for (a, transpose_a) in [([1.0, 2.0, 3.0, 4.0], false), ([1.0, 3.0, 2.0, 4.0], true)] {
            let mut c = [0.0; 4];
            gemm(
                2,
                2,
                2,
                &a,
                transpose_a,
                &[5.0, 6.0, 7.0, 8.0],
                false,
                &mut c,
                1.0,
                0.0,
            );
            assert_eq!(c, [19.0, 22.0, 43.0, 50.0], "transpose_a {transpose_a}");
        }
    }

    #[test]
    fn beta_zero_ignores_garbage_in_c() {
        let mut c = [f32::NAN; 2];
        gemm(
            1,
            2,
            2,
            &[1.0, 1.0],
            false,
            &[1.0, 2.0, 3.0, 4.0],
            false,
            &mut c,
            1.0,
            0.0,
        );
        assert_eq!(c, [4.0, 6.0]);
    }

    #[test]
    fn empty_dimensions() {
        // k == 0: C = beta * C.
        let mut c = [2.0, f32::NAN];
        gemm(1, 0, 2, &[], false, &[], false, &mut c, 1.0, 0.0);
        assert_eq!(c, [0.0, 0.0]);
        let mut c = [2.0, 4.0];
        gemm(2, 0, 1, &[], true, &[], true, &mut c, 1.0, 0.5);
        assert_eq!(c, [1.0, 2.0]);
        // m == 0 or n == 0: nothing to write.
        let mut c: [f32; 0] = [];
        gemm(0, 3, 2, &[], false, &[0.0; 6], false, &mut c, 1.0, 0.0);
        gemm(2, 3, 0, &[0.0; 6], false, &[], false, &mut c, 1.0, 0.0);
    }
}
