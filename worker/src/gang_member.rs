//! One member of a gang (issue 31) on this worker: a command job asked for several GPUs,
//! and the scheduler placed one process per slice, all at once. A member runs as any
//! command attempt does (its own slice, guard, directories and container); what this
//! module adds is its place in the gang ([`GangMemberLaunch`]): the `torch.distributed`
//! variables and placeholders (rendered in core, `carve_core::command::render`), the
//! master's port, the rendezvous deadline, and its network.
//!
//! The master port. A gang on one node gets `master_port = 0` from the scheduler: its
//! worker picks a free port itself (binds `127.0.0.1:0` and releases it, as `torchrun
//! --standalone` does) and gives the same port to every member of that gang it runs
//! ([`GangPorts`]). A gang over several nodes cannot wait for rank 0's worker to pick one
//! (its members start at once, on other nodes), so the scheduler names a port from the
//! rank-0 worker's `--gang-ports` range (reported at registration) that no other gang
//! led by that worker holds; rank 0's worker binds it once before the program starts and
//! ends the member `INTERRUPTED` (retried, with another port) when something else on
//! the node holds it. Between that check and the program's own bind another process
//! could take the port: the program then fails to listen, the gang's other members miss
//! their rendezvous, and the gang is retried, as with torchrun.
//!
//! The rendezvous. A member whose peers never come must not hold its slice forever: the
//! program gets `CARVE_RENDEZVOUS_TIMEOUT_SECONDS` (the assignment's, else
//! [`DEFAULT_RENDEZVOUS_TIMEOUT`]) and is expected to fail with a message naming the
//! missing ranks when it passes, as `torch.distributed.init_process_group(timeout=...)`
//! does (`examples/command/gang_data_parallel.py` is the stand-in that does). The worker
//! cannot see a rendezvous inside a program, so this deadline is the program's to keep;
//! the worker's own `max_duration` still bounds a program that ignores it.
//!
//! The network. An attempt's container has its own network namespace with only
//! loopback, where no other process can reach it. Members of a gang must reach rank 0:
//! on other nodes through the node's address, and on one node across their own
//! containers. So a contained member shares the node's network namespace
//! ([`crate::sandbox::Sandbox::share_host_network`]). The trade-off: such a member can
//! reach what the node can (other hosts, services listening on the node, the scheduler's
//! port), and whatever else shares the node's network (uncontained processes, another
//! tenant's gang members, `--sandbox-host-network` tenants) can connect to its master
//! port, so a gang's traffic is as trusted as the node's network. A namespace per gang
//! on one node (members meeting on loopback only) would close that for one-node gangs;
//! it is not built yet.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, UdpSocket};
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use carve_core::command::render::GangMemberPlace;
use carve_proto::v1;

/// How long members wait for their gang when the assignment names no deadline.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// The variable the rendezvous deadline reaches the program in (whole seconds).
pub const ENVIRONMENT_RENDEZVOUS_TIMEOUT_SECONDS: &str = "CARVE_RENDEZVOUS_TIMEOUT_SECONDS";

/// The variable naming the gang (the same for all members of one attempt).
pub const ENVIRONMENT_GANG_ID: &str = "CARVE_GANG_ID";

/// The ports a worker offers by default for the masters of gangs spread over several
/// nodes (`--gang-ports`): torch's usual 29500 on.
pub const DEFAULT_GANG_PORTS: RangeInclusive<u16> = 29500..=29999;

/// The master address of a gang on one node.
pub const LOOPBACK_MASTER_ADDRESS: &str = "127.0.0.1";

/// The worker's gang settings (`--advertise-address`, `--gang-ports`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangSettings {
    /// Where members on other nodes reach this worker's rank-0 members; `None`: the
    /// local address of the route to the scheduler ([`advertise_address`]).
    pub advertise_address: Option<IpAddr>,
    /// The ports the scheduler may name as the master port of a multi-node gang whose
    /// rank 0 runs here.
    pub ports: RangeInclusive<u16>,
}

impl Default for GangSettings {
    fn default() -> Self {
        GangSettings {
            advertise_address: None,
            ports: DEFAULT_GANG_PORTS,
        }
    }
}

/// What a worker launches one member with: its place in the gang (rendered into its
/// argv and environment by core), the gang's name and its rendezvous deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangMemberLaunch {
    pub gang_id: String,
    pub place: GangMemberPlace,
    pub rendezvous_timeout: Duration,
}

