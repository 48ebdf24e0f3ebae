//! libcarve_guard.so (work in progress).
