//! Where and how to reach PostgreSQL: a database URL parsed once into an
//! [`Endpoint`] (connection parameters, TLS and its connector), and the two
//! endpoints of a process, [`Database`]: the pooled one for statements and
//! transactions (which may be a transaction pooler such as PgBouncer) and
//! the direct one for what needs a session of its own (`LISTEN`,
//! session-level advisory locks).
//!
//! Every connection the binary opens is made here, so each honours the
//! URL's TLS parameters (see [`super::tls`]) and says how it is protected.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_postgres::{Client, Socket};
use tokio_util::sync::CancellationToken;

use super::tls::{SessionSecurity, SslMode, Tls, TlsSettings, TlsStream};
use super::DbError;

/// A connection's socket driver, to be polled (spawned) for the session to
/// make progress.
pub type PgConnection = tokio_postgres::Connection<Socket, TlsStream>;

/// One database URL, ready to connect. Cheap to clone.
#[derive(Clone)]
pub struct Endpoint {
    config: Arc<tokio_postgres::Config>,
    tls_settings: Arc<TlsSettings>,
    tls: Tls,
    /// How the newest session made here is protected.
    last_security: Arc<Mutex<Option<SessionSecurity>>>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Endpoint({})", self.describe())
    }
}

impl Endpoint {
    /// Parses `url` (a `postgres://` URL or libpq's `key=value` form),
    /// tagging its sessions with `application_name` unless the URL names
    /// one (so `pg_stat_activity` and `newsnack locks` say who is who), with
    /// TCP keepalives so a half-open connection is noticed. TLS files are
    /// read here: a missing one is an error naming it.
    pub fn parse(url: &str, application_name: &str) -> Result<Endpoint, DbError> {
        let (rest, tls_parameters) = split_tls_parameters(url)?;
        let tls_settings = TlsSettings::from_parameters(&tls_parameters)?;
        let mut config: tokio_postgres::Config = rest
            .parse()
            .map_err(|e: tokio_postgres::Error| DbError::BadUrl(super::describe(&e)))?;
        if config.get_application_name().is_none() {
            config.application_name(application_name);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(5));
        }
        config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(10))
            .keepalives_interval(Duration::from_secs(5))
            .keepalives_retries(3);
        let unix_only = !config.get_hosts().is_empty()
            && config
                .get_hosts()
                .iter()
                .all(|h| !matches!(h, tokio_postgres::config::Host::Tcp(_)));
        // `allow` starts without TLS (see `connect_raw`); PostgreSQL never
        // speaks TLS on a Unix socket, and libpq does not ask it to.
        config.ssl_mode(match tls_settings.mode {
            _ if unix_only => tokio_postgres::config::SslMode::Disable,
            SslMode::Disable | SslMode::Allow => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            _ => tokio_postgres::config::SslMode::Require,
        });
        let tls = tls_settings.connector()?;
        Ok(Endpoint {
            config: Arc::new(config),
            tls_settings: Arc::new(tls_settings),
            tls,
            last_security: Arc::new(Mutex::new(None)),
        })
    }

    /// The parsed connection parameters (without the TLS ones).
    pub fn config(&self) -> &tokio_postgres::Config {
        &self.config
    }

    /// The URL's `sslmode` (or its default).
    pub fn ssl_mode(&self) -> SslMode {
        self.tls_settings.mode
    }

    /// The same endpoint with sessions named `name`.
    pub fn with_application_name(&self, name: &str) -> Endpoint {
        let mut endpoint = self.clone();
        Arc::make_mut(&mut endpoint.config).application_name(name);
        endpoint
    }

    /// The same endpoint for another database on the same server.
    pub fn with_dbname(&self, dbname: &str) -> Endpoint {
        let mut endpoint = self.clone();
        Arc::make_mut(&mut endpoint.config).dbname(dbname);
        endpoint
    }

    /// `host:port/dbname (sslmode=…)`, for logs and errors: never the
    /// password.
    pub fn describe(&self) -> String {
        let host = match self.config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
            None => "?".into(),
        };
        let port = self.config.get_ports().first().copied().unwrap_or(5432);
        format!(
            "{host}:{port}/{} (sslmode={})",
            self.config.get_dbname().unwrap_or(""),
            self.tls_settings.mode
        )
    }

    /// How the newest session made through this endpoint is protected
    /// (`None` before the first).
    pub fn security(&self) -> Option<SessionSecurity> {
        *self.last_security.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Opens a session; the caller drives the returned connection. With
    /// `sslmode=allow`, a session refused without TLS is tried again with
    /// it, as libpq does.
    pub async fn connect_raw(
        &self,
    ) -> Result<(Client, PgConnection, SessionSecurity), tokio_postgres::Error> {
        let first = self.connect_once(&self.config).await;
        let (client, connection, encrypted) = match first {
            Err(_) if self.tls_settings.mode == SslMode::Allow => {
                let mut with_tls = (*self.config).clone();
                with_tls.ssl_mode(tokio_postgres::config::SslMode::Require);
                self.connect_once(&with_tls).await?
            }
            other => other?,
        };
        let security = SessionSecurity {
            encrypted,
            verified: if encrypted {
                self.tls_settings.verification()
            } else {
                super::tls::Verification::None
            },
        };
        self.record(security);
        Ok((client, connection, security))
    }

    async fn connect_once(
        &self,
        config: &tokio_postgres::Config,
    ) -> Result<(Client, PgConnection, bool), tokio_postgres::Error> {
        let (tls, encrypted) = self.tls.for_one_session();
        let (client, connection) = config.connect(tls).await?;
        Ok((client, connection, encrypted.load(Ordering::Acquire)))
    }

    /// Logs how sessions are protected when that is first known or
    /// changes (a `prefer` endpoint whose server turned TLS on or off).
    fn record(&self, security: SessionSecurity) {
        let mut last = self.last_security.lock().unwrap_or_else(|e| e.into_inner());
        if *last != Some(security) {
            tracing::info!(
                endpoint = %self.describe(),
                encrypted = security.encrypted,
                verified = ?security.verified,
                "database sessions: {security}"
            );
            *last = Some(security);
        }
    }

    /// Opens a session outside any pool and drives it in the background.
    /// For sessions that must not go back to a pool: advisory-lock holders
    /// and one-shot commands.
    pub async fn connect(&self) -> Result<Client, DbError> {
        Ok(self.connect_watched().await?.0)
    }

    /// [`Endpoint::connect`], with a token cancelled as soon as the session
    /// ends (closed by the server, e.g. `pg_terminate_backend`, or by a
    /// broken connection).
    pub async fn connect_watched(&self) -> Result<(Client, CancellationToken), DbError> {
        let (client, connection, _) = self.connect_raw().await?;
        let ended = CancellationToken::new();
        let signal = ended.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(error = %e, "dedicated connection closed");
            }
            signal.cancel();
        });
        Ok((client, ended))
    }

    /// Asks the server to cancel what the session of `token` is running,
    /// over this endpoint's TLS.
    pub async fn cancel(&self, token: &tokio_postgres::CancelToken) -> Result<(), DbError> {
        let (tls, _) = self.tls.for_one_session();
        token.cancel_query(tls).await.map_err(DbError::from)
    }
}

