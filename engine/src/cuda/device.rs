//! The CUDA driver, NVRTC and cuBLAS calls of the backend: opening the device, the one
//! slice reservation, copies, kernel launches and GEMMs. With `cudnn_ops.rs` this is the
//! only place the backend calls into C; everything above works with device addresses
//! (`u64`) inside the reserved region and `CudaFailure`s.
//!
//! cudarc is built with `dynamic-loading`: the libraries are opened on first use, and a
//! missing one makes cudarc panic. [`check_libraries`] therefore runs before any other
//! call and turns a missing library into a message saying which one.

// The FFI boundary: every unsafe block below says why it is sound.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;

use carve_core::plan::ElementType;
use cudarc::cublas::sys as cublas_sys;
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaStream, DeviceRepr, LaunchConfig,
    PushKernelArg, result as driver_result, sys as driver_sys,
};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use crate::cuda::batch_norm_kernels::{BATCH_NORM_KERNEL_NAMES, BATCH_NORM_KERNEL_SOURCE};
use crate::cuda::error::{CudaFailure, CudaLibrary};
use crate::cuda::kernels::{KERNEL_NAMES, KERNEL_SOURCE, MAILBOX_WORDS, THREADS_PER_BLOCK};
use crate::cuda::slice::SliceReservation;

/// Checks that the CUDA libraries the backend needs can be loaded, in the order they are
/// needed, and says which one is missing.
pub fn check_libraries() -> Result<(), String> {
    // SAFETY: `is_culib_present` only tries `dlopen` on the library's candidate names and
    // drops what it opened; it calls nothing inside the library.
    let driver = unsafe { driver_sys::is_culib_present() };
    if !driver {
        return Err("no CUDA driver (libcuda.so not found)".into());
    }
    // The bindings are CUDA 12's and so are the names cudarc looks for; CUDA 13 builds
    // (e.g. PyTorch's cu130 wheels) ship only `.so.13`, which works once linked under
    // the plain name (seen on an H200 with driver 580).
    if !nvrtc_present() {
        return Err(
            "NVRTC not found (libnvrtc.so.12 or libnvrtc.so): set LD_LIBRARY_PATH; \
             with CUDA 13, link libnvrtc.so to libnvrtc.so.13"
                .into(),
        );
    }
    // SAFETY: as above, a dlopen probe.
    let cublas = unsafe { cublas_sys::is_culib_present() };
    if !cublas {
        return Err(
            "cuBLAS not found (libcublas.so.12 or libcublas.so): set LD_LIBRARY_PATH; \
             with CUDA 13, link libcublas.so to libcublas.so.13"
                .into(),
        );
    }
    // SAFETY: as above, a dlopen probe.
    let cudnn = unsafe { cudarc::cudnn::sys::is_culib_present() };
    if !cudnn {
        return Err("cuDNN not found (libcudnn.so.9): set LD_LIBRARY_PATH".into());
    }
    Ok(())
}

/// Whether NVRTC can be loaded (it needs no GPU: the kernels can be compiled anywhere).
pub fn nvrtc_present() -> bool {
    // SAFETY: a dlopen probe, as in `check_libraries`.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles the engine's kernels for compute capability `major.minor`. `nvrtc_present`
/// must be true.
pub fn compile_kernels(major: i32, minor: i32) -> Result<cudarc::nvrtc::Ptx, CudaFailure> {
    compile_ptx_with_opts(
        format!("{KERNEL_SOURCE}{BATCH_NORM_KERNEL_SOURCE}"),
        CompileOptions {
            // Rust never fuses a * b + c; the kernels must round the same way.
            fmad: Some(false),
            // A virtual architecture: NVRTC emits PTX and the driver compiles it for the
            // device when the module loads.
            options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
            name: Some("carve_kernels.cu".into()),
            ..CompileOptions::default()
        },
    )
    .map_err(|error| {
        CudaFailure::new(CudaLibrary::Nvrtc, 0, error.to_string())
            .during("compiling the engine's kernels")
    })
}

/// How many CUDA devices the driver sees (`check_libraries` must have succeeded).
pub fn device_count() -> Result<usize, String> {
    driver_result::init().map_err(|error| format!("cuInit failed: {error}"))?;
    driver_result::device::get_count()
        .map(|count| count.max(0) as usize)
        .map_err(|error| format!("counting CUDA devices failed: {error}"))
}

fn driver_failure(error: driver_result::DriverError) -> CudaFailure {
    let name = error
        .error_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", error.0));
    CudaFailure::new(CudaLibrary::Driver, error.0 as u32, name)
}

fn cublas_check(status: cublas_sys::cublasStatus_t, during: &str) -> Result<(), CudaFailure> {
    if status == cublas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(
            CudaFailure::new(CudaLibrary::Cublas, status as u32, format!("{status:?}"))
                .during(during),
        )
    }
}