impl GangMemberLaunch {
    /// What the worker adds to the program's environment besides core's variables.
    pub fn environment(&self) -> [(String, String); 2] {
        [
            (
                ENVIRONMENT_RENDEZVOUS_TIMEOUT_SECONDS.to_string(),
                self.rendezvous_timeout.as_secs().max(1).to_string(),
            ),
            (ENVIRONMENT_GANG_ID.to_string(), self.gang_id.clone()),
        ]
    }
}

/// Why a member cannot be launched, and whether retrying the gang could help.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GangRefusal {
    /// `INTERRUPTED` when the node was at fault (the master port is taken): the gang is
    /// retried; `FAILED` for an assignment that cannot be right.
    pub outcome: v1::AttemptOutcome,
    pub reason: String,
}

impl GangRefusal {
    fn invalid(reason: String) -> GangRefusal {
        GangRefusal {
            outcome: v1::AttemptOutcome::Failed,
            reason,
        }
    }
}

/// The master ports this worker picked for the one-node gangs it runs members of: the
/// first member of a gang to arrive picks, the others get the same port, and the entry
/// goes when the last of them ended.
#[derive(Debug, Default)]
pub struct GangPorts {
    gangs: Mutex<HashMap<String, PickedPort>>,
}

#[derive(Debug)]
struct PickedPort {
    port: u16,
    /// Members of the gang that this worker launched and that have not ended.
    members: u32,
}

impl GangPorts {
    /// The port of the one-node gang `gang_id`, picked now if none of its members
    /// arrived yet. Counts one more member of it: call [`GangPorts::member_ended`] once
    /// that member ended.
    pub fn one_node_port(&self, gang_id: &str) -> std::io::Result<u16> {
        let mut gangs = self
            .gangs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(picked) = gangs.get_mut(gang_id) {
            picked.members += 1;
            return Ok(picked.port);
        }
        let port = free_port(IpAddr::V4(Ipv4Addr::LOCALHOST))?;
        gangs.insert(gang_id.to_string(), PickedPort { port, members: 1 });
        Ok(port)
    }

    /// One member of `gang_id` that took its port from [`GangPorts::one_node_port`]
    /// ended.
    pub fn member_ended(&self, gang_id: &str) {
        let mut gangs = self
            .gangs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(picked) = gangs.get_mut(gang_id) {
            picked.members = picked.members.saturating_sub(1);
            if picked.members == 0 {
                gangs.remove(gang_id);
            }
        }
    }
}

/// A port nobody listens on at `address` now: the kernel's choice for port 0, released
/// at once for the program to bind.
pub fn free_port(address: IpAddr) -> std::io::Result<u16> {
    let listener = TcpListener::bind(SocketAddr::new(address, 0))?;
    Ok(listener.local_addr()?.port())
}

/// Whether `port` can be listened on at `address` now (bound and released at once).
pub fn check_port_free(address: IpAddr, port: u16) -> Result<(), String> {
    TcpListener::bind(SocketAddr::new(address, port))
        .map(drop)
        .map_err(|error| format!("the gang's master port {address}:{port} is not free: {error}"))
}

