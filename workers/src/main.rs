//! The `oxidekiq` binary: parses the command line and runs this application's workers.

fn main() -> std::process::ExitCode {
    let config = match oxidekiq::cli::load(std::env::args()) {
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
