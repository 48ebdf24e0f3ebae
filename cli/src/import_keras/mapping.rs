//! Keras model JSON (`model.to_json()`, or a `.keras` file's `config.json`) to Carve
//! layer entries: Sequential and Functional models, Keras 3 and Keras 2 (tf.keras)
//! layouts. Only the configuration is read; nothing in it is executed, and a layer Carve
//! does not have is refused with its name and class.

use std::collections::HashMap;

use carve_core::spec::{
    BatchNormSpec, Conv2dSpec, DenseSpec, DepthwiseConv2dSpec, Dimensions, DropoutSpec, LayerEntry,
    LayerSpec, LeakyReluSpec, LossKind, MODEL_INPUT_NAME, NoSettings, Padding, PaddingMode,
    PoolSpec, ZeroPadding, ZeroPadding2dSpec,
};
use serde_json::Value;

/// A Keras model as Carve layers.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportedModel {
    pub name: String,
    pub input_shape: Vec<u64>,
    pub layers: Vec<LayerEntry>,
    pub loss: LossKind,
    /// What the import decided that a person should know (a folded softmax, the loss).
    pub notes: Vec<String>,
}

/// What a Keras tensor is in Carve: the model input or the output of an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Input,
    Entry(usize),
}

struct Importer {
    entries: Vec<LayerEntry>,
    by_keras_name: HashMap<String, Source>,
    input_shape: Option<Vec<u64>>,
    notes: Vec<String>,
    softmax_output: bool,
}

