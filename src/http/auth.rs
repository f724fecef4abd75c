//! Who may do what over HTTP: the tokens a request presents and what each
//! one opens, decided before the request reaches a route.
//!
//! | configured | `/healthz`, `/readyz` | `/metrics` | `GET`/`HEAD` elsewhere | anything else |
//! |---|---|---|---|---|
//! | no API or read token | open | open, or the metrics token | open | open |
//! | the API or the read token | open | open, or the metrics token | read or API token | API token |
//!
//! The API token opens everything, `/metrics` included; the metrics token
//! opens `GET /metrics` and nothing else. A token is presented as
//! `Authorization: Bearer <token>`, or as HTTP Basic with the token as the
//! password and any user name, so a browser can open the dashboard (and its
//! event stream) after its own prompt. A request with no token, or with one
//! that is none of the configured ones, is answered 401 with a
//! `WWW-Authenticate` challenge for both schemes; a configured token that
//! does not open the request (the read token on a write) is answered 403.
//! Either way nothing runs. A read token alone (no API token) opens reads
//! and leaves every write refused.
//!
//! Only the tokens' SHA-256 digests are kept; the presented token's digest
//! is compared in constant time with every configured one, so neither a
//! token's content nor its length can be learnt from response timing. Refusals are counted by reason
//! ([`crate::metrics::auth_rejected`]) and logged without the token.
//!
//! A configured token must be one a request can present and that is worth
//! guarding with ([`Tokens::check`]): `serve` stops at start-up, with one
//! line, on a token that is empty or blank, shorter than [`MIN_TOKEN_CHARS`],
//! not visible ASCII, or equal to another configured token. Surrounding
//! white space (the newline at the end of a secret's file) is ignored.
//!
//! The check is tower-http's `ValidateRequestHeader` with [`Access`]: it
//! decides before the request goes on, so an open request (a wait, an
//! event stream) holds no future of its own for it.

use std::sync::Arc;

use axum::body::Body;
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, HeaderValue, Method, Request};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};
use tower_http::validate_request::ValidateRequest;

use super::ApiError;

/// The fewest characters a configured token may have: 16 random visible
/// ASCII characters are about 100 bits.
pub const MIN_TOKEN_CHARS: usize = 16;

/// The challenges of a 401: a browser prompts for Basic; API clients read
/// Bearer.
const CHALLENGES: [&str; 2] = [
    "Bearer realm=\"newsnack\"",
    "Basic realm=\"newsnack\", charset=\"UTF-8\"",
];

/// The tokens as configured (`NEWSNACK_API_TOKEN`, `NEWSNACK_READ_TOKEN`,
/// `NEWSNACK_METRICS_TOKEN`); `None` is not configured.
#[derive(Clone, Default)]
pub struct Tokens {
    /// Opens everything.
    pub api: Option<String>,
    /// Opens `GET` and `HEAD`.
    pub read: Option<String>,
    /// Opens `GET /metrics`, which is open without it.
    pub metrics: Option<String>,
}

/// Tokens are secrets: their debug form says only which are set.
impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |t: &Option<String>| if t.is_some() { "set" } else { "unset" };
        f.debug_struct("Tokens")
            .field("api", &set(&self.api))
            .field("read", &set(&self.read))
            .field("metrics", &set(&self.metrics))
            .finish()
    }
}

/// A configured token no request should be checked against (see the
/// module docs). Names the variable, never shows the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadToken {
    #[error("{0} is set but blank: unset it for no token, or give it a secret")]
    Blank(&'static str),
    #[error(
        "{name} has {chars} characters: a token needs at least {MIN_TOKEN_CHARS} \
         (make one with `openssl rand -hex 32`)"
    )]
    TooShort { name: &'static str, chars: usize },
    #[error(
        "{0} must be visible ASCII (no spaces or other characters inside): \
         it holds a character an Authorization header cannot carry"
    )]
    NotVisibleAscii(&'static str),
    #[error("{0} equals {1}: give each token its own value")]
    Same(&'static str, &'static str),
}

