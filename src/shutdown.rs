//! The one shutdown signal: Ctrl-C or SIGTERM cancels a token that every
//! long-running task selects on. And the drain signal of `serve`: SIGUSR1
//! turns `/readyz` to 503 while the service goes on answering, so load
//! balancers stop sending before SIGTERM (Kubernetes' preStop hook sends
//! it; docs/production.md, "Deploying on Kubernetes").

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

/// Cancels `draining` on the first SIGUSR1.
pub fn drain_on_signal(draining: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let mut drain = match signal(SignalKind::user_defined1()) {
        Ok(drain) => drain,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGUSR1; draining by signal is off");
            return;
        }
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = drain.recv() => {}
            _ = draining.cancelled() => return,
        }
        tracing::info!(
            "drain requested: /readyz answers 503 from now on; still serving until SIGTERM"
        );
        draining.cancel();
    });
}