/// The geometry the direct convolution and pooling kernels receive by value; the layout
/// of `struct ConvGeometry` in the kernel source.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelGeometry {
    pub batch: i64,
    pub input_height: i64,
    pub input_width: i64,
    pub input_channels: i64,
    pub output_height: i64,
    pub output_width: i64,
    pub output_channels: i64,
    pub kernel_height: i64,
    pub kernel_width: i64,
    pub stride_height: i64,
    pub stride_width: i64,
    pub padding_top: i64,
    pub padding_left: i64,
}

// SAFETY: `KernelGeometry` is `repr(C)`, made of thirteen i64 with no padding, exactly
// the kernel source's `struct ConvGeometry`, so passing its bytes as a kernel parameter
// is what the kernel reads.
unsafe impl DeviceRepr for KernelGeometry {}

/// One kernel parameter.
#[derive(Debug, Clone, Copy)]
pub enum KernelArgument {
    /// A device address (0 for a null pointer).
    Pointer(u64),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
    F64(f64),
    Geometry(KernelGeometry),
}

/// How many blocks a kernel runs: enough for one thread per element (capped, the kernels
/// stride), or one block per item for the per-channel and single-block kernels.
#[derive(Debug, Clone, Copy)]
pub enum LaunchShape {
    Elements(u64),
    Blocks(u64),
}

/// A GEMM in cuBLAS' column-major terms; `c = alpha * op(a) * op(b) + beta * c`.
#[derive(Debug, Clone, Copy)]
pub struct GemmCall {
    pub transpose_a: bool,
    pub transpose_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: u64,
    pub lda: usize,
    pub b: u64,
    pub ldb: usize,
    pub c: u64,
    pub ldc: usize,
    /// The element type of a and b (the compute precision).
    pub input_type: ElementType,
    pub output_type: ElementType,
    pub beta: f32,
}

fn cuda_data_type(element_type: ElementType) -> Result<cublas_sys::cudaDataType, CudaFailure> {
    match element_type {
        ElementType::F32 => Ok(cublas_sys::cudaDataType::CUDA_R_32F),
        ElementType::F16 => Ok(cublas_sys::cudaDataType::CUDA_R_16F),
        ElementType::Bf16 => Ok(cublas_sys::cudaDataType::CUDA_R_16BF),
        other => Err(CudaFailure::new(
            CudaLibrary::Cublas,
            0,
            format!("no gemm on {other:?} buffers"),
        )),
    }
}

fn to_int(value: usize, what: &str) -> Result<i32, CudaFailure> {
    i32::try_from(value).map_err(|_| {
        CudaFailure::new(
            CudaLibrary::Cublas,
            0,
            format!("{what} of {value} exceeds cublas' 32-bit dimensions"),
        )
    })
}

/// The GPU driver's large page: the unit in which a slice is allocated.
pub const DRIVER_PAGE_BYTES: u64 = 2 << 20;

/// The reduction scratch outside the slice: one driver page.
pub const REDUCTION_SCRATCH_BYTES: u64 = DRIVER_PAGE_BYTES;

