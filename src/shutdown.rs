//! The one shutdown signal: Ctrl-C or SIGTERM cancels a token that every
//! long-running task selects on.

use tokio_util::sync::CancellationToken;

/// Cancels `token` on the first SIGINT or SIGTERM.
pub fn cancel_on_signal(token: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    // Installed here, before this returns, so a signal that comes at once
    // (say, while a cluster starts) is caught rather than fatal.
    let (interrupt, terminate) = match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(i), Ok(t)) => (i, t),
        (Err(e), _) | (_, Err(e)) => {
            tracing::warn!(error = %e, "cannot watch SIGINT and SIGTERM; the default handlers stay");
            return;
        }
    };
    let (mut interrupt, mut terminate) = (interrupt, terminate);
    tokio::spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
            _ = token.cancelled() => return,
        }
        tracing::info!("shutdown requested");
        token.cancel();
    });
}
