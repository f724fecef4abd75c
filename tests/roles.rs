//! Least-privilege roles and rules nobody can bend: every statement a
//! writer and a reader may and may not run; a writer that shadows every
//! function of the schema (and the log and settings with temp tables), or
//! runs with an empty search_path, still gets the real rules, the real log
//! and the real lease; `newsnack grant` (library and binary) is idempotent,
//! reversible, and refuses what it cannot restrict without changing
//! anything. Each database here is owned and migrated by a role that is
//! not a superuser, as in production.

mod common;

use common::process::{newsnack, text};
use common::{first_column, within, TestDb};
use futures::StreamExt;
use newsnack::db::migrate::{migrate, migrate_up_to};
use newsnack::db::role::{self, GrantError, RoleKind};
use tokio::sync::mpsc;
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Client, NoTls, Notification};

/// Every table of the schema a granted role may read, as `grant` names
/// them: all but `notification_key`, which signs the log's notifications.
const TABLES: [&str; 16] = [
    "ai_article",
    "ai_article_tokens",
    "briefing",
    "issue",
    "issue_priority",
    "issue_status_delta",
    "issue_transition",
    "llm_budget",
    "llm_call",
    "llm_holder",
    "llm_provider",
    "llm_token_day",
    "newsnack_migration",
    "pipeline_run",
    "setting",
    "setting_spec",
];

/// A database owned and migrated by a role of its own (not a superuser),
/// and the roles a test makes on it.
struct Owned {
    db: TestDb,
    owner: String,
}

impl Owned {
    /// Migrated to the newest version.
    async fn new() -> Owned {
        Owned::at_version(None).await
    }

    /// Migrated up to `last` (all when `None`).
    async fn at_version(last: Option<i32>) -> Owned {
        let db = TestDb::empty().await;
        let owner = format!("{}_owner", db.name);
        db.raw()
            .await
            .batch_execute(&format!(
                "CREATE ROLE {owner} LOGIN; ALTER DATABASE {} OWNER TO {owner}",
                db.name
            ))
            .await
            .unwrap();
        let owned = Owned { db, owner };
        let mut client = owned.connect_as(&owned.owner).await;
        migrate_up_to(&mut client, last).await.unwrap();
        owned
    }

    /// A superuser session ("the administrator").
    async fn admin(&self) -> Client {
        self.db.raw().await
    }

    /// A new login role, named after the database (roles are cluster-wide).
    async fn role(&self, suffix: &str) -> String {
        let name = format!("{}_{suffix}", self.db.name);
        self.admin()
            .await
            .batch_execute(&format!("CREATE ROLE {name} LOGIN"))
            .await
            .unwrap();
        name
    }

    fn config_as(&self, role: &str) -> tokio_postgres::Config {
        let mut config = self.db.config.clone();
        config.user(role);
        config
    }

    /// A URL that connects as `role` (the test cluster trusts every role).
    fn url_as(&self, role: &str) -> String {
        let config = &self.db.config;
        let host = match &config.get_hosts()[0] {
            tokio_postgres::config::Host::Tcp(host) => host.clone(),
            #[allow(unreachable_patterns)]
            other => panic!("the test cluster listens on TCP, not {other:?}"),
        };
        format!(
            "postgres://{role}@{host}:{}/{}",
            config.get_ports()[0],
            self.db.name
        )
    }

    async fn connect_as(&self, role: &str) -> Client {
        let (client, connection) = self.config_as(role).connect(NoTls).await.unwrap();
        tokio::spawn(connection);
        client
    }

    async fn owner(&self) -> Client {
        self.connect_as(&self.owner).await
    }

    /// `newsnack grant`, run by the owner.
    async fn grant(&self, kind: RoleKind, role: &str) -> Result<role::GrantReport, GrantError> {
        let mut owner = self.owner().await;
        role::grant(&mut owner, kind, role).await
    }

    /// A session of `role` that listens on every channel newsnack sends on.
    async fn listen_as(&self, role: &str) -> Listening {
        let (client, mut connection) = self.config_as(role).connect(NoTls).await.unwrap();
        let (tx, notes) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(Ok(message)) = messages.next().await {
                if let AsyncMessage::Notification(n) = message {
                    let _ = tx.send(n);
                }
            }
        });
        client
            .batch_execute("LISTEN issue_transition; LISTEN setting_changed; LISTEN issue_removed")
            .await
            .unwrap();
        Listening {
            _client: client,
            notes,
        }
    }

    /// Every privilege `role` holds on the schema's tables, columns,
    /// sequences and the schema, by any path, sorted.
    async fn privileges_of(&self, role: &str) -> Vec<String> {
        first_column(
            &self.admin().await,
            "SELECT x FROM (
                     SELECT format('%s %s', p, c.relname) x
                       FROM pg_class c,
                            unnest(ARRAY['SELECT','INSERT','UPDATE','DELETE','TRUNCATE','REFERENCES','TRIGGER']) p
                      WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r'
                        AND has_table_privilege($1::name, c.oid, p)
                     UNION ALL
                     SELECT format('%s %s(%s)', p, c.relname, a.attname)
                       FROM pg_class c
                       JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped,
                            unnest(ARRAY['INSERT','UPDATE','REFERENCES']) p
                      WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r'
                        AND NOT has_table_privilege($1::name, c.oid, p)
                        AND has_column_privilege($1::name, c.oid, a.attnum, p)
                     UNION ALL
                     SELECT format('%s sequence %s', p, c.relname)
                       FROM pg_class c, unnest(ARRAY['USAGE','SELECT','UPDATE']) p
                      WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'S'
                        AND has_sequence_privilege($1::name, c.oid, p)
                     UNION ALL
                     SELECT format('%s schema', p) FROM unnest(ARRAY['USAGE','CREATE']) p
                      WHERE has_schema_privilege($1::name, 'public', p)
                 ) s ORDER BY x",
            &[&role],
        )
        .await
    }

    /// Every access control list of the schema, its tables, columns and
    /// sequences: what a refused grant must leave as it was.
    async fn every_acl(&self) -> String {
        self.admin()
            .await
            .query_one(
                "SELECT string_agg(x, E'\\n' ORDER BY x) FROM (
                     SELECT format('%s %s', c.relname, c.relacl) x FROM pg_class c
                      WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'S')
                     UNION ALL
                     SELECT format('%s.%s %s', c.relname, a.attname, a.attacl)
                       FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                      WHERE c.relnamespace = 'public'::regnamespace AND a.attacl IS NOT NULL
                     UNION ALL
                     SELECT format('schema %s', nspacl) FROM pg_namespace WHERE nspname = 'public'
                 ) s",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    }
}

/// What a writer holds after `grant writer`, and nothing more.
fn writer_privileges() -> Vec<String> {
    let mut expected: Vec<String> = TABLES.iter().map(|t| format!("SELECT {t}")).collect();
    for column in role::WRITER_INSERT_COLUMNS {
        expected.push(format!("INSERT issue({column})"));
    }
    for column in role::WRITER_UPDATE_COLUMNS {
        expected.push(format!("UPDATE issue({column})"));
    }
    expected.push("USAGE schema".into());
    expected.sort();
    expected
}

/// What a reader holds after `grant reader`, and nothing more.
fn reader_privileges() -> Vec<String> {
    let mut expected: Vec<String> = TABLES.iter().map(|t| format!("SELECT {t}")).collect();
    expected.push("USAGE schema".into());
    expected.sort();
    expected
}

/// A listening session and what it has been sent.
struct Listening {
    _client: Client,
    notes: mpsc::UnboundedReceiver<Notification>,
}

impl Listening {
    /// The next notification on `channel` (others are skipped).
    async fn next(&mut self, channel: &str) -> String {
        within(10, &format!("a notification on {channel}"), async {
            loop {
                let note = self
                    .notes
                    .recv()
                    .await
                    .expect("the listening session is up");
                if note.channel() == channel {
                    return note.payload().to_string();
                }
            }
        })
        .await
    }

    /// The next transition announced.
    async fn transition(&mut self) -> serde_json::Value {
        serde_json::from_str(&self.next("issue_transition").await).unwrap()
    }
}

