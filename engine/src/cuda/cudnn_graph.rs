//! cuDNN's graph (backend) API for the three convolutions: a one-operation graph per
//! shape, direction, scale and pointer alignment, the engine configurations cuDNN's
//! heuristics list for it (mode A, then the fallback list), an execution plan per
//! configuration whose numerics the precision allows (`graph_engines::numerics_refusal`),
//! and the execution of the chosen one on the plan's buffers. Which configuration runs is
//! chosen in `conv_graph.rs` by `graph_engines::choose_graph_engine`, inside the plan's
//! workspace buffer; `GraphPlan::execute` checks that bound again before every call.
//!
//! Tensors are NHWC and filters KRSC as in `cudnn_ops.rs`, described to the graph API as
//! NCHW dimensions with NHWC strides. The legacy API's calls stay in `cudnn_ops.rs`; this
//! file holds only the graph API's, and like it is reached only after
//! `device::check_libraries` found cuDNN.

// The FFI boundary: every unsafe block below says why it is sound.
#![allow(unsafe_code)]

use std::ffi::c_void;
use std::rc::Rc;

use carve_core::plan::ElementType;
use cudarc::cudnn::sys;
use sys::cudnnBackendAttributeName_t as Name;
use sys::cudnnBackendAttributeType_t as Type;
use sys::cudnnBackendDescriptorType_t as Kind;

use super::cudnn_ops::{Cudnn, check, data_type};
use super::cudnn_shapes::{ConvolutionBuffers, ConvolutionDirection, ConvolutionShape};
use super::error::{CudaFailure, CudaLibrary};
use super::graph_engines::{
    EngineNotes, GRAPH_ENGINES_EXAMINED, GraphEngineCandidate, enough_engines, numerics_refusal,
};

/// The loaded cuDNN's version (`cudnnGetVersion`), which says whether its graph API is
/// the one the bindings describe (`graph_engines::graph_api_available`).
pub fn cudnn_version() -> usize {
    // SAFETY: a plain query without arguments; the caller checked that cuDNN loads
    // (`device::check_libraries`), so cudarc's lazy symbol lookup succeeds.
    unsafe { sys::cudnnGetVersion() }
}

/// A device address as the graph API's `CUDNN_TYPE_VOID_PTR` takes it.
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
struct DevicePointer(*mut c_void);

/// A numerical note as cuDNN writes it: a C enum read as its number, so a note a newer
/// cuDNN adds is never an invalid Rust enum value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
struct RawNote(u32);

/// A Rust type with the layout of one of the graph API's attribute types. Private, and
/// implemented only for the pairs below, so `Descriptor::set`/`get` never pass cuDNN an
/// array of the wrong element type.
trait AttributeValue: Copy {
    const TYPE: Type;
}

impl AttributeValue for i64 {
    const TYPE: Type = Type::CUDNN_TYPE_INT64;
}
impl AttributeValue for f32 {
    const TYPE: Type = Type::CUDNN_TYPE_FLOAT;
}
impl AttributeValue for sys::cudnnDataType_t {
    const TYPE: Type = Type::CUDNN_TYPE_DATA_TYPE;
}
impl AttributeValue for sys::cudnnConvolutionMode_t {
    const TYPE: Type = Type::CUDNN_TYPE_CONVOLUTION_MODE;
}
impl AttributeValue for sys::cudnnBackendHeurMode_t {
    const TYPE: Type = Type::CUDNN_TYPE_HEUR_MODE;
}
impl AttributeValue for sys::cudnnHandle_t {
    const TYPE: Type = Type::CUDNN_TYPE_HANDLE;
}
impl AttributeValue for sys::cudnnBackendDescriptor_t {
    const TYPE: Type = Type::CUDNN_TYPE_BACKEND_DESCRIPTOR;
}
impl AttributeValue for DevicePointer {
    const TYPE: Type = Type::CUDNN_TYPE_VOID_PTR;
}
impl AttributeValue for RawNote {
    const TYPE: Type = Type::CUDNN_TYPE_NUMERICAL_NOTE;
}

/// One backend descriptor, destroyed when dropped.
#[derive(Debug)]
struct Descriptor {
    raw: sys::cudnnBackendDescriptor_t,
}

