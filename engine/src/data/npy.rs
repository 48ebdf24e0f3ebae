//! NumPy `.npy` files (format versions 1.0, 2.0 and 3.0): a magic string, a version, a
//! little-endian header length and a header that is a Python dict literal such as
//! `{'descr': '<f4', 'fortran_order': False, 'shape': (60000, 28, 28), }`, then the raw
//! array.
//!
//! A data set is two arrays of the same first dimension: `inputs` `[N, ...]` whose trailing
//! dimensions hold the model input's elements (used as they are, converted to f32, no
//! scaling), and `targets`: `[N]` (or `[N, 1]`) integer class labels for
//! `softmax_cross_entropy`, or `[N, ...]` numbers with the model output's elements for `mse`.
//! Only the headers are kept in memory; samples are read with positioned reads.

use std::fmt;
use std::path::Path;

use super::file::{DataFile, SAMPLE_CHUNK_BYTES, SCAN_CHUNK_BYTES};
use super::{
    SampleLayout, SampleRequest, SampleSource, SampleTarget, TargetKind, label_out_of_range,
};
use crate::error::EngineError;

const NPY_MAGIC: &[u8; 6] = b"\x93NUMPY";
/// A header longer than this is not a NumPy header (NumPy itself writes a few hundred bytes):
/// refusing it keeps a corrupt length from turning into a huge allocation.
const MAX_HEADER_BYTES: u64 = 1 << 20;

/// Byte order of a multi-byte element.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ByteOrder {
    Little,
    Big,
}

/// The element types read: NumPy's bool, signed and unsigned integers and floats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ElementKind {
    Bool,
    Signed,
    Unsigned,
    Float,
}

/// A parsed `descr` such as `'<f4'`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElementType {
    pub kind: ElementKind,
    pub bytes: usize,
    pub order: ByteOrder,
}

impl ElementType {
    /// Parses a simple (non-structured) `descr`.
    pub fn parse(descr: &str) -> Option<ElementType> {
        let mut characters = descr.chars();
        let order = match characters.next()? {
            '<' => ByteOrder::Little,
            '>' => ByteOrder::Big,
            // `=` is the machine's order, `|` "not applicable" (one-byte types).
            '=' | '|' if cfg!(target_endian = "big") => ByteOrder::Big,
            '=' | '|' => ByteOrder::Little,
            _ => return None,
        };
        let kind = match characters.next()? {
            'b' => ElementKind::Bool,
            'i' => ElementKind::Signed,
            'u' => ElementKind::Unsigned,
            'f' => ElementKind::Float,
            _ => return None,
        };
        let bytes: usize = characters.as_str().parse().ok()?;
        let supported = match kind {
            ElementKind::Bool => bytes == 1,
            ElementKind::Signed | ElementKind::Unsigned => matches!(bytes, 1 | 2 | 4 | 8),
            ElementKind::Float => matches!(bytes, 2 | 4 | 8),
        };
        supported.then_some(ElementType { kind, bytes, order })
    }

    pub fn is_integer(self) -> bool {
        matches!(self.kind, ElementKind::Signed | ElementKind::Unsigned)
    }

    /// One element as f32 (integers wider than 24 bits round, as NumPy's astype does).
    fn to_f32(self, bytes: &[u8]) -> f32 {
        match self.kind {
            ElementKind::Float => match self.bytes {
                2 => half::f16::from_bits(self.unsigned(bytes) as u16).to_f32(),
                4 => f32::from_bits(self.unsigned(bytes) as u32),
                _ => f64::from_bits(self.unsigned(bytes)) as f32,
            },
            ElementKind::Signed => self.signed(bytes) as f32,
            ElementKind::Unsigned | ElementKind::Bool => self.unsigned(bytes) as f32,
        }
    }

    /// One integer element, widened to i128 so u64 values above i64::MAX stay exact.
    fn to_integer(self, bytes: &[u8]) -> i128 {
        match self.kind {
            ElementKind::Signed => i128::from(self.signed(bytes)),
            _ => i128::from(self.unsigned(bytes)),
        }
    }

    fn unsigned(self, bytes: &[u8]) -> u64 {
        let fold = |value: u64, byte: &u8| (value << 8) | u64::from(*byte);
        match self.order {
            ByteOrder::Big => bytes.iter().fold(0, fold),
            ByteOrder::Little => bytes.iter().rev().fold(0, fold),
        }
    }

