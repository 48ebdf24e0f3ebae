//! `cuGetErrorName` and `cuGetErrorString` for the codes the fake (and the guard in front of
//! it) returns; both work before `cuInit`, as in the real driver. An unknown code is
//! `CUDA_ERROR_INVALID_VALUE` with a null string.

#![allow(unsafe_code)]
// The exports' safety contract is the CUDA driver API's: valid or null pointers.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{CStr, c_char};

use crate::{CUDA_ERROR_INVALID_VALUE, CUDA_SUCCESS, CUresult, cuda_call};

/// Code, name, description (the real driver's wording, shortened).
const ERRORS: [(CUresult, &CStr, &CStr); 12] = [
    (0, c"CUDA_SUCCESS", c"no error"),
    (1, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (2, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (3, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (
        100,
        c"CUDA_ERROR_NO_DEVICE",
        c"no CUDA-capable device is detected",
    ),
    (101, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (
        201,
        c"CUDA_ERROR_INVALID_CONTEXT",
        c"invalid device context",
    ),
    (
        400,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (500, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (800, c"CUDA_ERROR_NOT_PERMITTED", c"operation not permitted"),
    (801, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (999, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

fn describe(
    code: CUresult,
    text_out: *mut *const c_char,
    pick: fn(&(CUresult, &'static CStr, &'static CStr)) -> &'static CStr,
) -> CUresult {
    cuda_call(|| {
        // SAFETY: CUDA's contract: the out-pointer is null or valid for writes.
        let Some(text_out) = (unsafe { text_out.as_mut() }) else {
            return CUDA_ERROR_INVALID_VALUE;
        };
        match ERRORS.iter().find(|entry| entry.0 == code) {
            Some(entry) => {
                *text_out = pick(entry).as_ptr();
                CUDA_SUCCESS
            }
            None => {
                *text_out = std::ptr::null();
                CUDA_ERROR_INVALID_VALUE
            }
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: CUresult, name_out: *mut *const c_char) -> CUresult {
    describe(code, name_out, |entry| entry.1)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(
    code: CUresult,
    text_out: *mut *const c_char,
) -> CUresult {
    describe(code, text_out, |entry| entry.2)
}