/// Reads a Keras model's JSON: the layers Carve maps, or the first one it cannot with its
/// name and class.
pub fn import_keras_json(text: &str) -> Result<ImportedModel, String> {
    let root: Value =
        serde_json::from_str(text).map_err(|error| format!("not Keras model JSON: {error}"))?;
    let class = root["class_name"].as_str().unwrap_or_default();
    let config = &root["config"];
    let layers = config["layers"]
        .as_array()
        .ok_or("not Keras model JSON: no config.layers (save it with model.to_json() or model.save(\"x.keras\"))")?;
    let name = config["name"].as_str().unwrap_or("keras-model").to_string();
    let mut importer = Importer {
        entries: Vec::new(),
        by_keras_name: HashMap::new(),
        input_shape: None,
        notes: Vec::new(),
        softmax_output: false,
    };
    let output_name = match class {
        "Sequential" => {
            if let Some(shape) = batch_shape(&config["build_input_shape"]) {
                importer.input_shape = Some(shape);
            }
            let mut previous = Source::Input;
            let mut last_name = String::new();
            for (position, layer) in layers.iter().enumerate() {
                let name = layer_name(layer, position);
                let is_last = position + 1 == layers.len();
                previous = importer.layer(layer, &name, vec![previous], is_last)?;
                importer.by_keras_name.insert(name.clone(), previous);
                last_name = name;
            }
            last_name
        }
        "Functional" | "Model" => {
            let outputs = tensor_names(&config["output_layers"]);
            let [output] = outputs.as_slice() else {
                return Err(format!(
                    "the model has {} outputs; Carve trains models with one",
                    outputs.len()
                ));
            };
            for (position, layer) in layers.iter().enumerate() {
                let name = layer_name(layer, position);
                let inputs = inbound_names(layer, &name)?
                    .iter()
                    .map(|inbound| {
                        importer.by_keras_name.get(inbound).copied().ok_or_else(|| {
                            format!("layer `{name}` reads `{inbound}`, which comes later or is not in the model")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let source = importer.layer(layer, &name, inputs, &name == output)?;
                importer.by_keras_name.insert(name, source);
            }
            output.clone()
        }
        other => {
            return Err(format!(
                "a `{other}` model: Carve imports Sequential and Functional Keras models"
            ));
        }
    };
    let input_shape = importer
        .input_shape
        .ok_or("the model does not say its input shape (give it a keras.Input)")?;
    if importer.by_keras_name.get(&output_name)
        != Some(&Source::Entry(importer.entries.len().saturating_sub(1)))
    {
        return Err(format!(
            "the output `{output_name}` is not the last layer Carve made; Carve's output is its last layer"
        ));
    }
    let loss = if importer.softmax_output {
        importer.notes.push(
            "the output softmax is part of Carve's softmax_cross_entropy loss (integer class labels)"
                .to_string(),
        );
        LossKind::SoftmaxCrossEntropy
    } else {
        importer.notes.push(
            "no softmax at the output: the loss is mse; pass --loss softmax_cross_entropy if the output is class logits"
                .to_string(),
        );
        LossKind::Mse
    };
    Ok(ImportedModel {
        name,
        input_shape,
        layers: importer.entries,
        loss,
        notes: importer.notes,
    })
}

fn layer_name(layer: &Value, position: usize) -> String {
    layer["name"]
        .as_str()
        .or_else(|| layer["config"]["name"].as_str())
        .map(str::to_string)
        .unwrap_or_else(|| format!("layer_{position}"))
}

/// `[null, 28, 28, 1]` (Keras' batch shape) as Carve's per-sample shape.
fn batch_shape(value: &Value) -> Option<Vec<u64>> {
    let dimensions = value.as_array()?;
    dimensions
        .iter()
        .skip(1)
        .map(Value::as_u64)
        .collect::<Option<Vec<u64>>>()
        .filter(|shape| !shape.is_empty())
}

/// The layer names in `input_layers` / `output_layers`: `[name, 0, 0]` or a list of them.
fn tensor_names(value: &Value) -> Vec<String> {
    match value.as_array().map(Vec::as_slice) {
        Some([Value::String(name), ..]) => vec![name.clone()],
        Some(list) => list.iter().flat_map(tensor_names).collect(),
        None => Vec::new(),
    }
}

/// The layers a Functional model's layer reads: Keras 3 `inbound_nodes` (tensors with a
/// `keras_history`) or Keras 2's nested lists. A layer called twice (shared) is refused.
fn inbound_names(layer: &Value, name: &str) -> Result<Vec<String>, String> {
    let nodes = layer["inbound_nodes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    match nodes.as_slice() {
        [] => Ok(Vec::new()),
        [node] => {
            let mut names = Vec::new();
            collect_histories(node, &mut names);
            Ok(names)
        }
        _ => Err(format!(
            "layer `{name}` is called {} times (a shared layer); Carve's layers are used once",
            nodes.len()
        )),
    }
}

fn collect_histories(value: &Value, names: &mut Vec<String>) {
    match value {
        Value::Object(object) => {
            if let Some(history) = object
                .get("config")
                .and_then(|config| config.get("keras_history"))
            {
                if let Some(name) = history.get(0).and_then(Value::as_str) {
                    names.push(name.to_string());
                }
                return;
            }
            if let Some(args) = object.get("args") {
                collect_histories(args, names);
            }
        }
        // Keras 2: [name, node_index, tensor_index, kwargs].
        Value::Array(items) => match items.first() {
            Some(Value::String(name)) => names.push(name.clone()),
            _ => items.iter().for_each(|item| collect_histories(item, names)),
        },
        _ => {}
    }
}

impl Importer {
    /// Maps one Keras layer; returns the source of its output.
    fn layer(
        &mut self,
        layer: &Value,
        name: &str,
        inputs: Vec<Source>,
        is_output: bool,
    ) -> Result<Source, String> {
        let class = layer["class_name"].as_str().unwrap_or_default();
        let config = &layer["config"];
        let refuse = |why: &str| format!("layer `{name}` ({class}): {why}");
        let channels_last = || match config["data_format"].as_str() {
            None | Some("channels_last") => Ok(()),
            Some(other) => Err(refuse(&format!(
                "data_format {other}; Carve's images are channels_last"
            ))),
        };
        let one_input = |inputs: &[Source]| match inputs {
            [source] => Ok(*source),
            _ => Err(refuse(&format!(
                "reads {} tensors; this layer reads one",
                inputs.len()
            ))),
        };
        let layer_spec = match class {
            "InputLayer" => {
                let shape = batch_shape(&config["batch_shape"])
                    .or_else(|| batch_shape(&config["batch_input_shape"]))
                    .ok_or_else(|| refuse("no batch_shape"))?;
                self.input_shape = Some(shape);
                return Ok(Source::Input);
            }
            "Conv2D" => {
                channels_last()?;
                unit_dilation(config).map_err(|why| refuse(&why))?;
                if config["groups"].as_u64().unwrap_or(1) != 1 {
                    return Err(refuse("grouped convolution (groups > 1)"));
                }
                LayerSpec::Conv2d(Conv2dSpec {
                    filters: positive(config, "filters").map_err(|why| refuse(&why))?,
                    kernel: dimensions(&config["kernel_size"])
                        .ok_or_else(|| refuse("kernel_size"))?,
                    stride: dimensions(&config["strides"]).unwrap_or(Dimensions::Square(1)),
                    padding: padding(config).map_err(|why| refuse(&why))?,
                    use_bias: config["use_bias"].as_bool().unwrap_or(true),
                })
            }
            "DepthwiseConv2D" => {
                channels_last()?;
                unit_dilation(config).map_err(|why| refuse(&why))?;
                LayerSpec::DepthwiseConv2d(DepthwiseConv2dSpec {
                    kernel: dimensions(&config["kernel_size"])
                        .ok_or_else(|| refuse("kernel_size"))?,
                    stride: dimensions(&config["strides"]).unwrap_or(Dimensions::Square(1)),
                    padding: padding(config).map_err(|why| refuse(&why))?,
                    depth_multiplier: config["depth_multiplier"].as_u64().unwrap_or(1),
                    use_bias: config["use_bias"].as_bool().unwrap_or(true),
                })
            }
            "Dense" => LayerSpec::Dense(DenseSpec {
                units: positive(config, "units").map_err(|why| refuse(&why))?,
                use_bias: config["use_bias"].as_bool().unwrap_or(true),
            }),
            "BatchNormalization" => {
                let axis = config["axis"]
                    .as_i64()
                    .or_else(|| config["axis"][0].as_i64())
                    .unwrap_or(-1);
                if axis != -1 && axis != 3 {
                    return Err(refuse(&format!(
                        "axis {axis}; Carve normalizes the last (channels) axis"
                    )));
                }
                if config["center"] == Value::Bool(false) || config["scale"] == Value::Bool(false) {
                    return Err(refuse("center or scale off; Carve's batch norm has both"));
                }
                LayerSpec::BatchNorm(BatchNormSpec {
                    momentum: config["momentum"].as_f64().unwrap_or(0.99),
                    epsilon: config["epsilon"].as_f64().unwrap_or(1e-3),
                })
            }
            "Activation" => {
                let activation =
                    activation_name(&config["activation"]).map_err(|why| refuse(&why))?;
                return self.activation(&activation, name, one_input(&inputs)?, is_output, &refuse);
            }
            "ReLU" => {
                let max_value = config["max_value"].as_f64();
                let slope = config["negative_slope"].as_f64().unwrap_or(0.0);
                if config["threshold"].as_f64().unwrap_or(0.0) != 0.0 {
                    return Err(refuse("a threshold other than 0"));
                }
                match (max_value, slope) {
                    (None, 0.0) => LayerSpec::Relu(NoSettings {}),
                    (Some(6.0), 0.0) => LayerSpec::Relu6(NoSettings {}),
                    (None, alpha) => LayerSpec::LeakyRelu(LeakyReluSpec { alpha }),
                    _ => return Err(refuse("max_value other than 6 (Carve has relu and relu6)")),
                }
            }
            "LeakyReLU" => LayerSpec::LeakyRelu(LeakyReluSpec {
                alpha: config["negative_slope"]
                    .as_f64()
                    .or_else(|| config["alpha"].as_f64())
                    .unwrap_or(0.3),
            }),
            "MaxPooling2D" | "AveragePooling2D" => {
                channels_last()?;
                let size = dimensions(&config["pool_size"]).ok_or_else(|| refuse("pool_size"))?;
                let pool = PoolSpec {
                    size,
                    stride: dimensions(&config["strides"]).filter(|stride| *stride != size),
                    padding: padding(config).map_err(|why| refuse(&why))?,
                };
                if class == "MaxPooling2D" {
                    LayerSpec::MaxPool(pool)
                } else {
                    LayerSpec::AvgPool(pool)
                }
            }
            "GlobalAveragePooling2D" => {
                channels_last()?;
                if config["keepdims"] == Value::Bool(true) {
                    return Err(refuse(
                        "keepdims; Carve's global pooling gives flat features",
                    ));
                }
                LayerSpec::GlobalAvgPool(NoSettings {})
            }
            "Flatten" => LayerSpec::Flatten(NoSettings {}),
            "Dropout" => LayerSpec::Dropout(DropoutSpec {
                rate: config["rate"].as_f64().ok_or_else(|| refuse("rate"))?,
            }),
            "ZeroPadding2D" => {
                channels_last()?;
                LayerSpec::ZeroPadding2d(ZeroPadding2dSpec {
                    padding: zero_padding(&config["padding"]).ok_or_else(|| refuse("padding"))?,
                })
            }
            "Add" => LayerSpec::Add(NoSettings {}),
            "Concatenate" => {
                let axis = config["axis"].as_i64().unwrap_or(-1);
                if axis != -1 && axis != 3 {
                    return Err(refuse(&format!(
                        "axis {axis}; Carve concatenates the last (channels) axis"
                    )));
                }
                LayerSpec::Concat(NoSettings {})
            }
            other => {
                return Err(format!(
                    "layer `{name}` is a {other}, which Carve does not have; it imports InputLayer, Conv2D, DepthwiseConv2D, Dense, BatchNormalization, Activation, ReLU, LeakyReLU, MaxPooling2D, AveragePooling2D, GlobalAveragePooling2D, Flatten, Dropout, ZeroPadding2D, Add and Concatenate"
                ));
            }
        };
        let is_merge = matches!(layer_spec, LayerSpec::Add(_) | LayerSpec::Concat(_));
        let inputs = if is_merge {
            inputs
        } else {
            vec![one_input(&inputs)?]
        };
        let activation = match class {
            "Conv2D" | "DepthwiseConv2D" | "Dense" => {
                activation_name(&config["activation"]).map_err(|why| refuse(&why))?
            }
            _ => "linear".to_string(),
        };
        let adds_no_layer = activation == "linear" || (activation == "softmax" && is_output);
        if adds_no_layer {
            let source = self.push(layer_spec, Some(name), inputs);
            return self.activation(&activation, name, source, is_output, &refuse);
        }
        let inner = self.push(layer_spec, None, inputs);
        self.activation(&activation, name, inner, is_output, &refuse)
    }

    /// An activation by Keras name; `linear` is no layer at all, and a softmax is only
    /// taken at the output, where it becomes part of the loss.
    fn activation(
        &mut self,
        activation: &str,
        name: &str,
        input: Source,
        is_output: bool,
        refuse: &dyn Fn(&str) -> String,
    ) -> Result<Source, String> {
        let layer = match activation {
            "linear" => return Ok(input),
            "softmax" if is_output => {
                self.softmax_output = true;
                return Ok(input);
            }
            "softmax" => {
                return Err(refuse(
                    "softmax inside the model; Carve's softmax is the loss's, at the output",
                ));
            }
            "relu" => LayerSpec::Relu(NoSettings {}),
            "relu6" => LayerSpec::Relu6(NoSettings {}),
            "gelu" => LayerSpec::Gelu(NoSettings {}),
            "sigmoid" => LayerSpec::Sigmoid(NoSettings {}),
            "tanh" => LayerSpec::Tanh(NoSettings {}),
            "leaky_relu" => LayerSpec::LeakyRelu(LeakyReluSpec { alpha: 0.2 }),
            other => {
                return Err(refuse(&format!(
                    "activation `{other}`, which Carve does not have (relu, relu6, leaky_relu, gelu, sigmoid, tanh, linear, and softmax at the output)"
                )));
            }
        };
        Ok(self.push(layer, Some(name), vec![input]))
    }

    /// Adds an entry reading `inputs`: written without `inputs` when it reads the entry
    /// before it, as a sequential list would.
    fn push(&mut self, layer: LayerSpec, name: Option<&str>, inputs: Vec<Source>) -> Source {
        let previous = match self.entries.len() {
            0 => Source::Input,
            count => Source::Entry(count - 1),
        };
        let inputs = if inputs == [previous] {
            None
        } else {
            Some(
                inputs
                    .iter()
                    .map(|source| self.source_name(*source))
                    .collect(),
            )
        };
        self.entries.push(LayerEntry {
            layer,
            name: name.map(carve_name),
            inputs,
        });
        Source::Entry(self.entries.len() - 1)
    }

    /// The name an entry is read by; an unnamed one (a Keras layer's inner entry) gets
    /// one made from its position.
    fn source_name(&mut self, source: Source) -> String {
        match source {
            Source::Input => MODEL_INPUT_NAME.to_string(),
            Source::Entry(index) => self.entries[index]
                .name
                .get_or_insert_with(|| format!("layer_{index}"))
                .clone(),
        }
    }
}

/// A Keras name as a Carve name: `input` is the model input's, so a layer called that
/// gets a suffix.
fn carve_name(name: &str) -> String {
    if name == MODEL_INPUT_NAME {
        format!("{name}_layer")
    } else {
        name.to_string()
    }
}

fn activation_name(value: &Value) -> Result<String, String> {
    match value {
        Value::Null => Ok("linear".to_string()),
        Value::String(name) => Ok(name.clone()),
        other => Err(format!(
            "a custom activation ({other}); Carve runs only its own"
        )),
    }
}

fn positive(config: &Value, key: &str) -> Result<u64, String> {
    config[key]
        .as_u64()
        .filter(|value| *value > 0)
        .ok_or_else(|| format!("{key} is not a positive integer"))
}

fn dimensions(value: &Value) -> Option<Dimensions> {
    match value {
        Value::Number(number) => number.as_u64().map(Dimensions::Square),
        Value::Array(items) => match items.as_slice() {
            [height, width] => {
                let (height, width) = (height.as_u64()?, width.as_u64()?);
                Some(if height == width {
                    Dimensions::Square(height)
                } else {
                    Dimensions::Rectangle([height, width])
                })
            }
            _ => None,
        },
        _ => None,
    }
}

fn padding(config: &Value) -> Result<Padding, String> {
    match config["padding"].as_str().unwrap_or("valid") {
        "valid" => Ok(Padding::Named(PaddingMode::Valid)),
        "same" => Ok(Padding::Named(PaddingMode::Same)),
        other => Err(format!("padding `{other}` (Carve has valid and same)")),
    }
}

fn unit_dilation(config: &Value) -> Result<(), String> {
    match dimensions(&config["dilation_rate"]) {
        None | Some(Dimensions::Square(1)) => Ok(()),
        Some(other) => Err(format!(
            "dilation {other}; Carve's convolutions are not dilated"
        )),
    }
}

fn zero_padding(value: &Value) -> Option<ZeroPadding> {
    if let Some(pixels) = value.as_u64() {
        return Some(ZeroPadding::Every(pixels));
    }
    let items = value.as_array()?;
    match items.as_slice() {
        [Value::Number(rows), Value::Number(columns)] => {
            Some(ZeroPadding::Symmetric([rows.as_u64()?, columns.as_u64()?]))
        }
        [rows, columns] => {
            let pair = |value: &Value| -> Option<[u64; 2]> {
                let items = value.as_array()?;
                Some([items.first()?.as_u64()?, items.get(1)?.as_u64()?])
            };
            Some(ZeroPadding::Sides([pair(rows)?, pair(columns)?]))
        }
        _ => None,
    }
}