    fn signed(self, bytes: &[u8]) -> i64 {
        // Sign-extend from the element's width.
        let shift = 64 - 8 * bytes.len() as u32;
        ((self.unsigned(bytes) << shift) as i64) >> shift
    }
}

impl fmt::Display for ElementType {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let order = match (self.bytes, self.order) {
            (1, _) => '|',
            (_, ByteOrder::Little) => '<',
            (_, ByteOrder::Big) => '>',
        };
        let kind = match self.kind {
            ElementKind::Bool => 'b',
            ElementKind::Signed => 'i',
            ElementKind::Unsigned => 'u',
            ElementKind::Float => 'f',
        };
        write!(formatter, "'{order}{kind}{}'", self.bytes)
    }
}

/// The header of an `.npy` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NpyHeader {
    pub element: ElementType,
    pub shape: Vec<u64>,
    /// Where the array data starts in the file.
    pub data_offset: u64,
}

/// One opened `.npy` array.
#[derive(Debug)]
pub struct NpyArray {
    file: DataFile,
    header: NpyHeader,
    elements_per_row: u64,
}

impl NpyArray {
    /// Opens the file and checks its header and its length against the shape.
    pub fn open(path: &Path) -> Result<Self, EngineError> {
        let file = DataFile::open(path)?;
        let header = read_header(&file)?;
        let element_count = header
            .shape
            .iter()
            .try_fold(1u64, |product, dimension| product.checked_mul(*dimension));
        let expected_length = element_count
            .and_then(|count| count.checked_mul(header.element.bytes as u64))
            .and_then(|payload| payload.checked_add(header.data_offset));
        match expected_length {
            Some(expected) if expected == file.length() => {}
            Some(expected) => {
                return Err(file.error(format!(
                    "file is {} bytes, expected {expected} for shape {} of {}",
                    file.length(),
                    shape_as_python(&header.shape),
                    header.element
                )));
            }
            None => {
                return Err(file.error(format!(
                    "shape {} is more elements than a file can hold",
                    shape_as_python(&header.shape)
                )));
            }
        }
        if header.shape.is_empty() {
            return Err(file.error("holds a single scalar; expected an array of shape (N, ...)"));
        }
        // Fits: the product of all dimensions did not overflow.
        let elements_per_row = header.shape[1..].iter().product();
        Ok(NpyArray {
            file,
            header,
            elements_per_row,
        })
    }

    pub fn header(&self) -> &NpyHeader {
        &self.header
    }

    pub fn path(&self) -> &str {
        self.file.path()
    }

    /// The first dimension.
    pub fn rows(&self) -> u64 {
        self.header.shape[0]
    }

    /// Elements in one row (the product of the trailing dimensions).
    pub fn elements_per_row(&self) -> u64 {
        self.elements_per_row
    }

    /// Reads row `row` into `output` (of `elements_per_row` elements) as f32, piece by piece
    /// on the stack.
    fn read_row(&self, row: u64, output: &mut [f32]) -> Result<(), EngineError> {
        let element = self.header.element;
        let row_bytes = self.elements_per_row * element.bytes as u64;
        // In range: row < rows and the file length was checked against the whole shape.
        let offset = self.header.data_offset + row * row_bytes;
        let mut buffer = [0u8; SAMPLE_CHUNK_BYTES];
        self.file.read_in_pieces(
            offset,
            row_bytes,
            element.bytes,
            &mut buffer,
            |before, piece| {
                let first = before as usize / element.bytes;
                for (value, bytes) in output[first..]
                    .iter_mut()
                    .zip(piece.chunks_exact(element.bytes))
                {
                    *value = element.to_f32(bytes);
                }
                Ok(())
            },
        )
    }

    /// Reads the integer element `position` of the flat array.
    fn read_integer(&self, position: u64) -> Result<i128, EngineError> {
        let element = self.header.element;
        let mut bytes = [0u8; 8];
        let bytes = &mut bytes[..element.bytes];
        self.file.read_exact_at(
            self.header.data_offset + position * element.bytes as u64,
            bytes,
        )?;
        Ok(element.to_integer(bytes))
    }
}

