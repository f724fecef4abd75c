//! Writers for tests that need the LLM to answer in a given way, without
//! one: offline articles, with failures chosen by the issue's title.

use futures::future::BoxFuture;
use futures::FutureExt;
use newsnack::writer::{Article, IssueText, OfflineWriter, WriteError, WriteErrorKind, Writer};

/// Writes offline articles, except for issues whose title starts with
/// `prefix`: those fail with a fatal bad-request error saying `message`
/// (no automatic retry), so a wait on them settles at once instead of at
/// its deadline.
pub struct FatalFor {
    /// The writer's name, as the articles record it.
    pub name: &'static str,
    pub prefix: &'static str,
    pub message: &'static str,
}

impl Writer for FatalFor {
    fn name(&self) -> &str {
        self.name
    }

    fn write<'a>(&'a self, issue: IssueText<'a>) -> BoxFuture<'a, Result<Article, WriteError>> {
        async move {
            if issue.title.starts_with(self.prefix) {
                return Err(WriteError::fatal(WriteErrorKind::BadRequest, self.message));
            }
            OfflineWriter.write(issue).await
        }
        .boxed()
    }
}