/// The two ways a process reaches its database.
#[derive(Clone, Debug)]
pub struct Database {
    /// For statements and transactions: pooled sessions, possibly through
    /// a transaction pooler (`DATABASE_URL`).
    pub pooled: Endpoint,
    /// For a session of its own: the listener and session-level advisory
    /// locks (`NEWSNACK_DIRECT_DATABASE_URL`, or `DATABASE_URL`).
    pub direct: Endpoint,
    /// How pooled sessions may be sent statements: named only without a
    /// direct URL, when no transaction pooler can stand in front.
    pub statements: super::Statements,
}

impl Database {
    /// Parses both URLs; without a direct one, the pooled one serves both.
    pub fn parse(
        url: &str,
        direct_url: Option<&str>,
        application_name: &str,
    ) -> Result<Database, DbError> {
        let pooled = Endpoint::parse(url, application_name)?;
        let direct_url = direct_url.map(str::trim).filter(|u| !u.is_empty());
        let statements = match direct_url {
            Some(_) => super::Statements::Unnamed,
            None => super::Statements::Named,
        };
        let direct = match direct_url {
            Some(direct) => Endpoint::parse(direct, application_name).map_err(|e| match e {
                DbError::BadUrl(why) => {
                    DbError::BadUrl(format!("NEWSNACK_DIRECT_DATABASE_URL: {why}"))
                }
                other => other,
            })?,
            None => pooled.clone(),
        };
        Ok(Database {
            pooled,
            direct,
            statements,
        })
    }

