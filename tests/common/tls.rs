//! A throwaway PostgreSQL cluster that takes only TLS sessions, as managed
//! services do: `ssl = on`, and `pg_hba.conf` with `hostssl` lines only
//! (SCRAM passwords; certificate login for the role `certuser`). The
//! certificates are made at test time: a CA, the server's certificate for
//! `localhost` and `127.0.0.1`, a client certificate for `certuser`, and a
//! second CA that signed none of them.

use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use newsnack::embedded::{EmbeddedOptions, EmbeddedPostgres};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};

/// The superuser's password on the TLS cluster.
pub const PASSWORD: &str = "s3cret-for-tests";

/// The running TLS cluster and the client's files.
pub struct TlsCluster {
    /// Taken and dropped at exit, which stops it and deletes its files.
    cluster: Mutex<Option<EmbeddedPostgres>>,
    port: u16,
    files: tempfile::TempDir,
}

static CLUSTER: OnceLock<TlsCluster> = OnceLock::new();

extern "C" fn stop_cluster() {
    if let Some(tls) = CLUSTER.get() {
        if let Ok(mut cluster) = tls.cluster.lock() {
            cluster.take();
        }
    }
}

/// The TLS cluster of this test process, started on first use.
pub fn cluster() -> &'static TlsCluster {
    CLUSTER.get_or_init(|| {
        let made = Certificates::make();
        let files = tempfile::tempdir().unwrap();
        for (name, pem) in [
            ("ca.pem", &made.ca),
            ("other-ca.pem", &made.other_ca),
            ("client.crt", &made.client_cert),
        ] {
            std::fs::write(files.path().join(name), pem).unwrap();
        }
        let key = files.path().join("client.key");
        std::fs::write(&key, &made.client_key).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        let options = EmbeddedOptions {
            durable: false,
            settings: vec![
                ("max_connections".into(), "200".into()),
                ("ssl".into(), "on".into()),
                ("ssl_cert_file".into(), "server.crt".into()),
                ("ssl_key_file".into(), "server.key".into()),
                ("ssl_ca_file".into(), "ca.crt".into()),
                ("password_encryption".into(), "scram-sha-256".into()),
            ],
            files: vec![
                ("server.crt".into(), made.server_cert.into_bytes()),
                ("server.key".into(), made.server_key.into_bytes()),
                ("ca.crt".into(), made.ca.into_bytes()),
            ],
            pg_hba: Some(
                "local all all trust\n\
                 hostssl all certuser 127.0.0.1/32 cert\n\
                 hostssl all all 127.0.0.1/32 scram-sha-256\n"
                    .into(),
            ),
            superuser_password: Some(PASSWORD.into()),
        };
        let cluster = EmbeddedPostgres::start(&options).expect("start the TLS cluster");
        // SAFETY: registers a plain extern "C" function to run at exit.
        unsafe {
            libc::atexit(stop_cluster);
        }
        TlsCluster {
            port: cluster.port(),
            cluster: Mutex::new(Some(cluster)),
            files,
        }
    })
}

impl TlsCluster {
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The CA that signed the server's certificate.
    pub fn ca(&self) -> PathBuf {
        self.files.path().join("ca.pem")
    }

    /// A CA that signed nothing here.
    pub fn other_ca(&self) -> PathBuf {
        self.files.path().join("other-ca.pem")
    }

    /// `certuser`'s certificate and key.
    pub fn client_cert(&self) -> (PathBuf, PathBuf) {
        (
            self.files.path().join("client.crt"),
            self.files.path().join("client.key"),
        )
    }

    /// A URL for `database` as the superuser, by host name `localhost`
    /// (which the server's certificate names), with `params` appended.
    pub fn url(&self, database: &str, params: &str) -> String {
        format!(
            "postgres://postgres:{PASSWORD}@localhost:{}/{database}?{params}",
            self.port()
        )
    }

    /// A new, empty database on the cluster; returns its name.
    pub async fn database(&self) -> String {
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let name = format!(
            "tls_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let params = format!("sslmode=verify-full&sslrootcert={}", self.ca().display());
        let admin = newsnack::db::Endpoint::parse(&self.url("postgres", &params), "tls-test")
            .unwrap()
            .connect()
            .await
            .expect("the superuser connects over verify-full");
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        name
    }
}

/// PEM texts made for one test process.
struct Certificates {
    ca: String,
    other_ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
}

impl Certificates {
    fn make() -> Certificates {
        let (ca, issuer) = authority("newsnack test CA");
        let (other_ca, _) = authority("a CA that signed nothing here");
        let (server_cert, server_key) = leaf(
            &issuer,
            "localhost",
            vec!["localhost".into(), "127.0.0.1".into()],
            ExtendedKeyUsagePurpose::ServerAuth,
        );
        let (client_cert, client_key) = leaf(
            &issuer,
            "certuser",
            Vec::new(),
            ExtendedKeyUsagePurpose::ClientAuth,
        );
        Certificates {
            ca,
            other_ca,
            server_cert,
            server_key,
            client_cert,
            client_key,
        }
    }
}

fn authority(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
    ];
    let key = KeyPair::generate().unwrap();
    let cert = params.self_signed(&key).unwrap();
    (cert.pem(), Issuer::new(params, key))
}

fn leaf(
    issuer: &Issuer<'static, KeyPair>,
    common_name: &str,
    names: Vec<String>,
    purpose: ExtendedKeyUsagePurpose,
) -> (String, String) {
    let mut params = CertificateParams::new(names).unwrap();
    params
        .distinguished_name
        .push(DnType::CommonName, common_name);
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![purpose];
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}