/// One device memory region from `cuMemAlloc`, freed on drop.
#[derive(Debug)]
struct Region {
    address: u64,
    bytes: u64,
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.address != 0 {
            // SAFETY: `address` came from `malloc_sync` in this context and is freed once,
            // here; nothing uses it after the owning `Device` is dropped.
            let _ = unsafe { driver_result::free_sync(self.address) };
        }
    }
}

/// The opened GPU: context, stream, cuBLAS handle, the compiled kernels, the slice and
/// the small result area the loss and overflow kernels write into.
pub struct Device {
    // The regions come first: fields drop in order, and device memory must be freed
    // while the context (kept alive by the stream and the kernels' module) still exists.
    slice: Option<Region>,
    /// `MAILBOX_WORDS` u64, outside the slice like the context and the handles.
    mailbox: Region,
    /// `REDUCTION_SCRATCH_BYTES` for the coalesced batch norm's per-chunk sums and
    /// completion counters: a fixed size per process, outside the slice like the result
    /// area, inside the worker's context allowance.
    scratch: Region,
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    ordinal: usize,
    cublas: cublas_sys::cublasHandle_t,
    functions: HashMap<&'static str, CudaFunction>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Device")
            .field("ordinal", &self.ordinal)
            .field("slice", &self.slice)
            .field("kernels", &self.functions.len())
            .finish()
    }
}

impl Device {
    /// Opens GPU `ordinal`: context, stream, cuBLAS, and the NVRTC kernels compiled for it.
    /// `check_libraries` must have succeeded.
    pub fn open(ordinal: usize) -> Result<Device, CudaFailure> {
        let context = CudaContext::new(ordinal)
            .map_err(|error| driver_failure(error).during(format!("opening cuda:{ordinal}")))?;
        // A stream of its own: the legacy default stream cannot be captured into a graph.
        let stream = context
            .new_stream()
            .map_err(|error| driver_failure(error).during("creating the stream"))?;
        let (major, minor) = context
            .compute_capability()
            .map_err(|error| driver_failure(error).during("reading the compute capability"))?;
        let ptx = compile_kernels(major, minor)?;
        let module = context
            .load_module(ptx)
            .map_err(|error| driver_failure(error).during("loading the engine's kernels"))?;
        let mut functions = HashMap::new();
        for name in KERNEL_NAMES.iter().chain(BATCH_NORM_KERNEL_NAMES) {
            let function = module
                .load_function(name)
                .map_err(|error| driver_failure(error).during(format!("loading kernel {name}")))?;
            functions.insert(*name, function);
        }
        let mut cublas: cublas_sys::cublasHandle_t = std::ptr::null_mut();
        cublas_check(
            // SAFETY: `cublas` is a valid out-pointer for the new handle.
            unsafe { cublas_sys::cublasCreate_v2(&mut cublas) },
            "creating the cublas handle",
        )?;
        cublas_check(
            // SAFETY: the handle was just created; the stream belongs to this context and
            // outlives the handle (both are dropped with the `Device`, the handle first).
            unsafe { cublas_sys::cublasSetStream_v2(cublas, stream.cu_stream() as _) },
            "binding cublas to the stream",
        )?;
        let mailbox_bytes = (MAILBOX_WORDS * 8) as u64;
        // SAFETY: a plain device allocation in the current context (bound by `new`).
        let mailbox_address = unsafe { driver_result::malloc_sync(mailbox_bytes as usize) }
            .map_err(|error| driver_failure(error).during("allocating the result area"))?;
        let mailbox = Region {
            address: mailbox_address,
            bytes: mailbox_bytes,
        };
        // SAFETY: as above.
        let scratch_address =
            unsafe { driver_result::malloc_sync(REDUCTION_SCRATCH_BYTES as usize) }.map_err(
                |error| driver_failure(error).during("allocating the reduction scratch"),
            )?;
        let scratch = Region {
            address: scratch_address,
            bytes: REDUCTION_SCRATCH_BYTES,
        };
        let device = Device {
            context,
            stream,
            ordinal,
            cublas,
            functions,
            slice: None,
            mailbox,
            scratch,
        };
        // The batch norm kernels' completion counters must start at zero; each kernel
        // leaves them at zero.
        device.zero(device.scratch.address, device.scratch.bytes)?;
        Ok(device)
    }

