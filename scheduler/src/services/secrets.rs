//! SecretService: a tenant's secrets (registry credentials a job's
//! `command.image_pull_secret` names). Values come in and never go out: every answer
//! shows names and times only. The scheduler authorizes (`scheduler/job_images.rs`).

use carve_proto::v1;
use carve_proto::v1::secret_service_server::SecretService;
use tonic::{Request, Response, Status};

use super::Services;
use crate::convert::timestamp;
use crate::store::SecretRecord;

fn secret_proto(secret: &SecretRecord) -> v1::Secret {
    v1::Secret {
        tenant: secret.tenant.clone(),
        name: secret.name.clone(),
        created_at: Some(timestamp(secret.created_at_ms)),
        updated_at: Some(timestamp(secret.updated_at_ms)),
    }
}

#[tonic::async_trait]
impl SecretService for Services {
    async fn create_secret(
        &self,
        request: Request<v1::CreateSecretRequest>,
    ) -> Result<Response<v1::CreateSecretResponse>, Status> {
        let caller = self.caller(&request).await?;
        let request = request.into_inner();
        let secret = self
            .scheduler
            .create_secret(
                &caller,
                &request.tenant,
                &request.name,
                &request.value,
                request.replace,
            )
            .await?;
        Ok(Response::new(v1::CreateSecretResponse {
            secret: Some(secret_proto(&secret)),
        }))
    }

    async fn list_secrets(
        &self,
        request: Request<v1::ListSecretsRequest>,
    ) -> Result<Response<v1::ListSecretsResponse>, Status> {
        let caller = self.caller(&request).await?;
        let request = request.into_inner();
        let secrets = self
            .scheduler
            .list_secrets(&caller, &request.tenant)
            .await?;
        Ok(Response::new(v1::ListSecretsResponse {
            secrets: secrets.iter().map(secret_proto).collect(),
        }))
    }

    async fn delete_secret(
        &self,
        request: Request<v1::DeleteSecretRequest>,
    ) -> Result<Response<v1::DeleteSecretResponse>, Status> {
        let caller = self.caller(&request).await?;
        let request = request.into_inner();
        self.scheduler
            .delete_secret(&caller, &request.tenant, &request.name)
            .await?;
        Ok(Response::new(v1::DeleteSecretResponse {}))
    }
}
