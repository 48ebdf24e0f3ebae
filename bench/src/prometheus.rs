//! Reading the scheduler's `/metrics` page: one plain HTTP GET, and the value of an
//! unlabelled sample in the text exposition format.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::BenchError;

/// The body of `GET /metrics` at `address`.
pub async fn scrape(address: SocketAddr) -> Result<String, BenchError> {
    let exchange = async {
        let mut stream = TcpStream::connect(address).await?;
        stream
            .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await?;
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await?;
        Ok::<_, std::io::Error>(response)
    };
    let response = tokio::time::timeout(Duration::from_secs(60), exchange)
        .await
        .map_err(|_| BenchError::Scheduler(format!("GET http://{address}/metrics timed out")))?
        .map_err(|error| BenchError::Scheduler(format!("GET http://{address}/metrics: {error}")))?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text.split_once("\r\n\r\n").ok_or_else(|| {
        BenchError::Scheduler(format!("GET http://{address}/metrics: no HTTP response"))
    })?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(BenchError::Scheduler(format!(
            "GET http://{address}/metrics: {}",
            head.lines().next().unwrap_or_default()
        )));
    }
    Ok(body.to_string())
}

/// The value of the sample `name` (exactly, without labels) in `text`.
pub fn sample_value(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|line| {
        let value = line.strip_prefix(name)?.strip_prefix(' ')?;
        value.trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_found_by_exact_name() {
        let text = "# HELP carve_submit_groups_committed_total x\n\
                    # TYPE carve_submit_groups_committed_total counter\n\
                    carve_submit_groups_committed_total 12\n\
                    carve_submit_jobs_committed_total 3400\n\
                    carve_queued_jobs{tenant=\"default\"} 5\n";
        assert_eq!(
            sample_value(text, "carve_submit_groups_committed_total"),
            Some(12.0)
        );
        assert_eq!(
            sample_value(text, "carve_submit_jobs_committed_total"),
            Some(3400.0)
        );
        assert_eq!(sample_value(text, "carve_submit_jobs"), None);
        assert_eq!(sample_value(text, "carve_queued_jobs"), None);
    }
}