const API: &str = "NEWSNACK_API_TOKEN (--api-token)";
const READ: &str = "NEWSNACK_READ_TOKEN (--read-token)";
const METRICS: &str = "NEWSNACK_METRICS_TOKEN (--metrics-token)";

impl Tokens {
    /// Only the API token.
    pub fn api(token: &str) -> Tokens {
        Tokens {
            api: Some(token.to_string()),
            ..Tokens::default()
        }
    }

    /// True when the API (every route but the probes and `/metrics`) needs
    /// a token.
    pub fn guard_the_api(&self) -> bool {
        self.api.is_some() || self.read.is_some()
    }

    /// Each configured token, trimmed, with its name.
    fn named(&self) -> impl Iterator<Item = (&'static str, &str)> {
        [
            (API, &self.api),
            (READ, &self.read),
            (METRICS, &self.metrics),
        ]
        .into_iter()
        .filter_map(|(name, token)| token.as_deref().map(|t| (name, t.trim())))
    }

    /// Checks every configured token (see the module docs).
    pub fn check(&self) -> Result<(), BadToken> {
        for (name, token) in self.named() {
            if token.is_empty() {
                return Err(BadToken::Blank(name));
            }
            if !token.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(BadToken::NotVisibleAscii(name));
            }
            if token.len() < MIN_TOKEN_CHARS {
                return Err(BadToken::TooShort {
                    name,
                    chars: token.len(),
                });
            }
        }
        let named: Vec<_> = self.named().collect();
        for (i, (name, token)) in named.iter().enumerate() {
            if let Some((other, _)) = named[i + 1..].iter().find(|(_, t)| t == token) {
                return Err(BadToken::Same(other, name));
            }
        }
        Ok(())
    }
}

/// What a request needs to go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    Nothing,
    Read,
    Write,
    Metrics,
}

/// Which configured token a request presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holder {
    Api,
    Read,
    Metrics,
}

impl Holder {
    fn may(self, need: Need) -> bool {
        match self {
            Holder::Api => true,
            Holder::Read => need == Need::Read,
            Holder::Metrics => need == Need::Metrics,
        }
    }
}

/// Why a request was refused: the label of the rejection counter, and what
/// the log says (the client gets one message per status).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("no Authorization header")]
    Missing,
    #[error("the Authorization header is neither `Bearer <token>` nor Basic with a password")]
    Malformed,
    #[error("a token that is none of the configured ones")]
    Wrong,
    #[error("a token that does not open this request")]
    Forbidden,
}

impl Refusal {
    /// The `reason` label of `newsnack_auth_rejections_total`.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Malformed => "malformed",
            Refusal::Wrong => "wrong",
            Refusal::Forbidden => "forbidden",
        }
    }
}

type Sha = [u8; 32];

fn sha(token: &str) -> Sha {
    Sha256::digest(token.trim().as_bytes()).into()
}

/// The configured tokens' digests.
struct Digests {
    api: Option<Sha>,
    read: Option<Sha>,
    metrics: Option<Sha>,
}

/// The check in front of every route (see the module docs). Cheap to
/// clone: the router clones it for every request.
#[derive(Clone, Default)]
pub struct Access {
    /// `None`: no token configured, everything open.
    digests: Option<Arc<Digests>>,
}

impl Access {
    /// The check for `tokens`, which [`Tokens::check`] has accepted.
    pub fn new(tokens: &Tokens) -> Access {
        let digests = Digests {
            api: tokens.api.as_deref().map(sha),
            read: tokens.read.as_deref().map(sha),
            metrics: tokens.metrics.as_deref().map(sha),
        };
        let any = digests.api.is_some() || digests.read.is_some() || digests.metrics.is_some();
        Access {
            digests: any.then(|| Arc::new(digests)),
        }
    }

    fn need(digests: &Digests, method: &Method, path: &str) -> Need {
        let reads = matches!(*method, Method::GET | Method::HEAD);
        match path {
            "/healthz" | "/readyz" => Need::Nothing,
            "/metrics" if digests.metrics.is_some() && reads => Need::Metrics,
            "/metrics" if digests.metrics.is_some() => Need::Write,
            "/metrics" => Need::Nothing,
            _ if digests.api.is_none() && digests.read.is_none() => Need::Nothing,
            _ if reads => Need::Read,
            _ => Need::Write,
        }
    }

