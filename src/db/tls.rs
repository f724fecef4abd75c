//! TLS for every connection to PostgreSQL, with libpq's meaning of the
//! `sslmode`, `sslrootcert`, `sslcert` and `sslkey` URL parameters, over
//! rustls (through `tokio-postgres-rustls`).
//!
//! | `sslmode` | encrypts | checks the chain | checks the host name |
//! |---|---|---|---|
//! | `disable` | never | | |
//! | `allow` | only when a plain session is refused | with a root file | |
//! | `prefer` (default) | when the server offers TLS | with a root file | |
//! | `require` | always | with a root file | |
//! | `verify-ca` | always | yes | |
//! | `verify-full` | always | yes | yes |
//!
//! "With a root file": as in libpq, `allow`, `prefer` and `require` check
//! the chain when `sslrootcert` names a file or `~/.postgresql/root.crt`
//! exists. `sslrootcert=system` takes the operating system's trust store
//! and, as in libpq 16, demands `verify-full`. A client certificate comes
//! from `sslcert`/`sslkey` (default `~/.postgresql/postgresql.crt`/`.key`
//! when present). Files are read when the URL is parsed, so a missing one
//! is reported at start-up, named.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use futures::future::BoxFuture;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::Socket;
use tokio_postgres_rustls::MakeRustlsConnect;

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    const ALL: [SslMode; 6] = [
        SslMode::Disable,
        SslMode::Allow,
        SslMode::Prefer,
        SslMode::Require,
        SslMode::VerifyCa,
        SslMode::VerifyFull,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

impl std::str::FromStr for SslMode {
    type Err = TlsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SslMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| TlsError::BadMode(s.to_string()))
    }
}

impl std::fmt::Display for SslMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the client checks of the server's certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Verification {
    /// Nothing: encryption without authentication.
    None,
    /// The chain up to a trusted root (libpq's `verify-ca`).
    Chain,
    /// The chain and the host name (libpq's `verify-full`).
    ChainAndHost,
}

/// Where trusted root certificates come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCerts {
    File(PathBuf),
    /// The operating system's trust store (`sslrootcert=system`).
    System,
}

impl std::fmt::Display for RootCerts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RootCerts::File(path) => write!(f, "sslrootcert {}", path.display()),
            RootCerts::System => {
                f.write_str("the operating system's trust store (sslrootcert=system)")
            }
        }
    }
}

/// A TLS parameter that cannot be honoured.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error(
        "invalid sslmode \"{0}\": expected one of disable, allow, prefer, require, verify-ca, verify-full"
    )]
    BadMode(String),
    #[error("{param} file {} cannot be read: {source}", path.display())]
    Unreadable {
        param: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{param} file {} holds no {what}", path.display())]
    Empty {
        param: &'static str,
        path: PathBuf,
        what: &'static str,
    },
    #[error(
        "sslmode={0} checks the server's certificate, but there is no root certificate to check it against: \
         set sslrootcert to a PEM file, or to \"system\" for the operating system's trust store \
         (~/.postgresql/root.crt does not exist)"
    )]
    NoRoots(SslMode),
    #[error("weak sslmode \"{0}\" may not be used with sslrootcert=system (use \"verify-full\")")]
    WeakWithSystem(SslMode),
    #[error("sslrootcert=system: the operating system's trust store has no certificates ({0})")]
    NoSystemRoots(String),
    #[error(
        "sslkey file {} has group or world access: it must be readable by its owner only (chmod 600)",
        .0.display()
    )]
    KeyExposed(PathBuf),
    #[error("the client certificate and key cannot be used: {0}")]
    ClientIdentity(rustls::Error),
    #[error("the root certificates cannot be used: {0}")]
    Roots(String),
}