    pub fn cu_stream(&self) -> driver_sys::CUstream {
        self.stream.cu_stream()
    }

    pub fn bind(&self) -> Result<(), CudaFailure> {
        self.context
            .bind_to_thread()
            .map_err(|error| driver_failure(error).during("binding the cuda context"))
    }

    /// `cuMemGetInfo`: (free, total) bytes of the device.
    pub fn memory_info(&self) -> Result<(u64, u64), CudaFailure> {
        self.bind()?;
        let (free, total) = driver_result::mem_get_info()
            .map_err(|error| driver_failure(error).during("reading free device memory"))?;
        Ok((free as u64, total as u64))
    }

    /// Reserves the slice in one allocation and reports free memory around it.
    pub fn reserve_slice(&mut self, bytes: u64) -> Result<SliceReservation, CudaFailure> {
        self.slice = None;
        let device_name = self.context.name().unwrap_or_else(|_| "unknown".into());
        let (free_before, total) = self.memory_info()?;
        // The driver serves allocations under its 2 MiB page from pools it already holds,
        // so free memory would not move and the reservation could not be verified (seen
        // on an H200: a 0.5 MiB slice left `cuMemGetInfo` unchanged). Whole pages are
        // always mapped fresh.
        let allocated = bytes
            .max(1)
            .checked_next_multiple_of(DRIVER_PAGE_BYTES)
            .unwrap_or(u64::MAX);
        let size = usize::try_from(allocated).map_err(|_| {
            CudaFailure::new(
                CudaLibrary::Driver,
                2,
                "slice larger than the address space",
            )
            .requesting(bytes)
        })?;
        // SAFETY: a plain device allocation in this context; the region owns it.
        let address = unsafe { driver_result::malloc_sync(size) }.map_err(|error| {
            driver_failure(error)
                .during(format!("reserving the {bytes}-byte slice"))
                .requesting(bytes)
        })?;
        self.slice = Some(Region { address, bytes });
        let (free_after, _) = self.memory_info()?;
        Ok(SliceReservation {
            device_ordinal: self.ordinal,
            device_name,
            reserved_bytes: bytes,
            allocated_bytes: allocated,
            device_total_bytes: total,
            free_before_bytes: free_before,
            free_after_bytes: free_after,
        })
    }

    /// The device address of `offset` in the slice.
    pub fn slice_address(&self, offset: u64) -> Result<u64, CudaFailure> {
        match &self.slice {
            Some(region) if offset <= region.bytes => Ok(region.address + offset),
            _ => Err(CudaFailure::new(
                CudaLibrary::Driver,
                1,
                format!("offset {offset} is outside the reserved slice"),
            )),
        }
    }

    pub fn mailbox_address(&self) -> u64 {
        self.mailbox.address
    }

