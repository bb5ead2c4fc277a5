//! What several integration tests share.

use std::ffi::OsString;
use std::process::Command;

/// The `headroom` program under test: `$HEADROOM_BIN` where set, else the one cargo built for
/// these tests. The variable points the tests at a copy that a rebuild cannot replace half-way
/// (long campaigns), and at the program beside the test binaries in a device bundle, where the
/// path cargo compiled in does not exist.
pub fn headroom_path() -> OsString {
    std::env::var_os("HEADROOM_BIN").unwrap_or_else(|| env!("CARGO_BIN_EXE_headroom").into())
}

/// A command running [`headroom_path`].
pub fn headroom_command() -> Command {
    Command::new(headroom_path())
}