/// The TLS parameters of one database URL.
#[derive(Debug, Clone)]
pub struct TlsSettings {
    pub mode: SslMode,
    /// The trusted roots: given, or libpq's default file if it exists.
    pub roots: Option<RootCerts>,
    /// A client certificate and its key.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// The parameter names this module takes out of a URL.
pub const PARAMETERS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

impl TlsSettings {
    /// Reads the parameters of [`PARAMETERS`] (name, value pairs; any other
    /// name is ignored), with libpq's defaults for what is missing.
    pub fn from_parameters(parameters: &[(String, String)]) -> Result<TlsSettings, TlsError> {
        Self::with_home(parameters, std::env::var_os("HOME").map(PathBuf::from))
    }

    /// [`TlsSettings::from_parameters`], with libpq's default files looked
    /// for under `home`.
    fn with_home(
        parameters: &[(String, String)],
        home: Option<PathBuf>,
    ) -> Result<TlsSettings, TlsError> {
        let get = |name: &str| {
            parameters
                .iter()
                .rev()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.as_str())
        };
        let given_mode = get("sslmode").map(str::parse::<SslMode>).transpose()?;
        let default_file = |name: &str| {
            home.as_ref()
                .map(|h| h.join(".postgresql").join(name))
                .filter(|p| p.exists())
        };
        let roots = match get("sslrootcert") {
            Some("system") => Some(RootCerts::System),
            Some(path) if !path.is_empty() => Some(RootCerts::File(PathBuf::from(path))),
            _ => default_file("root.crt").map(RootCerts::File),
        };
        let mode = match (&roots, given_mode) {
            (Some(RootCerts::System), None) => SslMode::VerifyFull,
            (Some(RootCerts::System), Some(mode)) if mode != SslMode::VerifyFull => {
                return Err(TlsError::WeakWithSystem(mode))
            }
            (_, mode) => mode.unwrap_or(SslMode::Prefer),
        };
        if roots.is_none() && mode >= SslMode::VerifyCa {
            return Err(TlsError::NoRoots(mode));
        }
        let cert = get("sslcert")
            .filter(|p| !p.is_empty())
            .map(PathBuf::from)
            .or_else(|| default_file("postgresql.crt"));
        let identity = cert.map(|cert| {
            let key = get("sslkey")
                .filter(|p| !p.is_empty())
                .map(PathBuf::from)
                .or_else(|| {
                    home.as_ref()
                        .map(|h| h.join(".postgresql").join("postgresql.key"))
                })
                .unwrap_or_else(|| PathBuf::from("postgresql.key"));
            (cert, key)
        });
        Ok(TlsSettings {
            mode,
            roots,
            identity,
        })
    }

    /// What sessions made with these settings check of the server.
    pub fn verification(&self) -> Verification {
        match self.mode {
            SslMode::Disable => Verification::None,
            SslMode::VerifyFull => Verification::ChainAndHost,
            SslMode::VerifyCa => Verification::Chain,
            _ if self.roots.is_some() => Verification::Chain,
            _ => Verification::None,
        }
    }

    /// The connector: reads the root and client files now, so a missing
    /// or unusable one is an error here, named.
    pub fn connector(&self) -> Result<Tls, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verification = self.verification();
        let chain = match (&self.roots, self.mode) {
            (_, SslMode::Disable) | (None, _) => None,
            (Some(roots), _) if verification != Verification::None => {
                let store = Arc::new(root_store(roots)?);
                let verifier = WebPkiServerVerifier::builder_with_provider(store, provider.clone())
                    .build()
                    .map_err(|e| TlsError::Roots(e.to_string()))?;
                Some((verifier, roots.clone()))
            }
            _ => None,
        };
        let check = ServerCheck {
            verification,
            chain,
            provider: provider.clone(),
        };
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Roots(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(check));
        let config = match &self.identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let (certs, key) = client_identity(cert, key)?;
                builder
                    .with_client_auth_cert(certs, key)
                    .map_err(TlsError::ClientIdentity)?
            }
        };
        Ok(Tls {
            inner: MakeRustlsConnect::new(config),
            encrypted: Arc::new(AtomicBool::new(false)),
        })
    }
}

fn read(param: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Unreadable {
        param,
        path: path.to_path_buf(),
        source,
    })
}