impl Descriptor {
    fn new(kind: Kind) -> Result<Descriptor, CudaFailure> {
        let mut raw: sys::cudnnBackendDescriptor_t = std::ptr::null_mut();
        check(
            // SAFETY: `raw` is a valid out-pointer for one descriptor.
            unsafe { sys::cudnnBackendCreateDescriptor(kind, &mut raw) },
            "creating a cudnn backend descriptor",
        )?;
        Ok(Descriptor { raw })
    }

    fn set<T: AttributeValue>(&self, name: Name, values: &[T]) -> Result<(), CudaFailure> {
        let count = i64::try_from(values.len()).unwrap_or(i64::MAX);
        check(
            // SAFETY: the descriptor is live and not finalized by anyone else; `values`
            // holds `count` elements of the C type `T::TYPE` names (`AttributeValue` pairs
            // each Rust type with its layout-identical C type), which cuDNN copies before
            // it returns.
            unsafe {
                sys::cudnnBackendSetAttribute(
                    self.raw,
                    name,
                    T::TYPE,
                    count,
                    values.as_ptr().cast(),
                )
            },
            "setting a cudnn backend attribute",
        )
        .map_err(|failure| failure.during(format!("setting {name:?}")))
    }

    /// Reads up to `out.len()` values into `out` and returns how many cuDNN has (which
    /// may be more; an empty `out` asks only for the count).
    fn get<T: AttributeValue>(&self, name: Name, out: &mut [T]) -> Result<usize, CudaFailure> {
        let requested = i64::try_from(out.len()).unwrap_or(i64::MAX);
        let array: *mut c_void = if out.is_empty() {
            std::ptr::null_mut()
        } else {
            out.as_mut_ptr().cast()
        };
        let mut count: i64 = 0;
        check(
            // SAFETY: the descriptor is live; `array` is null with a request of 0 (cuDNN
            // then writes only the count) or holds `requested` elements of the C type
            // `T::TYPE` names, of which cuDNN writes at most `requested`; for descriptors
            // the elements are live descriptors of the kind the attribute holds, which
            // cuDNN fills in place.
            unsafe {
                sys::cudnnBackendGetAttribute(self.raw, name, T::TYPE, requested, &mut count, array)
            },
            "reading a cudnn backend attribute",
        )
        .map_err(|failure| failure.during(format!("reading {name:?}")))?;
        Ok(usize::try_from(count).unwrap_or(0))
    }

    fn finalize(&self, what: &str) -> Result<(), CudaFailure> {
        check(
            // SAFETY: the descriptor is live and its required attributes were set above.
            unsafe { sys::cudnnBackendFinalize(self.raw) },
            "finalizing a cudnn backend descriptor",
        )
        .map_err(|failure| failure.during(format!("finalizing {what}")))
    }
}

impl Drop for Descriptor {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once, here; descriptors that refer to it
        // (an engine config to its graph, a plan to its config) are dropped first, as
        // `GraphPlan` and `OperationGraph` order their fields, and no execution that uses
        // it is pending on the host (cuDNN reads descriptors when a call is enqueued).
        let _ = unsafe { sys::cudnnBackendDestroyDescriptor(self.raw) };
    }
}

/// The tensor unique ids of a convolution's three operands, the same in every direction:
/// x (or dx), w (or dw), y (or dy), so a variant pack is the buffers in that order.
const INPUT_UID: i64 = 1;
const FILTER_UID: i64 = 2;
const OUTPUT_UID: i64 = 3;

fn dimension(value: usize) -> Result<i64, CudaFailure> {
    i64::try_from(value).map_err(|_| {
        CudaFailure::new(
            CudaLibrary::Cudnn,
            2000,
            format!("dimension {value} exceeds i64"),
        )
    })
}