/// Runs `sql` as the session's role and expects "permission denied".
async fn refused(client: &Client, sql: &str) {
    let err = client
        .batch_execute(sql)
        .await
        .expect_err(&format!("refused: {sql}"));
    // Ends a transaction block the statement opened (a warning otherwise).
    client.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        err.code(),
        Some(&SqlState::INSUFFICIENT_PRIVILEGE),
        "{sql}: {err:?}"
    );
}

/// The whole state a refused statement must leave alone: every row of the
/// issue table, the log, articles and settings.
async fn snapshot(client: &Client) -> String {
    client
        .query_one(
            "SELECT concat_ws(E'\\n',
                 (SELECT string_agg(i::text, ' ' ORDER BY id) FROM public.issue i),
                 (SELECT string_agg(t::text, ' ' ORDER BY seq) FROM public.issue_transition t),
                 (SELECT string_agg(a::text, ' ' ORDER BY id) FROM public.ai_article a),
                 (SELECT string_agg(s::text, ' ' ORDER BY key) FROM public.setting s),
                 (SELECT string_agg(s::text, ' ' ORDER BY key) FROM public.setting_spec s),
                 (SELECT count(*) FROM public.briefing), (SELECT count(*) FROM public.pipeline_run),
                 (SELECT count(*) FROM public.newsnack_migration),
                 (SELECT last_value FROM public.issue_claim_id_seq))",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Inserts an issue as the session's role; returns its id.
async fn add_issue(client: &Client, title: &str) -> i64 {
    client
        .query_one(
            "INSERT INTO issue (title, body, score) VALUES ($1, 'the source', 2.5) RETURNING id",
            &[&title],
        )
        .await
        .unwrap()
        .get(0)
}

/// Moves issue `id` into `to` as the session's role, and checks that the
/// move was logged in the real log and announced with the same `seq`,
/// `from` and `to`.
async fn moves(client: &Client, listening: &mut Listening, id: i64, from: &str, to: &str) {
    let changed = client
        .execute(
            "UPDATE issue SET processing_status = $2 WHERE id = $1",
            &[&id, &to],
        )
        .await
        .unwrap_or_else(|e| panic!("{from} -> {to}: {e:?}"));
    assert_eq!(changed, 1);
    let note = listening.transition().await;
    assert_eq!(
        (
            note["issue_id"].as_i64(),
            note["from"].as_str(),
            note["to"].as_str()
        ),
        (Some(id), Some(from), Some(to)),
        "{note}"
    );
    let logged = client
        .query_one(
            "SELECT issue_id, from_status, to_status FROM public.issue_transition WHERE seq = $1",
            &[&note["seq"].as_i64()],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            logged.get::<_, i64>(0),
            logged.get::<_, Option<String>>(1),
            logged.get::<_, String>(2)
        ),
        (id, Some(from.to_string()), to.to_string())
    );
}

/// Takes an issue to DONE as the owner.
async fn done_by_owner(owned: &Owned, id: i64) {
    let owner = owned.owner().await;
    for step in ["IN_PROGRESS", "DONE"] {
        owner
            .execute(
                "UPDATE issue SET processing_status = $2 WHERE id = $1",
                &[&id, &step],
            )
            .await
            .unwrap();
    }
}

/// Asserts that moving `id` to `to` is refused with the usual message.
async fn illegal(client: &Client, id: i64, from: &str, to: &str) {
    let err = client
        .execute(
            "UPDATE issue SET processing_status = $2 WHERE id = $1",
            &[&id, &to],
        )
        .await
        .expect_err("an illegal transition is refused");
    assert_eq!(err.code(), Some(&SqlState::CHECK_VIOLATION), "{err:?}");
    assert_eq!(
        err.as_db_error().unwrap().message(),
        format!("illegal status transition for issue {id}: {from} -> {to}")
    );
}

