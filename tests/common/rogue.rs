//! A decode's Hello as a rogue or broken peer crafts it (any data endpoint and pool key), sent
//! straight to a prefill's control socket, and the prefill's answer.

use kvferry::layout::{KvLayout, ModelSpec, PageOrder};
use kvferry::memory::RemoteMemory;
use kvferry::protocol::{Hello, Message, Ranks, Role, WireLayout};
use uuid::Uuid;

/// The `tiny` preset's whole layout, token-major, as a Hello carries it.
pub fn tiny_layout() -> WireLayout {
    let l = KvLayout::new(ModelSpec::preset("tiny").expect("tiny"), 16).expect("layout");
    WireLayout {
        kind: l.model.kind,
        dtype: l.model.dtype,
        order: PageOrder::TokenMajor,
        num_layers: l.model.num_layers as u32,
        num_kv_heads: l.model.num_kv_heads as u32,
        head_dim: l.model.head_dim as u32,
        page_size: 16,
        heads: 0..l.model.num_kv_heads as u32,
        layers: 0..l.model.num_layers as u32,
    }
}

/// A 1P1D decode's Hello for `tiny` with this data endpoint, pool (the transport's key) and
/// shared pool (a pool socket's key).
pub fn hello(
    data_endpoint: String,
    pool: Option<RemoteMemory>,
    shared_pool: Option<RemoteMemory>,
) -> Message {
    Message::Hello(Hello {
        min_version: kvferry::protocol::MIN_VERSION,
        max_version: kvferry::protocol::VERSION,
        instance: Uuid::new_v4(),
        role: Role::Decode,
        ranks: Ranks {
            dp_rank: 0,
            dp_size: 1,
            tp_rank: 0,
            tp_size: 1,
            pp_rank: 0,
            pp_size: 1,
        },
        layout: tiny_layout(),
        data_endpoint,
        token: String::new(),
        slots: 4,
        slot_bytes: 1 << 20,
        pool,
        revocable_runs: false,
        chunk_key: kvferry::protocol::Secret::default(),
        shared_pool,
        nonce: None,
    })
}

/// Sends each message to the prefill's control endpoint from one DEALER and returns its
/// answers, each within 20 s.
pub fn answers(control: &str, messages: Vec<Message>) -> Vec<Message> {
    let ctx = zmq::Context::new();
    let socket = ctx.socket(zmq::DEALER).expect("a DEALER");
    socket.set_linger(0).expect("linger");
    socket.connect(control).expect("connect");
    messages
        .into_iter()
        .map(|m| {
            socket.send(m.encode(), 0).expect("send");
            let ready = socket.poll(zmq::POLLIN, 20_000).expect("poll");
            assert_eq!(ready, 1, "an answer within 20 s to {m:?}");
            let frame = socket.recv_bytes(0).expect("recv");
            Message::decode(&frame).expect("an answer that decodes")
        })
        .collect()
}
