//! The `oxidekiq` binary: parses the command line and runs this application's workers, or one of the
//! migration subcommands (`check`, `route`, `routes`, `report`) with the same flags and config.

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc; // glibc malloc/free were ~14% of a no-op job's CPU

fn main() -> std::process::ExitCode {
    let (config, command) = match oxidekiq::cli::load_command(std::env::args()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("oxidekiq: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let _log = oxidekiq::logging::init_with(config.verbose, config.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("oxidekiq: cannot start the runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    if let Some(command) = command {
        let registry = oxidekiq_workers::registry();
        return match runtime.block_on(oxidekiq::migrate::run(command, &config, &registry)) {
            Ok((out, ok)) => {
                print!("{out}");
                if ok {
                    std::process::ExitCode::SUCCESS
                } else {
                    std::process::ExitCode::from(1)
                }
            }
            Err(e) => {
                eprintln!("oxidekiq: {e}");
                std::process::ExitCode::from(1)
            }
        };
    }
    runtime.block_on(oxidekiq::migrate::handoff::warn_if_unserved(&config));
    let launcher = oxidekiq::launcher::Launcher::new(config, oxidekiq_workers::registry());
    match runtime.block_on(launcher.run()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "oxidekiq stopped");
            eprintln!("oxidekiq: {e}");
            std::process::ExitCode::from(1)
        }
    }
}
