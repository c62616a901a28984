//! What a connection runs under and what a session reads: the settings (GUCs) of the jobs' and the status page's
//! connections, a transaction's `lock_timeout`, the database clock, and the tick's dedicated [`Session`] (its
//! status statement itself is [`job_runs::tick_status`]).

use std::time::Duration;

use sqlx::{postgres::PgConnectOptions, Connection, Executor, PgConnection};

use super::{job_runs, Db};
use crate::config::Engine;

/// The session settings a pool's connections run under, each a PostgreSQL parameter and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Gucs(Vec<(&'static str, String)>);

impl Gucs {
    /// No settings: the server's defaults (the migrations' connection, which must not time out).
    pub(super) fn none() -> Self {
        Gucs(Vec::new())
    }

    /// Whether there is nothing to set.
    pub(super) fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The job connections' settings: the batch timeout as both `statement_timeout` and
    /// `idle_in_transaction_session_timeout`; no parallel query; generic plans; and no JIT compilation.
    ///
    /// A batch reads a few thousand rows through an index. With parallel workers allowed, the planner started
    /// workers (and a parallel scan plus sort) for every batch query, several times slower than the index walk.
    /// With custom plans (PostgreSQL's default for a statement's first five executions), the literal month made
    /// the planner read the month's whole range from the index ordered by return date, or the whole table, and
    /// sort it for each batch, 80–150 ms each. A generic plan did not always walk the id-ordered index either
    /// (on a table rewritten by `vacuum full` it chose the month's range again): the settlement batch's walk is
    /// now written so that no plan can do otherwise ([`crate::store::loans::next_batch`]).
    ///
    /// A generic plan is costed without its parameters, so on a large `loans` table the planner's estimate of
    /// statements that read a few rows (the accrual re-check with nothing queued, a batch scan) passes
    /// `jit_above_cost` and PostgreSQL compiles them: about 100 ms of a re-check that executes in 0.3 ms at
    /// 5,000,000 open overdue loans, and a few percent of each accrual batch (bench/README.md).
    ///
    /// And no sequential scan where an index serves: a generic plan is built once per connection, at the
    /// statement's first execution, with the table sizes of that moment and kept for the connection's life. On a
    /// new deployment the ledger is empty then, so the accrual batch's probe "is this loan already charged
    /// today" was planned as a sequential scan of `fine_ledger` — and after a few batches had charged 10,000
    /// loans each, every probe read them all: a batch of 1,000,000 loans took 20 s instead of 0.13 s and the run
    /// failed at its batch timeout (measured with auto_explain). Every job statement reads by a key or walks an
    /// index; a table with no index for a statement is still scanned. Where two indexes could serve a key and
    /// an empty table makes them cost the same, the kept plan can still pick the wrong one: an accrual batch
    /// has its statements planned afresh ([`crate::store::ledger::lock_loans`]).
    ///
    /// And read committed, whatever the database's or the role's `default_transaction_isolation`: the cap's guard
    /// and the calendar's lock take a lock in one statement and read what it protects in the next, which sees
    /// what committed meanwhile only under read committed. Under repeatable read a charge read the loan's ledger
    /// from before the lock it waited for, and a loan's net passed its cap.
    ///
    /// On Citus the plans are custom: the coordinator cannot build a distributed plan of a generic one whose
    /// parameters reach the shards ("could not create distributed plan"), and the workers plan each shard's
    /// statement afresh with the values in it anyway (docs/citus.md). And a transaction's `set local` commands
    /// reach the workers it writes on ([`set_local_lock_timeout`]).
    pub(super) fn jobs(batch_timeout: Duration, engine: Engine) -> Self {
        let timeout = batch_timeout.as_millis().max(1).to_string();
        let plans = match engine {
            Engine::Postgresql => "force_generic_plan",
            Engine::Citus => "force_custom_plan",
        };
        let mut gucs = vec![
            ("statement_timeout", timeout.clone()),
            ("idle_in_transaction_session_timeout", timeout),
            ("max_parallel_workers_per_gather", "0".into()),
            ("plan_cache_mode", plans.into()),
            ("jit", "off".into()),
            ("enable_seqscan", "off".into()),
            ("default_transaction_isolation", "read committed".into()),
        ];
        if engine == Engine::Citus {
            gucs.push(("citus.propagate_set_commands", "local".into()));
        }
        Gucs(gucs)
    }

    /// The status page's: every statement under `statement_timeout = timeout`, no parallel query.
    pub(super) fn status(timeout: Duration) -> Self {
        Gucs(vec![
            ("statement_timeout", timeout.as_millis().max(1).to_string()),
            ("max_parallel_workers_per_gather", "0".into()),
        ])
    }

    /// The settings as startup `options` (a direct connection). The server splits `options` at spaces unless a
    /// backslash escapes them (`read committed`), and sqlx writes each value as it is.
    pub(super) fn apply(&self, options: PgConnectOptions) -> PgConnectOptions {
        options.options(
            self.0
                .iter()
                .map(|(k, v)| (*k, v.replace('\\', "\\\\").replace(' ', "\\ "))),
        )
    }

