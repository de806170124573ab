//! The `oxidekiq` binary: parses the command line and runs this application's workers.
fn main() {}
