//! How `newsnack tail` prints a transition: aligned, readable columns
//! (coloured on a terminal), or one JSON object per line.

use time::format_description::well_known::Rfc3339;
use time::macros::format_description;

use crate::model::status::Status;
use crate::model::transition::Transition;

/// The output format of the tail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TailStyle {
    Plain,
    Color,
    Json,
}

/// One line, without the trailing newline.
pub fn render(t: &Transition, style: TailStyle) -> String {
    match style {
        TailStyle::Json => serde_json::json!({
            "seq": t.seq,
            "issue_id": t.issue_id,
            "from": t.from,
            "to": t.to,
            "at": t.at.format(&Rfc3339).unwrap_or_default(),
            "attempts": t.attempts,
            "fatal": t.fatal,
        })
        .to_string(),
        TailStyle::Plain | TailStyle::Color => {
            let at =
                t.at.to_offset(time::UtcOffset::UTC)
                    .format(format_description!(
                        "[year]-[month]-[day] [hour]:[minute]:[second].[subsecond digits:3]Z"
                    ))
                    .unwrap_or_default();
            let from = t.from.map_or("(new)", Status::as_str);
            let color = style == TailStyle::Color;
            format!(
                "{at}  seq {:<8} issue {:<8} {} -> {}",
                t.seq,
                t.issue_id,
                paint(from, t.from, 11, color),
                paint(t.to.as_str(), Some(t.to), 11, color),
            )
        }
    }
}

fn paint(text: &str, status: Option<Status>, width: usize, color: bool) -> String {
    let padded = format!("{text:<width$}");
    if !color {
        return padded;
    }
    let code = match status {
        None => "2",
        Some(Status::Pending) => "36",
        Some(Status::InProgress) => "33",
        Some(Status::Done) => "32",
        Some(Status::Failed) => "31;1",
    };
    format!("\x1b[{code}m{padded}\x1b[0m")
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    fn sample() -> Transition {
        Transition {
            seq: 42,
            issue_id: 7,
            from: Some(Status::Pending),
            to: Status::InProgress,
            at: datetime!(2026-11-29 20:14:12.5 UTC),
            attempts: 1,
            fatal: false,
        }
    }

    #[test]
    fn plain_lines_are_aligned_and_uncoloured() {
        let line = render(&sample(), TailStyle::Plain);
        assert_eq!(
            line,
            "2026-11-29 20:14:12.500Z  seq 42       issue 7        PENDING     -> IN_PROGRESS"
        );
        assert!(render(&sample(), TailStyle::Color).contains("\x1b[33m"));
    }

    #[test]
    fn json_lines_carry_the_payload_fields() {
        let v: serde_json::Value =
            serde_json::from_str(&render(&sample(), TailStyle::Json)).unwrap();
        assert_eq!(v["seq"], 42);
        assert_eq!(v["issue_id"], 7);
        assert_eq!(v["from"], "PENDING");
        assert_eq!(v["to"], "IN_PROGRESS");
        assert_eq!(v["at"], "2026-11-29T20:14:12.5Z");
    }
}
