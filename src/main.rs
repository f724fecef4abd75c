//! The `newsnack` binary: parse the command line, start logging, dispatch.

use std::process::ExitCode;

use clap::Parser;
use newsnack::cli::{self, Cli};
use newsnack::{logging, telemetry};

/// jemalloc, not the C library's allocator: it keeps no header beside each
/// block, so the part of a buffer never written (most of the 16 KB hyper
/// gives every connection while its request waits) is never resident.
/// docs/performance.md "wait_memory" measures it.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            logging::eprint_line(format_args!(
                "newsnack: cannot start the async runtime: {e}"
            ));
            return ExitCode::FAILURE;
        }
    };
    // Inside the runtime: the OTLP exporter's channel runs on it.
    let export = match runtime.block_on(async { telemetry::Export::from_env() }) {
        Ok(export) => export,
        Err(e) => {
            logging::eprint_line(format_args!("newsnack: {e}"));
            return ExitCode::FAILURE;
        }
    };
    // The demo speaks for itself; everything else logs warnings and info.
    let quiet = matches!(cli.command, cli::Command::Demo);
    logging::init(
        if quiet { "error" } else { "warn,newsnack=info" },
        export.as_ref(),
    );
    let code = match runtime.block_on(cli::run(cli)) {
        Ok(code) => code,
        Err(e) => {
            logging::eprint_line(format_args!("newsnack: {e}"));
            ExitCode::FAILURE
        }
    };
    if let Some(Err(e)) = export.map(telemetry::Export::shutdown) {
        logging::eprint_line(format_args!(
            "newsnack: the last trace spans were not all exported: {e}"
        ));
    }
    code
}