    /// Both endpoints for sessions named `name`.
    pub fn with_application_name(&self, name: &str) -> Database {
        Database {
            pooled: self.pooled.with_application_name(name),
            direct: self.direct.with_application_name(name),
            statements: self.statements,
        }
    }
}

/// Takes libpq's TLS parameters ([`super::tls::PARAMETERS`]) out of a
/// connection string, which tokio-postgres would refuse or read otherwise;
/// returns the rest and the TLS parameters, decoded.
pub fn split_tls_parameters(url: &str) -> Result<(String, Vec<(String, String)>), DbError> {
    let is_tls = |name: &str| super::tls::PARAMETERS.contains(&name);
    let trimmed = url.trim();
    if trimmed.starts_with("postgres://") || trimmed.starts_with("postgresql://") {
        let Some((base, query)) = trimmed.split_once('?') else {
            return Ok((trimmed.to_string(), Vec::new()));
        };
        let mut kept = Vec::new();
        let mut tls = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let name_decoded = percent_decode(name)?;
            if is_tls(&name_decoded) {
                tls.push((name_decoded, percent_decode(value)?));
            } else {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, tls));
    }
    let mut kept = Vec::new();
    let mut tls = Vec::new();
    for (name, value) in key_value_pairs(trimmed)? {
        if is_tls(&name) {
            tls.push((name, value));
        } else {
            let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
            kept.push(format!("{name}='{quoted}'"));
        }
    }
    Ok((kept.join(" "), tls))
}

fn percent_decode(text: &str) -> Result<String, DbError> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = text
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| DbError::BadUrl(format!("invalid percent-encoding in {text:?}")))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| DbError::BadUrl(format!("{text:?} is not UTF-8 once decoded")))
}

