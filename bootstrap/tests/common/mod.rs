//! Helpers shared by the registry's behaviour tests: a real server on 127.0.0.1 (port 0 unless
//! a test restarts one on a known port) and registrations of valid shapes.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

pub(crate) mod etcd;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvferry_bootstrap::{
    AttentionKind, Dtype, IndexRange, KvLayout, Registration, Role, ServerConfig, Slice, serve,
};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// A registry serving in this process.
pub(crate) struct TestServer {
    pub(crate) addr: SocketAddr,
    pub(crate) url: String,
    /// The registry's metrics port (`/metrics`, `/livez`, `/readyz`), which every test server has.
    pub(crate) metrics: String,
    shutdown: CancellationToken,
    task: JoinHandle<std::io::Result<()>>,
}

impl TestServer {
    /// Starts a registry on an ephemeral port.
    pub(crate) async fn start(config: ServerConfig) -> Self {
        Self::start_on("127.0.0.1:0".parse().unwrap(), config).await
    }

    /// Starts a registry on `addr`, retrying the bind for a while (a port just released may
    /// take a moment to be bindable again).
    pub(crate) async fn start_on(addr: SocketAddr, config: ServerConfig) -> Self {
        let deadline = Instant::now() + Duration::from_secs(10);
        let listener = loop {
            match TcpListener::bind(addr).await {
                Ok(l) => break l,
                Err(e) if Instant::now() < deadline => {
                    println!("bind {addr} failed ({e}); retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("bind {addr}: {e}"),
            }
        };
        let addr = listener.local_addr().unwrap();
        let metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics_url = format!("http://{}", metrics.local_addr().unwrap());
        let listeners = kvferry_bootstrap::Listeners {
            api: listener,
            metrics: Some(metrics),
        };
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(serve(listeners, config, shutdown.clone()));
        Self {
            addr,
            url: format!("http://{addr}"),
            metrics: metrics_url,
            shutdown,
            task,
        }
    }

    /// Shuts the registry down and waits until it returned (asserting it returned Ok).
    pub(crate) async fn stop(self) {
        self.shutdown.cancel();
        let result = tokio::time::timeout(Duration::from_secs(20), self.task)
            .await
            .expect("server did not stop within 20 s")
            .expect("server task panicked");
        result.expect("serve returned an error");
    }

    /// `base` + `path`.
    pub(crate) fn at(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }
}

/// A registry config with leases of `ms` milliseconds.
pub(crate) fn ttl_ms(ms: u64) -> ServerConfig {
    ServerConfig::with_lease_ttl(Duration::from_millis(ms))
}

/// The layout of a model with 61 layers and 8 KV heads (bf16, 16 tokens per page).
pub(crate) fn layout() -> KvLayout {
    KvLayout {
        kind: AttentionKind::Mha,
        num_layers: 61,
        num_kv_heads: 8,
        head_dim: 128,
        dtype: Dtype::Bf16,
        page_size: 16,
        order: None,
    }
}

/// Prefill rank (`tp_rank` of `tp`, `pp_rank` of `pp`) of DP group `dp` (dp_size 2), holding
/// its share of the heads (replicated when `tp` > 8) and an uneven PP share of the 61 layers.
pub(crate) fn prefill(dp: u32, tp_rank: u32, tp: u32, pp_rank: u32, pp: u32) -> Registration {
    let heads = layout().num_kv_heads;
    let (h0, h1) = if tp <= heads {
        let per = heads / tp;
        (tp_rank * per, (tp_rank + 1) * per)
    } else {
        let h = tp_rank * heads / tp;
        (h, h + 1)
    };
    let layers = layout().num_layers;
    let (l0, l1) = (pp_rank * layers / pp, (pp_rank + 1) * layers / pp);
    Registration {
        instance_id: Uuid::new_v4(),
        role: Role::Prefill,
        dp_rank: dp,
        dp_size: 2,
        tp_rank,
        tp_size: tp,
        pp_rank,
        pp_size: pp,
        layout: layout(),
        slice: Slice {
            heads: IndexRange::new(h0, h1),
            layers: IndexRange::new(l0, l1),
        },
        control_endpoint: format!("tcp://prefill-{dp}-{tp_rank}-{pp_rank}:7000"),
        data_endpoints: BTreeMap::from([(
            "zmq-tcp".to_owned(),
            format!("tcp://prefill-{dp}-{tp_rank}-{pp_rank}:7001"),
        )]),
        about: Default::default(),
    }
}

/// A decode rank registration (informational for the registry).
pub(crate) fn decode(dp: u32, tp_rank: u32, tp: u32) -> Registration {
    Registration {
        role: Role::Decode,
        control_endpoint: format!("tcp://decode-{dp}-{tp_rank}:7000"),
        ..prefill(dp, tp_rank, tp, 0, 1)
    }
}

/// Polls `check` every 20 ms until it returns true or `bound` passes; returns the time taken.
pub(crate) async fn wait_until<F, Fut>(what: &str, bound: Duration, mut check: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        if check().await {
            let took = start.elapsed();
            println!("{what}: took {took:?}");
            return took;
        }
        assert!(start.elapsed() < bound, "{what}: not within {bound:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