/// Reads and parses the header of an `.npy` file.
fn read_header(file: &DataFile) -> Result<NpyHeader, EngineError> {
    let mut prefix = [0u8; 12];
    let readable = file.length().min(prefix.len() as u64) as usize;
    file.read_exact_at(0, &mut prefix[..readable])?;
    if (6..10).contains(&readable) && &prefix[..6] == NPY_MAGIC {
        return Err(file.error(format!(
            "file is {} bytes, shorter than the 10-byte npy preamble",
            file.length()
        )));
    }
    if readable < 10 || &prefix[..6] != NPY_MAGIC {
        let shown: Vec<String> = prefix[..readable.min(6)]
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        return Err(file.error(format!(
            "bad magic [{}], expected \\x93NUMPY (npy)",
            shown.join(" ")
        )));
    }
    let (major, minor) = (prefix[6], prefix[7]);
    let (header_length, header_start) = match major {
        1 => (u64::from(u16::from_le_bytes([prefix[8], prefix[9]])), 10u64),
        2 | 3 if readable == 12 => (
            u64::from(u32::from_le_bytes([
                prefix[8], prefix[9], prefix[10], prefix[11],
            ])),
            12u64,
        ),
        2 | 3 => {
            return Err(file.error(format!(
                "file is {} bytes, shorter than an npy {major}.{minor} preamble",
                file.length()
            )));
        }
        _ => {
            return Err(file.error(format!(
                "npy format version {major}.{minor} is not supported (1.0, 2.0 and 3.0 are)"
            )));
        }
    };
    if header_length > MAX_HEADER_BYTES {
        return Err(file.error(format!(
            "header claims {header_length} bytes; npy headers are a few hundred"
        )));
    }
    let data_offset = header_start + header_length;
    if data_offset > file.length() {
        return Err(file.error(format!(
            "file is {} bytes, shorter than its {data_offset}-byte header",
            file.length()
        )));
    }
    let mut text = vec![0u8; header_length as usize];
    file.read_exact_at(header_start, &mut text)?;
    let text = String::from_utf8(text).map_err(|_| file.error("header is not text"))?;
    let header = parse_header_text(&text, data_offset).map_err(|reason| file.error(reason))?;
    Ok(header)
}

/// Parses the header dict (public for tests and tools; `data_offset` is carried through).
pub fn parse_header_text(text: &str, data_offset: u64) -> Result<NpyHeader, String> {
    let entries = PythonLiteralParser::new(text)
        .parse_dict()
        .map_err(|reason| format!("header {reason}: {}", text.trim_end()))?;
    let find = |key: &str| {
        entries
            .iter()
            .find(|(name, _)| name == key)
            .map(|(_, value)| value)
            .ok_or_else(|| format!("header has no '{key}': {}", text.trim_end()))
    };
    let element = match find("descr")? {
        PythonValue::Text(descr) => ElementType::parse(descr).ok_or_else(|| {
            format!(
                "descr '{descr}' is not supported; use floats ('<f2', '<f4', '<f8'), integers ('|i1'..'<i8', '|u1'..'<u8') or '|b1'"
            )
        })?,
        PythonValue::Sequence(_) => {
            return Err("structured arrays (a list descr) are not supported; save a plain numeric array".to_string());
        }
        other => return Err(format!("descr is {other:?}, expected a string such as '<f4'")),
    };
    match find("fortran_order")? {
        PythonValue::Bool(false) => {}
        PythonValue::Bool(true) => {
            return Err("fortran_order is true (column-major data); save a c-ordered array, e.g. np.save(path, np.ascontiguousarray(array))".to_string());
        }
        other => {
            return Err(format!(
                "fortran_order is {other:?}, expected True or False"
            ));
        }
    }
    let shape = match find("shape")? {
        PythonValue::Sequence(dimensions) => dimensions
            .iter()
            .map(|dimension| match dimension {
                PythonValue::Integer(value) => Ok(*value),
                other => Err(format!("shape has {other:?}, expected integers")),
            })
            .collect::<Result<Vec<u64>, String>>()?,
        other => return Err(format!("shape is {other:?}, expected a tuple")),
    };
    Ok(NpyHeader {
        element,
        shape,
        data_offset,
    })
}

/// `(60000, 28, 28)`, as NumPy writes a shape.
fn shape_as_python(shape: &[u64]) -> String {
    match shape {
        [single] => format!("({single},)"),
        _ => {
            let parts: Vec<String> = shape.iter().map(u64::to_string).collect();
            format!("({})", parts.join(", "))
        }
    }
}