/// libpq's `key = value` connection string: values may be single-quoted,
/// with `\'` and `\\` escapes.
fn key_value_pairs(text: &str) -> Result<Vec<(String, String)>, DbError> {
    let mut pairs = Vec::new();
    let mut chars = text.chars().peekable();
    let skip_spaces = |chars: &mut std::iter::Peekable<std::str::Chars<'_>>| {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
    };
    loop {
        skip_spaces(&mut chars);
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut name = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            name.push(c);
            chars.next();
        }
        skip_spaces(&mut chars);
        if chars.next() != Some('=') {
            return Err(DbError::BadUrl(format!(
                "missing \"=\" after {name:?} in the connection string"
            )));
        }
        skip_spaces(&mut chars);
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            loop {
                match chars.next() {
                    Some('\\') => value.extend(chars.next()),
                    Some('\'') => break,
                    Some(c) => value.push(c),
                    None => {
                        return Err(DbError::BadUrl(format!(
                            "unterminated quoted value for {name:?} in the connection string"
                        )))
                    }
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                chars.next();
                if c == '\\' {
                    value.extend(chars.next());
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((name, value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn tls_parameters_leave_a_url_and_the_rest_stays() {
        let (rest, tls) = split_tls_parameters(
            "postgres://u:p@db.example.com:6432/app?sslmode=verify-full&application_name=x&sslrootcert=%2Fetc%2Fca%201.pem",
        )
        .unwrap();
        assert_eq!(
            rest,
            "postgres://u:p@db.example.com:6432/app?application_name=x"
        );
        assert_eq!(
            tls,
            pairs(&[("sslmode", "verify-full"), ("sslrootcert", "/etc/ca 1.pem")])
        );
        let (rest, tls) = split_tls_parameters("postgresql://h/db?sslmode=require").unwrap();
        assert_eq!(
            (rest.as_str(), tls),
            ("postgresql://h/db", pairs(&[("sslmode", "require")]))
        );
        let (rest, tls) = split_tls_parameters("postgres://h1:5432,h2:5433/db").unwrap();
        assert_eq!(
            (rest.as_str(), tls.len()),
            ("postgres://h1:5432,h2:5433/db", 0)
        );
    }

    #[test]
    fn tls_parameters_leave_a_key_value_string() {
        let (rest, tls) = split_tls_parameters(
            r"host=db port = 5432 sslmode=verify-ca sslrootcert='/etc/my ca\'s.pem' password='a b'",
        )
        .unwrap();
        assert_eq!(rest, "host='db' port='5432' password='a b'");
        assert_eq!(
            tls,
            pairs(&[
                ("sslmode", "verify-ca"),
                ("sslrootcert", "/etc/my ca's.pem")
            ])
        );
        let parsed: tokio_postgres::Config = rest.parse().unwrap();
        assert_eq!(parsed.get_password(), Some(&b"a b"[..]));
    }

    #[test]
    fn broken_connection_strings_are_refused() {
        assert!(split_tls_parameters("host=db sslmode").is_err());
        assert!(split_tls_parameters("host='db").is_err());
        assert!(split_tls_parameters("postgres://h/db?sslrootcert=%zz").is_err());
    }

    #[test]
    fn an_endpoint_maps_sslmode_and_names_its_sessions() {
        let e = Endpoint::parse("postgres://u@localhost/db?sslmode=disable", "newsnack-x").unwrap();
        assert_eq!(e.ssl_mode(), SslMode::Disable);
        assert_eq!(e.config().get_application_name(), Some("newsnack-x"));
        assert_eq!(
            e.config().get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable
        );
        assert_eq!(e.describe(), "localhost:5432/db (sslmode=disable)");
        let e = Endpoint::parse("postgres://u@localhost/db?sslmode=require", "n").unwrap();
        assert_eq!(
            e.config().get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        let e = Endpoint::parse("host=/run/postgresql dbname=db sslmode=require", "n").unwrap();
        assert_eq!(
            e.config().get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable,
            "no TLS on a Unix socket"
        );
    }

    #[test]
    fn another_database_on_the_same_server_keeps_the_rest() {
        for url in [
            "postgres://me:pw@db:5433/prod?sslmode=disable",
            "host=db port=5433 user=me dbname=prod sslmode=disable",
        ] {
            let e = Endpoint::parse(url, "t")
                .unwrap()
                .with_dbname("newsnack_demo_1");
            assert_eq!(e.config().get_dbname(), Some("newsnack_demo_1"), "{url}");
            assert_eq!(
                (e.config().get_user(), e.config().get_ports(), e.ssl_mode()),
                (Some("me"), &[5433][..], SslMode::Disable),
                "{url}"
            );
        }
    }

    #[test]
    fn a_bad_sslmode_in_a_url_names_the_allowed_values() {
        let e = Endpoint::parse("postgres://u@localhost/db?sslmode=strict", "n").unwrap_err();
        assert!(
            e.to_string().contains(
                "invalid sslmode \"strict\": expected one of disable, allow, prefer, require, verify-ca, verify-full"
            ),
            "{e}"
        );
    }
}