/// An NHWC tensor `[n, h, w, c]` (a KRSC filter is `[k, r, s, c]`) as the graph API's
/// NCHW dimensions with NHWC strides.
fn nhwc_tensor(
    uid: i64,
    element_type: ElementType,
    [n, h, w, c]: [usize; 4],
    alignment: u64,
) -> Result<Descriptor, CudaFailure> {
    let [n, h, w, c] = [dimension(n)?, dimension(h)?, dimension(w)?, dimension(c)?];
    let tensor = Descriptor::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    tensor.set(
        Name::CUDNN_ATTR_TENSOR_DATA_TYPE,
        &[data_type(element_type)?],
    )?;
    tensor.set(Name::CUDNN_ATTR_TENSOR_DIMENSIONS, &[n, c, h, w])?;
    tensor.set(Name::CUDNN_ATTR_TENSOR_STRIDES, &[h * w * c, 1, w * c, c])?;
    tensor.set(Name::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[uid])?;
    tensor.set(Name::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[alignment as i64])?;
    tensor.finalize("a tensor descriptor")?;
    Ok(tensor)
}

/// The descriptors of one convolution's graph, shared by every plan built for it.
#[derive(Debug)]
struct OperationGraph {
    // Dropped in this order: the graph before the operation before its operands.
    graph: Descriptor,
    _operation: Descriptor,
    _convolution: Descriptor,
    _tensors: [Descriptor; 3],
}

/// What a one-convolution graph is built for; plans are cached by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    pub shape: ConvolutionShape,
    pub direction: ConvolutionDirection,
    /// The budget the choice was made within.
    pub budget_bytes: u64,
    /// Every pointer's alignment (`graph_engines::common_alignment`).
    pub alignment: u64,
    /// `beta`'s bits: the scale is part of the operation, not of the call.
    pub beta_bits: u32,
}

/// A finalized execution plan and what it needs kept alive.
#[derive(Debug)]
pub struct GraphPlan {
    // Dropped in this order: the plan before its configuration and engine, those before
    // the graph they were listed for.
    plan: Descriptor,
    _configuration: Descriptor,
    _engine: Descriptor,
    _graph: Rc<OperationGraph>,
    pub workspace_bytes: u64,
}

impl GraphPlan {
    /// Runs the plan on `buffers` (x/dx, w/dw, y/dy as the direction reads them), with
    /// the workspace at `buffers.workspace`. A plan that needs more than
    /// `buffers.workspace_bytes` is refused here, never run: the workspace is the plan's
    /// buffer and the bytes after it belong to other buffers.
    pub fn execute(&self, cudnn: &Cudnn, buffers: &ConvolutionBuffers) -> Result<(), CudaFailure> {
        if self.workspace_bytes > buffers.workspace_bytes {
            return Err(CudaFailure::new(
                CudaLibrary::Cudnn,
                2000,
                format!(
                    "an execution plan needing {} bytes of workspace was given {}",
                    self.workspace_bytes, buffers.workspace_bytes
                ),
            ));
        }
        let pack = Descriptor::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        let address = |value: u64| DevicePointer(value as *mut c_void);
        pack.set(
            Name::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
            &[INPUT_UID, FILTER_UID, OUTPUT_UID],
        )?;
        pack.set(
            Name::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            &[
                address(buffers.input),
                address(buffers.filter),
                address(buffers.output),
            ],
        )?;
        pack.set(
            Name::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            &[address(buffers.workspace)],
        )?;
        pack.finalize("a variant pack")?;
        check(
            // SAFETY: the plan and the pack are live, finalized descriptors; the pack's
            // pointers are live slice buffers matching the tensors the plan was built for
            // (shape and alignment are the cache key), and its workspace pointer has at
            // least the plan's workspace bytes (checked above); the handle is the one the
            // plan was built with, bound to the backend's stream.
            unsafe { sys::cudnnBackendExecute(cudnn.raw_handle(), self.plan.raw, pack.raw) },
            "cudnnBackendExecute",
        )
    }
}