#[tokio::test]
async fn a_writer_adds_issues_and_moves_them_enforced_logged_and_announced() {
    let owned = Owned::new().await;
    let writer = owned.role("writer").await;
    owned.grant(RoleKind::Writer, &writer).await.unwrap();
    assert_eq!(owned.privileges_of(&writer).await, writer_privileges());
    let mut listening = owned.listen_as(&owned.owner).await;
    let w = owned.connect_as(&writer).await;
    // The trigger functions fire for it without its being able to call
    // them.
    let may_call: bool = w
        .query_one(
            "SELECT has_function_privilege('public.issue_before_update()', 'EXECUTE')
                 OR has_function_privilege('public.issue_transition_record()', 'EXECUTE')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!may_call);

    let id = add_issue(&w, "Rates rise").await;
    let note = listening.transition().await;
    assert_eq!(
        (note["issue_id"].as_i64(), note["to"].as_str()),
        (Some(id), Some("PENDING"))
    );
    assert!(note["from"].is_null(), "{note}");
    let logged: i64 = w
        .query_one(
            "SELECT count(*) FROM public.issue_transition WHERE issue_id = $1 AND seq = $2",
            &[&id, &note["seq"].as_i64()],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(logged, 1);

    moves(&w, &mut listening, id, "PENDING", "IN_PROGRESS").await;
    // A claim by a writer is a claim like anyone's: an attempt, a fencing
    // token from the real sequence, the default lease.
    let row = w
        .query_one(
            "SELECT attempts, claim_id, extract(epoch FROM lease_until - now())::float8,
                    (SELECT claim_id FROM public.issue_transition
                      WHERE issue_id = $1 AND to_status = 'IN_PROGRESS')
               FROM issue WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let (attempts, token, lease, logged_token): (i32, Option<i64>, f64, Option<i64>) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(attempts, 1);
    assert!(
        token.is_some_and(|t| t > 0) && token == logged_token,
        "{token:?}"
    );
    assert!((50.0..=61.0).contains(&lease), "{lease}");
    moves(&w, &mut listening, id, "IN_PROGRESS", "DONE").await;

    let other = add_issue(&w, "Storm").await;
    assert_eq!(
        listening.transition().await["issue_id"].as_i64(),
        Some(other)
    );
    moves(&w, &mut listening, other, "PENDING", "IN_PROGRESS").await;
    moves(&w, &mut listening, other, "IN_PROGRESS", "FAILED").await;
    moves(&w, &mut listening, other, "FAILED", "PENDING").await;
    moves(&w, &mut listening, other, "PENDING", "IN_PROGRESS").await;
    moves(&w, &mut listening, other, "IN_PROGRESS", "FAILED").await;
    moves(&w, &mut listening, other, "FAILED", "IN_PROGRESS").await;

    // Illegal changes are refused with the usual message, logged nowhere
    // and announced never: the next announcement is the next legal move.
    let owner = owned.owner().await;
    let before = snapshot(&owner).await;
    illegal(&w, id, "DONE", "PENDING").await;
    illegal(&w, id, "DONE", "FAILED").await;
    illegal(&w, other, "IN_PROGRESS", "PENDING").await;
    assert_eq!(snapshot(&owner).await, before);
    moves(&w, &mut listening, other, "IN_PROGRESS", "DONE").await;

    // The other columns it may write, on insert and update, are not
    // transitions.
    let third: i64 = w
        .query_one(
            "INSERT INTO issue (title, body, score, collected_at)
             VALUES ('Old news', 'from yesterday', 1, now() - interval '1 day') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        listening.transition().await["issue_id"].as_i64(),
        Some(third)
    );
    let seq_before: i64 = w
        .query_one("SELECT max(seq) FROM public.issue_transition", &[])
        .await
        .unwrap()
        .get(0);
    w.execute(
        "UPDATE issue SET title = 'Older news', body = 'b', score = 9,
                          collected_at = now() - interval '2 days' WHERE id = $1",
        &[&third],
    )
    .await
    .unwrap();
    let row = w
        .query_one(
            "SELECT title, score, (SELECT max(seq) FROM public.issue_transition) FROM issue WHERE id = $1",
            &[&third],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            row.get::<_, String>(0),
            row.get::<_, f64>(1),
            row.get::<_, i64>(2)
        ),
        ("Older news".to_string(), 9.0, seq_before)
    );
}

/// Another system adds stories keyed by where they came from, as a writer:
/// `ON CONFLICT (source_key) DO NOTHING` adds each key once, logged and
/// announced once, and the writer may set and change the key.
#[tokio::test]
async fn a_writer_adds_keyed_issues_once_with_on_conflict() {
    let owned = Owned::new().await;
    let writer = owned.role("writer").await;
    owned.grant(RoleKind::Writer, &writer).await.unwrap();
    let mut listening = owned.listen_as(&owned.owner).await;
    let w = owned.connect_as(&writer).await;
    let keyed = "INSERT INTO issue (title, body, score, source_key)
                 VALUES ($1, 'b', 1, 'feed:42') ON CONFLICT (source_key) DO NOTHING RETURNING id";
    let first: i64 = w.query_one(keyed, &[&"Rates rise"]).await.unwrap().get(0);
    let note = listening.transition().await;
    assert_eq!(note["issue_id"].as_i64(), Some(first));
    let again = w.query(keyed, &[&"Rates rise (again)"]).await.unwrap();
    assert!(again.is_empty(), "the key is there: nothing added");
    // Without a key, as before, each insert adds one.
    let unkeyed = add_issue(&w, "Storm").await;
    assert_eq!(
        listening.transition().await["issue_id"].as_i64(),
        Some(unkeyed),
        "the refused insert was neither logged nor announced"
    );
    w.execute(
        "UPDATE issue SET source_key = 'feed:43' WHERE id = $1",
        &[&unkeyed],
    )
    .await
    .unwrap();
    let keys: Vec<(i64, Option<String>)> = w
        .query("SELECT id, source_key FROM issue ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        keys,
        [
            (first, Some("feed:42".to_string())),
            (unkeyed, Some("feed:43".to_string()))
        ]
    );
    let empty = w
        .execute(
            "INSERT INTO issue (title, source_key) VALUES ('x', '')",
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(empty.code(), Some(&SqlState::CHECK_VIOLATION), "{empty:?}");
}

#[tokio::test]
async fn a_writer_may_do_nothing_else() {
    let owned = Owned::new().await;
    let writer = owned.role("writer").await;
    owned.grant(RoleKind::Writer, &writer).await.unwrap();
    let w = owned.connect_as(&writer).await;
    let id = add_issue(&w, "Held").await;
    w.execute(
        "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    let done = add_issue(&w, "Finished").await;
    done_by_owner(&owned, done).await;
    let owner = owned.owner().await;
    owner
        .execute(
            "INSERT INTO ai_article (issue_id, headline, body, writer, claim_id)
             SELECT id, 'h', 'b', 'test', claim_id FROM issue WHERE id = $1",
            &[&done],
        )
        .await
        .unwrap();

    // It reads every table, and may lock rows to claim them.
    for table in TABLES {
        w.batch_execute(&format!("SELECT * FROM {table}"))
            .await
            .unwrap();
    }
    w.batch_execute(
        "BEGIN; SELECT id FROM issue WHERE processing_status = 'PENDING' FOR NO KEY UPDATE SKIP LOCKED; ROLLBACK",
    )
    .await
    .unwrap();

    let before = snapshot(&owner).await;
    let columns = [
        "attempts = 9",
        "claim_id = 1",
        "claimed_by = 'me'",
        "lease_until = now() + interval '1 day'",
        "last_error = 'x'",
        "retry_not_before = 'infinity'",
        "updated_at = now()",
        "id = id + 1000",
    ];
    for set in columns {
        refused(&w, &format!("UPDATE issue SET {set} WHERE id = {id}")).await;
        // Not even alongside a status change.
        refused(
            &w,
            &format!("UPDATE issue SET processing_status = 'FAILED', {set} WHERE id = {id}"),
        )
        .await;
    }
    for statement in [
        "INSERT INTO issue (id, title) VALUES (99999, 'x')",
        "INSERT INTO issue (title, processing_status) VALUES ('x', 'PENDING')",
        "INSERT INTO issue (title, attempts) VALUES ('x', 0)",
        "INSERT INTO issue (title, claimed_by) VALUES ('x', 'me')",
        "INSERT INTO issue (title, retry_not_before) VALUES ('x', now())",
        "DELETE FROM issue WHERE id = 1",
        "TRUNCATE issue CASCADE",
        "BEGIN; LOCK TABLE issue IN ACCESS EXCLUSIVE MODE",
        "INSERT INTO issue_transition (issue_id, to_status, at, attempts) VALUES (1, 'DONE', now(), 1)",
        "UPDATE issue_transition SET to_status = 'DONE'",
        "DELETE FROM issue_transition",
        "TRUNCATE issue_transition",
        "INSERT INTO ai_article (issue_id, headline, body, writer, claim_id) VALUES (1, 'h', 'b', 'w', 1)",
        "UPDATE ai_article SET body = 'rewritten'",
        "DELETE FROM ai_article",
        "INSERT INTO setting (key, value) VALUES ('top_k', '9')",
        "UPDATE setting SET value = '9' WHERE key = 'top_k'",
        "DELETE FROM setting",
        "TRUNCATE setting",
        "UPDATE setting_spec SET max_value = 1",
        "INSERT INTO briefing (title, briefing_date, issue_ids, body) VALUES ('t', now(), '{1}', 'b')",
        "UPDATE pipeline_run SET outcome = 'skip'",
        "DELETE FROM newsnack_migration",
        "SELECT nextval('issue_claim_id_seq')",
        "SELECT setval('issue_transition_seq_seq', 1)",
        "SELECT nextval('issue_id_seq')",
        "CREATE TABLE public.mine (x int)",
        "CREATE FUNCTION public.issue_transition_is_legal(int) RETURNS boolean LANGUAGE sql AS 'SELECT true'",
        "ALTER TABLE issue DISABLE TRIGGER USER",
        "CREATE TRIGGER mine BEFORE UPDATE ON issue FOR EACH ROW EXECUTE FUNCTION issue_before_insert()",
        "SET session_replication_role = replica",
        "SELECT public.issue_transition_record()",
        "SELECT public.setting_validate()",
        "SELECT * FROM notification_key",
        "SELECT public.newsnack_rotate_notification_key()",
    ] {
        refused(&w, statement).await;
    }
    assert_eq!(snapshot(&owner).await, before);
}

#[tokio::test]
async fn a_reader_reads_everything_and_writes_nothing() {
    let owned = Owned::new().await;
    let reader = owned.role("reader").await;
    let report = owned.grant(RoleKind::Reader, &reader).await.unwrap();
    assert_eq!(
        report.tables,
        TABLES
            .iter()
            .map(|t| format!("public.{t}"))
            .collect::<Vec<_>>()
    );
    assert_eq!(owned.privileges_of(&reader).await, reader_privileges());
    let owner = owned.owner().await;
    let id = add_issue(&owner, "Read me").await;
    let r = owned.connect_as(&reader).await;
    for table in TABLES {
        r.batch_execute(&format!("SELECT * FROM {table}"))
            .await
            .unwrap();
    }
    let before = snapshot(&owner).await;
    for statement in [
        "INSERT INTO issue (title, body, score) VALUES ('x', 'y', 1)".to_string(),
        format!("UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = {id}"),
        format!("UPDATE issue SET title = 'renamed' WHERE id = {id}"),
        format!("DELETE FROM issue WHERE id = {id}"),
        "TRUNCATE issue CASCADE".into(),
        format!("SELECT id FROM issue WHERE id = {id} FOR NO KEY UPDATE SKIP LOCKED"),
        "INSERT INTO issue_transition (issue_id, to_status, at, attempts) VALUES (1, 'DONE', now(), 1)".into(),
        "DELETE FROM issue_transition".into(),
        format!("INSERT INTO ai_article (issue_id, headline, body, writer, claim_id) VALUES ({id}, 'h', 'b', 'w', 1)"),
        "UPDATE setting SET value = '9' WHERE key = 'top_k'".into(),
        "TRUNCATE setting".into(),
        "UPDATE setting_spec SET max_value = 1".into(),
        "UPDATE pipeline_run SET outcome = 'skip'".into(),
        "DELETE FROM briefing".into(),
        "SELECT nextval('issue_claim_id_seq')".into(),
        "CREATE TABLE public.mine (x int)".into(),
        "SELECT key FROM notification_key".into(),
        "SELECT public.newsnack_rotate_notification_key()".into(),
    ] {
        refused(&r, &statement).await;
    }
    assert_eq!(snapshot(&owner).await, before);
}

/// A schema named after `role` and owned by it, which every role may use:
/// the owner whose rights the rules run with included, since a schema it
/// may not use would be off its path whatever the setting.
async fn schema_of_its_own(owned: &Owned, role: &str, client: &Client) {
    owned
        .admin()
        .await
        .batch_execute(&format!("CREATE SCHEMA {role} AUTHORIZATION {role}"))
        .await
        .unwrap();
    client
        .batch_execute(&format!("GRANT USAGE ON SCHEMA {role} TO PUBLIC"))
        .await
        .unwrap();
}

/// The writer's own schema, first on its search_path by default
/// (`"$user", public`), with a stand-in for every function of the schema
/// and for the catalogue's functions and operators the rules use; temp
/// tables for the log and the settings. Returns how many functions of the
/// schema it shadowed.
async fn shadow_everything(owned: &Owned, role: &str, client: &Client) -> usize {
    schema_of_its_own(owned, role, client).await;
    let functions = client
        .query(
            "SELECT p.proname::text, pg_get_function_identity_arguments(p.oid),
                    pg_get_function_result(p.oid), pg_get_function_arguments(p.oid)
               FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace",
            &[],
        )
        .await
        .unwrap();
    assert!(functions.len() >= 11, "{}", functions.len());
    for f in &functions {
        let (name, args, result): (String, String, String) = (f.get(0), f.get(1), f.get(2));
        let body = match result.as_str() {
            "trigger" => "LANGUAGE plpgsql AS $$BEGIN RETURN NEW; END$$".to_string(),
            "boolean" => "LANGUAGE sql AS 'SELECT true'".into(),
            "integer" => "LANGUAGE sql AS 'SELECT 86400'".into(),
            "bigint" => "LANGUAGE sql AS 'SELECT 0::bigint'".into(),
            "text" => "LANGUAGE sql AS 'SELECT NULL::text'".into(),
            "timestamp with time zone" => {
                "LANGUAGE sql AS $$SELECT '2000-01-01'::timestamptz$$".into()
            }
            "void" => "LANGUAGE sql AS ''".into(),
            // A function with OUT parameters (the LLM budget's exchange).
            "record" => {
                let all_args: String = f.get(3);
                client
                    .batch_execute(&format!(
                        "CREATE FUNCTION {role}.{name}({all_args}) LANGUAGE plpgsql AS $$BEGIN END$$"
                    ))
                    .await
                    .unwrap();
                continue;
            }
            table if table.starts_with("TABLE(") => {
                "LANGUAGE plpgsql AS $$BEGIN RETURN; END$$".into()
            }
            other => panic!("a function of the schema returning {other}: {name}"),
        };
        client
            .batch_execute(&format!(
                "CREATE FUNCTION {role}.{name}({args}) RETURNS {result} {body}"
            ))
            .await
            .unwrap();
    }
    client
        .batch_execute(&format!(
            "CREATE FUNCTION {role}.now() RETURNS timestamptz LANGUAGE sql AS $$SELECT '2000-01-01'::timestamptz$$;
             CREATE FUNCTION {role}.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS $$SELECT '2000-01-01'::timestamptz$$;
             CREATE FUNCTION {role}.nextval(regclass) RETURNS bigint LANGUAGE sql AS 'SELECT -42::bigint';
             CREATE FUNCTION {role}.pg_notify(text, text) RETURNS void LANGUAGE sql AS '';
             CREATE FUNCTION {role}.pg_advisory_xact_lock(bigint) RETURNS void LANGUAGE sql AS '';
             CREATE FUNCTION {role}.txid_current() RETURNS bigint LANGUAGE sql AS 'SELECT 0::bigint';
             CREATE FUNCTION {role}.sha256(bytea) RETURNS bytea LANGUAGE sql AS $$SELECT '\\x00'::bytea$$;
             CREATE FUNCTION {role}.encode(bytea, text) RETURNS text LANGUAGE sql AS $$SELECT 'forged'$$;
             CREATE FUNCTION {role}.convert_to(text, name) RETURNS bytea LANGUAGE sql AS $$SELECT '\\x00'::bytea$$;
             CREATE FUNCTION {role}.make_interval(years int DEFAULT 0, months int DEFAULT 0,
                 weeks int DEFAULT 0, days int DEFAULT 0, hours int DEFAULT 0, mins int DEFAULT 0,
                 secs double precision DEFAULT 0) RETURNS interval LANGUAGE sql AS $$SELECT interval '1 day'$$;
             CREATE FUNCTION {role}.always(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT true';
             CREATE FUNCTION {role}.never(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT false';
             CREATE OPERATOR {role}.= (LEFTARG = text, RIGHTARG = text, FUNCTION = {role}.always);
             CREATE OPERATOR {role}.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = {role}.never);
             CREATE TEMP TABLE issue_transition (LIKE public.issue_transition INCLUDING ALL);
             CREATE TEMP TABLE setting (LIKE public.setting INCLUDING ALL);
             INSERT INTO pg_temp.setting (key, value) VALUES ('lease_s', '86400');
             CREATE TABLE {role}.issue_transition (LIKE public.issue_transition INCLUDING ALL);
             CREATE TABLE {role}.setting (LIKE public.setting INCLUDING ALL);
             INSERT INTO {role}.setting (key, value) VALUES ('lease_s', '86400');"
        ))
        .await
        .unwrap();
    functions.len()
}

/// The key the log's trigger signs with, read as the owner.
async fn notification_key(owner: &Client) -> newsnack::model::transition::NotificationKey {
    let key: Vec<u8> = owner
        .query_one("SELECT key FROM public.notification_key", &[])
        .await
        .unwrap()
        .get(0);
    newsnack::model::transition::NotificationKey::new(&key)
}

/// A claim made in `client`'s session: the lease it got (seconds from now)
/// and its token.
async fn claim(client: &Client, id: i64) -> (f64, i64) {
    client
        .execute(
            "UPDATE public.issue SET processing_status = 'IN_PROGRESS' WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let row = client
        .query_one(
            "SELECT extract(epoch FROM lease_until OPERATOR(pg_catalog.-) pg_catalog.now())::float8,
                    claim_id FROM public.issue WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test]
async fn a_writer_that_shadows_every_function_gets_the_real_rules_log_and_lease() {
    let owned = Owned::new().await;
    let writer = owned.role("writer").await;
    owned.grant(RoleKind::Writer, &writer).await.unwrap();
    let w = owned.connect_as(&writer).await;
    let shadowed = shadow_everything(&owned, &writer, &w).await;
    let mut listening = owned.listen_as(&owned.owner).await;
    let owner = owned.owner().await;
    let done = add_issue(&owner, "Done").await;
    let pending = add_issue(&owner, "Pending").await;
    let another = add_issue(&owner, "Another").await;
    done_by_owner(&owned, done).await;
    for _ in 0..5 {
        listening.transition().await;
    }
    let key = notification_key(&owner).await;

    // Its own schema first (the default path), then before the catalogue
    // too, so that its operators win.
    for (path, id, shadows) in [
        (r#""$user", public"#.to_string(), pending, "f t"),
        (format!("{writer}, pg_catalog, public"), another, "t t"),
    ] {
        w.batch_execute(&format!("SET search_path = {path}"))
            .await
            .unwrap();
        let resolved: String = w
            .query_one(
                "SELECT pg_catalog.format('%s %s', 'x' = 'y', issue_transition_is_legal('DONE', 'PENDING'))",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(resolved, shadows, "{path}: the shadows are in effect");
        illegal(&w, done, "DONE", "PENDING").await;
        let (lease, token) = claim(&w, id).await;
        assert!((50.0..=61.0).contains(&lease), "{path}: {lease}");
        assert!(token > 0, "{path}: {token}");
        let payload = listening.next("issue_transition").await;
        let signed = key.verify(&payload);
        assert_eq!(
            signed.map(|t| (t.issue_id, t.to)),
            Some((id, newsnack::model::status::Status::InProgress)),
            "{path}: announced and signed with the owner's key: {payload}"
        );
        let row = w
            .query_one(
                "SELECT (SELECT pg_catalog.count(*) FROM public.issue_transition
                          WHERE issue_id OPERATOR(pg_catalog.=) $1),
                        (SELECT pg_catalog.count(*) FROM pg_temp.issue_transition),
                        (SELECT pg_catalog.count(*) FROM public.issue
                          WHERE updated_at OPERATOR(pg_catalog.<) '2001-01-01')",
                &[&id],
            )
            .await
            .unwrap();
        assert_eq!(
            (
                row.get::<_, i64>(0),
                row.get::<_, i64>(1),
                row.get::<_, i64>(2)
            ),
            (2, 0, 0),
            "{path}: the real log holds the issue's two rows, the temp one none"
        );
    }
    assert!(shadowed >= 11);
}

/// The issue's two row triggers have no search_path of their own (the
/// log's since migration 20, the rule's since 21: the setting cost every
/// row), so they and the two helpers the rule inlines name every function,
/// operator and type with its schema. A writer whose own schema comes
/// before the catalogue, with a stand-in that fails for every built-in
/// operator and for every built-in function and base type whose name their
/// sources hold, still claims, renames, fails, resets and finishes an issue
/// (the lease moved on for a claim held open), each transition in the real
/// log and signed with the owner's key, and is still refused `DONE ->
/// PENDING` by the rule itself. Leave one name unqualified and the
/// stand-in's error fails the statement or the commit.
#[tokio::test]
async fn the_row_triggers_name_nothing_a_caller_can_shadow() {
    let owned = Owned::new().await;
    let writer = owned.role("writer").await;
    owned.grant(RoleKind::Writer, &writer).await.unwrap();
    let owner = owned.owner().await;
    let mut listening = owned.listen_as(&owned.owner).await;
    let id = add_issue(&owner, "Shadowed").await;
    listening.transition().await;
    let key = notification_key(&owner).await;

    // A new session, so that the trigger is compiled under the shadows.
    let w = owned.connect_as(&writer).await;
    schema_of_its_own(&owned, &writer, &w).await;
    w.batch_execute(&format!(
        r#"SET search_path = {writer}, pg_catalog, public;
        DO $shadow$
        DECLARE
            source pg_catalog.text := (SELECT pg_catalog.string_agg(p.prosrc, ' ') FROM pg_catalog.pg_proc p
                WHERE p.oid OPERATOR(pg_catalog.=) ANY (ARRAY['public.issue_transition_record()',
                    'public.issue_before_update()', 'public.issue_transition_is_legal(text, text)',
                    'public.newsnack_lease_seconds()']::pg_catalog.regprocedure[]));
            f record;
            fails pg_catalog.text := 'LANGUAGE plpgsql AS $f$BEGIN RAISE EXCEPTION ''a shadow ran''; END$f$';
        BEGIN
            FOR f IN SELECT o.oid, o.oprname, o.oprleft::pg_catalog.regtype AS l,
                            o.oprright::pg_catalog.regtype AS r, o.oprresult::pg_catalog.regtype AS result
                       FROM pg_catalog.pg_operator o
                      WHERE o.oprnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace LOOP
                BEGIN
                    IF f.l IS NULL THEN
                        EXECUTE pg_catalog.format('CREATE FUNCTION {writer}.op%s(%s) RETURNS %s %s',
                            f.oid, f.r, f.result, fails);
                        EXECUTE pg_catalog.format('CREATE OPERATOR {writer}.%s (RIGHTARG = %s, FUNCTION = {writer}.op%s)',
                            f.oprname, f.r, f.oid);
                    ELSE
                        EXECUTE pg_catalog.format('CREATE FUNCTION {writer}.op%s(%s, %s) RETURNS %s %s',
                            f.oid, f.l, f.r, f.result, fails);
                        EXECUTE pg_catalog.format('CREATE OPERATOR {writer}.%s (LEFTARG = %s, RIGHTARG = %s, FUNCTION = {writer}.op%s)',
                            f.oprname, f.l, f.r, f.oid);
                    END IF;
                EXCEPTION WHEN OTHERS THEN NULL;
                END;
            END LOOP;
            FOR f IN SELECT p.proname, pg_catalog.pg_get_function_identity_arguments(p.oid) AS args,
                            pg_catalog.pg_get_function_result(p.oid) AS result
                       FROM pg_catalog.pg_proc p
                      WHERE p.pronamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace
                        AND p.prokind OPERATOR(pg_catalog.=) 'f'
                        AND source OPERATOR(pg_catalog.~) ('\m' OPERATOR(pg_catalog.||) p.proname OPERATOR(pg_catalog.||) '\M') LOOP
                BEGIN
                    EXECUTE pg_catalog.format('CREATE FUNCTION {writer}.%I(%s) RETURNS %s %s',
                        f.proname, f.args, f.result, fails);
                EXCEPTION WHEN OTHERS THEN NULL;
                END;
            END LOOP;
            FOR f IN SELECT t.typname FROM pg_catalog.pg_type t
                      WHERE t.typnamespace OPERATOR(pg_catalog.=) 'pg_catalog'::pg_catalog.regnamespace
                        AND t.typtype OPERATOR(pg_catalog.=) 'b'
                        AND source OPERATOR(pg_catalog.~) ('\m' OPERATOR(pg_catalog.||) t.typname OPERATOR(pg_catalog.||) '\M') LOOP
                EXECUTE pg_catalog.format('CREATE DOMAIN {writer}.%I AS pg_catalog.int4 CHECK (VALUE IS NULL)', f.typname);
            END LOOP;
        END
        $shadow$;"#
    ))
    .await
    .unwrap();
    let shadows = w
        .query_one(
            "SELECT (SELECT pg_catalog.count(*) FROM pg_catalog.pg_operator
                      WHERE oprnamespace OPERATOR(pg_catalog.=) $1::pg_catalog.text::pg_catalog.regnamespace),
                    (SELECT pg_catalog.array_agg(proname::pg_catalog.text ORDER BY proname) FROM pg_catalog.pg_proc
                      WHERE pronamespace OPERATOR(pg_catalog.=) $1::pg_catalog.text::pg_catalog.regnamespace
                        AND proname OPERATOR(pg_catalog.!~) '^op[0-9]+$'),
                    (SELECT pg_catalog.array_agg(typname::pg_catalog.text ORDER BY typname) FROM pg_catalog.pg_type
                      WHERE typnamespace OPERATOR(pg_catalog.=) $1::pg_catalog.text::pg_catalog.regnamespace
                        AND typtype OPERATOR(pg_catalog.=) 'd')",
            &[&writer],
        )
        .await
        .unwrap();
    let (operators, functions, types): (i64, Vec<String>, Vec<String>) =
        (shadows.get(0), shadows.get(1), shadows.get(2));
    assert!(operators >= 500, "{operators} operators shadowed");
    for function in [
        "clock_timestamp",
        "convert_to",
        "current_setting",
        "encode",
        "isfinite",
        "make_interval",
        "nextval",
        "now",
        "pg_advisory_xact_lock",
        "pg_notify",
        "sha384",
        "to_json",
        "txid_current",
    ] {
        assert!(
            functions.iter().any(|f| f == function),
            "{function}: {functions:?}"
        );
    }
    for shadowed_type in [
        "bool",
        "bytea",
        "int4",
        "int8",
        "interval",
        "text",
        "timestamptz",
    ] {
        assert!(
            types.iter().any(|t| t == shadowed_type),
            "{shadowed_type}: {types:?}"
        );
    }
    // The stand-ins are what this session finds.
    let err = w
        .query_one("SELECT 1 = 1", &[])
        .await
        .expect_err("the shadow of = fails");
    assert_eq!(
        err.as_db_error().map(|e| e.message()),
        Some("a shadow ran"),
        "{err:?}"
    );

    let set = |to: &'static str| {
        format!(
            "UPDATE public.issue SET processing_status = '{to}' WHERE id OPERATOR(pg_catalog.=) {id}"
        )
    };
    // A claim held open for more than a second: its lease moves on at commit.
    w.batch_execute(&format!(
        "BEGIN; {}; SELECT pg_catalog.pg_sleep(1.2); COMMIT",
        set("IN_PROGRESS")
    ))
    .await
    .unwrap();
    // Without the move it would run out 1.2 s before the claim's log time
    // plus the lease (60 s).
    let lease_after_commit: f64 = owner
        .query_one(
            "SELECT extract(epoch FROM i.lease_until - t.at)::float8
               FROM public.issue i JOIN public.issue_transition t ON t.issue_id = i.id
              WHERE i.id = $1 AND t.to_status = 'IN_PROGRESS'",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        (59.5..=60.0).contains(&lease_after_commit),
        "{lease_after_commit}"
    );
    let rename =
        format!("UPDATE public.issue SET title = 'Renamed' WHERE id OPERATOR(pg_catalog.=) {id}");
    for step in [
        rename.clone(),
        set("FAILED"),
        set("PENDING"),
        set("IN_PROGRESS"),
        set("DONE"),
        rename,
    ] {
        w.batch_execute(&step).await.unwrap();
    }
    let refused = w.batch_execute(&set("PENDING")).await.unwrap_err();
    assert_eq!(
        refused.as_db_error().map(|e| e.message().to_string()),
        Some(format!(
            "illegal status transition for issue {id}: DONE -> PENDING"
        )),
        "{refused:?}"
    );
    let mut announced = Vec::new();
    for _ in 0..5 {
        let payload = listening.next("issue_transition").await;
        let t = key
            .verify(&payload)
            .unwrap_or_else(|| panic!("signed with the owner's key: {payload}"));
        announced.push((t.issue_id, t.to.to_string()));
    }
    let statuses = ["IN_PROGRESS", "FAILED", "PENDING", "IN_PROGRESS", "DONE"];
    assert_eq!(announced, statuses.map(|s| (id, s.to_string())).to_vec());
    let logged: Vec<String> = first_column(
        &owner,
        "SELECT to_status FROM public.issue_transition WHERE issue_id = $1 AND from_status IS NOT NULL ORDER BY seq",
        &[&id],
    )
    .await;
    assert_eq!(logged, statuses);
}

/// Before PostgreSQL 15 every role may create objects in `public` by
/// default. A writer's functions there that match the rules' calls better
/// than the built-in ones (an untyped literal prefers `text` to
/// `regclass`, concrete types beat `"any"` and an integer beats a cast to
/// double precision) would be picked by a rule that had `public` on its
/// path, and run with the owner's rights; the rules keep it off.
#[tokio::test]
async fn a_writer_that_may_create_in_public_cannot_take_over_the_rules() {
    let owned = Owned::new().await;
    let writer = owned.role("writer").await;
    owned
        .admin()
        .await
        .batch_execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        .await
        .unwrap();
    let report = owned.grant(RoleKind::Writer, &writer).await.unwrap();
    assert_eq!(report.warnings.len(), 1, "{:?}", report.warnings);
    let w = owned.connect_as(&writer).await;
    w.batch_execute(
        "CREATE FUNCTION public.nextval(text) RETURNS bigint LANGUAGE sql AS 'SELECT -42::bigint';
         CREATE FUNCTION public.make_interval(secs integer) RETURNS interval
             LANGUAGE sql AS $$SELECT interval '1 day'$$;
         CREATE FUNCTION public.json_build_object(text, bigint, text, bigint, text, text, text,
             text, text, timestamptz, text, integer, text, boolean) RETURNS json
             LANGUAGE sql AS $$SELECT '{\"forged\": true}'::json$$;
         CREATE FUNCTION public.current_setting(text, boolean) RETURNS text
             LANGUAGE sql AS 'SELECT NULL::text';",
    )
    .await
    .unwrap();
    // They are what a session with `public` on its path gets.
    let picked: i64 = w
        .query_one("SELECT nextval('public.issue_claim_id_seq')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(picked, -42);

    let mut listening = owned.listen_as(&owned.owner).await;
    let id = add_issue(&w, "Tempting").await;
    listening.transition().await;
    let (lease, token) = claim(&w, id).await;
    assert!((50.0..=61.0).contains(&lease), "{lease}");
    assert!(token > 0, "{token}");
    let note = listening.transition().await;
    assert_eq!(
        (note["issue_id"].as_i64(), note["to"].as_str()),
        (Some(id), Some("IN_PROGRESS")),
        "{note}"
    );
}

/// The same attack before migration 15 works, so the test above can fail:
/// a role with full rights on the tables and a schema of its own moves an
/// issue out of DONE, hides the log row in a temp table and claims with a
/// day-long lease; with an empty search_path nobody can change a status. After migration 15 the
/// same sessions are refused and can.
#[tokio::test]
async fn before_migration_15_the_caller_could_bend_the_rules() {
    let owned = Owned::at_version(Some(14)).await;
    let attacker = owned.role("attacker").await;
    // grant needs the rules of migration 15.
    let err = owned.grant(RoleKind::Writer, &attacker).await.unwrap_err();
    let newest = newsnack::db::migrate::MIGRATIONS.last().unwrap().version;
    assert_eq!(
        err.to_string(),
        format!(
            "schema \"public\" is not at newsnack's schema version {newest} (version 14); \
             run `newsnack migrate` first"
        )
    );
    let owner = owned.owner().await;
    owner
        .batch_execute(&format!(
            "GRANT ALL ON ALL TABLES IN SCHEMA public TO {attacker};
             GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {attacker};"
        ))
        .await
        .unwrap();
    let a = owned.connect_as(&attacker).await;
    shadow_everything(&owned, &attacker, &a).await;
    let done = add_issue(&owner, "Done").await;
    done_by_owner(&owned, done).await;
    let count_log = "SELECT count(*) FROM public.issue_transition";
    let real_before: i64 = a.query_one(count_log, &[]).await.unwrap().get(0);
    a.execute(
        "UPDATE issue SET processing_status = 'PENDING' WHERE id = $1",
        &[&done],
    )
    .await
    .expect("before migration 15 the shadow makes DONE -> PENDING legal");
    let row = a
        .query_one(
            "SELECT (SELECT count(*) FROM public.issue_transition),
                    (SELECT count(*) FROM pg_temp.issue_transition)",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, i64>(0), row.get::<_, i64>(1)),
        (real_before, 1),
        "the log row went to the temp table"
    );
    let (lease, _) = claim(&a, done).await;
    assert!(lease > 86_000.0, "the shadow's day-long lease: {lease}");
    let empty_path = owned.owner().await;
    empty_path
        .batch_execute("SET search_path = ''")
        .await
        .unwrap();
    let err = empty_path
        .execute(
            "UPDATE public.issue SET processing_status = 'FAILED' WHERE id = $1",
            &[&done],
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.as_db_error().map(|e| e.message()),
        Some("function issue_transition_is_legal(text, text) does not exist")
    );

    let mut owner = owned.owner().await;
    migrate(&mut owner).await.unwrap();
    // New sessions: plpgsql keeps compiled functions per session.
    let a = owned.connect_as(&attacker).await;
    a.batch_execute(
        "CREATE TEMP TABLE issue_transition (LIKE public.issue_transition INCLUDING ALL);
         CREATE TEMP TABLE setting (LIKE public.setting INCLUDING ALL)",
    )
    .await
    .unwrap();
    let id = add_issue(&owner, "Later").await;
    done_by_owner(&owned, id).await;
    illegal(&a, id, "DONE", "PENDING").await;
    let empty_path = owned.owner().await;
    empty_path
        .batch_execute("SET search_path = ''")
        .await
        .unwrap();
    empty_path
        .execute(
            "UPDATE public.issue SET processing_status = 'FAILED' WHERE id = $1",
            &[&done],
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn an_empty_search_path_works_with_qualified_names() {
    let owned = Owned::new().await;
    let writer = owned.role("writer").await;
    owned.grant(RoleKind::Writer, &writer).await.unwrap();
    let mut listening = owned.listen_as(&owned.owner).await;
    let w = owned.connect_as(&writer).await;
    w.batch_execute("SET search_path = ''").await.unwrap();
    let id: i64 = w
        .query_one(
            "INSERT INTO public.issue (title, body, score) VALUES ('Qualified', 'b', 1) RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(listening.transition().await["issue_id"].as_i64(), Some(id));
    for (from, to) in [
        ("PENDING", "IN_PROGRESS"),
        ("IN_PROGRESS", "FAILED"),
        ("FAILED", "PENDING"),
    ] {
        w.execute(
            "UPDATE public.issue SET processing_status = $2 WHERE id = $1",
            &[&id, &to],
        )
        .await
        .unwrap();
        let note = listening.transition().await;
        assert_eq!(
            (note["from"].as_str(), note["to"].as_str()),
            (Some(from), Some(to))
        );
    }

    // The owner's settings, claims and removals with an empty path too.
    let owner = owned.owner().await;
    owner.batch_execute("SET search_path = ''").await.unwrap();
    owner
        .execute(
            "UPDATE public.setting SET value = ' 120 ' WHERE key = 'lease_s'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(listening.next("setting_changed").await, "lease_s");
    let (lease, _) = claim(&owner, id).await;
    assert!((110.0..=121.0).contains(&lease), "{lease}");
    listening.transition().await;
    let err = owner
        .execute(
            "UPDATE public.setting SET value = '99 * * * *' WHERE key = 'schedule'",
            &[],
        )
        .await
        .unwrap_err();
    assert!(
        err.as_db_error()
            .unwrap()
            .message()
            .contains("\"99\" is outside the minute field's range 0-59"),
        "{err:?}"
    );
    owner
        .batch_execute("UPDATE public.setting SET value = 'every 15m' WHERE key = 'schedule'")
        .await
        .unwrap();
    assert_eq!(listening.next("setting_changed").await, "schedule");
    let removable: i64 = owner
        .query_one(
            "INSERT INTO public.issue (title) VALUES ('gone') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    listening.transition().await;
    owner
        .execute("DELETE FROM public.issue WHERE id = $1", &[&removable])
        .await
        .unwrap();
    assert_eq!(listening.next("issue_removed").await, "DELETE");
    owner
        .batch_execute("TRUNCATE public.setting")
        .await
        .unwrap();
    assert_eq!(listening.next("setting_changed").await, "*");
}

/// A later migration that replaces a rule's function without repeating
/// SECURITY DEFINER and the search_path would undo all of this: every
/// trigger function runs as its owner with a fixed search_path (but the
/// transition trigger, which names everything with its schema), and PUBLIC
/// may not call it; every other function has the fixed search_path, but
/// the two that run on every transition (see migration 15) and the
/// service's claim and completion (migration 16), which run as their
/// caller, the service, and which PUBLIC may not call either (they carry
/// no setting since migration 22).
#[tokio::test]
async fn every_rule_runs_as_its_owner_with_a_fixed_search_path() {
    let db = TestDb::new().await;
    let client = db.raw().await;
    let rows = client
        .query(
            "SELECT p.proname::text, p.prosecdef, p.proconfig,
                    p.prorettype = 'trigger'::regtype,
                    EXISTS (SELECT 1 FROM aclexplode(COALESCE(p.proacl, acldefault('f', p.proowner))) a
                             WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')
               FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace ORDER BY 1",
            &[],
        )
        .await
        .unwrap();
    let fixed = Some(vec!["search_path=pg_catalog, pg_temp".to_string()]);
    let mut triggers = 0;
    for row in &rows {
        let (name, definer, config, trigger, public_may_call): (
            String,
            bool,
            Option<Vec<String>>,
            bool,
            bool,
        ) = (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
        if trigger {
            triggers += 1;
            assert!(definer, "{name} runs as its owner");
            if ["issue_transition_record", "issue_before_update"].contains(&name.as_str()) {
                // They name everything with their schema instead (migrations
                // 20 and 21): the_row_triggers_name_nothing_a_caller_can_shadow.
                assert_eq!(config, None, "{name}");
            } else {
                assert_eq!(config, fixed, "{name}");
            }
            assert!(!public_may_call, "{name}");
        } else if [
            "newsnack_rotate_notification_key",
            "newsnack_fold_status_counts",
            "newsnack_fold_article_tokens",
        ]
        .contains(&name.as_str())
        {
            assert!(!definer, "{name} runs as its caller");
            assert!(!public_may_call, "{name} is the owner's");
            assert_eq!(config, fixed, "{name}");
        } else if ["newsnack_claim", "newsnack_complete"].contains(&name.as_str()) {
            assert!(!definer, "{name} runs as its caller");
            assert!(!public_may_call, "{name} is the service's");
            // No setting of their own since migration 22: the generic plan
            // is the server's choice, the values it could be costed by
            // hidden from it.
            assert_eq!(config, None, "{name}");
        } else if name == "newsnack_claim_traced" {
            // The claim in a trace context (migration 34), kept for the
            // previous release: held to the same rules.
            assert!(!definer, "{name} runs as its caller");
            assert!(!public_may_call, "{name} is the service's");
            assert_eq!(config, None, "{name}");
        } else {
            assert!(!definer, "{name} runs as its caller");
            assert!(public_may_call, "{name} is a helper anyone may call");
            // Inlined into their callers' plans, they name everything
            // with `pg_catalog` instead (migration 38 for the traceparent's).
            if ![
                "issue_transition_is_legal",
                "newsnack_lease_seconds",
                "newsnack_traceparent",
            ]
            .contains(&name.as_str())
            {
                assert_eq!(config, fixed, "{name}");
            }
        }
    }
    // 8, the four that keep the counts per status (migration 27), and the
    // five that keep the articles' and the briefings' tokens (migration 36).
    assert_eq!(triggers, 17);
    // And every trigger on the tables runs one of them.
    let foreign: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
              WHERE NOT t.tgisinternal
                AND (NOT p.prosecdef OR (p.proconfig IS NULL
                     AND p.proname NOT IN ('issue_transition_record', 'issue_before_update')))",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(foreign, 0);
}

#[tokio::test]
async fn grant_is_idempotent_and_a_later_grant_replaces_an_earlier_one() {
    let owned = Owned::new().await;
    let role = owned.role("etl").await;
    // Whatever it held before is taken away: everything on every table and
    // sequence, and CREATE on the schema.
    owned
        .owner()
        .await
        .batch_execute(&format!(
            "GRANT ALL ON ALL TABLES IN SCHEMA public TO {role};
             GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role};
             GRANT CREATE ON SCHEMA public TO {role};"
        ))
        .await
        .unwrap();
    let first = owned.grant(RoleKind::Writer, &role).await.unwrap();
    assert_eq!(owned.privileges_of(&role).await, writer_privileges());
    let acl = owned.every_acl().await;
    let again = owned.grant(RoleKind::Writer, &role).await.unwrap();
    assert_eq!(first, again);
    assert_eq!(owned.every_acl().await, acl);

    owned.grant(RoleKind::Reader, &role).await.unwrap();
    assert_eq!(owned.privileges_of(&role).await, reader_privileges());
    let id = add_issue(&owned.owner().await, "x").await;
    let r = owned.connect_as(&role).await;
    refused(
        &r,
        &format!("UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = {id}"),
    )
    .await;
    refused(&r, "INSERT INTO issue (title) VALUES ('x')").await;

    owned.grant(RoleKind::Writer, &role).await.unwrap();
    assert_eq!(owned.every_acl().await, acl);
    r.execute(
        "UPDATE issue SET processing_status = 'IN_PROGRESS' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn grant_refuses_what_it_cannot_restrict_and_changes_nothing() {
    let owned = Owned::new().await;
    let admin = owned.admin().await;
    let name = |suffix: &str| format!("{}_{suffix}", owned.db.name);
    admin
        .batch_execute(&format!(
            "CREATE ROLE {super_} LOGIN SUPERUSER;
             CREATE ROLE {bypass} LOGIN BYPASSRLS;
             CREATE ROLE {member} LOGIN IN ROLE {owner};
             CREATE ROLE {group_};
             CREATE ROLE {grouped} LOGIN IN ROLE {group_};",
            super_ = name("super"),
            bypass = name("bypass"),
            member = name("member"),
            owner = owned.owner,
            group_ = name("group"),
            grouped = name("grouped"),
        ))
        .await
        .unwrap();
    // A group role can write articles: a member of it cannot be a reader.
    owned
        .owner()
        .await
        .batch_execute(&format!("GRANT INSERT ON ai_article TO {}", name("group")))
        .await
        .unwrap();
    let acl = owned.every_acl().await;

    let missing = format!("{}_nobody", owned.db.name);
    let err = owned.grant(RoleKind::Writer, &missing).await.unwrap_err();
    assert!(matches!(&err, GrantError::NoSuchRole(r) if *r == missing));
    assert_eq!(
        err.to_string(),
        format!("role \"{missing}\" does not exist")
    );

    for (role, why) in [
        (name("super"), "is a superuser".to_string()),
        (name("bypass"), "has BYPASSRLS".to_string()),
        (owned.owner.clone(), "owns newsnack's tables".to_string()),
        (
            name("member"),
            format!(
                "is a member of \"{}\", which owns newsnack's tables",
                owned.owner
            ),
        ),
    ] {
        for kind in [RoleKind::Writer, RoleKind::Reader] {
            let err = owned.grant(kind, &role).await.unwrap_err();
            assert!(
                matches!(&err, GrantError::Unrestricted { role: r, why: w } if *r == role && *w == why),
                "{role}: {err}"
            );
        }
    }
    let err = owned
        .grant(RoleKind::Reader, &name("grouped"))
        .await
        .unwrap_err();
    match &err {
        GrantError::Leftover { extra, .. } => {
            assert_eq!(extra, &["INSERT on public.ai_article".to_string()])
        }
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("nothing was changed"), "{err}");

    // Run by anyone but the owner, it is refused.
    let writer = owned.role("writer").await;
    let mut not_owner = owned.connect_as(&writer).await;
    let err = role::grant(&mut not_owner, RoleKind::Reader, &writer)
        .await
        .unwrap_err();
    assert!(matches!(err, GrantError::NotOwner { .. }), "{err}");

    assert_eq!(
        owned.every_acl().await,
        acl,
        "a refused grant changes nothing"
    );
}

#[tokio::test]
async fn grant_quotes_any_role_name() {
    let owned = Owned::new().await;
    let role = format!("{} We\"ird'; DROP TABLE issue; --", owned.db.name);
    let quoted: String = owned
        .admin()
        .await
        .query_one("SELECT quote_ident($1)", &[&role])
        .await
        .unwrap()
        .get(0);
    owned
        .admin()
        .await
        .batch_execute(&format!("CREATE ROLE {quoted} LOGIN"))
        .await
        .unwrap();
    let report = owned.grant(RoleKind::Writer, &role).await.unwrap();
    assert!(report.statements.iter().all(|s| s.ends_with(&quoted)));
    assert_eq!(owned.privileges_of(&role).await, writer_privileges());
    let w = owned.connect_as(&role).await;
    add_issue(&w, "still here").await;
}

#[tokio::test]
async fn the_grant_command_end_to_end() {
    let owned = Owned::new().await;
    let writer = owned.role("writer").await;
    let as_owner = owned.url_as(&owned.owner);

    let out = newsnack(&as_owner, &["grant", "writer", &writer]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed["role"], writer.as_str());
    assert_eq!(printed["kind"], "writer");
    assert_eq!(printed["schema"], "public");
    assert_eq!(
        printed["select"],
        serde_json::json!(TABLES
            .iter()
            .map(|t| format!("public.{t}"))
            .collect::<Vec<_>>())
    );
    assert_eq!(
        printed["update_issue"],
        serde_json::json!(role::WRITER_UPDATE_COLUMNS)
    );
    assert_eq!(text(&out.stdout).lines().count(), 1);
    assert_eq!(owned.privileges_of(&writer).await, writer_privileges());
    let w = owned.connect_as(&writer).await;
    add_issue(&w, "via the command").await;

    // Bad input: one line naming the role, nothing changed.
    let acl = owned.every_acl().await;
    let out = newsnack(&as_owner, &["grant", "reader", "nosuch_role_here"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert_eq!(
        stderr.trim_end(),
        "newsnack: role \"nosuch_role_here\" does not exist"
    );
    let out = newsnack(&as_owner, &["grant", "admin", &writer]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("invalid value 'admin'")
            && stderr.contains("writer")
            && stderr.contains("reader"),
        "{stderr}"
    );
    let out = newsnack(&as_owner, &["grant", "writer", "postgres"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("is a superuser"));
    assert_eq!(owned.every_acl().await, acl);

    // PUBLIC allowed to create in the schema (PostgreSQL 13 and 14's
    // default): granted, with a warning that says how to fix it.
    owned
        .admin()
        .await
        .batch_execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        .await
        .unwrap();
    let out = newsnack(&as_owner, &["grant", "reader", &writer]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("newsnack: warning: PUBLIC may create objects in schema \"public\"")
            && stderr.contains("REVOKE CREATE ON SCHEMA public FROM PUBLIC"),
        "{stderr}"
    );
    assert_eq!(
        owned.privileges_of(&writer).await,
        [reader_privileges(), vec!["CREATE schema".to_string()]]
            .concat()
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect::<Vec<_>>()
    );
}

/// Migrated into a schema of its own whose name needs quoting, the rules
/// name that schema, and a writer whose search_path does not include it
/// moves issues with qualified names; `grant` works on the schema the
/// owner's session is in.
#[tokio::test]
async fn a_schema_of_its_own_is_the_one_the_rules_name() {
    let db = TestDb::empty().await;
    let owner = format!("{}_owner", db.name);
    let writer = format!("{}_writer", db.name);
    db.raw()
        .await
        .batch_execute(&format!(
            "CREATE ROLE {owner} LOGIN; CREATE ROLE {writer} LOGIN;
             CREATE SCHEMA \"News Snack\" AUTHORIZATION {owner};"
        ))
        .await
        .unwrap();
    let owned = Owned { db, owner };
    let mut owner = owned.owner().await;
    owner
        .batch_execute("SET search_path = \"News Snack\"")
        .await
        .unwrap();
    migrate(&mut owner).await.unwrap();
    let report = role::grant(&mut owner, RoleKind::Writer, &writer)
        .await
        .unwrap();
    assert_eq!(report.schema, "News Snack");
    assert!(
        report.tables.contains(&"\"News Snack\".issue".to_string()),
        "{:?}",
        report.tables
    );
    let config: Option<Vec<String>> = owner
        .query_one(
            "SELECT proconfig FROM pg_proc WHERE oid = '\"News Snack\".issue_before_insert()'::regprocedure",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        config,
        Some(vec!["search_path=pg_catalog, pg_temp".to_string()])
    );

    let mut listening = owned.listen_as(&owned.owner).await;
    let w = owned.connect_as(&writer).await;
    let id: i64 = w
        .query_one(
            "INSERT INTO \"News Snack\".issue (title) VALUES ('elsewhere') RETURNING id",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    listening.transition().await;
    w.execute(
        "UPDATE \"News Snack\".issue SET processing_status = 'IN_PROGRESS' WHERE id = $1",
        &[&id],
    )
    .await
    .unwrap();
    let note = listening.transition().await;
    assert_eq!(note["to"], "IN_PROGRESS");
    let row = w
        .query_one(
            "SELECT count(*), extract(epoch FROM (SELECT lease_until FROM \"News Snack\".issue
                                                   WHERE id = $1) - now())::float8
               FROM \"News Snack\".issue_transition WHERE issue_id = $1",
            &[&id],
        )
        .await
        .unwrap();
    let (logged, lease): (i64, f64) = (row.get(0), row.get(1));
    assert_eq!(logged, 2);
    assert!((50.0..=61.0).contains(&lease), "{lease}");
}

/// docs/sql.md shows, literally, what `grant writer etl` runs (and a
/// reader gets its first five statements).
#[tokio::test]
async fn the_documented_grant_is_what_grant_runs() {
    let docs = include_str!("../docs/sql.md");
    let block = docs
        .split("<!-- grant writer etl -->\n```sql\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("docs/sql.md has the grant block");
    let documented: Vec<String> = block
        .lines()
        .map(|line| line.trim_end_matches(';').to_string())
        .collect();
    let owned = Owned::new().await;
    let role = owned.role("etl").await;
    let as_etl = |statements: Vec<String>| -> Vec<String> {
        statements
            .into_iter()
            .map(|s| s.replace(&role, "etl"))
            .collect()
    };
    let writer = owned.grant(RoleKind::Writer, &role).await.unwrap();
    assert_eq!(as_etl(writer.statements), documented);
    let reader = owned.grant(RoleKind::Reader, &role).await.unwrap();
    assert_eq!(as_etl(reader.statements), documented[..5]);
}
