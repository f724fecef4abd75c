//! The `newsnack` binary: parse the command line, start logging, dispatch.

use std::process::ExitCode;

use clap::Parser;
use newsnack::cli::{self, Cli};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The demo speaks for itself; everything else logs warnings and info.
    let quiet = matches!(cli.command, cli::Command::Demo);
    init_tracing(if quiet { "error" } else { "warn,newsnack=info" });
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("newsnack: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("newsnack: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Logs go to stderr; `RUST_LOG` picks levels (otherwise `default`),
/// `NEWSNACK_LOG_FORMAT=json` switches to JSON lines.
fn init_tracing(default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var("NEWSNACK_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json")) {
        builder.json().init();
    } else {
        builder.init();
    }
}
