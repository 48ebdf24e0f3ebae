//! The graph checks of `[model]`: layer names, what each layer reads (`inputs`, by
//! default the layer before), that the reads form no cycle and leave no output unread,
//! and the shapes a merge (`add`, `concat`) can combine.

use std::collections::HashMap;

use super::checked_elements;
use crate::error::FieldError;
use crate::model::{FeatureShape, LayerNode, TensorSource};
use crate::spec::{LayerEntry, MODEL_INPUT_NAME};

/// What every layer reads, in order, from the names its entry gives (or the layer before
/// it). A layer may read only earlier layers: naming a later one is either a cycle (said
/// as such, with the loop) or an order the list must fix.
pub(super) fn resolve_layer_inputs(
    entries: &[LayerEntry],
) -> Result<Vec<Vec<TensorSource>>, FieldError> {
    let mut index_by_name: HashMap<&str, usize> = HashMap::new();
    for (index, entry) in entries.iter().enumerate() {
        let Some(name) = entry.name.as_deref() else {
            continue;
        };
        let path = format!("model.layers[{index}].name");
        if name.is_empty() {
            return Err(FieldError::new(path, "must not be empty"));
        }
        if name == MODEL_INPUT_NAME {
            return Err(FieldError::new(
                path,
                format!("`{MODEL_INPUT_NAME}` names the model input; choose another name"),
            ));
        }
        if let Some(first) = index_by_name.insert(name, index) {
            return Err(FieldError::new(
                path,
                format!("`{name}` is already the name of layers[{first}]"),
            ));
        }
    }
    // Every named read as an index, before checking the order, so a read of a later layer
    // can be told apart as a cycle.
    let mut named_reads: Vec<Option<Vec<Option<usize>>>> = Vec::with_capacity(entries.len());
    for (index, entry) in entries.iter().enumerate() {
        let Some(names) = &entry.inputs else {
            named_reads.push(None);
            continue;
        };
        let path = format!("model.layers[{index}].inputs");
        if names.is_empty() {
            return Err(FieldError::new(
                path,
                "is empty; leave it out to read the layer before",
            ));
        }
        let mut reads = Vec::with_capacity(names.len());
        for name in names {
            if name == MODEL_INPUT_NAME {
                reads.push(None);
                continue;
            }
            let producer = index_by_name.get(name.as_str()).ok_or_else(|| {
                FieldError::new(
                    path.clone(),
                    format!("`{name}` is not the name of any layer (nor `{MODEL_INPUT_NAME}`)"),
                )
            })?;
            reads.push(Some(*producer));
        }
        named_reads.push(Some(reads));
    }
    let reads_of = |index: usize| -> Vec<Option<usize>> {
        match &named_reads[index] {
            Some(reads) => reads.clone(),
            None if index == 0 => vec![None],
            None => vec![Some(index - 1)],
        }
    };
    let mut sources = Vec::with_capacity(entries.len());
    for (index, entry) in entries.iter().enumerate() {
        let reads = reads_of(index);
        let path = format!("model.layers[{index}].inputs");
        for producer in reads.iter().flatten() {
            if *producer >= index {
                let message = match find_cycle(index, *producer, &reads_of) {
                    Some(cycle) => format!(
                        "makes a cycle: {}; a layer cannot depend on its own output",
                        cycle
                            .iter()
                            .map(|layer| layer_name(entries, *layer))
                            .collect::<Vec<_>>()
                            .join(" -> ")
                    ),
                    None => format!(
                        "reads {}, which comes later in the list; list layers in the order they run",
                        layer_name(entries, *producer)
                    ),
                };
                return Err(FieldError::new(path, message));
            }
        }
        let is_merge = entry.layer.kind_name() == "add" || entry.layer.kind_name() == "concat";
        if is_merge && reads.len() < 2 {
            return Err(FieldError::new(
                path,
                format!(
                    "{} needs at least two inputs, got {}",
                    entry.layer.kind_name(),
                    reads.len()
                ),
            ));
        }
        if !is_merge && reads.len() != 1 {
            return Err(FieldError::new(
                path,
                format!(
                    "{} reads one input, got {}; merge them first with add or concat",
                    entry.layer.kind_name(),
                    reads.len()
                ),
            ));
        }
        sources.push(
            reads
                .into_iter()
                .map(|read| read.map_or(TensorSource::ModelInput, TensorSource::Layer))
                .collect(),
        );
    }
    Ok(sources)
}

