//! Compiles `proto/carve/v1/*.proto` into Rust with protox (a protobuf compiler in pure
//! Rust, so building Carve needs no `protoc`) and tonic-prost-build, and writes the encoded
//! descriptor set that `carve_proto::FILE_DESCRIPTOR_SET` serves to gRPC reflection.

use std::env;
use std::error::Error;
use std::fs;
use std::path::{Path, PathBuf};

use protox::prost::Message;

/// The include root: files are named `carve/v1/jobs.proto` relative to it, as their
/// imports say.
const PROTO_ROOT: &str = "proto";
/// The package directory whose files make up the API.
const PACKAGE_DIR: &str = "proto/carve/v1";

fn main() -> Result<(), Box<dyn Error>> {
    // Watching the directory alone would miss edits to files inside it, so name each file
    // as well as the directory (for files added or removed).
    println!("cargo:rerun-if-changed={PACKAGE_DIR}");
    let proto_files = proto_files(Path::new(PACKAGE_DIR))?;
    for file in &proto_files {
        println!("cargo:rerun-if-changed={}", file.display());
    }

    // protox resolves google/protobuf/*.proto from its own copies of the well-known types
    // and includes them (with source info, for doc comments) in the set.
    let descriptor_set = protox::compile(&proto_files, [PROTO_ROOT])?;

    // Reflection needs the well-known types the API imports, so the set written out keeps
    // every file.
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(
        out_dir.join("carve_descriptor.bin"),
        descriptor_set.encode_to_vec(),
    )?;

    // The whole set goes to code generation too: prost-build needs the imported
    // well-known types to decide which derives a message can have, and it maps them to
    // prost-types (its default extern path) instead of generating them.
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptor_set)?;
    Ok(())
}

/// Every `.proto` file in `directory`, sorted so the generated code does not depend on
/// the order the file system lists them in.
fn proto_files(directory: &Path) -> Result<Vec<PathBuf>, Box<dyn Error>> {
    let mut files = Vec::new();
    for entry in fs::read_dir(directory)? {
        let path = entry?.path();
        if path
            .extension()
            .is_some_and(|extension| extension == "proto")
        {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}
