//! Rank pairing across real processes (release binary, `tiny` and `tiny-mla` presets): equal
//! and heterogeneous TP in both directions, MLA, PP, two DP groups. The synthetic pattern
//! encodes the global layer and head, so a misplaced head or layer fails verification; every
//! byte is checked on take. Pools of other page sizes exchange KV in token rows.

use crate::common;

use common::{AgentOpts, BOUND, http, runtime};
use kvferry::cluster::{LocalCluster, Shape, drive_rooms};
use serde_json::json;

/// Runs rooms through the shape; every rank of every prefill group serves some except those
/// of `idle` (ranks of a group, PP stages in order): one holding a head that no decode rank
/// asks it for, because its window has fewer layers than holders to share them.
fn run_shape(model: &'static str, prefill: Shape, decode: Shape, idle: &[usize]) {
    let tag = format!(
        "pair-{model}-p{}x{}x{}-d{}",
        prefill.dp, prefill.tp, prefill.pp, decode.tp
    );
    let opts = AgentOpts {
        model,
        pool_pages: 128,
        ..AgentOpts::default()
    };
    let cluster = LocalCluster::start_shaped(
        &common::release_binary(),
        &tag,
        &opts.args(),
        prefill,
        decode,
    )
    .unwrap_or_else(|e| panic!("{tag}: {e:#}"));
    let apis = cluster.apis().unwrap();
    let rooms: Vec<(u64, usize)> = [1usize, 15, 16, 17, 100, 333]
        .iter()
        .enumerate()
        .map(|(i, t)| (i as u64 + 1, *t))
        .collect();
    let started = std::time::Instant::now();
    let results = runtime().block_on(drive_rooms(&apis, rooms, 3)).unwrap();
    for r in &results {
        assert!(
            r.verified,
            "{tag}: room {} ({} tokens) {} {:?}; logs in {}",
            r.room,
            r.tokens,
            r.state,
            r.code,
            cluster.logs.display()
        );
    }
    println!(
        "{tag}: {} rooms verified in {:.0} ms",
        results.len(),
        started.elapsed().as_secs_f64() * 1e3
    );
    // Every rank of every prefill DP group served rooms (rooms go to groups by room id; a
    // head held by several ranks is read in parts from each).
    let http = http();
    runtime().block_on(async {
        for group in &apis.prefill {
            for (rank, api) in group.iter().enumerate() {
                let served = common::metric(
                    &http,
                    api,
                    "kvferry_rooms_total{role=\"prefill\",state=\"success\"}",
                )
                .await
                .unwrap_or(0.0);
                assert_eq!(
                    served > 0.0,
                    !idle.contains(&rank),
                    "{tag}: prefill rank {rank} ({api}) served {served} rooms"
                );
            }
        }
    });
}

#[test]
fn equal_tp() {
    run_shape("tiny", Shape::tp(1), Shape::tp(1), &[]);
    run_shape("tiny", Shape::tp(2), Shape::tp(2), &[]);
}

#[test]
fn prefill_tp_greater_than_decode_tp() {
    run_shape("tiny", Shape::tp(2), Shape::tp(1), &[]);
    run_shape("tiny", Shape::tp(4), Shape::tp(2), &[]);
}

#[test]
fn prefill_tp_smaller_than_decode_tp() {
    run_shape("tiny", Shape::tp(1), Shape::tp(2), &[]);
    run_shape("tiny", Shape::tp(2), Shape::tp(4), &[]);
}

#[test]
fn mla_latent_shared_out_over_the_prefill_ranks() {
    // More readers than holders: each decode rank from one prefill rank.
    run_shape("tiny-mla", Shape::tp(2), Shape::tp(4), &[]);
    // Fewer: the decode rank reads its layers in parts from both.
    run_shape("tiny-mla", Shape::tp(2), Shape::tp(1), &[]);
}

#[test]
fn pipeline_stages_each_send_their_layers() {
    // tiny has 4 layers; tiny-mla 3 (an uneven split: 2 + 1).
    run_shape(
        "tiny",
        Shape {
            pp: 2,
            ..Shape::ONE
        },
        Shape::ONE,
        &[],
    );
    // The second stage's one layer is held by two ranks: one of them sends it.
    run_shape(
        "tiny-mla",
        Shape {
            pp: 2,
            tp: 2,
            ..Shape::ONE
        },
        Shape::tp(1),
        &[3],
    );
}

#[test]
fn two_dp_groups_take_rooms_by_room_id() {
    run_shape(
        "tiny",
        Shape {
            dp: 2,
            ..Shape::ONE
        },
        Shape::ONE,
        &[],
    );
}

/// Token-granular pools of other page sizes exchange KV in token rows: decodes with 32-token
/// pages (token-major, and head-major, whose own order cannot meet 16-token page blocks) take
/// rooms from a prefill of 16-token pages, and every byte verifies.
#[test]
fn pools_of_other_page_sizes_exchange_kv_in_token_rows() {
    let exe = common::release_binary();
    let prefill = AgentOpts::default().args();
    let cluster = LocalCluster::start(&exe, "pair-pagesize", &prefill).unwrap();
    let p = cluster.apis().unwrap().prefill[0][0].clone();
    // More decodes with another page size, registered with the same registry (as other DP
    // ranks: the registry never lets two live instances hold one rank).
    let url = cluster.registry.field("url").unwrap();
    let decode = |dp: &str, order: &str| {
        let mut args: Vec<String> = vec!["decode".into(), "--bootstrap".into(), url.clone()];
        args.extend(AgentOpts::default().args());
        args.extend(["--dp-rank", dp, "--dp-size", "3", "--page-order", order].map(String::from));
        let i = args.iter().position(|a| a == "--page-size").unwrap();
        args[i + 1] = "32".into();
        let name = format!("decode-p32-{order}");
        kvferry::cluster::Process::spawn(&exe, &name, &args, &cluster.logs, BOUND).unwrap()
    };
    let decodes = [decode("1", "token_major"), decode("2", "head_major")];
    let http = http();
    runtime().block_on(async {
        let mut room = 5;
        for d in &decodes {
            let d = d.field("api").unwrap();
            for tokens in [1, 15, 16, 17, 40, 333] {
                room += 1;
                let body = json!({ "tokens": tokens });
                common::request_and_ready(&http, &d, &p, room, &body).await;
                let taken = common::take_verified(&http, &d, room).await;
                println!(
                    "{d}: room {room}, {tokens} tokens: {} bytes verified",
                    taken["bytes"]
                );
            }
        }
    });
}
