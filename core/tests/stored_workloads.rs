//! A workload's stored form (`core/src/workload/stored.rs`) reads back as the workload
//! admission validated, for every example job of either kind, without parsing or
//! checking the spec again; and what is not a form of this version is refused, not
//! guessed.

use std::path::Path;

use carve_core::workload::{JobKind, STORED_FORM_VERSION, Workload};

/// Every example job file (`examples/*.toml`, `examples/command/*.toml`) as its workload.
fn example_workloads() -> Vec<(String, Workload)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut workloads = Vec::new();
    for directory in [root.clone(), root.join("command")] {
        for entry in std::fs::read_dir(&directory).unwrap() {
            let path = entry.unwrap().path();
            if path
                .extension()
                .is_some_and(|extension| extension == "toml")
            {
                let text = std::fs::read_to_string(&path).unwrap();
                let workload = Workload::from_toml(&text)
                    .unwrap_or_else(|error| panic!("{}: {error:?}", path.display()));
                workloads.push((path.display().to_string(), workload));
            }
        }
    }
    assert!(workloads.len() >= 10, "{} examples", workloads.len());
    assert!(workloads.iter().any(|(_, w)| w.kind() == JobKind::Command));
    workloads
}

#[test]
fn every_example_reads_back_from_its_stored_form_as_validated() {
    for (path, workload) in example_workloads() {
        let text = workload.to_stored_form();
        let read = Workload::from_stored_form(workload.kind(), &text)
            .unwrap_or_else(|error| panic!("{path}: {error:?}"))
            .unwrap_or_else(|| panic!("{path}: read as an older version"));
        assert_eq!(read, workload, "{path}");
        // Written again, the text is the same: one encoding per workload.
        assert_eq!(read.to_stored_form(), text, "{path}");
    }
}

#[test]
fn a_stored_form_of_another_kind_or_version_is_not_read_as_this_job() {
    let workloads = example_workloads();
    let (_, model) = workloads
        .iter()
        .find(|(_, w)| w.kind() == JobKind::Model)
        .unwrap();
    let text = model.to_stored_form();
    // Stored as a command job, a model's form is refused naming the kind.
    let error = Workload::from_stored_form(JobKind::Command, &text).unwrap_err();
    assert_eq!(error.field, "kind");
    // An older version is for the caller to read from the spec; a newer one is refused.
    let version = format!("\"version\":{STORED_FORM_VERSION}");
    let older = text.replace(&version, "\"version\":0");
    assert_eq!(Workload::from_stored_form(JobKind::Model, &older), Ok(None));
    let newer = text.replace(
        &version,
        &format!("\"version\":{}", STORED_FORM_VERSION + 1),
    );
    assert_eq!(
        Workload::from_stored_form(JobKind::Model, &newer)
            .unwrap_err()
            .field,
        "version"
    );
    // A graph whose layer kind or parameter name this build does not know is refused.
    for (from, to) in [
        ("\"kind_name\":\"conv2d\"", "\"kind_name\":\"conv9d\""),
        ("\"name\":\"kernel\"", "\"name\":\"kernal\""),
    ] {
        assert!(text.contains(from), "{from}");
        let error =
            Workload::from_stored_form(JobKind::Model, &text.replacen(from, to, 1)).unwrap_err();
        assert_eq!(error.field, "graph", "{from}");
    }
    for broken in ["", "{}", "[]", "{\"version\":1,\"kind\":\"model\"}"] {
        assert!(
            Workload::from_stored_form(JobKind::Model, broken).is_err(),
            "{broken:?}"
        );
    }
}