/// The operation graph of one convolution direction.
fn operation_graph(cudnn: &Cudnn, key: &GraphKey) -> Result<OperationGraph, CudaFailure> {
    let shape = &key.shape;
    let tensors = [
        nhwc_tensor(INPUT_UID, shape.element_type, shape.input, key.alignment)?,
        nhwc_tensor(
            FILTER_UID,
            shape.element_type,
            shape.filter(),
            key.alignment,
        )?,
        nhwc_tensor(OUTPUT_UID, shape.element_type, shape.output, key.alignment)?,
    ];
    let [x, w, y] = [tensors[0].raw, tensors[1].raw, tensors[2].raw];

    let convolution = Descriptor::new(Kind::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
    let padding = [dimension(shape.padding[0])?, dimension(shape.padding[1])?];
    // fp32 sums for every data type, as the legacy descriptors say.
    convolution.set(
        Name::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
        &[sys::cudnnDataType_t::CUDNN_DATA_FLOAT],
    )?;
    convolution.set(
        Name::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
        &[sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION],
    )?;
    convolution.set(Name::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &[2i64])?;
    convolution.set(Name::CUDNN_ATTR_CONVOLUTION_DILATIONS, &[1i64, 1])?;
    convolution.set(
        Name::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES,
        &[dimension(shape.stride[0])?, dimension(shape.stride[1])?],
    )?;
    convolution.set(Name::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &padding)?;
    convolution.set(Name::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &padding)?;
    convolution.finalize("a convolution descriptor")?;

    let beta = f32::from_bits(key.beta_bits);
    let (kind, names) = match key.direction {
        ConvolutionDirection::Forward => (
            Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR,
            [
                (Name::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, x),
                (Name::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, w),
                (Name::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, y),
                (
                    Name::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
                    convolution.raw,
                ),
            ],
        ),
        ConvolutionDirection::BackwardData => (
            Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR,
            [
                (Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, x),
                (Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, w),
                (Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, y),
                (
                    Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC,
                    convolution.raw,
                ),
            ],
        ),
        ConvolutionDirection::BackwardFilter => (
            Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR,
            [
                (Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, x),
                (Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, w),
                (Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, y),
                (
                    Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC,
                    convolution.raw,
                ),
            ],
        ),
    };
    let (alpha_name, beta_name) = match key.direction {
        ConvolutionDirection::Forward => (
            Name::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
            Name::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
        ),
        ConvolutionDirection::BackwardData => (
            Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
            Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA,
        ),
        ConvolutionDirection::BackwardFilter => (
            Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
            Name::CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA,
        ),
    };
    let operation = Descriptor::new(kind)?;
    for (name, descriptor) in names {
        operation.set(name, &[descriptor])?;
    }
    operation.set(alpha_name, &[1.0f32])?;
    operation.set(beta_name, &[beta])?;
    operation.finalize("a convolution operation")?;

    let graph = Descriptor::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    graph.set(
        Name::CUDNN_ATTR_OPERATIONGRAPH_HANDLE,
        &[cudnn.raw_handle()],
    )?;
    graph.set(Name::CUDNN_ATTR_OPERATIONGRAPH_OPS, &[operation.raw])?;
    graph.finalize("an operation graph")?;
    Ok(OperationGraph {
        graph,
        _operation: operation,
        _convolution: convolution,
        _tensors: tensors,
    })
}

/// The engine configurations one heuristics mode lists for `graph`, at most `limit`.
fn listed_configurations(
    graph: &OperationGraph,
    mode: sys::cudnnBackendHeurMode_t,
    limit: usize,
) -> Result<Vec<Descriptor>, CudaFailure> {
    let heuristics = Descriptor::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heuristics.set(
        Name::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH,
        &[graph.graph.raw],
    )?;
    heuristics.set(Name::CUDNN_ATTR_ENGINEHEUR_MODE, &[mode])?;
    heuristics.finalize("the engine heuristics")?;
    let available = heuristics
        .get::<sys::cudnnBackendDescriptor_t>(Name::CUDNN_ATTR_ENGINEHEUR_RESULTS, &mut [])?;
    let configurations = (0..available.min(limit))
        .map(|_| Descriptor::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
        .collect::<Result<Vec<_>, _>>()?;
    if configurations.is_empty() {
        return Ok(configurations);
    }
    let mut raw: Vec<sys::cudnnBackendDescriptor_t> = configurations
        .iter()
        .map(|configuration| configuration.raw)
        .collect();
    let returned = heuristics.get(Name::CUDNN_ATTR_ENGINEHEUR_RESULTS, &mut raw)?;
    let mut configurations = configurations;
    configurations.truncate(returned);
    Ok(configurations)
}

/// The engine behind a configuration, its global index and numerical notes.
fn engine_of(configuration: &Descriptor) -> Result<(Descriptor, i64, EngineNotes), CudaFailure> {
    let engine = Descriptor::new(Kind::CUDNN_BACKEND_ENGINE_DESCRIPTOR)?;
    configuration.get(Name::CUDNN_ATTR_ENGINECFG_ENGINE, &mut [engine.raw])?;
    let mut index = [0i64];
    engine.get(Name::CUDNN_ATTR_ENGINE_GLOBAL_INDEX, &mut index)?;
    let mut raw_notes = [RawNote(u32::MAX); 16];
    let count = engine
        .get(Name::CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, &mut raw_notes)?
        .min(raw_notes.len());
    let has =
        |note: sys::cudnnBackendNumericalNote_t| raw_notes[..count].contains(&RawNote(note as u32));
    use sys::cudnnBackendNumericalNote_t as Note;
    let notes = EngineNotes {
        tensor_core: has(Note::CUDNN_NUMERICAL_NOTE_TENSOR_CORE),
        down_convert_inputs: has(Note::CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS),
        reduced_precision_reduction: has(Note::CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION),
    };
    Ok((engine, index[0], notes))
}

/// The candidates for `key` in the heuristics' order (mode A, then the fallback list),
/// each with its plan when one was built: engines whose numerics `allow_tf32` and the
/// data type refuse get no plan, nor do configurations cuDNN cannot finalize (it lists
/// some it then does not support). Listing stops once `wanted` built plans fit
/// `key.budget_bytes` (`graph_engines::enough_engines`).
pub fn graph_engines(
    cudnn: &Cudnn,
    key: &GraphKey,
    allow_tf32: bool,
    wanted: usize,
) -> Result<Vec<(GraphEngineCandidate, Option<GraphPlan>)>, CudaFailure> {
    let graph = Rc::new(operation_graph(cudnn, key)?);
    let mut found: Vec<(GraphEngineCandidate, Option<GraphPlan>)> = Vec::new();
    let stop = |found: &[(GraphEngineCandidate, Option<GraphPlan>)]| {
        let candidates: Vec<GraphEngineCandidate> =
            found.iter().map(|(candidate, _)| *candidate).collect();
        enough_engines(&candidates, key.budget_bytes, wanted)
    };
    for mode in [
        sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A,
        sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_FALLBACK,
    ] {
        if stop(&found) {
            break;
        }
        // A mode that lists nothing for this graph (the fallback list may not support
        // it) leaves the other's list.
        let Ok(configurations) = listed_configurations(&graph, mode, GRAPH_ENGINES_EXAMINED) else {
            continue;
        };
        for configuration in configurations {
            if stop(&found) {
                break;
            }
            let (engine, global_index, notes) = engine_of(&configuration)?;
            let mut candidate = GraphEngineCandidate {
                global_index,
                notes,
                workspace_bytes: None,
                time_milliseconds: None,
            };
            if numerics_refusal(notes, key.shape.element_type, allow_tf32).is_some() {
                found.push((candidate, None));
                continue;
            }
            let plan = match execution_plan(cudnn, &configuration) {
                Ok((plan, workspace_bytes)) => {
                    candidate.workspace_bytes = Some(workspace_bytes);
                    Some(GraphPlan {
                        plan,
                        _configuration: configuration,
                        _engine: engine,
                        _graph: Rc::clone(&graph),
                        workspace_bytes,
                    })
                }
                Err(_) => None,
            };
            found.push((candidate, plan));
        }
    }
    Ok(found)
}

/// A finalized execution plan of `configuration` and the workspace it needs.
fn execution_plan(
    cudnn: &Cudnn,
    configuration: &Descriptor,
) -> Result<(Descriptor, u64), CudaFailure> {
    let plan = Descriptor::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
    plan.set(
        Name::CUDNN_ATTR_EXECUTION_PLAN_HANDLE,
        &[cudnn.raw_handle()],
    )?;
    plan.set(
        Name::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
        &[configuration.raw],
    )?;
    plan.finalize("an execution plan")?;
    let mut workspace = [0i64];
    plan.get(
        Name::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
        &mut workspace,
    )?;
    Ok((plan, u64::try_from(workspace[0]).unwrap_or(u64::MAX)))
}
