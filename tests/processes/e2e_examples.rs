//! The runnable examples keep working: the in-process example lands its room through the
//! agents' Rust handles, the engine script drives real agents (release binary) through their
//! HTTP API, and every room verifies.

use crate::common;

use std::process::Command;

#[test]
fn the_engine_script_drives_two_agents() {
    let exe = common::release_binary();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/02-engine.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&exe)
        .output()
        .expect("running python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(
        out.status.success(),
        "{}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.matches("verified True").count(), 3, "{stdout}");
    assert!(stdout.contains("aux b'first token: 42'"), "{stdout}");
}

/// The in-process example plays its room through the agents' Rust handles (no HTTP client) and
/// exits 0 only when every byte verified. `cargo test` and `cargo nextest run` build examples
/// beside the test binaries (`target/<profile>/examples/`).
#[test]
fn the_in_process_example_lands_its_room_through_the_handles() {
    let me = std::env::current_exe().expect("the test executable's path");
    let profile = me
        .parent()
        .and_then(std::path::Path::parent)
        .expect("target/<profile>/deps/<test>");
    let name = format!("01-in-process-1p1d{}", std::env::consts::EXE_SUFFIX);
    let exe = profile.join("examples").join(name);
    assert!(
        exe.is_file(),
        "{} is missing: run `cargo build --examples` (cargo test builds it)",
        exe.display()
    );
    let started = std::time::Instant::now();
    let out = Command::new(&exe).output().expect("running the example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}ran in {:?}", started.elapsed());
    assert!(
        out.status.success(),
        "{}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("room 42: success with 614400 bytes, every byte verified: Some(true)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("free_pages: 64, total_pages: 64"),
        "{stdout}"
    );
}
