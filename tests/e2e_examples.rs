//! The runnable examples keep working: the engine script drives real agents (release binary)
//! through their HTTP API and every room verifies.

mod common;

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