/// The part of Python's literal syntax NumPy writes in headers.
#[derive(Debug, Clone, PartialEq, Eq)]
enum PythonValue {
    Text(String),
    Bool(bool),
    None,
    Integer(u64),
    Sequence(Vec<PythonValue>),
}

struct PythonLiteralParser<'a> {
    text: &'a [u8],
    position: usize,
}

/// Sequences nested deeper than this are not a NumPy header (and would recurse without end
/// on a hostile file).
const MAX_NESTING: usize = 16;

impl<'a> PythonLiteralParser<'a> {
    fn new(text: &'a str) -> Self {
        PythonLiteralParser {
            text: text.as_bytes(),
            position: 0,
        }
    }

    fn skip_whitespace(&mut self) {
        while self
            .text
            .get(self.position)
            .is_some_and(|byte| byte.is_ascii_whitespace())
        {
            self.position += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_whitespace();
        self.text.get(self.position).copied()
    }

    fn expect(&mut self, wanted: u8) -> Result<(), String> {
        match self.peek() {
            Some(byte) if byte == wanted => {
                self.position += 1;
                Ok(())
            }
            Some(byte) => Err(format!(
                "has '{}' at byte {} where '{}' was expected",
                byte as char, self.position, wanted as char
            )),
            None => Err(format!("ends where '{}' was expected", wanted as char)),
        }
    }

    fn parse_dict(&mut self) -> Result<Vec<(String, PythonValue)>, String> {
        self.expect(b'{')?;
        let mut entries = Vec::new();
        loop {
            if self.peek() == Some(b'}') {
                self.position += 1;
                return Ok(entries);
            }
            let key = match self.parse_value(0)? {
                PythonValue::Text(key) => key,
                other => return Err(format!("has a key {other:?}, expected a string")),
            };
            self.expect(b':')?;
            let value = self.parse_value(0)?;
            entries.push((key, value));
            match self.peek() {
                Some(b',') => self.position += 1,
                Some(b'}') => {}
                _ => return Err("is not a dict literal".to_string()),
            }
        }
    }

    fn parse_value(&mut self, depth: usize) -> Result<PythonValue, String> {
        if depth > MAX_NESTING {
            return Err("nests too deeply".to_string());
        }
        match self.peek() {
            Some(quote @ (b'\'' | b'"')) => {
                self.position += 1;
                let start = self.position;
                while self
                    .text
                    .get(self.position)
                    .is_some_and(|byte| *byte != quote)
                {
                    self.position += 1;
                }
                if self.position >= self.text.len() {
                    return Err("has an unterminated string".to_string());
                }
                let text = String::from_utf8_lossy(&self.text[start..self.position]).into_owned();
                self.position += 1;
                Ok(PythonValue::Text(text))
            }
            Some(open @ (b'(' | b'[')) => {
                let close = if open == b'(' { b')' } else { b']' };
                self.position += 1;
                let mut items = Vec::new();
                loop {
                    if self.peek() == Some(close) {
                        self.position += 1;
                        return Ok(PythonValue::Sequence(items));
                    }
                    items.push(self.parse_value(depth + 1)?);
                    match self.peek() {
                        Some(b',') => self.position += 1,
                        Some(byte) if byte == close => {}
                        _ => return Err("has an unterminated tuple or list".to_string()),
                    }
                }
            }
            Some(byte) if byte.is_ascii_digit() => {
                let start = self.position;
                while self
                    .text
                    .get(self.position)
                    .is_some_and(|byte| byte.is_ascii_digit())
                {
                    self.position += 1;
                }
                let digits = std::str::from_utf8(&self.text[start..self.position])
                    .map_err(|_| "has a malformed number".to_string())?;
                let value = digits
                    .parse::<u64>()
                    .map_err(|_| format!("has a dimension {digits} that does not fit 64 bits"))?;
                // Python 2 wrote long integers as `3L`.
                if self.text.get(self.position) == Some(&b'L') {
                    self.position += 1;
                }
                Ok(PythonValue::Integer(value))
            }
            Some(byte) if byte.is_ascii_alphabetic() => {
                let start = self.position;
                while self
                    .text
                    .get(self.position)
                    .is_some_and(|byte| byte.is_ascii_alphanumeric() || *byte == b'_')
                {
                    self.position += 1;
                }
                match &self.text[start..self.position] {
                    b"True" => Ok(PythonValue::Bool(true)),
                    b"False" => Ok(PythonValue::Bool(false)),
                    b"None" => Ok(PythonValue::None),
                    other => Err(format!(
                        "has an unexpected name '{}'",
                        String::from_utf8_lossy(other)
                    )),
                }
            }
            Some(byte) => Err(format!(
                "has an unexpected '{}' at byte {}",
                byte as char, self.position
            )),
            None => Err("ends early".to_string()),
        }
    }
}

/// An inputs array and a targets array as one data set.
#[derive(Debug)]
pub struct NpyDataset {
    inputs: NpyArray,
    targets: NpyArray,
    samples: u64,
    input_elements: usize,
    target_kind: TargetKind,
}

impl NpyDataset {
    /// Opens both arrays and checks them against the model: `input_elements` per input row;
    /// for class targets, integer labels in `0..classes` of shape `(N,)` or `(N, 1)`; for
    /// value targets, `elements` per row.
    pub fn open(
        inputs_path: &Path,
        targets_path: &Path,
        input_elements: usize,
        target_kind: TargetKind,
    ) -> Result<Self, EngineError> {
        let inputs = NpyArray::open(inputs_path)?;
        let samples = inputs.rows();
        if samples == 0 {
            return Err(inputs.file.error(format!(
                "has no samples (shape {})",
                shape_as_python(&inputs.header.shape)
            )));
        }
        if inputs.elements_per_row() != input_elements as u64 {
            return Err(inputs.file.error(format!(
                "inputs have shape {}: {} elements per sample, but the model input has {input_elements}",
                shape_as_python(&inputs.header.shape),
                inputs.elements_per_row()
            )));
        }
        let targets = NpyArray::open(targets_path)?;
        if targets.rows() != samples {
            return Err(targets.file.error(format!(
                "has {} targets but {samples} inputs (in {})",
                targets.rows(),
                inputs.path()
            )));
        }
        match target_kind {
            TargetKind::Classes { classes } => {
                let element = targets.header.element;
                if !element.is_integer() {
                    return Err(targets.file.error(format!(
                        "class labels must be integers, got {element}; save them with .astype(np.int64)"
                    )));
                }
                if targets.elements_per_row() != 1 {
                    return Err(targets.file.error(format!(
                        "class labels must have shape (N,) or (N, 1), got {}",
                        shape_as_python(&targets.header.shape)
                    )));
                }
                check_labels(&targets, classes)?;
            }
            TargetKind::Values { elements } => {
                if targets.elements_per_row() != elements as u64 {
                    return Err(targets.file.error(format!(
                        "targets have shape {}: {} elements per sample, but the model output has {elements}",
                        shape_as_python(&targets.header.shape),
                        targets.elements_per_row()
                    )));
                }
            }
        }
        Ok(NpyDataset {
            inputs,
            targets,
            samples,
            input_elements,
            target_kind,
        })
    }
}

/// One pass over the labels so an out-of-range label fails the open.
fn check_labels(targets: &NpyArray, classes: u64) -> Result<(), EngineError> {
    let element = targets.header.element;
    let mut buffer = vec![0u8; SCAN_CHUNK_BYTES];
    let total_bytes = targets.rows() * element.bytes as u64;
    targets.file.read_in_pieces(
        targets.header.data_offset,
        total_bytes,
        element.bytes,
        &mut buffer,
        |before, piece| {
            let first = before / element.bytes as u64;
            for (offset, bytes) in piece.chunks_exact(element.bytes).enumerate() {
                let label = element.to_integer(bytes);
                if !(0..i128::from(classes)).contains(&label) {
                    return Err(targets.file.error(label_out_of_range(
                        label,
                        first + offset as u64,
                        classes,
                    )));
                }
            }
            Ok(())
        },
    )
}

impl SampleSource for NpyDataset {
    fn source(&self) -> &str {
        self.inputs.path()
    }