/// Reads the assignment's gang into what the member is launched with. A one-node gang
/// without a port gets one from `ports` (one more member counted there, see
/// [`GangPorts::member_ended`]); rank 0 of a gang with a named port checks that nothing
/// on this node holds it.
pub fn member_launch(
    gang: &v1::GangMember,
    ports: &GangPorts,
) -> Result<GangMemberLaunch, GangRefusal> {
    if gang.gang_id.is_empty() {
        return Err(GangRefusal::invalid(
            "the assignment's gang.gang_id is empty".to_string(),
        ));
    }
    if gang.world_size == 0 || gang.rank >= gang.world_size {
        return Err(GangRefusal::invalid(format!(
            "the assignment's gang.rank {} is not below gang.world_size {}",
            gang.rank, gang.world_size
        )));
    }
    if gang.local_world_size == 0
        || gang.local_world_size > gang.world_size
        || gang.local_rank >= gang.local_world_size
    {
        return Err(GangRefusal::invalid(format!(
            "the assignment's gang.local_rank {} is not below gang.local_world_size {} \
             (at most gang.world_size {})",
            gang.local_rank, gang.local_world_size, gang.world_size
        )));
    }
    let one_node = gang.local_world_size == gang.world_size;
    let master_addr = if gang.master_addr.is_empty() {
        if !one_node {
            return Err(GangRefusal::invalid(
                "the assignment's gang.master_addr is empty for a gang over several nodes"
                    .to_string(),
            ));
        }
        LOOPBACK_MASTER_ADDRESS.to_string()
    } else {
        gang.master_addr.clone()
    };
    let master_port = match u16::try_from(gang.master_port) {
        Ok(0) if one_node => ports
            .one_node_port(&gang.gang_id)
            .map_err(|error| GangRefusal {
                outcome: v1::AttemptOutcome::Interrupted,
                reason: format!("cannot pick a free port for the gang's master: {error}"),
            })?,
        Ok(0) => {
            return Err(GangRefusal::invalid(
                "the assignment's gang.master_port is 0 for a gang over several nodes: \
                 the scheduler names it from rank 0's worker's gang ports"
                    .to_string(),
            ));
        }
        Ok(port) => {
            if gang.rank == 0 {
                let address = master_addr.parse::<IpAddr>().map_err(|error| {
                    GangRefusal::invalid(format!(
                        "the assignment's gang.master_addr {master_addr:?} is not an IP \
                         address: {error}"
                    ))
                })?;
                check_port_free(address, port).map_err(|reason| GangRefusal {
                    outcome: v1::AttemptOutcome::Interrupted,
                    reason,
                })?;
            }
            port
        }
        Err(_) => {
            return Err(GangRefusal::invalid(format!(
                "the assignment's gang.master_port {} is not a port",
                gang.master_port
            )));
        }
    };
    let rendezvous_timeout = gang
        .rendezvous_timeout
        .and_then(|timeout| {
            let seconds = u64::try_from(timeout.seconds).ok()?;
            (seconds > 0).then(|| Duration::from_secs(seconds))
        })
        .unwrap_or(DEFAULT_RENDEZVOUS_TIMEOUT);
    Ok(GangMemberLaunch {
        gang_id: gang.gang_id.clone(),
        place: GangMemberPlace {
            rank: gang.rank,
            world_size: gang.world_size,
            local_rank: gang.local_rank,
            local_world_size: gang.local_world_size,
            node_rank: gang.node_rank,
            master_addr,
            master_port,
        },
        rendezvous_timeout,
    })
}

/// A member's own `{checkpoint_dir}`: rank 0 keeps the job's directory (its checkpoint
/// and progress are the job's, and a retry's rank 0 resumes from it); every other rank
/// gets a sibling of its own, `{job}.rank-{r}`, never inside another member's, so a
/// member's container sees no other member's files.
pub fn member_checkpoint_directory(job_directory: &Path, rank: u32) -> PathBuf {
    if rank == 0 {
        return job_directory.to_path_buf();
    }
    let mut name = job_directory.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".rank-{rank}"));
    job_directory.with_file_name(name)
}

/// The address to report at registration: the operator's `--advertise-address`, else the
/// local address of this node's route to the scheduler (a UDP socket connected to it:
/// no packet is sent), else 127.0.0.1.
pub fn advertise_address(configured: Option<IpAddr>, scheduler_url: &str) -> IpAddr {
    configured
        .or_else(|| route_source_address(scheduler_url))
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

fn route_source_address(scheduler_url: &str) -> Option<IpAddr> {
    // The first of a comma-separated list; `http(s)://host:port/...`.
    let first = scheduler_url.split(',').next()?.trim();
    let without_scheme = first.split_once("://").map_or(first, |(_, rest)| rest);
    let authority = without_scheme.split('/').next()?;
    let with_port = if authority.starts_with('[') || authority.matches(':').count() == 1 {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let target = std::net::ToSocketAddrs::to_socket_addrs(&with_port)
        .ok()?
        .next()?;
    let local = match target {
        SocketAddr::V4(_) => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0),
        SocketAddr::V6(_) => SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), 0),
    };
    let socket = UdpSocket::bind(local).ok()?;
    socket.connect(target).ok()?;
    Some(socket.local_addr().ok()?.ip())
}

/// `--gang-ports FIRST-LAST`.
pub fn parse_gang_ports(text: &str) -> Result<RangeInclusive<u16>, String> {
    let (first, last) = text
        .split_once('-')
        .ok_or_else(|| format!("{text:?} is not FIRST-LAST (29500-29999)"))?;
    let port = |part: &str| {
        part.trim()
            .parse::<u16>()
            .map_err(|error| format!("{part:?} in {text:?} is not a port: {error}"))
    };
    let (first, last) = (port(first)?, port(last)?);
    if first == 0 || first > last {
        return Err(format!(
            "{text:?}: the first port must be at least 1 and at most the last"
        ));
    }
    Ok(first..=last)
}

#[cfg(test)]
mod tests;
