//! What an LLM call is for ([`Priority`]), which provider answers it
//! ([`Provider`]) and what it spent ([`TokenUsage`]).

/// Which calls go first: `briefing` (the default of `POST /ai-articles`,
/// and every pipeline run) before `feed`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Deserialize, serde::Serialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Priority {
    Briefing,
    Feed,
}

impl Priority {
    pub fn as_str(self) -> &'static str {
        match self {
            Priority::Briefing => "briefing",
            Priority::Feed => "feed",
        }
    }
}

impl Priority {
    /// The stored name; `None` for anything else.
    pub fn parse(text: &str) -> Option<Priority> {
        match text {
            "briefing" => Some(Priority::Briefing),
            "feed" => Some(Priority::Feed),
            _ => None,
        }
    }
}

/// The LLM provider a call goes to: `NEWSNACK_LLM_URL`'s, or
/// `NEWSNACK_LLM_FALLBACK_URL`'s while the primary is down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    Primary,
    Fallback,
}

impl Provider {
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::Primary => "primary",
            Provider::Fallback => "fallback",
        }
    }

    /// The stored name; `None` for anything else.
    pub fn parse(text: &str) -> Option<Provider> {
        match text {
            "primary" => Some(Provider::Primary),
            "fallback" => Some(Provider::Fallback),
            _ => None,
        }
    }
}

/// What a model said it spent on one article, from the API's `usage`
/// (`None` where it did not say).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TokenUsage {
    pub prompt_tokens: Option<i32>,
    pub completion_tokens: Option<i32>,
}

impl TokenUsage {
    /// What two calls spent together; a count either call did not report
    /// stays unknown.
    pub fn plus(self, other: TokenUsage) -> TokenUsage {
        let add = |a: Option<i32>, b: Option<i32>| Some(a?.saturating_add(b?));
        TokenUsage {
            prompt_tokens: add(self.prompt_tokens, other.prompt_tokens),
            completion_tokens: add(self.completion_tokens, other.completion_tokens),
        }
    }
}
