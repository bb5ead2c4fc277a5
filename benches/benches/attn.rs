//! Placeholder: filled by its crate's issue.
fn main() {}