    fn layout(&self) -> SampleLayout {
        SampleLayout {
            samples: self.samples,
            input_elements: self.input_elements,
            target_kind: self.target_kind,
        }
    }

    fn read_checked(&self, request: SampleRequest<'_>) -> Result<SampleTarget, EngineError> {
        let (index, input, target_values) = (request.index, request.input, request.target_values);
        self.inputs.read_row(index, input)?;
        match self.target_kind {
            TargetKind::Classes { classes } => {
                let label = self.targets.read_integer(index)?;
                // Checked at open; checked again because the file may have been replaced.
                if !(0..i128::from(classes)).contains(&label) {
                    return Err(self
                        .targets
                        .file
                        .error(label_out_of_range(label, index, classes)));
                }
                Ok(SampleTarget::Class(label as i32))
            }
            TargetKind::Values { .. } => {
                self.targets.read_row(index, target_values)?;
                Ok(SampleTarget::Values)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_as_numpy_writes_them_parse() {
        let header = parse_header_text(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (60000, 28, 28), }          \n",
            128,
        )
        .unwrap();
        assert_eq!(header.shape, vec![60000, 28, 28]);
        assert_eq!(
            header.element,
            ElementType {
                kind: ElementKind::Float,
                bytes: 4,
                order: ByteOrder::Little
            }
        );
        assert_eq!(header.data_offset, 128);

        let one_dimension = parse_header_text(
            "{'descr': '|u1', 'fortran_order': False, 'shape': (7,), }",
            64,
        )
        .unwrap();
        assert_eq!(one_dimension.shape, vec![7]);
        let scalar = parse_header_text(
            "{'descr': '<i8', 'fortran_order': False, 'shape': (), }",
            64,
        )
        .unwrap();
        assert!(scalar.shape.is_empty());
        let python2 = parse_header_text(
            "{\"descr\": \">i2\", \"shape\": (3L, 2L), \"fortran_order\": False}",
            64,
        )
        .unwrap();
        assert_eq!(python2.shape, vec![3, 2]);
        assert_eq!(python2.element.order, ByteOrder::Big);
    }

    #[test]
    fn bad_headers_are_reasons_not_panics() {
        for (text, fragment) in [
            (
                "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
                "fortran_order is true",
            ),
            (
                "{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }",
                "descr '<c8' is not supported",
            ),
            (
                "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }",
                "structured",
            ),
            ("{'descr': '<f4', 'fortran_order': False, }", "no 'shape'"),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }",
                "does not fit 64 bits",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2, ",
                "ends early",
            ),
            ("{'descr': '<f4", "unterminated string"),
            ("not a dict", "where '{' was expected"),
            ("", "ends where '{'"),
            (
                "{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2,), }",
                "unexpected name 'Maybe'",
            ),
        ] {
            let reason = parse_header_text(text, 64).unwrap_err();
            assert!(reason.contains(fragment), "{text}: {reason}");
        }
        let deep = format!("{{'shape': {}", "(".repeat(100));
        assert!(
            parse_header_text(&deep, 64)
                .unwrap_err()
                .contains("nests too deeply")
        );
    }

