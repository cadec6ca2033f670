//! Fuzzes the control-protocol decoder: any byte string decodes to a message or a typed error,
//! never a panic; a decoded message re-encodes to a frame that decodes to the same message, and
//! to the very same bytes when the input was stamped with this build's version (the encoding is
//! canonical: one frame per message).
//!
//! Run with a nightly toolchain: `cargo +nightly fuzz run decode` (from the repository root).

#![no_main]

use kvferry::protocol::{HEADER_LEN, Message, VERSION};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(msg) = Message::decode(data) else {
        return;
    };
    let again = msg.encode();
    assert_eq!(
        Message::decode(&again).as_ref(),
        Ok(&msg),
        "re-encoded frame decodes differently"
    );
    // A Hello from another version may carry fields this build skips; every other accepted
    // frame carries this build's version and must come back byte for byte.
    let version = u16::from_le_bytes([data[4], data[5]]);
    if version == VERSION {
        assert_eq!(
            again.as_slice(),
            data,
            "decode -> encode is not the identity"
        );
    }
    assert!(again.len() >= HEADER_LEN);
});
