//! What a failed CUDA, cuBLAS, cuDNN or NVRTC call means for an attempt.
//!
//! Every allocation failure — the driver's `CUDA_ERROR_OUT_OF_MEMORY`, cuBLAS'
//! `CUBLAS_STATUS_ALLOC_FAILED`, cuDNN's allocation statuses — is the slice running out of
//! memory and becomes the engine's `OutOfMemory` with the slice's numbers, so the
//! scheduler shrinks the job as it would after a cpu-backend OOM. Anything else is a
//! backend error that names the library, the status and what was being done, and is never
//! reported as out of memory (a retry with a smaller config would not help it).
//!
//! The classification works on the numeric status codes, so it is a pure function tested
//! on every machine.

use carve_core::allocator::OutOfMemory;

use crate::error::EngineError;

/// The library a status code comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLibrary {
    Driver,
    Cublas,
    Cudnn,
    Nvrtc,
}

impl CudaLibrary {
    fn name(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "cuda driver",
            CudaLibrary::Cublas => "cublas",
            CudaLibrary::Cudnn => "cudnn",
            CudaLibrary::Nvrtc => "nvrtc",
        }
    }
}

/// A failed call: the library, its status code and name, and what the backend was doing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaFailure {
    pub library: CudaLibrary,
    pub code: u32,
    /// The status' name (`CUDA_ERROR_OUT_OF_MEMORY`) or the compiler log for NVRTC.
    pub status: String,
    /// What the backend was doing (`cudnn convolution forward of layers[3].conv2d`).
    pub during: String,
    /// Bytes the call wanted, when known (a reservation, a workspace).
    pub requested_bytes: Option<u64>,
}

impl CudaFailure {
    pub fn new(library: CudaLibrary, code: u32, status: impl Into<String>) -> Self {
        CudaFailure {
            library,
            code,
            status: status.into(),
            during: String::new(),
            requested_bytes: None,
        }
    }

    /// Says what the backend was doing when the call failed.
    pub fn during(mut self, what: impl Into<String>) -> Self {
        self.during = what.into();
        self
    }

    pub fn requesting(mut self, bytes: u64) -> Self {
        self.requested_bytes = Some(bytes);
        self
    }
}

/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;
/// `CUBLAS_STATUS_ALLOC_FAILED`.
pub const CUBLAS_STATUS_ALLOC_FAILED: u32 = 3;
/// `CUDNN_STATUS_ALLOC_FAILED` before cuDNN 9.
pub const CUDNN_8_STATUS_ALLOC_FAILED: u32 = 2;
/// cuDNN 9's `CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED`, which cuDNN 9 also
/// names `CUDNN_STATUS_ALLOC_FAILED`.
pub const CUDNN_9_STATUS_HOST_ALLOCATION_FAILED: u32 = 4003;
/// cuDNN 9's `CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED`.
pub const CUDNN_9_STATUS_DEVICE_ALLOCATION_FAILED: u32 = 4004;

/// Whether a status code of `library` means an allocation failed.
pub fn is_allocation_failure(library: CudaLibrary, code: u32) -> bool {
    match library {
        CudaLibrary::Driver => code == CUDA_ERROR_OUT_OF_MEMORY,
        CudaLibrary::Cublas => code == CUBLAS_STATUS_ALLOC_FAILED,
        CudaLibrary::Cudnn => matches!(
            code,
            CUDNN_8_STATUS_ALLOC_FAILED
                | CUDNN_9_STATUS_HOST_ALLOCATION_FAILED
                | CUDNN_9_STATUS_DEVICE_ALLOCATION_FAILED
        ),
        // NVRTC compiles on the host; its failures are never device memory.
        CudaLibrary::Nvrtc => false,
    }
}

/// The slice's numbers at the moment of a failure, for the `OutOfMemory` report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SliceNumbers {
    pub in_use: u64,
    pub limit: u64,
    pub largest_free: u64,
    pub peak: u64,
}

