//! The progress thread's engine driven on the test's own thread: two engines (sender and
//! receiver) progressed in turn, so what is in flight at each step is known.

use std::rc::Weak;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::*;
use crate::transport::ucx::command::RemoteRegionId;
use crate::transport::ucx::region::Region;

fn engine() -> Engine {
    engine_of(UcxConfig::tcp_loopback())
}

fn engine_of(config: UcxConfig) -> Engine {
    Engine::new(&config).expect("a UCX worker over tcp on loopback")
}

/// Sends `command` (built around its reply) to `engine` and progresses both engines until
/// it is answered.
fn call<T>(
    engine: &mut Engine,
    other: &mut Engine,
    command: impl FnOnce(oneshot::Sender<Result<T, UcxError>>) -> Command,
) -> Result<T, UcxError> {
    let (reply, mut answer) = oneshot::channel();
    engine.handle(command(reply));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(answer) = answer.try_recv() {
            return answer;
        }
        assert!(Instant::now() < deadline, "no answer within 20 s");
        engine.worker.progress();
        engine.sweep();
        other.worker.progress();
        other.sweep();
    }
}

/// A put queued on an endpoint when the endpoint goes (the peer disconnects; its write timed
/// out and was dropped) keeps the remote key it writes with alive until it completes: the key
/// is destroyed after the put, never under it. With the key owned by the region alone, the
/// disconnect destroyed it while the put was still queued.
#[test]
fn a_queued_put_keeps_its_rkey_until_it_completes() {
    // Puts over tcp need RMA on both (two engines of this test: they trust each other).
    let rma = || engine_of(UcxConfig::tcp_loopback().rma(true));
    let (mut sender, mut receiver) = (rma(), rma());
    let size = 64 << 20;
    let target: Arc<dyn RegisterableMemory> = Arc::new(Region::new(size).unwrap());
    let registered = call(&mut receiver, &mut sender, |reply| Command::Register {
        memory: target.clone(),
        reply,
    })
    .unwrap();
    let address = receiver.worker.address().unwrap();
    let ep = call(&mut sender, &mut receiver, |reply| Command::Connect {
        address: address.clone().into(),
        reply,
    })
    .unwrap();
    let region: RemoteRegionId = call(&mut sender, &mut receiver, |reply| Command::AddRemote {
        ep,
        base: registered.base,
        size: registered.size,
        rkey: registered.rkey.clone(),
        reply,
    })
    .unwrap();
    let key: Weak<_> = Rc::downgrade(&sender.remote[&region.0].key);
    // Many puts, emulated over tcp (slow): still queued when the caller gives up.
    let source: Arc<dyn RegisterableMemory> = Arc::new(Region::new(size).unwrap());
    let runs: Vec<WriteRun> = (0..64u64)
        .map(|i| WriteRun {
            src: i << 20,
            dst: i << 20,
            len: 1 << 20,
        })
        .collect();
    let (reply, answer) = oneshot::channel();
    sender.handle(Command::Write {
        region,
        source,
        runs,
        reply,
    });
    drop(answer);
    let queued = sender.bulk.len();
    assert!(queued > 0, "every put completed at once: nothing to test");
    let (reply, _answer) = oneshot::channel();
    sender.handle(Command::Disconnect { ep, reply });
    assert!(
        sender.remote.is_empty(),
        "the region went with its endpoint"
    );
    assert!(
        key.upgrade().is_some(),
        "{queued} puts queued, and their key is already destroyed"
    );
    // The puts end (the endpoint closes under them); then the key goes.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !sender.idle() {
        assert!(Instant::now() < deadline, "puts still queued after 30 s");
        sender.worker.progress();
        sender.sweep();
        receiver.worker.progress();
        receiver.sweep();
    }
    assert!(key.upgrade().is_none(), "the key outlived every put");
    // The sender keeps serving: a new endpoint to the receiver carries a message.
    let ep = call(&mut sender, &mut receiver, |reply| Command::Connect {
        address: address.clone().into(),
        reply,
    })
    .unwrap();
    let (got, mut received) = oneshot::channel();
    receiver.handle(Command::RecvTag {
        tag: 7,
        mask: u64::MAX,
        capacity: 16,
        from: None,
        into: None,
        reply: got,
    });
    call(&mut sender, &mut receiver, |reply| Command::SendTag {
        ep,
        tag: 7,
        parts: vec![bytes::Bytes::from_static(b"still serving")],
        from: None,
        reply,
    })
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let message = loop {
        if let Ok(r) = received.try_recv() {
            break r.unwrap();
        }
        assert!(Instant::now() < deadline);
        receiver.worker.progress();
        receiver.sweep();
        sender.worker.progress();
        sender.sweep();
    };
    assert_eq!(&message.data[..], b"still serving");
    sender.close();
    receiver.close();
}

/// Set in the child process of the test below: there, the test panics with an engine alive.
const PANIC_CHILD: &str = "KVFERRY_TEST_PANIC_WITH_ENGINE";

/// A panic while an engine lives (as on its progress thread) aborts the process, with a
/// message, before the engine's buffers are dropped: the test runs itself in a child process
/// that panics so, and checks it died of SIGABRT rather than unwinding to a test failure.
#[test]
fn a_panic_with_an_engine_alive_aborts_the_process() {
    if std::env::var_os(PANIC_CHILD).is_some() {
        let _engine = engine();
        panic!("injected panic with a UCX engine alive");
    }
    let name = "transport::ucx::progress::tests::a_panic_with_an_engine_alive_aborts_the_process";
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(PANIC_CHILD, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGABRT),
        "{:?}\n{stderr}",
        out.status
    );
    assert!(stderr.contains("injected panic"), "{stderr}");
    assert!(stderr.contains("UCX progress thread panicked"), "{stderr}");
}

/// A completed receive into a receiver's own buffer hands out the bytes that arrived, and the
/// buffer goes back whole, still as long as it was taken: taken again, it needs no zero-fill
/// (cut to a header's length, it was filled again up to 1 MiB on the progress thread).
#[test]
fn a_short_message_leaves_its_buffer_whole_for_the_next_receive() {
    #[derive(Default)]
    struct Lengths(std::sync::Mutex<Vec<usize>>);
    impl crate::transport::RecvBuffers for Lengths {
        fn take(&self, len: usize) -> Vec<u8> {
            vec![0; len]
        }
        fn freeze(self: Arc<Self>, buf: Vec<u8>) -> bytes::Bytes {
            self.0.lock().unwrap().push(buf.len());
            bytes::Bytes::from(buf)
        }
    }
    let owner = Arc::new(Lengths::default());
    let mut buffer = owner.take(1 << 20);
    buffer[..3].copy_from_slice(b"hdr");
    let info = sys::ucp_tag_recv_info_t {
        sender_tag: 7,
        length: 3,
    };
    let into: Arc<dyn crate::transport::RecvBuffers> = owner.clone();
    let Ok(got) = pending::recv_result(buffer, 1 << 20, Some(into), sys::UCS_OK, info) else {
        panic!("the receive failed");
    };
    assert_eq!((got.tag, &got.data[..]), (7, &b"hdr"[..]));
    assert_eq!(
        *owner.0.lock().unwrap(),
        [1 << 20],
        "the buffer went back whole"
    );
}
