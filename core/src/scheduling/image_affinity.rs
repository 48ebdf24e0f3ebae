//! Placement's preference for workers that already hold a job's image (issue 30).
//!
//! Best fit (rule 3 of the module docs) often ties: on an idle cluster of one GPU model
//! every GPU has the same free bytes. Such a tie used to fall to the GPU whose id sorts
//! first; with [`CachedImages`] it falls first to a GPU whose worker reported the job's
//! image (its manifest digest) in its cache, so a retried attempt, or a job whose image
//! a node pulled for another, starts without pulling again. The preference never
//! changes which free bytes best fit picks, so packing, quotas, reservations and the
//! decision's independence of input order are what they were; with nothing cached (or
//! a job whose image no worker holds) the decision is exactly the one without it.

use std::collections::{BTreeMap, BTreeSet};

/// Which job runs which image and which worker's cache holds which images, by manifest
/// digest: what the scheduler passes in from the jobs' recorded digests and the
/// workers' heartbeats.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CachedImages {
    job_images: BTreeMap<String, String>,
    worker_images: BTreeMap<String, BTreeSet<String>>,
}

impl CachedImages {
    /// `job_id` runs the image with this manifest digest.
    pub fn add_job_image(&mut self, job_id: impl Into<String>, digest: impl Into<String>) {
        self.job_images.insert(job_id.into(), digest.into());
    }

    /// `worker_id`'s cache holds these images.
    pub fn add_worker_images<D: Into<String>>(
        &mut self,
        worker_id: impl Into<String>,
        digests: impl IntoIterator<Item = D>,
    ) {
        self.worker_images
            .entry(worker_id.into())
            .or_default()
            .extend(digests.into_iter().map(Into::into));
    }

    /// The image `job_id` runs, if known.
    pub fn job_image(&self, job_id: &str) -> Option<&str> {
        self.job_images.get(job_id).map(String::as_str)
    }

    /// Whether `worker_id` reported `digest` in its cache.
    pub fn worker_holds(&self, worker_id: &str, digest: &str) -> bool {
        self.worker_images
            .get(worker_id)
            .is_some_and(|digests| digests.contains(digest))
    }
}

/// The GPU a job goes to among GPUs that tie on best fit (`ties`: GPU index and its
/// worker, in the pool's order): the first whose worker holds the job's image
/// (`image`, `None` when unknown), else the first of all. `None` only for no ties.
pub fn break_best_fit_tie<'a>(
    mut ties: impl Iterator<Item = (usize, &'a str)>,
    image: Option<&str>,
    images: &CachedImages,
) -> Option<usize> {
    let (first, first_worker) = ties.next()?;
    let Some(image) = image else {
        return Some(first);
    };
    if images.worker_holds(first_worker, image) {
        return Some(first);
    }
    Some(
        ties.find(|(_, worker)| images.worker_holds(worker, image))
            .map_or(first, |(index, _)| index),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const IMAGE: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";

    #[test]
    fn a_tie_goes_to_the_worker_that_holds_the_image() {
        let mut images = CachedImages::default();
        images.add_job_image("job-1", IMAGE);
        images.add_worker_images("node-b", [IMAGE]);
        let ties = [(0, "node-a"), (1, "node-b"), (2, "node-c")];
        let image = images.job_image("job-1");
        assert_eq!(
            break_best_fit_tie(ties.into_iter(), image, &images),
            Some(1)
        );
    }

    #[test]
    fn solve_places_a_job_on_the_idle_gpu_whose_worker_holds_its_image() {
        use crate::scheduling::{
            GpuState, PendingJob, SchedulingOptions, SchedulingProblem, TenantState,
            solve_with_cached_images, solve_with_options,
        };
        let gpu = |gpu_id: &str, worker_id: &str| GpuState {
            gpu_id: gpu_id.into(),
            worker_id: worker_id.into(),
            total_bytes: 80 << 30,
            context_bytes: 0,
            allocated_bytes: 0,
            schedulable: true,
        };
        let problem = SchedulingProblem {
            gpus: vec![gpu("gpu-a", "node-a"), gpu("gpu-b", "node-b")],
            tenants: vec![TenantState {
                tenant: "team".into(),
                weight: 1,
                vram_quota_bytes: None,
                running_jobs_quota: None,
                vram_in_use_bytes: 0,
                running_jobs: 0,
                decayed_usage_byte_seconds: 0,
            }],
            pending: vec![PendingJob {
                job_id: "job-1".into(),
                tenant: "team".into(),
                priority: 0,
                submit_sequence: 1,
                slice_bytes: 8 << 30,
            }],
        };
        let options = SchedulingOptions::default();
        let placed_on = |images: &CachedImages| {
            solve_with_cached_images(&problem, &options, images).placements[0]
                .gpu_id
                .clone()
        };
        // Without anything cached the tie falls to the id that sorts first, as before.
        assert_eq!(placed_on(&CachedImages::default()), "gpu-a");
        assert_eq!(
            solve_with_options(&problem, &options).placements[0].gpu_id,
            "gpu-a"
        );
        let mut images = CachedImages::default();
        images.add_job_image("job-1", IMAGE);
        images.add_worker_images("node-b", [IMAGE]);
        assert_eq!(placed_on(&images), "gpu-b");
        // Best fit still comes first: a fuller GPU that holds the job wins only on a tie.
        let mut fuller = problem.clone();
        fuller.gpus[0].allocated_bytes = 4 << 30;
        let decision = solve_with_cached_images(&fuller, &options, &images);
        assert_eq!(decision.placements[0].gpu_id, "gpu-a");
    }

    #[test]
    fn without_a_holder_or_an_image_the_first_of_the_tie_is_kept() {
        let mut images = CachedImages::default();
        images.add_worker_images("node-b", ["sha256:other"]);
        let ties = [(0, "node-a"), (1, "node-b")];
        assert_eq!(
            break_best_fit_tie(ties.into_iter(), Some(IMAGE), &images),
            Some(0)
        );
        assert_eq!(break_best_fit_tie(ties.into_iter(), None, &images), Some(0));
        assert_eq!(
            break_best_fit_tie(std::iter::empty(), Some(IMAGE), &images),
            None
        );
    }
}