/// Turns a failed call into the engine's error: allocation failures become
/// `OutOfMemory` with the slice's numbers, everything else a backend error naming the
/// library and status.
pub fn classify_failure(failure: &CudaFailure, slice: SliceNumbers) -> EngineError {
    if is_allocation_failure(failure.library, failure.code) {
        return EngineError::OutOfMemory(OutOfMemory {
            // A library's own allocation of unknown size still needs at least a byte more
            // than the slice had.
            requested: failure
                .requested_bytes
                .unwrap_or_else(|| slice.largest_free.saturating_add(1)),
            in_use: slice.in_use,
            limit: slice.limit,
            largest_free: slice.largest_free,
            peak: slice.peak,
        });
    }
    let during = if failure.during.is_empty() {
        String::new()
    } else {
        format!(" during {}", failure.during)
    };
    EngineError::Backend(format!(
        "cuda: {} failed with {} (code {}){during}",
        failure.library.name(),
        failure.status,
        failure.code
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice() -> SliceNumbers {
        SliceNumbers {
            in_use: 700,
            limit: 1024,
            largest_free: 200,
            peak: 900,
        }
    }

    #[test]
    fn every_allocation_status_becomes_out_of_memory_with_the_slice_numbers() {
        let cases = [
            (CudaLibrary::Driver, CUDA_ERROR_OUT_OF_MEMORY),
            (CudaLibrary::Cublas, CUBLAS_STATUS_ALLOC_FAILED),
            (CudaLibrary::Cudnn, CUDNN_8_STATUS_ALLOC_FAILED),
            (CudaLibrary::Cudnn, CUDNN_9_STATUS_HOST_ALLOCATION_FAILED),
            (CudaLibrary::Cudnn, CUDNN_9_STATUS_DEVICE_ALLOCATION_FAILED),
        ];
        for (library, code) in cases {
            let failure = CudaFailure::new(library, code, "alloc").requesting(4096);
            match classify_failure(&failure, slice()) {
                EngineError::OutOfMemory(report) => {
                    assert_eq!(report.requested, 4096);
                    assert_eq!(report.in_use, 700);
                    assert_eq!(report.limit, 1024);
                    assert_eq!(report.largest_free, 200);
                    assert_eq!(report.peak, 900);
                }
                other => panic!("{library:?} {code} gave {other:?}"),
            }
        }
    }

    #[test]
    fn an_allocation_of_unknown_size_asks_for_more_than_the_largest_hole() {
        let failure = CudaFailure::new(CudaLibrary::Cublas, CUBLAS_STATUS_ALLOC_FAILED, "x");
        match classify_failure(&failure, slice()) {
            EngineError::OutOfMemory(report) => assert_eq!(report.requested, 201),
            other => panic!("gave {other:?}"),
        }
    }

    #[test]
    fn other_statuses_are_backend_errors_naming_library_status_and_action() {
        let cases = [
            (CudaLibrary::Driver, 700, "CUDA_ERROR_ILLEGAL_ADDRESS"),
            (CudaLibrary::Driver, 1, "CUDA_ERROR_INVALID_VALUE"),
            (CudaLibrary::Cublas, 7, "CUBLAS_STATUS_INVALID_VALUE"),
            (CudaLibrary::Cudnn, 2000, "CUDNN_STATUS_BAD_PARAM"),
            (CudaLibrary::Cudnn, 3000, "CUDNN_STATUS_NOT_SUPPORTED"),
            (CudaLibrary::Nvrtc, 2, "compile log"),
        ];
        for (library, code, status) in cases {
            let failure = CudaFailure::new(library, code, status).during("conv forward");
            match classify_failure(&failure, slice()) {
                EngineError::Backend(message) => {
                    assert!(message.contains(status), "{message}");
                    assert!(message.contains("conv forward"), "{message}");
                    assert!(message.contains(&format!("code {code}")), "{message}");
                }
                other => panic!("{library:?} {code} gave {other:?}"),
            }
        }
    }

    #[test]
    fn the_same_code_means_different_things_in_different_libraries() {
        // 2 is out of memory for the driver and cuDNN 8, but a plain failure for NVRTC;
        // 3 is out of memory for cuBLAS only.
        assert!(is_allocation_failure(CudaLibrary::Driver, 2));
        assert!(!is_allocation_failure(CudaLibrary::Nvrtc, 2));
        assert!(is_allocation_failure(CudaLibrary::Cublas, 3));
        assert!(!is_allocation_failure(CudaLibrary::Driver, 3));
        assert!(!is_allocation_failure(CudaLibrary::Cudnn, 3));
    }
}