    /// Copies host bytes to `address` (inside the slice; the caller checked the length).
    pub fn upload(&self, address: u64, bytes: &[u8]) -> Result<(), CudaFailure> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller checked that `address .. address + bytes.len()` lies inside
        // a live buffer of the slice; `bytes` stays borrowed until the stream is
        // synchronized below, so the asynchronous copy never reads freed host memory.
        unsafe { driver_result::memcpy_htod_async(address, bytes, self.stream.cu_stream()) }
            .map_err(|error| driver_failure(error).during("copying to the device"))?;
        self.synchronize()
    }

    /// Copies device bytes at `address` into `bytes`.
    pub fn download(&self, address: u64, bytes: &mut [u8]) -> Result<(), CudaFailure> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: as `upload`: the source lies inside a live buffer, and `bytes` is
        // exclusively borrowed until the synchronization below completes the copy.
        unsafe { driver_result::memcpy_dtoh_async(bytes, address, self.stream.cu_stream()) }
            .map_err(|error| driver_failure(error).during("copying from the device"))?;
        self.synchronize()
    }

    /// Zeroes `bytes` bytes at `address`.
    pub fn zero(&self, address: u64, bytes: u64) -> Result<(), CudaFailure> {
        self.fill_bytes(address, bytes, 0)
    }

    /// Sets `bytes` bytes at `address` to `value`.
    pub fn fill_bytes(&self, address: u64, bytes: u64, value: u8) -> Result<(), CudaFailure> {
        if bytes == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller passes a live buffer's address and length inside the slice
        // (or one of the device's own regions).
        unsafe {
            driver_result::memset_d8_async(address, value, bytes as usize, self.stream.cu_stream())
        }
        .map_err(|error| driver_failure(error).during("filling device memory"))
    }

    /// The batch norm reduction scratch: its address and size.
    pub fn scratch(&self) -> (u64, u64) {
        (self.scratch.address, self.scratch.bytes)
    }

    /// Starts recording the stream's work into a graph instead of running it.
    pub fn begin_capture(&self) -> Result<(), CudaFailure> {
        self.stream
            .begin_capture(driver_sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .map_err(|error| driver_failure(error).during("starting a graph capture"))
    }

    /// Ends the recording: the graph, instantiated (`None` when nothing was recorded).
    pub fn end_capture(&self) -> Result<Option<CudaGraph>, CudaFailure> {
        self.stream
            .end_capture(driver_sys::CUgraphInstantiate_flags(0))
            .map_err(|error| driver_failure(error).during("ending a graph capture"))
    }

    /// Runs a recorded graph on the stream.
    pub fn launch_graph(&self, graph: &CudaGraph) -> Result<(), CudaFailure> {
        graph
            .launch()
            .map_err(|error| driver_failure(error).during("launching a graph"))
    }

    /// An event with timing recorded on the backend's stream now (`profile` tuning).
    pub fn record_timing_event(&self) -> Result<CudaEvent, CudaFailure> {
        self.stream
            .record_event(Some(driver_sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|error| driver_failure(error).during("recording a timing event"))
    }

    pub fn synchronize(&self) -> Result<(), CudaFailure> {
        self.stream
            .synchronize()
            .map_err(|error| driver_failure(error).during("waiting for the gpu"))
    }

    /// Zeroes the result area before a loss or overflow kernel writes into it.
    pub fn clear_mailbox(&self) -> Result<(), CudaFailure> {
        self.zero(self.mailbox.address, self.mailbox.bytes)
    }

    /// Reads the result area (waits for the kernels before it).
    pub fn read_mailbox(&self) -> Result<[u64; MAILBOX_WORDS], CudaFailure> {
        let mut bytes = [0u8; MAILBOX_WORDS * 8];
        self.download(self.mailbox.address, &mut bytes)?;
        let mut words = [0u64; MAILBOX_WORDS];
        for (word, chunk) in words.iter_mut().zip(bytes.chunks_exact(8)) {
            let mut array = [0u8; 8];
            array.copy_from_slice(chunk);
            *word = u64::from_le_bytes(array);
        }
        Ok(words)
    }

    /// Launches kernel `name` of the engine's module.
    pub fn launch(
        &self,
        name: &str,
        shape: LaunchShape,
        arguments: &[KernelArgument],
    ) -> Result<(), CudaFailure> {
        let function = self.functions.get(name).ok_or_else(|| {
            CudaFailure::new(
                CudaLibrary::Driver,
                500,
                format!("kernel {name} is not loaded"),
            )
        })?;
        let blocks = match shape {
            LaunchShape::Elements(0) | LaunchShape::Blocks(0) => return Ok(()),
            LaunchShape::Elements(elements) => {
                elements.div_ceil(u64::from(THREADS_PER_BLOCK)).min(65_535)
            }
            LaunchShape::Blocks(blocks) => blocks.min(i32::MAX as u64),
        };
        let config = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (THREADS_PER_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        self.bind()?;
        let mut builder = self.stream.launch_builder(function);
        for argument in arguments {
            match argument {
                KernelArgument::Pointer(value) | KernelArgument::U64(value) => builder.arg(value),
                KernelArgument::I32(value) => builder.arg(value),
                KernelArgument::I64(value) => builder.arg(value),
                KernelArgument::F32(value) => builder.arg(value),
                KernelArgument::F64(value) => builder.arg(value),
                KernelArgument::Geometry(value) => builder.arg(value),
            };
        }
        // SAFETY: the argument list matches the kernel's parameters in order and type (each
        // call site mirrors the kernel's signature in `kernels.rs`); every pointer is a
        // live buffer of the slice, the result area, or 0 where the kernel checks for null;
        // the arguments outlive the launch call, which copies them.
        unsafe { builder.launch(config) }
            .map(|_| ())
            .map_err(|error| driver_failure(error).during(format!("launching {name}")))
    }

    /// Runs a GEMM with fp32 accumulation (`CUBLAS_COMPUTE_32F`, also for half inputs).
    pub fn gemm(&self, call: &GemmCall) -> Result<(), CudaFailure> {
        let input_type = cuda_data_type(call.input_type)?;
        let output_type = cuda_data_type(call.output_type)?;
        let operation = |transpose: bool| {
            if transpose {
                cublas_sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                cublas_sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let alpha = 1.0f32;
        let beta = call.beta;
        if call.m == 0 || call.n == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the handle is live and bound to this stream; a, b and c are live buffers
        // of the slice whose sizes the caller derived from the same m, n, k and leading
        // dimensions; alpha and beta are host f32 as CUBLAS_COMPUTE_32F requires, read
        // before the call returns.
        let status = unsafe {
            cublas_sys::cublasGemmEx(
                self.cublas,
                operation(call.transpose_a),
                operation(call.transpose_b),
                to_int(call.m, "m")?,
                to_int(call.n, "n")?,
                to_int(call.k, "k")?,
                (&alpha as *const f32).cast(),
                call.a as *const std::ffi::c_void,
                input_type,
                to_int(call.lda.max(1), "lda")?,
                call.b as *const std::ffi::c_void,
                input_type,
                to_int(call.ldb.max(1), "ldb")?,
                (&beta as *const f32).cast(),
                call.c as *mut std::ffi::c_void,
                output_type,
                to_int(call.ldc.max(1), "ldc")?,
                cublas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        cublas_check(status, "cublasGemmEx")
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // The regions free themselves with `cuMemFree`, which needs the context current.
        let _ = self.bind();
        let _ = self.synchronize();
        // SAFETY: the handle was created in `open` and is destroyed once, here, after the
        // stream finished every call that used it.
        let _ = unsafe { cublas_sys::cublasDestroy_v2(self.cublas) };
        // The slice and the result area are freed by their `Region`s after this.
        self.slice = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NVRTC needs no GPU, so wherever it is installed (e.g. the `nvidia-cuda-nvrtc-cu12`
    /// wheel on LD_LIBRARY_PATH) the kernel source is compiled for real, for the oldest
    /// and newest architectures the backend targets.
    #[test]
    fn the_kernel_source_compiles_with_nvrtc_when_nvrtc_is_present() {
        if !nvrtc_present() {
            println!("skipped: NVRTC not available (libnvrtc.so not found)");
            return;
        }
        // 7.5 (Turing) is the oldest architecture CUDA 13's NVRTC still compiles for; it
        // refuses compute_70 as an invalid option.
        for (major, minor) in [(7, 5), (8, 0), (9, 0)] {
            if let Err(failure) = compile_kernels(major, minor) {
                panic!("compute_{major}{minor}: {}", failure.status);
            }
        }
    }
}