fn root_store(roots: &RootCerts) -> Result<rustls::RootCertStore, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    match roots {
        RootCerts::File(path) => {
            let pem = read("sslrootcert", path)?;
            let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<_, _>>()
                .map_err(|e| TlsError::Roots(format!("{}: {e}", path.display())))?;
            if certs.is_empty() {
                return Err(TlsError::Empty {
                    param: "sslrootcert",
                    path: path.clone(),
                    what: "PEM certificate",
                });
            }
            for cert in certs {
                store
                    .add(cert)
                    .map_err(|e| TlsError::Roots(format!("{}: {e}", path.display())))?;
            }
        }
        RootCerts::System => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map_or_else(|| "none found".to_string(), |e| e.to_string());
                return Err(TlsError::NoSystemRoots(why));
            }
        }
    }
    Ok(store)
}

fn client_identity(
    cert: &Path,
    key: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let pem = read("sslcert", cert)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| TlsError::Roots(format!("{}: {e}", cert.display())))?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            param: "sslcert",
            path: cert.to_path_buf(),
            what: "PEM certificate",
        });
    }
    let pem = read("sslkey", key)?;
    // As libpq: a key others may read is refused.
    if let Ok(meta) = std::fs::metadata(key) {
        use std::os::unix::fs::MetadataExt;
        if meta.mode() & 0o077 != 0 && meta.uid() != 0 {
            return Err(TlsError::KeyExposed(key.to_path_buf()));
        }
    }
    let key_der = PrivateKeyDer::from_pem_slice(&pem).map_err(|_| TlsError::Empty {
        param: "sslkey",
        path: key.to_path_buf(),
        what: "unencrypted PEM private key (PKCS#8, PKCS#1 or SEC1)",
    })?;
    Ok((certs, key_der))
}

/// The server's certificate, refused, and why in words.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct CertificateRefused(pub String);

/// Checks the server's certificate as the settings ask: not at all, the
/// chain only (accepting a name mismatch), or the chain and the name.
#[derive(Debug)]
struct ServerCheck {
    verification: Verification,
    chain: Option<(Arc<WebPkiServerVerifier>, RootCerts)>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ServerCheck {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some((chain, roots)) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        let refused = |why: String| {
            rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(
                Arc::new(CertificateRefused(why)),
            )))
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Ok(verified) => Ok(verified),
            // The name is checked last, after the chain: verify-ca
            // accepts a certificate for another name.
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if self.verification == Verification::Chain => Ok(ServerCertVerified::assertion()),
            Err(rustls::Error::InvalidCertificate(e)) => Err(refused(match e {
                CertificateError::UnknownIssuer => {
                    format!("the server's certificate is not signed by a root of {roots}")
                }
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => format!(
                    "{e} (sslmode=verify-full checks that the certificate names the host connected to: \
                     connect by a name it lists, or use sslmode=verify-ca)"
                ),
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                    format!("the server's certificate has expired ({e})")
                }
                other => format!("the server's certificate was refused: {other}"),
            })),
            Err(other) => Err(other),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The stream of an encrypted session.
pub type TlsStream = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Stream;

/// The TLS connector of one endpoint. Each clone made by
/// [`Tls::for_one_session`] records whether its session was encrypted.
#[derive(Clone)]
pub struct Tls {
    inner: MakeRustlsConnect,
    encrypted: Arc<AtomicBool>,
}

impl Tls {
    /// A connector for one session, and the flag it sets once the
    /// session's handshake is done.
    pub fn for_one_session(&self) -> (Tls, Arc<AtomicBool>) {
        let encrypted = Arc::new(AtomicBool::new(false));
        (
            Tls {
                inner: self.inner.clone(),
                encrypted: encrypted.clone(),
            },
            encrypted,
        )
    }
}

impl MakeTlsConnect<Socket> for Tls {
    type Stream = TlsStream;
    type TlsConnect = TrackedConnect;
    type Error = <MakeRustlsConnect as MakeTlsConnect<Socket>>::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<TrackedConnect, Self::Error> {
        Ok(TrackedConnect {
            inner: MakeTlsConnect::<Socket>::make_tls_connect(&mut self.inner, domain)?,
            encrypted: self.encrypted.clone(),
        })
    }
}

