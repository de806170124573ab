//! The `oxidekiq` binary: this application's workers, run by [`oxidekiq::run`] (the command line, the
//! config file, the migration subcommands `check`, `route`, `routes` and `report`, and the launcher).

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc; // glibc malloc/free were ~14% of a no-op job's CPU

fn main() -> std::process::ExitCode {
    oxidekiq::run(oxidekiq_workers::registry)
}
