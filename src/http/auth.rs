//! Bearer-token authentication for every request that can change something.
//!
//! When an API token is configured (`NEWSNACK_API_TOKEN`, non-empty), every
//! request other than `GET`, `HEAD` and `OPTIONS` must carry
//! `Authorization: Bearer <token>`; anything else is answered 401
//! `{"error": ".."}` with `WWW-Authenticate: Bearer` before any handler
//! runs, so nothing happens. Reads stay open. Without a token every request
//! is let through (the service binds to loopback by default).
//!
//! The comparison is constant-time over SHA-256 digests of the expected and
//! the presented token, so neither the token's content nor its length can
//! be learnt from response timing.
//!
//! A token must be printable ASCII: a header value the server reads as
//! text carries nothing else, so any other token could never be presented
//! and every write would be refused. `serve` refuses such a token at
//! start-up ([`check_configurable`]).

use std::sync::Arc;

use axum::body::Body;
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::{HeaderMap, HeaderValue, Method, Request};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tower_http::validate_request::ValidateRequest;

use super::ApiError;

/// Why a request was refused (for the logs; the client gets one message).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("no `Authorization: Bearer` header")]
    Missing,
    #[error("the Authorization header is not `Bearer <token>`")]
    Malformed,
    #[error("wrong bearer token")]
    Wrong,
}

/// A configured token no request could ever present.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "NEWSNACK_API_TOKEN (--api-token) must be printable ASCII: it contains a character \
     an Authorization header cannot carry, so every write would be refused"
)]
pub struct UnusableToken;

/// Checks a token to configure: one with a character outside printable
/// ASCII (space and tab allowed inside) could never match a request.
/// `None` or blank (no authentication) is fine.
pub fn check_configurable(token: Option<&str>) -> Result<(), UnusableToken> {
    let presentable = |b: u8| b == b'\t' || (b' '..=b'~').contains(&b);
    match token.map(str::trim) {
        Some(t) if !t.bytes().all(presentable) => Err(UnusableToken),
        _ => Ok(()),
    }
}

/// The configured token, kept only as its digest. Cheap to clone.
#[derive(Clone, Default)]
pub struct ApiToken {
    digest: Option<Arc<[u8]>>,
}

impl ApiToken {
    /// `None` or an empty (or all-blank) token means: no authentication.
    /// Surrounding whitespace (a trailing newline from a file) is ignored.
    pub fn new(token: Option<&str>) -> ApiToken {
        ApiToken {
            digest: token
                .map(str::trim)
                .filter(|t| !t.is_empty())
                .map(|t| Arc::from(Sha256::digest(t.as_bytes()).as_slice())),
        }
    }

    /// True when requests that change something need the token.
    pub fn is_required(&self) -> bool {
        self.digest.is_some()
    }

    /// Checks the request headers; `Ok` when no token is configured.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), AuthError> {
        let Some(expected) = &self.digest else {
            return Ok(());
        };
        let presented = bearer_token(headers)?;
        let presented = Sha256::digest(presented.as_bytes());
        if bool::from(presented.as_slice().ct_eq(expected)) {
            Ok(())
        } else {
            Err(AuthError::Wrong)
        }
    }
}

/// Methods that only read, and so need no token.
pub fn is_read_only(method: &Method) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// The token of an `Authorization: Bearer <token>` header (the scheme is
/// case-insensitive, as RFC 7235 has it).
fn bearer_token(headers: &HeaderMap) -> Result<&str, AuthError> {
    let value = headers.get(AUTHORIZATION).ok_or(AuthError::Missing)?;
    let value = value.to_str().map_err(|_| AuthError::Malformed)?.trim();
    let (scheme, token) = value.split_once(' ').ok_or(AuthError::Malformed)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(AuthError::Malformed);
    }
    Ok(token)
}

/// The check in front of every route (`ValidateRequestHeaderLayer::custom`
/// with an [`ApiToken`]): refuses unauthenticated non-read requests with
/// 401. It decides before the request goes on, so it adds no future of its
/// own to a request that stays open.
impl<B> ValidateRequest<B> for ApiToken {
    type ResponseBody = Body;

    fn validate(&mut self, request: &mut Request<B>) -> Result<(), Response> {
        if is_read_only(request.method()) {
            return Ok(());
        }
        self.check(request.headers()).map_err(|reason| {
            tracing::warn!(method = %request.method(), path = request.uri().path(), %reason, "refused: not authenticated");
            crate::metrics::auth_rejected();
            let mut response = ApiError::Unauthorized.into_response();
            response
                .headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(authorization: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(value) = authorization {
            headers.insert(AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn no_token_configured_lets_everything_through() {
        for token in [None, Some(""), Some("  ")] {
            let open = ApiToken::new(token);
            assert!(!open.is_required());
            assert_eq!(open.check(&headers(None)), Ok(()));
        }
    }

    #[test]
    fn only_the_exact_bearer_token_passes() {
        let token = ApiToken::new(Some("s3cret"));
        assert!(token.is_required());
        assert_eq!(token.check(&headers(Some("Bearer s3cret"))), Ok(()));
        assert_eq!(token.check(&headers(Some("bearer  s3cret "))), Ok(()));
        assert_eq!(token.check(&headers(None)), Err(AuthError::Missing));
        assert_eq!(
            token.check(&headers(Some("Bearer s3cre"))),
            Err(AuthError::Wrong)
        );
        assert_eq!(
            token.check(&headers(Some("Bearer s3cret2"))),
            Err(AuthError::Wrong)
        );
        assert_eq!(
            token.check(&headers(Some("Basic s3cret"))),
            Err(AuthError::Malformed)
        );
        assert_eq!(
            token.check(&headers(Some("Bearer"))),
            Err(AuthError::Malformed)
        );
        assert_eq!(
            token.check(&headers(Some("s3cret"))),
            Err(AuthError::Malformed)
        );
    }

    /// A token is usable exactly when a request can present it: printable
    /// ASCII, with spaces or tabs inside.
    #[test]
    fn only_tokens_a_header_can_carry_are_configurable() {
        for usable in [
            None,
            Some(""),
            Some("s3cret"),
            Some("a b\tc~!"),
            Some(" padded \n"),
        ] {
            assert_eq!(check_configurable(usable), Ok(()), "{usable:?}");
            if let Some(token) = usable.map(str::trim).filter(|t| !t.is_empty()) {
                let header = format!("Bearer {token}");
                assert_eq!(ApiToken::new(usable).check(&headers(Some(&header))), Ok(()));
            }
        }
        for unusable in ["tökén", "naïve", "a\u{7f}b", "a\rb", "🔑"] {
            assert_eq!(
                check_configurable(Some(unusable)),
                Err(UnusableToken),
                "{unusable:?}"
            );
        }
    }

    #[test]
    fn reads_need_no_token() {
        assert!(is_read_only(&Method::GET));
        assert!(is_read_only(&Method::HEAD));
        assert!(is_read_only(&Method::OPTIONS));
        assert!(!is_read_only(&Method::POST));
        assert!(!is_read_only(&Method::PUT));
        assert!(!is_read_only(&Method::DELETE));
        assert!(!is_read_only(&Method::PATCH));
    }
}
