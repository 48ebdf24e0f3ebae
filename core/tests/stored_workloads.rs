//! A workload's stored form (`core/src/workload/stored.rs`) reads back as the workload
//! admission validated, for every example job of either kind, without parsing or
//! checking the spec again; and what is not a form of this version is refused, not
//! guessed.

use std::path::Path;

use carve_core::spec::GangPlacementPolicy;
use carve_core::workload::{
    JobKind, OLDEST_READ_STORED_FORM_VERSION, STORED_FORM_VERSION, Workload,
};

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
    // A job of one slice is written with the oldest version that holds it.
    let version = format!("\"version\":{OLDEST_READ_STORED_FORM_VERSION}");
    assert!(text.contains(&version), "{text}");
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

/// A gang's members and placement survive the stored form, which is then version 2: a
/// build from before gangs (which reads only version 1) refuses it as newer instead of
/// running the gang as one slice. A one-slice command job's form stays version 1.
#[test]
fn a_gang_is_stored_as_version_2_and_reads_back_with_its_members_and_placement() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/command");
    let (path, text) = std::fs::read_dir(&root)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.extension()
                .is_some_and(|extension| extension == "toml")
        })
        .map(|path| {
            let text = std::fs::read_to_string(&path).unwrap();
            (path, text)
        })
        .find(|(_, text)| text.contains("[resources]") && !text.contains("gpus"))
        .expect("a command example with [resources]");
    let single = Workload::from_toml(&text).unwrap();
    assert!(
        single
            .to_stored_form()
            .contains(&format!("\"version\":{OLDEST_READ_STORED_FORM_VERSION}")),
        "{}",
        path.display()
    );
    let gang_text = text.replacen(
        "[resources]",
        "[resources]\ngpus = 4\nplacement = \"spread\"",
        1,
    );
    let gang = Workload::from_toml(&gang_text).unwrap();
    assert_eq!(gang.resources().gpus, 4);
    assert_eq!(gang.resources().placement, GangPlacementPolicy::Spread);
    let stored = gang.to_stored_form();
    assert!(
        stored.contains(&format!("\"version\":{STORED_FORM_VERSION}")),
        "{stored}"
    );
    assert_eq!(STORED_FORM_VERSION, 2);
    let read = Workload::from_stored_form(JobKind::Command, &stored)
        .unwrap()
        .expect("this build reads version 2");
    assert_eq!(read, gang);
    // A form of version 1 holding a gang (what no build writes) would be read as one by
    // this build too; the version is what keeps an older build from misreading it.
    let as_version_1 = stored.replace("\"version\":2", "\"version\":1");
    assert_eq!(
        Workload::from_stored_form(JobKind::Command, &as_version_1)
            .unwrap()
            .map(|workload| workload.resources().gpus),
        Some(4)
    );
}
