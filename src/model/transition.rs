//! One status change of one issue: a row of `issue_transition` and the JSON
//! payload of `NOTIFY issue_transition`, with the MAC that shows the log's
//! trigger sent it (migrations 18 and 20).

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha384};
use subtle::ConstantTimeEq;
use time::OffsetDateTime;

use crate::model::status::Status;

/// A committed status change. `seq` is the log position: strictly increasing
/// in commit order, so it doubles as a resume cursor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Transition {
    pub seq: i64,
    pub issue_id: i64,
    /// `None` for the initial `PENDING` of a new issue.
    pub from: Option<Status>,
    pub to: Status,
    #[serde(with = "time::serde::rfc3339")]
    pub at: OffsetDateTime,
    /// Attempts so far, as of this transition.
    #[serde(default)]
    pub attempts: i32,
    /// A `FAILED` that must not be retried automatically (a fatal error).
    #[serde(default)]
    pub fatal: bool,
}

impl Transition {
    /// Parses a NOTIFY payload.
    pub fn from_payload(payload: &str) -> Result<Self, serde_json::Error> {
        serde_json::from_str(payload)
    }
}

/// What the trigger puts between the payload (its closing brace dropped)
/// and the MAC's hex digits; a closing `"}` follows them.
const MAC_FIELD: &str = ", \"mac\" : \"";
/// A SHA-384 digest, in hex.
const MAC_HEX_DIGITS: usize = 96;

/// The key the log's trigger signs notifications with (`notification_key`,
/// readable by the owner only). Anyone may `NOTIFY` on the channel; only
/// the trigger, running as the owner, can sign.
///
/// The MAC is SHA-384 of the key followed by the payload: one digest where
/// HMAC takes two, and the trigger makes it while every transitioning
/// commit waits on the log's lock. SHA-384 keeps 128 bits of its state
/// out of the digest, so a MAC cannot be extended to a longer payload, the
/// flaw that rules out SHA-256 used this way.
#[derive(Clone)]
pub struct NotificationKey(Vec<u8>);

impl std::fmt::Debug for NotificationKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NotificationKey(..)")
    }
}

impl NotificationKey {
    pub fn new(key: &[u8]) -> Self {
        NotificationKey(key.to_vec())
    }

    fn mac(&self, payload: &str) -> [u8; 48] {
        Sha384::new()
            .chain_update(&self.0)
            .chain_update(payload.as_bytes())
            .finalize()
            .into()
    }

    /// The transition a payload announces, if its MAC was made with this
    /// key over the rest of it; `None` for anything else (no MAC, a wrong
    /// one, a payload changed after signing).
    pub fn verify(&self, payload: &str) -> Option<Transition> {
        let tag_start = payload.len().checked_sub(MAC_HEX_DIGITS + 2)?;
        let body_end = tag_start.checked_sub(MAC_FIELD.len())?;
        if payload.get(body_end..tag_start)? != MAC_FIELD || !payload.ends_with("\"}") {
            return None;
        }
        let tag = decode_hex(payload.get(tag_start..tag_start + MAC_HEX_DIGITS)?)?;
        let signed = format!("{}}}", payload.get(..body_end)?);
        if !bool::from(self.mac(&signed).ct_eq(tag.as_slice())) {
            return None;
        }
        Transition::from_payload(&signed).ok()
    }

    /// `payload` signed as the trigger signs it (for tests: only the
    /// owner holds the key).
    pub fn sign(&self, payload: &str) -> String {
        let tag: String = self
            .mac(payload)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let body = payload.strip_suffix('}').unwrap_or(payload);
        format!("{body}{MAC_FIELD}{tag}\"}}")
    }
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    hex.as_bytes()
        .chunks(2)
        .map(|pair| match pair {
            [hi, lo] => Some(digit(*hi)? << 4 | digit(*lo)?),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_payload_postgres_sends() {
        let payload = r#"{"seq" : 42, "issue_id" : 7, "from" : null, "to" : "PENDING", "at" : "2026-11-29T20:14:12.123456+00:00"}"#;
        let t = Transition::from_payload(payload).unwrap();
        assert_eq!(
            (t.seq, t.issue_id, t.from, t.to),
            (42, 7, None, Status::Pending)
        );
        assert_eq!(t.at.microsecond(), 123_456);
        let again = Transition::from_payload(&serde_json::to_string(&t).unwrap()).unwrap();
        assert_eq!(again, t);
    }

    #[test]
    fn a_signed_payload_verifies_with_its_key_only_and_unchanged() {
        let payload = r#"{"seq" : 42, "issue_id" : 7, "from" : null, "to" : "PENDING", "at" : "2026-11-29T20:14:12.123456+00:00"}"#;
        let key = NotificationKey::new(&[7; 32]);
        let signed = key.sign(payload);
        assert!(
            signed.starts_with(&payload[..payload.len() - 1]),
            "{signed}"
        );
        assert_eq!(key.verify(&signed), Transition::from_payload(payload).ok());
        assert_eq!(NotificationKey::new(&[8; 32]).verify(&signed), None);
        assert_eq!(key.verify(payload), None, "unsigned");
        assert_eq!(
            key.verify(&signed.replace("\"seq\" : 42", "\"seq\" : 43")),
            None
        );
        let mut flipped = signed.clone().into_bytes();
        let last_digit = flipped.len() - 3;
        flipped[last_digit] = if flipped[last_digit] == b'0' {
            b'1'
        } else {
            b'0'
        };
        assert_eq!(key.verify(&String::from_utf8(flipped).unwrap()), None);
        for bad in [
            "",
            "}",
            "\"}",
            "é\"}",
            &signed[1..],
            &signed.replace("\"}", "\" }"),
        ] {
            assert_eq!(key.verify(bad), None, "{bad}");
        }
    }

    /// The MAC is SHA-384 of the key and then the payload, as the trigger
    /// makes it (`sha384sum` of the two together gives the same digits).
    #[test]
    fn the_mac_is_sha384_of_key_and_payload() {
        let signed = NotificationKey::new(b"Jefe").sign("what do ya want for nothing?");
        assert!(
            signed.ends_with(
                "3e06a947ce4a9ca02c5dedaf4e95c1e31bc81c1971b59f71f4122feb3cce7e89\
                 80bd30fc073e41e189d9061cd7bcfdc1\"}"
            ),
            "{signed}"
        );
    }
}
