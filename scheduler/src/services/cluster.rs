//! ClusterService (workers, drains, slices) and WorkerService (registration and the
//! session stream workers hold).

use carve_proto::ApiError;
use carve_proto::v1;
use carve_proto::v1::cluster_service_server::ClusterService;
use carve_proto::v1::worker_service_server::WorkerService;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::{SchedulerMessageStream, Services, invalid};
use crate::auth::Caller;
use crate::convert::{
    attempt_ref_from_proto, registered_to_proto, registration_from_proto, slice_to_proto,
    usage_answer_to_proto, usage_request_from_proto, worker_command_to_proto, worker_to_proto,
};
use crate::scheduler::worker_reports::AttemptRef;

impl Services {
    /// Drain and undrain: admins only; answers with the worker as it is now.
    async fn set_draining(
        &self,
        caller: &Caller,
        reference: &str,
        draining: bool,
        reason: &str,
    ) -> Result<Option<v1::Worker>, Status> {
        let worker_id = self
            .scheduler
            .set_draining(caller, reference, draining, reason)
            .await?;
        Ok(self
            .scheduler
            .workers()
            .iter()
            .map(worker_to_proto)
            .find(|worker| worker.id == worker_id))
    }
}

#[tonic::async_trait]
impl ClusterService for Services {
    async fn list_workers(
        &self,
        request: Request<v1::ListWorkersRequest>,
    ) -> Result<Response<v1::ListWorkersResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let states = request.into_inner().states;
        let workers = self
            .scheduler
            .workers_seen_by(&caller)
            .iter()
            .map(worker_to_proto)
            .filter(|worker| states.is_empty() || states.contains(&worker.state))
            .collect();
        Ok(Response::new(v1::ListWorkersResponse { workers }))
    }

    async fn get_worker(
        &self,
        request: Request<v1::GetWorkerRequest>,
    ) -> Result<Response<v1::GetWorkerResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let worker_id = request.into_inner().worker_id;
        let worker = self
            .scheduler
            .workers_seen_by(&caller)
            .iter()
            .map(worker_to_proto)
            .find(|worker| worker.id == worker_id)
            .ok_or_else(|| {
                Status::from(ApiError::NotFound {
                    what: "worker",
                    id: worker_id,
                })
            })?;
        Ok(Response::new(v1::GetWorkerResponse {
            worker: Some(worker),
        }))
    }

    async fn drain_worker(
        &self,
        request: Request<v1::DrainWorkerRequest>,
    ) -> Result<Response<v1::DrainWorkerResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let request = request.into_inner();
        let worker = self
            .set_draining(&caller, &request.worker_id, true, &request.reason)
            .await?;
        Ok(Response::new(v1::DrainWorkerResponse { worker }))
    }

    async fn undrain_worker(
        &self,
        request: Request<v1::UndrainWorkerRequest>,
    ) -> Result<Response<v1::UndrainWorkerResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let worker = self
            .set_draining(&caller, &request.into_inner().worker_id, false, "")
            .await?;
        Ok(Response::new(v1::UndrainWorkerResponse { worker }))
    }

    async fn remove_worker(
        &self,
        request: Request<v1::RemoveWorkerRequest>,
    ) -> Result<Response<v1::RemoveWorkerResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let removed = self
            .scheduler
            .remove_worker(&caller, &request.into_inner().worker_id)
            .await?;
        Ok(Response::new(v1::RemoveWorkerResponse {
            worker: Some(worker_to_proto(&removed)),
        }))
    }

    async fn get_usage(
        &self,
        request: Request<v1::GetUsageRequest>,
    ) -> Result<Response<v1::GetUsageResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Read from the store alone: a standby answers as the leader would.
        let usage_request = usage_request_from_proto(request.into_inner())?;
        let answer = self.scheduler.usage(&caller, &usage_request).await?;
        Ok(Response::new(usage_answer_to_proto(&answer)))
    }

    async fn list_slices(
        &self,
        request: Request<v1::ListSlicesRequest>,
    ) -> Result<Response<v1::ListSlicesResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let request = request.into_inner();
        let slices = self
            .scheduler
            // The same rule as the worker views: only admins see other tenants' jobs (a
            // worker token included: a worker process never needs this list).
            .slices_seen_by(&caller)
            .iter()
            .map(slice_to_proto)
            .filter(|slice| request.worker_id.is_empty() || slice.worker_id == request.worker_id)
            .filter(|slice| request.gpu_uuid.is_empty() || slice.gpu_uuid == request.gpu_uuid)
            .filter(|slice| request.job_id.is_empty() || slice.job_id == request.job_id)
            .collect();
        Ok(Response::new(v1::ListSlicesResponse { slices }))
    }
}

#[tonic::async_trait]
impl WorkerService for Services {
    async fn register(
        &self,
        request: Request<v1::RegisterWorkerRequest>,
    ) -> Result<Response<v1::RegisterWorkerResponse>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        let registered = self
            .scheduler
            .register_worker(&caller, registration_from_proto(request.into_inner()))
            .await?;
        Ok(Response::new(registered_to_proto(registered)))
    }

    type SessionStream = SchedulerMessageStream;

    async fn session(
        &self,
        request: Request<Streaming<v1::WorkerMessage>>,
    ) -> Result<Response<Self::SessionStream>, Status> {
        let caller = self.caller(&request).await?;
        // Live state (sessions, running attempts, events) is the leader's alone.
        self.scheduler.require_leader()?;
        self.scheduler.may_hold_sessions(&caller)?;
        let mut incoming = request.into_inner();
        // A worker says hello as soon as the stream is open; one that does not within
        // the lease would hold a stream, and a handler, open for ever.
        let lease = self.scheduler.settings.lease_duration;
        let first = tokio::time::timeout(lease, incoming.next())
            .await
            .map_err(|_| {
                invalid(
                    "body.hello",
                    format!("a session starts with hello, and none came within {lease:?}"),
                )
            })?
            .ok_or_else(|| invalid("body.hello", "a session starts with hello"))??;
        let hello = match first.body {
            Some(v1::worker_message::Body::Hello(hello)) => hello,
            _ => return Err(invalid("body.hello", "a session starts with hello")),
        };
        let running_attempts: Vec<AttemptRef> = hello
            .running_attempts
            .into_iter()
            .map(|attempt| attempt_ref_from_proto(Some(attempt)))
            .collect();
        let (sender, receiver) = mpsc::channel(1024);
        let session = self
            .scheduler
            .open_session(&caller, &hello.worker_id, &running_attempts, sender.clone())
            .await?;
        let commands =
            ReceiverStream::new(receiver).map(|command| command.map(worker_command_to_proto));
        super::worker_session::serve_session(
            self.scheduler.clone(),
            hello.worker_id,
            session,
            incoming,
            sender,
        );
        Ok(Response::new(Box::pin(commands)))
    }
}
