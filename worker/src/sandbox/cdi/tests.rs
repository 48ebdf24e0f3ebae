//! CDI specs as fixtures: the toolkit's usual YAML, JSON, a later directory winning, and
//! hostile or odd specs (a host file as a device, `..`, a link, a missing node, a node at
//! another host path, a mount elsewhere, hooks). `/dev/null` and `/dev/zero` stand in
//! for the GPU's nodes: character devices every host has.

use super::*;

const UUID: &str = "GPU-0a1b2c3d-0000-4000-8000-000000000001";

/// The shape `nvidia-ctk cdi generate` writes, trimmed.
fn toolkit_yaml(gpu_node: &str) -> String {
    format!(
        r#"---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: {gpu_node}
- name: {UUID}
  containerEdits:
    deviceNodes:
    - path: {gpu_node}
- name: "1"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia1-not-here
- name: all
  containerEdits:
    deviceNodes:
    - path: {gpu_node}
containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  deviceNodes:
  - path: /dev/zero
  hooks:
  - hookName: createContainer
    path: /usr/bin/nvidia-ctk
    args: [nvidia-ctk, hook, update-ldcache]
  mounts:
  - hostPath: /usr/lib
    containerPath: /usr/lib
    options: [ro, nosuid, nodev, bind]
  - hostPath: /usr/bin
    containerPath: /elsewhere/bin
    options: [ro, bind]
"#
    )
}

fn directory_with(files: &[(&str, &str)]) -> tempfile::TempDir {
    let directory = tempfile::tempdir().unwrap();
    for (name, text) in files {
        std::fs::write(directory.path().join(name), text).unwrap();
    }
    directory
}

fn lookup(directories: &[&tempfile::TempDir], index: u32, uuid: &str) -> Result<CdiLookup, String> {
    let paths: Vec<PathBuf> = directories
        .iter()
        .map(|directory| directory.path().to_path_buf())
        .collect();
    find_gpu(&paths, index, uuid).map_err(|error| error.to_string())
}

#[test]
fn the_toolkits_yaml_gives_the_gpus_nodes_mounts_and_env_and_says_what_it_leaves_out() {
    let directory = directory_with(&[("nvidia.yaml", &toolkit_yaml("/dev/null"))]);
    let gpu = lookup(&[&directory], 0, UUID)
        .unwrap()
        .gpu
        .expect("gpu 0 is named");
    assert_eq!(gpu.spec_file, directory.path().join("nvidia.yaml"));
    // By index and by uuid: one node once, then the common ones; never `all`'s alone.
    assert_eq!(
        gpu.device_nodes,
        vec![PathBuf::from("/dev/null"), PathBuf::from("/dev/zero")]
    );
    assert_eq!(gpu.read_only_paths, vec![PathBuf::from("/usr/lib")]);
    assert_eq!(
        gpu.environment,
        vec![("NVIDIA_VISIBLE_DEVICES".to_string(), "void".to_string())]
    );
    assert_eq!(gpu.left_out.len(), 2, "{:?}", gpu.left_out);
    assert!(
        gpu.left_out[0].contains("/elsewhere/bin"),
        "{:?}",
        gpu.left_out
    );
    assert!(
        gpu.left_out[1].starts_with("1 hook(s)"),
        "{:?}",
        gpu.left_out
    );
}

#[test]
fn a_gpu_is_found_by_its_uuid_or_its_type_index_name_and_no_spec_means_none() {
    let by_uuid = toolkit_yaml("/dev/null").replace("name: \"0\"", "name: \"9\"");
    let directory = directory_with(&[("nvidia.yaml", &by_uuid)]);
    let gpu = lookup(&[&directory], 0, UUID).unwrap().gpu.unwrap();
    assert_eq!(gpu.device_nodes[0], PathBuf::from("/dev/null"));
    // Another GPU (index 3, another uuid) is not in the spec: the built-in list then.
    assert_eq!(lookup(&[&directory], 3, "GPU-other").unwrap().gpu, None);

    let type_index = r#"{"cdiVersion": "0.6.0", "kind": "nvidia.com/gpu",
        "devices": [{"name": "gpu2", "containerEdits": {"deviceNodes": [{"path": "/dev/null"}]}}]}"#;
    let directory = directory_with(&[("nvidia.json", type_index)]);
    let gpu = lookup(&[&directory], 2, "").unwrap().gpu.unwrap();
    assert_eq!(gpu.device_nodes, vec![PathBuf::from("/dev/null")]);

    let empty = tempfile::tempdir().unwrap();
    assert_eq!(lookup(&[&empty], 0, UUID).unwrap(), CdiLookup::default());
    let missing = PathBuf::from("/nonexistent/cdi");
    assert_eq!(find_gpu(&[missing], 0, UUID).unwrap(), CdiLookup::default());
}

#[test]
fn the_later_directory_wins_and_other_kinds_and_broken_files_are_skipped() {
    let etc = directory_with(&[("nvidia.yaml", &toolkit_yaml("/dev/null"))]);
    let run = directory_with(&[
        ("nvidia.json", &toolkit_yaml("/dev/zero")),
        (
            "intel.yaml",
            "cdiVersion: 0.5.0\nkind: intel.com/gpu\ndevices:\n- name: \"0\"\n  containerEdits:\n    deviceNodes:\n    - path: /dev/null\n",
        ),
        ("broken.yaml", "kind: [unclosed"),
        ("notes.txt", "not a spec: not read"),
    ]);
    let found = lookup(&[&etc, &run], 0, UUID).unwrap();
    let gpu = found.gpu.unwrap();
    assert_eq!(gpu.spec_file, run.path().join("nvidia.json"));
    assert_eq!(gpu.device_nodes, vec![PathBuf::from("/dev/zero")]);
    assert_eq!(found.skipped_files.len(), 1, "{:?}", found.skipped_files);
    assert!(found.skipped_files[0].contains("broken.yaml"));
}