    /// One statement setting them for the session (behind a session-mode pooler, run after connecting).
    pub(super) fn set_session(&self) -> String {
        self.0
            .iter()
            .map(|(k, v)| format!("set {k} = '{v}'"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// The statement that begins a transaction behind a transaction-mode pooler: `begin`, read committed (the
    /// transaction has begun before its settings are made; see [`Gucs::jobs`]); drop whatever
    /// prepared statements an earlier client left on the server connection the pooler assigned (sqlx names
    /// its statements per client connection, so another client's could collide with ours); then the settings,
    /// local to the transaction. One round trip.
    pub(super) fn begin_local(&self) -> String {
        let sets = self
            .0
            .iter()
            .map(|(k, v)| format!("set_config('{k}', '{v}', true)"))
            .collect::<Vec<_>>()
            .join(", ");
        format!("begin isolation level read committed; deallocate all; select {sets}")
    }
}

/// Sets this transaction's `lock_timeout` (`claim.lock_timeout`): a statement that waits longer for a row lock
/// fails with `lock_not_available` (55P03), which the jobs handle by leaving the row for later. Set per
/// transaction rather than per connection, so that the claim statements — which wait for an in-flight batch
/// on purpose — are not cut short.
///
/// A `set local` command rather than `set_config(…, true)`: on Citus the row locks a batch waits for are the
/// workers', and Citus passes a transaction's `set local` commands on to every worker it reaches
/// (`citus.propagate_set_commands = local`, set for the jobs' connections there) but not a function's setting.
/// Without it a loan libraryd held locked kept a settlement batch waiting until the batch timeout failed the run.
pub async fn set_local_lock_timeout(tx: &mut PgConnection, timeout: Duration) -> Result<(), sqlx::Error> {
    let set = format!("set local lock_timeout = {}", timeout.as_millis().max(1));
    sqlx::query(&set).execute(&mut *tx).await?;
    Ok(())
}

/// The database clock.
pub async fn database_now(pool: &Db) -> Result<chrono::DateTime<chrono::Utc>, sqlx::Error> {
    sqlx::query_scalar!(r#"select now() as "now!""#)
        .fetch_one(pool)
        .await
}

/// One dedicated connection, re-opened after any error. The daemon reads its tick status through it, so an idle
/// tick is a single round trip (a pooled connection adds a health-check ping at every checkout and release).
pub struct Session {
    /// The jobs' pool: the session connects to its current host, with its options.
    db: Db,
    application_name: String,
    connect_timeout: Duration,
    /// The longest the status statement may take, client side (the server's `statement_timeout` cannot end a
    /// wait on a host that vanished without closing the connection).
    statement_limit: Duration,
    /// The connection, and the generation of the pool's route it was opened in (see [`Db::reconnect`]).
    conn: Option<(PgConnection, u64)>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("db", &self.db)
            .field("connected", &self.conn.is_some())
            .finish_non_exhaustive()
    }
}

impl Session {
    /// A session beside `db`'s pool, on the same host and with the same settings; its statement may take
    /// `statement_limit` at most.
    pub fn new(
        db: &Db,
        application_name: &str,
        connect_timeout: Duration,
        statement_limit: Duration,
    ) -> Self {
        Session {
            db: db.clone(),
            application_name: application_name.into(),
            connect_timeout,
            statement_limit,
            conn: None,
        }
    }

    /// How long the session waits for a connection to its host.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The database clock, this shard's recent `job_runs` rows and due pending charges (see
    /// [`job_runs::tick_status`]). `Err` (see [`read_only`](super::read_only)) if the server cannot write.
    pub async fn tick_status(
        &mut self,
        shard: crate::shard::ShardSpec,
        since: chrono::NaiveDate,
        late: job_runs::LateProbe,
    ) -> Result<job_runs::TickStatus, sqlx::Error> {
        if self
            .conn
            .as_ref()
            .is_some_and(|(_, opened)| *opened != self.db.generation())
        {
            // The pool looked for a server again since: so does the session.
            self.conn = None;
        }
        if self.conn.is_none() {
            // Before the generation is read: learning that the host needs no TLS makes older connections stale.
            self.db.learn_tls().await;
            let generation = self.db.generation();
            let options = self.db.current_options().application_name(&self.application_name);
            let connect = PgConnection::connect_with(&options);
            let mut conn = tokio::time::timeout(self.connect_timeout, connect)
                .await
                .map_err(|_| sqlx::Error::PoolTimedOut)??;
            if let Some(sql) = self.db.after_connect() {
                conn.execute(sql).await?;
            }
            self.conn = Some((conn, generation));
        }
        let Some((conn, _)) = self.conn.as_mut() else {
            return Err(sqlx::Error::PoolClosed);
        };
        let begin = self.db.begin_statement();
        let read = async {
            match begin {
                None => job_runs::tick_status(conn, shard, since, late).await,
                Some(begin) => {
                    let mut tx = conn.begin_with(begin.to_string()).await?;
                    let status = job_runs::tick_status(&mut tx, shard, since, late).await?;
                    tx.commit().await?;
                    Ok(status)
                }
            }
        };
        let result = tokio::time::timeout(self.statement_limit, read)
            .await
            .unwrap_or(Err(sqlx::Error::PoolTimedOut));
        if result.is_err() {
            // Whatever went wrong, the next tick starts from a fresh connection.
            self.conn = None;
        }
        result
    }
}