/// A handshake that says when it succeeded.
pub struct TrackedConnect {
    inner: <MakeRustlsConnect as MakeTlsConnect<Socket>>::TlsConnect,
    encrypted: Arc<AtomicBool>,
}

impl TlsConnect<Socket> for TrackedConnect {
    type Stream = TlsStream;
    type Error = io::Error;
    type Future = BoxFuture<'static, Result<TlsStream, io::Error>>;

    fn connect(self, stream: Socket) -> Self::Future {
        let handshake = self.inner.connect(stream);
        let encrypted = self.encrypted;
        Box::pin(async move {
            let stream = handshake.await?;
            encrypted.store(true, Ordering::Release);
            Ok(stream)
        })
    }
}

/// How one database session is protected, for the log and `/readyz`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct SessionSecurity {
    pub encrypted: bool,
    /// What was checked of the server (nothing when not encrypted).
    pub verified: Verification,
}

impl std::fmt::Display for SessionSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.encrypted, self.verified) {
            (false, _) => f.write_str("not encrypted"),
            (true, Verification::None) => f.write_str("encrypted, server not verified"),
            (true, Verification::Chain) => {
                f.write_str("encrypted, server certificate verified (not its host name)")
            }
            (true, Verification::ChainAndHost) => {
                f.write_str("encrypted, server certificate and host name verified")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Settings from `pairs`, with a home that has no `~/.postgresql`.
    fn settings(pairs: &[(&str, &str)]) -> Result<TlsSettings, TlsError> {
        TlsSettings::with_home(&params(pairs), Some(PathBuf::from("/nonexistent-home")))
    }

    #[test]
    fn prefer_is_the_default_and_checks_nothing_without_a_root_file() {
        let s = settings(&[]).unwrap();
        assert_eq!(s.mode, SslMode::Prefer);
        assert_eq!(s.verification(), Verification::None);
        assert!(s.identity.is_none());
    }

    #[test]
    fn an_unknown_sslmode_names_the_allowed_values() {
        let e = settings(&[("sslmode", "verify_full")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "invalid sslmode \"verify_full\": expected one of disable, allow, prefer, require, verify-ca, verify-full"
        );
    }

    #[test]
    fn verifying_modes_need_roots() {
        let e = settings(&[("sslmode", "verify-ca")]).unwrap_err();
        assert!(e.to_string().contains("sslrootcert"), "{e}");
    }

    #[test]
    fn system_roots_demand_verify_full() {
        assert_eq!(
            settings(&[("sslrootcert", "system")]).unwrap().mode,
            SslMode::VerifyFull
        );
        let e = settings(&[("sslrootcert", "system"), ("sslmode", "require")]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "weak sslmode \"require\" may not be used with sslrootcert=system (use \"verify-full\")"
        );
    }

    #[test]
    fn a_root_file_makes_require_check_the_chain() {
        let s = settings(&[("sslmode", "require"), ("sslrootcert", "/x/ca.pem")]).unwrap();
        assert_eq!(s.verification(), Verification::Chain);
        let s = settings(&[("sslmode", "verify-full"), ("sslrootcert", "/x/ca.pem")]).unwrap();
        assert_eq!(s.verification(), Verification::ChainAndHost);
    }

    #[test]
    fn a_missing_root_file_is_named_when_the_connector_is_built() {
        let s = settings(&[
            ("sslmode", "verify-full"),
            ("sslrootcert", "/nonexistent/ca.pem"),
        ])
        .unwrap();
        let e = s.connector().err().unwrap();
        assert!(
            e.to_string()
                .starts_with("sslrootcert file /nonexistent/ca.pem cannot be read"),
            "{e}"
        );
    }

    #[test]
    fn a_root_file_without_certificates_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ca.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let s = settings(&[
            ("sslmode", "verify-ca"),
            ("sslrootcert", path.to_str().unwrap()),
        ])
        .unwrap();
        let e = s.connector().err().unwrap();
        assert!(e.to_string().contains("holds no PEM certificate"), "{e}");
    }
}