/// Every way a spec could hand a container something that is not the GPU's device:
/// each refuses the spec, naming why, so nothing of it reaches a container.
#[test]
fn a_hostile_or_odd_spec_is_refused_with_its_reason() {
    let link = tempfile::tempdir().unwrap();
    let cases = [
        ("/etc/shadow", "not a plain path under /dev"),
        ("/dev/../etc/shadow", "not a plain path under /dev"),
        ("dev/null", "not a plain path under /dev"),
        ("/dev", "not a plain path under /dev"),
        ("/dev/nvidia-not-on-this-host", "missing here"),
        // /dev/stdin is a link (to /proc/self/fd/0): never followed.
        ("/dev/stdin", "not a character device"),
        ("/dev/shm", "not a character device"),
    ];
    for (node, reason) in cases {
        let spec = toolkit_yaml(node);
        let directory = directory_with(&[("nvidia.yaml", &spec)]);
        let refused = lookup(&[&directory], 0, UUID).expect_err(node);
        assert!(refused.contains(reason), "{node}: {refused}");
        assert!(refused.contains("nvidia.yaml"), "{refused}");
    }
    // A node brought in from another host path.
    let moved = r#"{"kind": "nvidia.com/gpu", "devices": [{"name": "0", "containerEdits":
        {"deviceNodes": [{"path": "/dev/null", "hostPath": "/dev/sda"}]}}]}"#;
    let directory = directory_with(&[("moved.json", moved)]);
    let refused = lookup(&[&directory], 0, UUID).unwrap_err();
    assert!(refused.contains("another host path"), "{refused}");
    // A device with no node at all.
    let empty = r#"{"kind": "nvidia.com/gpu", "devices": [{"name": "0"}]}"#;
    let directory = directory_with(&[("empty.json", empty)]);
    let refused = lookup(&[&directory], 0, UUID).unwrap_err();
    assert!(refused.contains("no device node"), "{refused}");
    // A link in /dev of the test's own making is no device either.
    std::os::unix::fs::symlink("/dev/null", link.path().join("nvidia0")).unwrap();
    let node = DeviceNode {
        path: "/dev/null".into(),
        host_path: Some(link.path().join("nvidia0").display().to_string()),
        other: BTreeMap::new(),
    };
    assert!(device_node(&node).is_err());
}

#[test]
fn mounts_of_relative_or_dotted_paths_and_bad_env_lines_are_left_out() {
    let spec = r#"{"kind": "nvidia.com/gpu", "devices": [{"name": "0", "containerEdits": {
        "deviceNodes": [{"path": "/dev/null"}],
        "mounts": [{"hostPath": "usr/lib", "containerPath": "usr/lib"},
                   {"hostPath": "/usr/../etc", "containerPath": "/usr/../etc"}],
        "env": ["=x", "NOEQUALS", "GOOD=1"],
        "additionalGIDs": [44]}}]}"#;
    let directory = directory_with(&[("odd.json", spec)]);
    let gpu = lookup(&[&directory], 0, UUID).unwrap().gpu.unwrap();
    assert!(gpu.read_only_paths.is_empty());
    assert_eq!(gpu.environment, vec![("GOOD".into(), "1".into())]);
    assert_eq!(gpu.left_out.len(), 5, "{:?}", gpu.left_out);
}

#[test]
fn a_spec_too_large_or_not_a_file_is_skipped() {
    let directory = tempfile::tempdir().unwrap();
    std::fs::create_dir(directory.path().join("folder.yaml")).unwrap();
    let large = std::fs::File::create(directory.path().join("large.json")).unwrap();
    large.set_len(LARGEST_SPEC_BYTES + 1).unwrap();
    let found = lookup(&[&directory], 0, UUID).unwrap();
    assert_eq!(found.gpu, None);
    assert_eq!(found.skipped_files.len(), 2, "{:?}", found.skipped_files);
}

/// What the worker gives a GPU's container: the spec's nodes and mounts where a spec
/// names the GPU, and the built-in list (only nodes this host has) where none does or
/// the one that does is refused.
#[test]
fn a_gpus_devices_come_from_its_spec_else_from_the_built_in_list() {
    use crate::sandbox::{GpuDevices, gpu_device_nodes, gpu_devices};
    let directory = directory_with(&[("nvidia.yaml", &toolkit_yaml("/dev/null"))]);
    let from_spec = gpu_devices(&[directory.path().to_path_buf()], 0, UUID);
    assert_eq!(
        from_spec,
        GpuDevices {
            nodes: vec![PathBuf::from("/dev/null"), PathBuf::from("/dev/zero")],
            read_only_paths: vec![PathBuf::from("/usr/lib")],
        }
    );
    let built_in = GpuDevices {
        nodes: gpu_device_nodes(3),
        read_only_paths: Vec::new(),
    };
    assert_eq!(
        gpu_devices(&[directory.path().to_path_buf()], 3, "GPU-x"),
        built_in
    );
    let hostile = directory_with(&[("nvidia.yaml", &toolkit_yaml("/etc/shadow"))]);
    let refused = gpu_devices(&[hostile.path().to_path_buf()], 3, UUID);
    assert_eq!(refused, built_in);
    assert!(!refused.nodes.contains(&PathBuf::from("/etc/shadow")));
}