    /// Which configured token `presented` is, comparing with every one.
    fn holder(digests: &Digests, presented: &str) -> Option<Holder> {
        let presented = sha(presented);
        let is = |d: &Option<Sha>| d.map_or(Choice::from(0), |d| d.ct_eq(&presented));
        let (api, read, metrics) = (is(&digests.api), is(&digests.read), is(&digests.metrics));
        if bool::from(api) {
            Some(Holder::Api)
        } else if bool::from(read) {
            Some(Holder::Read)
        } else if bool::from(metrics) {
            Some(Holder::Metrics)
        } else {
            None
        }
    }

    /// Whether a request with this method, path and headers may go on.
    pub fn decide(&self, method: &Method, path: &str, headers: &HeaderMap) -> Result<(), Refusal> {
        let Some(digests) = &self.digests else {
            return Ok(());
        };
        let need = Access::need(digests, method, path);
        if need == Need::Nothing {
            return Ok(());
        }
        let holder = with_presented(headers, |token| Access::holder(digests, token))?;
        match holder {
            None => Err(Refusal::Wrong),
            Some(holder) if holder.may(need) => Ok(()),
            Some(_) => Err(Refusal::Forbidden),
        }
    }
}

/// Calls `f` with the token of an `Authorization: Bearer <token>` header,
/// or the password of an `Authorization: Basic` one (schemes are
/// case-insensitive, as RFC 7235 has it).
fn with_presented<T>(headers: &HeaderMap, f: impl FnOnce(&str) -> T) -> Result<T, Refusal> {
    let value = headers.get(AUTHORIZATION).ok_or(Refusal::Missing)?;
    let value = value.to_str().map_err(|_| Refusal::Malformed)?.trim();
    let (scheme, credentials) = value.split_once(' ').ok_or(Refusal::Malformed)?;
    let credentials = credentials.trim();
    if credentials.is_empty() {
        return Err(Refusal::Malformed);
    }
    if scheme.eq_ignore_ascii_case("bearer") {
        Ok(f(credentials))
    } else if scheme.eq_ignore_ascii_case("basic") {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(credentials)
            .map_err(|_| Refusal::Malformed)?;
        let user_pass = std::str::from_utf8(&decoded).map_err(|_| Refusal::Malformed)?;
        let (_user, password) = user_pass.split_once(':').ok_or(Refusal::Malformed)?;
        Ok(f(password))
    } else {
        Err(Refusal::Malformed)
    }
}

/// The answer to a refused request (see the module docs).
fn refused(refusal: Refusal) -> Response {
    if refusal == Refusal::Forbidden {
        return ApiError::Forbidden.into_response();
    }
    let mut response = ApiError::Unauthorized.into_response();
    for challenge in CHALLENGES {
        response
            .headers_mut()
            .append(WWW_AUTHENTICATE, HeaderValue::from_static(challenge));
    }
    response
}

impl<B> ValidateRequest<B> for Access {
    type ResponseBody = Body;