/// The loop `from -> ... -> from` when `from` reads `producer` and `producer` depends on
/// `from`; `None` when it does not.
fn find_cycle(
    from: usize,
    producer: usize,
    reads_of: &dyn Fn(usize) -> Vec<Option<usize>>,
) -> Option<Vec<usize>> {
    // Depth-first from the producer through what each layer reads, looking for `from`.
    let mut stack = vec![(producer, vec![from, producer])];
    let mut seen = vec![producer];
    while let Some((layer, path)) = stack.pop() {
        if layer == from {
            return Some(path);
        }
        for next in reads_of(layer).into_iter().flatten() {
            if !seen.contains(&next) {
                seen.push(next);
                let mut longer = path.clone();
                longer.push(next);
                stack.push((next, longer));
            }
        }
    }
    None
}

fn layer_name(entries: &[LayerEntry], index: usize) -> String {
    match &entries[index].name {
        Some(name) => format!("`{name}` (layers[{index}])"),
        None => format!("layers[{index}]"),
    }
}

fn source_name(source: TensorSource, earlier: &[LayerNode]) -> String {
    match source {
        TensorSource::ModelInput => format!("`{MODEL_INPUT_NAME}`"),
        TensorSource::Layer(index) => earlier[index].named_label(),
    }
}

/// The output of `add` (every input the same shape) or `concat` (images of one height
/// and width, or flat vectors, joined along the last axis).
pub(super) fn merged_shape(
    path: &str,
    is_add: bool,
    shapes: &[FeatureShape],
    sources: &[TensorSource],
    earlier: &[LayerNode],
) -> Result<FeatureShape, FieldError> {
    let first = shapes[0];
    let mismatch = |position: usize, why: &str| {
        FieldError::new(
            path,
            format!(
                "cannot {} {} ({}) and {} ({}): {why}",
                if is_add { "add" } else { "concatenate" },
                source_name(sources[0], earlier),
                first,
                source_name(sources[position], earlier),
                shapes[position],
            ),
        )
    };
    if is_add {
        return match shapes.iter().position(|shape| *shape != first) {
            Some(position) => Err(mismatch(position, "add needs equal shapes")),
            None => Ok(first),
        };
    }
    let mut joined: u64 = 0;
    for (position, shape) in shapes.iter().enumerate() {
        let last_axis = match (first, *shape) {
            (
                FeatureShape::Image { height, width, .. },
                FeatureShape::Image {
                    height: other_height,
                    width: other_width,
                    channels,
                },
            ) if height == other_height && width == other_width => channels,
            (FeatureShape::Flat { .. }, FeatureShape::Flat { features }) => features,
            _ => {
                return Err(mismatch(
                    position,
                    "concat joins images of the same height and width, or flat vectors",
                ));
            }
        };
        joined = joined
            .checked_add(last_axis)
            .ok_or_else(|| FieldError::new(path, "the joined size is too large"))?;
    }
    Ok(match first {
        FeatureShape::Image { height, width, .. } => {
            checked_elements(&[height, width, joined], path)?;
            FeatureShape::Image {
                height,
                width,
                channels: joined,
            }
        }
        FeatureShape::Flat { .. } => {
            checked_elements(&[joined], path)?;
            FeatureShape::Flat { features: joined }
        }
    })
}

/// Every layer's output but the last (the model's output) must be read by some layer: an
/// unread branch is work and memory for nothing, and almost always a typo in `inputs`.
pub(super) fn check_every_output_is_read(layers: &[LayerNode]) -> Result<(), FieldError> {
    let mut read = vec![false; layers.len()];
    for layer in layers {
        for source in &layer.inputs {
            if let TensorSource::Layer(index) = source {
                read[*index] = true;
            }
        }
    }
    let last = layers.len().saturating_sub(1);
    match read[..last].iter().position(|was_read| !was_read) {
        Some(unread) => Err(FieldError::new(
            format!("model.layers[{unread}]"),
            format!(
                "the output of {} is never read: only the last layer is the model's output; name it in a later layer's inputs",
                layers[unread].named_label()
            ),
        )),
        None => Ok(()),
    }
}
