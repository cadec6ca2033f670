//! Agents started and stopped one after another in one process (an engine that restarts its
//! agents): each new pair connects and moves its room, whatever the pairs before it left behind
//! (a room aborted before the prefill engine announced it, a room left pending at shutdown).
//! Without the socket monitors stopped before they go, libzmq's I/O threads blocked on events
//! for monitors nobody read, and a later pair's handshake never began (failed by the third to
//! the twelfth pair).

use crate::common;

use std::time::{Duration, Instant};

use kvferry::agent::EngineApi;
use kvferry::agent::decode::{DecodeAgent, RoomRequest};
use kvferry::agent::prefill::{PrefillAgent, ReadyRequest};
use tokio_util::sync::CancellationToken;

#[test]
fn pairs_started_after_others_stopped_connect_and_move_their_rooms() {
    common::runtime().block_on(async {
        for cycle in 0..12u64 {
            let shutdown = CancellationToken::new();
            let (registry, served) = common::registry_in_process(&shutdown).await;
            let cfg = common::in_process_config(&registry, &[]);
            let prefill = PrefillAgent::start(cfg.clone(), shutdown.clone())
                .await
                .unwrap();
            let decode = DecodeAgent::start(cfg, shutdown.clone()).await.unwrap();
            let room = 100 + cycle;
            let req = RoomRequest {
                tokens: 40,
                ..RoomRequest::default()
            };
            decode.request(room, req).await.unwrap();
            let t = Instant::now();
            match cycle % 3 {
                // Aborted before the prefill engine announced it.
                0 => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    decode.abort(room).await.unwrap();
                }
                // Left pending at shutdown.
                1 => tokio::time::sleep(Duration::from_millis(50)).await,
                _ => {
                    prefill
                        .ready(
                            room,
                            ReadyRequest {
                                tokens: 40,
                                ..ReadyRequest::default()
                            },
                        )
                        .await
                        .unwrap();
                    let view = loop {
                        let v = decode.wait(room, Duration::from_secs(10)).await.unwrap();
                        if v.state.is_final() || t.elapsed() > Duration::from_secs(60) {
                            break v;
                        }
                    };
                    println!(
                        "cycle {cycle}: {} in {:?} ({:?})",
                        view.state.name(),
                        t.elapsed(),
                        view.reason
                    );
                    assert_eq!(
                        view.state.name(),
                        "success",
                        "cycle {cycle}: {:?}",
                        view.reason
                    );
                }
            }
            shutdown.cancel();
            prefill.join().await;
            decode.join().await;
            served.await.unwrap().unwrap();
        }
    });
}
