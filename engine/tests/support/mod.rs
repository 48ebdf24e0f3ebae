//! Helpers shared by the engine's integration tests.

use carve_engine::checkpoint::NamedTensor;

/// Each tensor's largest difference relative to its largest magnitude: rounding in sums of
/// a different order shows up on tiny elements, not on the tensor. Non-finite values fail.
pub fn assert_close(label: &str, left: &[NamedTensor], right: &[NamedTensor], relative: f32) {
    assert_eq!(left.len(), right.len(), "{label}: tensor count");
    for (a, b) in left.iter().zip(right) {
        assert_eq!(a.name, b.name, "{label}");
        assert!(
            a.values
                .iter()
                .chain(&b.values)
                .all(|value| value.is_finite()),
            "{label}: {} is not finite",
            a.name
        );
        let magnitude = a
            .values
            .iter()
            .chain(&b.values)
            .fold(0f32, |largest, value| largest.max(value.abs()));
        let difference = a
            .values
            .iter()
            .zip(&b.values)
            .fold(0f32, |largest, (x, y)| largest.max((x - y).abs()));
        assert!(
            difference <= relative * magnitude.max(1e-6),
            "{label}: {}: the two runs differ by {difference} against magnitude {magnitude}",
            a.name
        );
    }
}
