//! The shared memory account (work in progress).