    #[test]
    fn elements_decode_in_both_byte_orders() {
        let little_i16 = ElementType::parse("<i2").unwrap();
        assert_eq!(little_i16.to_integer(&(-300i16).to_le_bytes()), -300);
        let big_i32 = ElementType::parse(">i4").unwrap();
        assert_eq!(big_i32.to_f32(&(-7i32).to_be_bytes()), -7.0);
        let big_f8 = ElementType::parse(">f8").unwrap();
        assert_eq!(big_f8.to_f32(&2.5f64.to_be_bytes()), 2.5);
        let half = ElementType::parse("<f2").unwrap();
        assert_eq!(
            half.to_f32(&half::f16::from_f32(0.75).to_bits().to_le_bytes()),
            0.75
        );
        let unsigned = ElementType::parse("<u8").unwrap();
        assert_eq!(
            unsigned.to_integer(&u64::MAX.to_le_bytes()),
            i128::from(u64::MAX)
        );
        let boolean = ElementType::parse("|b1").unwrap();
        assert_eq!(boolean.to_f32(&[1]), 1.0);
        assert_eq!(ElementType::parse("<f4").unwrap().to_string(), "'<f4'");
        assert_eq!(ElementType::parse("|u1").unwrap().to_string(), "'|u1'");
        for unsupported in ["<f16", "<c8", "f4", "<U10", "<b2", "<i3", ""] {
            assert_eq!(ElementType::parse(unsupported), None, "{unsupported}");
        }
    }
}
