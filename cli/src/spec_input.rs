//! Where a command's job spec comes from: the file it names, or stdin when that name is
//! `-` (`generate-spec | carve submit -`). Shared by estimate, run and submit so the three
//! read, name and resolve a spec the same way: relative data paths mean the job file's
//! folder (the current one for stdin), read there by `run` and made absolute by `submit`.

use std::io::Read as _;
use std::path::Path;

use carve_core::validate::ValidatedJob;
use carve_core::workload::{JobKind, SpecFormat};

fn is_stdin(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// The spec's text: the file at `path`, or all of stdin for `-`.
pub fn read_job_spec_text(path: &Path) -> std::io::Result<String> {
    if is_stdin(path) {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text)?;
        Ok(text)
    } else {
        std::fs::read_to_string(path)
    }
}

/// How messages name the spec: its path, or `<stdin>`.
pub fn job_spec_name(path: &Path) -> String {
    if is_stdin(path) {
        "<stdin>".to_string()
    } else {
        path.display().to_string()
    }
}

/// The folder relative data paths resolve against: the spec file's, or the current one
/// for a spec from stdin (it has no folder of its own).
pub fn data_base_directory(path: &Path) -> &Path {
    if is_stdin(path) {
        return Path::new(".");
    }
    path.parent()
        .filter(|parent| !parent.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Makes the relative data paths of a spec document (every path under `data.train` and
/// `data.test`) absolute against `base`, for a job that a worker runs in a directory of
/// its own: `carve submit` sends paths that mean what they meant beside the job file, as
/// `carve run` reads them. A path that is not UTF-8 once joined is an error naming it.
pub fn make_data_paths_absolute(document: &mut toml::Table, base: &Path) -> Result<(), String> {
    let Some(toml::Value::Table(data)) = document.get_mut("data") else {
        return Ok(());
    };
    for split in ["train", "test"] {
        let Some(toml::Value::Table(files)) = data.get_mut(split) else {
            continue;
        };
        for (field, value) in files.iter_mut() {
            let paths: Vec<&mut String> = match value {
                toml::Value::String(path) => vec![path],
                toml::Value::Array(paths) => paths
                    .iter_mut()
                    .filter_map(|path| match path {
                        toml::Value::String(path) => Some(path),
                        _ => None,
                    })
                    .collect(),
                // Not a path: validation names it.
                _ => Vec::new(),
            };
            for path in paths {
                if path.is_empty() || Path::new(path.as_str()).is_absolute() {
                    continue;
                }
                let absolute = std::path::absolute(base.join(path.as_str()))
                    .map_err(|error| format!("data.{split}.{field}: {error}"))?;
                *path = absolute
                    .to_str()
                    .ok_or_else(|| {
                        format!("data.{split}.{field}: {} is not UTF-8", absolute.display())
                    })?
                    .to_string();
            }
        }
    }
    Ok(())
}

/// Refuses a job whose memory is measured by running it (a command job: a TOML spec with
/// a `[command]` table, as core's `JobKind::of_spec_text` reads it) where only a job the
/// estimator sizes makes sense: `carve estimate` and `carve run`.
pub fn refuse_command_job(text: &str, spec_name: &str) -> Result<(), String> {
    if JobKind::of_spec_text(text, SpecFormat::Toml).memory_is_measured() {
        return Err(format!(
            "{spec_name} {}",
            carve_proto::convert::COMMAND_JOB_HAS_NO_ESTIMATE
        ));
    }
    Ok(())
}

/// Gives a command job (a spec with a `[command]` table) an absolute working directory:
/// a relative one is made absolute against `base` (the job file's folder), and none
/// means `base` itself, so `argv = ["python3", "train.py"]` runs the script beside the
/// job file. The worker runs the program there; on a cluster, that folder must be on a
/// file system the workers share.
pub fn make_command_directory_absolute(
    document: &mut toml::Table,
    base: &Path,
) -> Result<(), String> {
    let Some(toml::Value::Table(command)) = document.get_mut("command") else {
        return Ok(());
    };
    let directory = match command.get("working_directory") {
        Some(toml::Value::String(directory)) if Path::new(directory).is_absolute() => {
            return Ok(());
        }
        Some(toml::Value::String(directory)) => base.join(directory),
        // Not a string: validation names it.
        Some(_) => return Ok(()),
        None => base.to_path_buf(),
    };
    let absolute = std::path::absolute(&directory)
        .map_err(|error| format!("command.working_directory: {error}"))?;
    let text = absolute.to_str().ok_or_else(|| {
        format!(
            "command.working_directory: {} is not UTF-8",
            absolute.display()
        )
    })?;
    command.insert("working_directory".into(), toml::Value::String(text.into()));
    Ok(())
}

/// Shows a validated spec's warnings on stderr, named as its errors are; the job goes on.
pub fn print_job_spec_warnings(job: &ValidatedJob, spec_name: &str) {
    for warning in job.warnings() {
        eprintln!("{spec_name}: warning: {warning}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_data_paths_become_absolute_against_the_base_and_others_stay() {
        let mut document: toml::Table = toml::from_str(
            "name = \"x\"\n[data]\nformat = \"cifar10\"\n\
             train = { files = [\"batches/one.bin\", \"/srv/two.bin\"] }\n\
             test = { images = \"../t10k\", labels = \"/srv/labels\" }\n",
        )
        .unwrap();
        make_data_paths_absolute(&mut document, Path::new("/jobs/mnist")).unwrap();
        let data = &document["data"];
        assert_eq!(
            data["train"]["files"],
            toml::Value::Array(vec![
                "/jobs/mnist/batches/one.bin".into(),
                "/srv/two.bin".into()
            ])
        );
        assert_eq!(data["test"]["images"].as_str(), Some("/jobs/mnist/../t10k"));
        assert_eq!(data["test"]["labels"].as_str(), Some("/srv/labels"));
        assert_eq!(data["format"].as_str(), Some("cifar10"));
        // A relative base is taken from the current directory.
        make_data_paths_absolute(&mut document, Path::new(".")).unwrap();
        assert_eq!(data_base_directory(Path::new("-")), Path::new("."));
        assert_eq!(data_base_directory(Path::new("job.toml")), Path::new("."));
        assert_eq!(data_base_directory(Path::new("a/job.toml")), Path::new("a"));
    }

    #[test]
    fn a_command_runs_beside_its_job_file_unless_it_says_where() {
        let mut document: toml::Table =
            toml::from_str("name = \"x\"\n[command]\nargv = [\"python3\", \"t.py\"]\n").unwrap();
        make_command_directory_absolute(&mut document, Path::new("/jobs/cnn")).unwrap();
        assert_eq!(
            document["command"]["working_directory"].as_str(),
            Some("/jobs/cnn")
        );
        let mut relative: toml::Table =
            toml::from_str("[command]\nworking_directory = \"src\"\n").unwrap();
        make_command_directory_absolute(&mut relative, Path::new("/jobs/cnn")).unwrap();
        assert_eq!(
            relative["command"]["working_directory"].as_str(),
            Some("/jobs/cnn/src")
        );
        let mut absolute: toml::Table =
            toml::from_str("[command]\nworking_directory = \"/srv\"\n").unwrap();
        make_command_directory_absolute(&mut absolute, Path::new("/jobs")).unwrap();
        assert_eq!(
            absolute["command"]["working_directory"].as_str(),
            Some("/srv")
        );
        // A model job has no command to place.
        let mut model: toml::Table = toml::from_str("name = \"m\"\n").unwrap();
        make_command_directory_absolute(&mut model, Path::new("/jobs")).unwrap();
        assert!(!model.contains_key("command"));
    }

    #[test]
    fn estimate_and_run_refuse_a_command_job_by_core_s_reading_of_its_kind() {
        let refused = refuse_command_job("name = \"x\"\n[command]\nargv = [\"t\"]\n", "job.toml")
            .unwrap_err();
        assert!(
            refused.starts_with("job.toml is a command job"),
            "{refused}"
        );
        assert!(refuse_command_job("name = \"m\"\n[model]\nloss = \"mse\"\n", "m.toml").is_ok());
        // Not TOML: left to the parser, which names the error.
        assert!(refuse_command_job("name = [", "bad.toml").is_ok());
    }
}
