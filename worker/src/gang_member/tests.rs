use std::net::{IpAddr, Ipv4Addr, TcpListener};
use std::path::Path;
use std::time::Duration;

use carve_proto::v1;

use super::*;

fn one_node_gang(rank: u32) -> v1::GangMember {
    v1::GangMember {
        gang_id: "job-1/attempt-1".into(),
        rank,
        world_size: 2,
        local_rank: rank,
        local_world_size: 2,
        node_rank: 0,
        master_addr: String::new(),
        master_port: 0,
        rendezvous_timeout: None,
    }
}

#[test]
fn a_one_node_gang_gets_one_free_port_for_all_its_members_on_loopback() {
    let ports = GangPorts::default();
    let first = member_launch(&one_node_gang(0), &ports).unwrap();
    let second = member_launch(&one_node_gang(1), &ports).unwrap();
    assert_eq!(first.place.master_port, second.place.master_port);
    assert_ne!(first.place.master_port, 0);
    assert_eq!(first.place.master_addr, "127.0.0.1");
    assert_eq!(second.place.rank, 1);
    assert_eq!(first.rendezvous_timeout, DEFAULT_RENDEZVOUS_TIMEOUT);
    // The picked port was released: the program can listen on it.
    TcpListener::bind(("127.0.0.1", first.place.master_port)).unwrap();
    // Another gang gets its own entry; the first's goes with its last member.
    let other = v1::GangMember {
        gang_id: "job-2/attempt-1".into(),
        ..one_node_gang(0)
    };
    member_launch(&other, &ports).unwrap();
    ports.member_ended("job-1/attempt-1");
    assert!(ports.gangs.lock().unwrap().contains_key("job-1/attempt-1"));
    ports.member_ended("job-1/attempt-1");
    assert!(!ports.gangs.lock().unwrap().contains_key("job-1/attempt-1"));
    assert!(ports.gangs.lock().unwrap().contains_key("job-2/attempt-1"));
}

#[test]
fn rank_0_with_a_named_port_that_is_taken_is_interrupted_with_the_port_in_the_reason() {
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let gang = v1::GangMember {
        local_world_size: 1,
        local_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: u32::from(port),
        rendezvous_timeout: Some(prost_types::Duration {
            seconds: 7,
            nanos: 0,
        }),
        ..one_node_gang(0)
    };
    let refusal = member_launch(&gang, &GangPorts::default()).unwrap_err();
    assert_eq!(refusal.outcome, v1::AttemptOutcome::Interrupted);
    assert!(
        refusal.reason.contains(&format!("127.0.0.1:{port}")),
        "{}",
        refusal.reason
    );
    // Rank 1 does not check rank 0's port: it runs elsewhere.
    let member = member_launch(
        &v1::GangMember {
            rank: 1,
            ..gang.clone()
        },
        &GangPorts::default(),
    )
    .unwrap();
    assert_eq!(member.place.master_port, port);
    assert_eq!(member.rendezvous_timeout, Duration::from_secs(7));
    drop(taken);
    member_launch(&gang, &GangPorts::default()).unwrap();
}

#[test]
fn assignments_that_cannot_be_right_fail_naming_the_field() {
    let ports = GangPorts::default();
    let cases = [
        (
            v1::GangMember {
                rank: 2,
                ..one_node_gang(0)
            },
            "gang.rank",
        ),
        (
            v1::GangMember {
                gang_id: String::new(),
                ..one_node_gang(0)
            },
            "gang.gang_id",
        ),
        (
            v1::GangMember {
                local_world_size: 1,
                local_rank: 1,
                ..one_node_gang(1)
            },
            "gang.local_rank",
        ),
        (
            v1::GangMember {
                local_world_size: 1,
                local_rank: 0,
                master_addr: "10.0.0.1".into(),
                ..one_node_gang(1)
            },
            "gang.master_port",
        ),
        (
            v1::GangMember {
                local_world_size: 1,
                local_rank: 0,
                master_port: 29500,
                ..one_node_gang(1)
            },
            "gang.master_addr",
        ),
        (
            v1::GangMember {
                master_addr: "rank-zero.example".into(),
                master_port: 29500,
                ..one_node_gang(0)
            },
            "gang.master_addr",
        ),
        (
            v1::GangMember {
                master_port: 70_000,
                ..one_node_gang(0)
            },
            "gang.master_port",
        ),
    ];
    for (gang, field) in cases {
        let refusal = member_launch(&gang, &ports).unwrap_err();
        assert_eq!(refusal.outcome, v1::AttemptOutcome::Failed, "{gang:?}");
        assert!(
            refusal.reason.contains(field),
            "{field}: {}",
            refusal.reason
        );
    }
}

#[test]
fn members_other_than_rank_0_get_a_checkpoint_directory_beside_the_jobs_not_inside() {
    let job = Path::new("/var/lib/carve/checkpoints/job-1");
    assert_eq!(member_checkpoint_directory(job, 0), job);
    assert_eq!(
        member_checkpoint_directory(job, 3),
        Path::new("/var/lib/carve/checkpoints/job-1.rank-3")
    );
    assert!(!member_checkpoint_directory(job, 3).starts_with(job));
}

#[test]
fn the_advertised_address_is_the_flag_else_the_route_to_the_scheduler() {
    let configured = IpAddr::V4(Ipv4Addr::new(10, 1, 2, 3));
    assert_eq!(
        advertise_address(Some(configured), "http://127.0.0.1:50051"),
        configured
    );
    assert_eq!(
        advertise_address(None, "http://127.0.0.1:50051,http://127.0.0.1:50052"),
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    );
    // An address that does not resolve: loopback, never a failure.
    assert_eq!(
        advertise_address(None, "not a url"),
        IpAddr::V4(Ipv4Addr::LOCALHOST)
    );
}

#[test]
fn gang_ports_are_read_as_first_dash_last() {
    assert_eq!(parse_gang_ports("29500-29999").unwrap(), 29500..=29999);
    for bad in ["29500", "0-10", "30000-29999", "a-b", "1-70000"] {
        assert!(parse_gang_ports(bad).is_err(), "{bad}");
    }
}