    fn validate(&mut self, request: &mut Request<B>) -> Result<(), Response> {
        let (method, path) = (request.method(), request.uri().path());
        self.decide(method, path, request.headers())
            .map_err(|refusal| {
                // A browser asks without credentials first, then answers
                // the challenge: a missing token is routine.
                if refusal == Refusal::Missing {
                    tracing::debug!(%method, path, reason = %refusal, "refused: no token");
                } else {
                    tracing::warn!(%method, path, reason = %refusal, "refused");
                }
                crate::metrics::auth_rejected(refusal.label());
                refused(refusal)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const API_T: &str = "api-0123456789abcdef";
    const READ_T: &str = "read-0123456789abcdef";
    const METRICS_T: &str = "metrics-0123456789abcdef";

    fn headers(authorization: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(value) = authorization {
            headers.insert(AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    fn basic(user: &str, password: &str) -> String {
        let encoded =
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        format!("Basic {encoded}")
    }

    fn all() -> Access {
        Access::new(&Tokens {
            api: Some(API_T.into()),
            read: Some(READ_T.into()),
            metrics: Some(METRICS_T.into()),
        })
    }

    #[test]
    fn nothing_configured_lets_everything_through() {
        let open = Access::new(&Tokens::default());
        for method in [Method::GET, Method::POST, Method::DELETE] {
            for path in ["/", "/issues", "/metrics", "/healthz"] {
                assert_eq!(open.decide(&method, path, &headers(None)), Ok(()));
            }
        }
    }

    #[test]
    fn each_token_opens_what_it_is_for() {
        let access = all();
        let get =
            |path: &str, auth: Option<&str>| access.decide(&Method::GET, path, &headers(auth));
        let post =
            |path: &str, auth: Option<&str>| access.decide(&Method::POST, path, &headers(auth));
        let (api, read, metrics) = (
            format!("Bearer {API_T}"),
            format!("Bearer {READ_T}"),
            format!("Bearer {METRICS_T}"),
        );
        for probe in ["/healthz", "/readyz"] {
            assert_eq!(get(probe, None), Ok(()));
        }
        assert_eq!(get("/issues/1", None), Err(Refusal::Missing));
        assert_eq!(get("/issues/1", Some(&read)), Ok(()));
        assert_eq!(get("/issues/1", Some(&api)), Ok(()));
        assert_eq!(get("/issues/1", Some(&metrics)), Err(Refusal::Forbidden));
        assert_eq!(post("/issues", Some(&read)), Err(Refusal::Forbidden));
        assert_eq!(post("/issues", Some(&api)), Ok(()));
        assert_eq!(get("/metrics", None), Err(Refusal::Missing));
        assert_eq!(get("/metrics", Some(&metrics)), Ok(()));
        assert_eq!(get("/metrics", Some(&api)), Ok(()));
        assert_eq!(get("/metrics", Some(&read)), Err(Refusal::Forbidden));
        assert_eq!(post("/metrics", Some(&metrics)), Err(Refusal::Forbidden));
        let head = access.decide(&Method::HEAD, "/", &headers(Some(&read)));
        assert_eq!(head, Ok(()));
        let options = access.decide(&Method::OPTIONS, "/", &headers(Some(&read)));
        assert_eq!(options, Err(Refusal::Forbidden));
    }

    #[test]
    fn the_metrics_token_alone_guards_only_metrics_and_a_read_token_alone_refuses_writes() {
        let metrics_only = Access::new(&Tokens {
            metrics: Some(METRICS_T.into()),
            ..Tokens::default()
        });
        let none = headers(None);
        assert_eq!(metrics_only.decide(&Method::POST, "/issues", &none), Ok(()));
        assert_eq!(
            metrics_only.decide(&Method::GET, "/metrics", &none),
            Err(Refusal::Missing)
        );
        let read_only = Access::new(&Tokens {
            read: Some(READ_T.into()),
            ..Tokens::default()
        });
        let read = headers(Some(&format!("Bearer {READ_T}")));
        assert_eq!(read_only.decide(&Method::GET, "/issues/1", &read), Ok(()));
        assert_eq!(
            read_only.decide(&Method::POST, "/issues", &read),
            Err(Refusal::Forbidden)
        );
        assert_eq!(read_only.decide(&Method::GET, "/metrics", &none), Ok(()));
    }

    #[test]
    fn only_the_exact_token_passes_as_bearer_or_basic_password() {
        let access = Access::new(&Tokens::api(API_T));
        let get = |auth: &str| access.decide(&Method::GET, "/", &headers(Some(auth)));
        assert_eq!(get(&format!("Bearer {API_T}")), Ok(()));
        assert_eq!(get(&format!("bearer  {API_T} ")), Ok(()));
        assert_eq!(get(&basic("anyone", API_T)), Ok(()));
        assert_eq!(get(&basic("", API_T)), Ok(()));
        assert_eq!(get(&basic(API_T, "x")), Err(Refusal::Wrong));
        assert_eq!(get(&format!("Bearer {}", &API_T[1..])), Err(Refusal::Wrong));
        assert_eq!(get(&format!("Bearer {API_T}2")), Err(Refusal::Wrong));
        assert_eq!(get(&format!("Basic {API_T}")), Err(Refusal::Malformed));
        let no_colon = base64::engine::general_purpose::STANDARD.encode(API_T);
        assert_eq!(get(&format!("Basic {no_colon}")), Err(Refusal::Malformed));
        assert_eq!(get("Bearer"), Err(Refusal::Malformed));
        assert_eq!(get("Bearer   "), Err(Refusal::Malformed));
        assert_eq!(get(API_T), Err(Refusal::Malformed));
        assert_eq!(get(&format!("Token {API_T}")), Err(Refusal::Malformed));
    }

    #[test]
    fn a_refusal_names_its_challenges_or_is_forbidden() {
        let unauthorized = refused(Refusal::Wrong);
        assert_eq!(unauthorized.status(), 401);
        let challenges: Vec<_> = unauthorized
            .headers()
            .get_all(WWW_AUTHENTICATE)
            .iter()
            .collect();
        assert_eq!(
            challenges,
            CHALLENGES
                .map(HeaderValue::from_static)
                .iter()
                .collect::<Vec<_>>()
        );
        let forbidden = refused(Refusal::Forbidden);
        assert_eq!(forbidden.status(), 403);
        assert!(forbidden.headers().get(WWW_AUTHENTICATE).is_none());
    }

    #[test]
    fn only_tokens_worth_guarding_with_are_configurable() {
        let api = |t: &str| Tokens::api(t).check();
        assert_eq!(Tokens::default().check(), Ok(()));
        assert_eq!(api(API_T), Ok(()));
        assert_eq!(api(&format!(" {API_T}\n")), Ok(()));
        assert_eq!(api("~!#$%&'()*+,-./:;<=>?@[]^_`{|}"), Ok(()));
        assert_eq!(api(""), Err(BadToken::Blank(API)));
        assert_eq!(api(" \t\n"), Err(BadToken::Blank(API)));
        assert_eq!(
            api("s3cret"),
            Err(BadToken::TooShort {
                name: API,
                chars: 6
            })
        );
        for unusable in [
            "tökén-0123456789abcdef",
            "a b-0123456789abcdef",
            "a\tb-0123456789abcdef",
            "a\u{7f}b-0123456789abcdef",
            "🔑-0123456789abcdef",
        ] {
            assert_eq!(
                api(unusable),
                Err(BadToken::NotVisibleAscii(API)),
                "{unusable:?}"
            );
        }
        let same = Tokens {
            api: Some(API_T.into()),
            read: Some(format!("{API_T}\n")),
            metrics: None,
        };
        assert_eq!(same.check(), Err(BadToken::Same(READ, API)));
        let same = Tokens {
            api: None,
            read: Some(READ_T.into()),
            metrics: Some(READ_T.into()),
        };
        assert_eq!(same.check(), Err(BadToken::Same(METRICS, READ)));
        let short_read = Tokens {
            api: Some(API_T.into()),
            read: Some("r".into()),
            metrics: None,
        };
        assert!(matches!(
            short_read.check(),
            Err(BadToken::TooShort { name: READ, .. })
        ));
    }

    #[test]
    fn every_refusal_has_its_counter_label() {
        let all = [
            Refusal::Missing,
            Refusal::Malformed,
            Refusal::Wrong,
            Refusal::Forbidden,
        ];
        assert_eq!(all.map(Refusal::label), crate::metrics::AUTH_REASONS);
    }

    /// The messages name the variable, never the token.
    #[test]
    fn bad_token_messages_do_not_show_the_token() {
        let secret = "s3cret-tökén";
        let message = Tokens::api(secret).check().unwrap_err().to_string();
        assert!(message.starts_with("NEWSNACK_API_TOKEN"), "{message}");
        assert!(!message.contains(secret), "{message}");
    }
}
