//! PostgreSQL's connections for the rollout store: the schema's migrations (applied once,
//! under an advisory lock, whoever starts first), the pool of blocking clients (validated on
//! checkout, a broken one replaced), the trainer's claim on an adapter (a session advisory lock
//! on a connection of its own) and the LISTEN threads that hear what the store announces
//! (committed steps, new rewards).

use super::*;

/// Schema migrations, applied in order; `flywheel_meta.schema_version` is how many ran. The
/// first is the SQLite log's schema after its four migrations; the second its fifth (the
/// sessions and runs clients drive), the third its sixth (decisions), the fourth its seventh
/// (steps), the fifth its eighth (agent sessions), the sixth its ninth (sampling log-probs), the
/// seventh its tenth (version switches).
const MIGRATIONS: &[&str] = &[
    "
    CREATE TABLE completions (
        id TEXT NOT NULL, choice INTEGER NOT NULL,
        adapter TEXT NOT NULL, version BIGINT NOT NULL,
        group_id TEXT NOT NULL, group_size BIGINT NOT NULL,
        prompt BYTEA NOT NULL, completion BYTEA NOT NULL, logprobs BYTEA NOT NULL,
        temperature DOUBLE PRECISION NOT NULL, policy_sampled BOOLEAN NOT NULL,
        params TEXT NOT NULL, finish_reason TEXT NOT NULL, key_hash TEXT NOT NULL,
        created DOUBLE PRECISION NOT NULL,
        reward DOUBLE PRECISION, rewarded_at DOUBLE PRECISION, consumed_step BIGINT,
        dropped TEXT, episode TEXT, forced BYTEA NOT NULL DEFAULT '\\x',
        PRIMARY KEY (id, choice));
    CREATE INDEX completions_pending ON completions (adapter, consumed_step, dropped, group_id);
    CREATE INDEX completions_created ON completions (created);
    CREATE INDEX completions_episode ON completions (episode);
    CREATE TABLE lineages (
        id BIGSERIAL PRIMARY KEY, adapter TEXT NOT NULL,
        first_version BIGINT NOT NULL, created DOUBLE PRECISION NOT NULL,
        ended DOUBLE PRECISION);
    CREATE INDEX lineages_adapter ON lineages (adapter, ended);
    CREATE TABLE checkpoints (
        adapter TEXT NOT NULL, version BIGINT NOT NULL, lineage BIGINT NOT NULL,
        step BIGINT NOT NULL, path TEXT NOT NULL, created DOUBLE PRECISION NOT NULL,
        stats TEXT NOT NULL,
        PRIMARY KEY (adapter, version));
    CREATE TABLE episode_rewards (
        episode TEXT PRIMARY KEY, reward DOUBLE PRECISION NOT NULL,
        rewarded_at DOUBLE PRECISION NOT NULL);
",
    "
    CREATE TABLE client_sessions (
        id TEXT PRIMARY KEY, owner TEXT NOT NULL, info TEXT NOT NULL,
        created DOUBLE PRECISION NOT NULL);
    CREATE TABLE client_runs (
        id TEXT PRIMARY KEY, session TEXT NOT NULL, owner TEXT NOT NULL, info TEXT NOT NULL,
        state TEXT NOT NULL, step BIGINT NOT NULL, pending BIGINT NOT NULL);
    CREATE INDEX client_runs_session ON client_runs (session);
",
    "
    CREATE TABLE decisions (
        id BIGSERIAL PRIMARY KEY, adapter TEXT NOT NULL, lineage BIGINT NOT NULL,
        decision TEXT NOT NULL, reason TEXT NOT NULL, from_version BIGINT NOT NULL,
        to_version BIGINT NOT NULL, evidence TEXT NOT NULL, paused BOOLEAN NOT NULL,
        created DOUBLE PRECISION NOT NULL);
    CREATE INDEX decisions_adapter ON decisions (adapter, id);
",
    "
    CREATE TABLE steps (
        adapter TEXT NOT NULL, lineage BIGINT NOT NULL, version BIGINT NOT NULL,
        created DOUBLE PRECISION NOT NULL, stats TEXT NOT NULL, PRIMARY KEY (adapter, version));
",
    "
    CREATE TABLE agent_sessions (
        id TEXT PRIMARY KEY, key_hash TEXT NOT NULL UNIQUE, owner TEXT NOT NULL,
        adapter TEXT NOT NULL, group_name TEXT NOT NULL, gamma DOUBLE PRECISION NOT NULL,
        max_turns BIGINT, idle_secs DOUBLE PRECISION NOT NULL, idle_reward DOUBLE PRECISION,
        created DOUBLE PRECISION NOT NULL, state TEXT NOT NULL, returns BYTEA,
        episode TEXT NOT NULL, ended DOUBLE PRECISION);
    CREATE INDEX agent_sessions_state ON agent_sessions (state);
",
    "ALTER TABLE completions ADD COLUMN sampling BYTEA NOT NULL DEFAULT '\\x';",
    "ALTER TABLE completions ADD COLUMN switches BYTEA NOT NULL DEFAULT '\\x';",
];

/// The channel a committed step is announced on (payload `adapter:version`).
pub(super) const STEPS_CHANNEL: &str = "flywheel_versions";
/// The channel new rewards are announced on (no payload: the trainer reads what is pending).
const REWARDS_CHANNEL: &str = "flywheel_rewards";

/// The channel `what` is announced on.
pub(super) fn channel(what: Announcement) -> &'static str {
    match what {
        Announcement::Steps => STEPS_CHANNEL,
        Announcement::Rewards => REWARDS_CHANNEL,
    }
}

/// Announce new rewards, delivered to the listeners when (and only if) `tx` commits.
pub(super) fn announce_rewards(tx: &mut Transaction) -> Result<(), postgres::Error> {
    tx.execute("SELECT pg_notify($1, '')", &[&REWARDS_CHANNEL])?;
    Ok(())
}

/// The advisory lock key of schema migrations (any constant of our own).
const MIGRATION_LOCK: i64 = 0x666c_7977_6865_656c; // "flywheel"

/// Idle connections kept for reuse.
const POOL_IDLE: usize = 4;

/// How long a pooled connection has to answer before it is replaced.
const VALIDATE_TIMEOUT: Duration = Duration::from_secs(2);

/// A pooled connection: back to the pool when dropped, unless it broke.
pub(super) struct Conn<'a> {
    log: &'a PgLog,
    client: Option<Client>,
}

impl std::ops::Deref for Conn<'_> {
    type Target = Client;
    fn deref(&self) -> &Client {
        self.client.as_ref().expect("a live connection")
    }
}

impl std::ops::DerefMut for Conn<'_> {
    fn deref_mut(&mut self) -> &mut Client {
        self.client.as_mut().expect("a live connection")
    }
}

impl Drop for Conn<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.client.take().filter(|c| !c.is_closed()) {
            let mut idle = self.log.idle.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() < POOL_IDLE {
                idle.push(c);
            }
        }
    }
}

/// The blocking client owns a runtime of its own, which may not be dropped inside another
/// (tokio panics, and a panic in a destructor during unwinding aborts): the store is dropped
/// last by whoever holds it, often an async task at shutdown. Its clients are closed on a thread
/// of their own.
impl Drop for PgLog {
    fn drop(&mut self) {
        let idle = std::mem::take(self.idle.get_mut().unwrap_or_else(|e| e.into_inner()));
        let claims = std::mem::take(self.claims.get_mut().unwrap_or_else(|e| e.into_inner()));
        if idle.is_empty() && claims.is_empty() {
            return;
        }
        let closing = std::thread::Builder::new()
            .name("pg-close".into())
            .spawn(move || drop((idle, claims)));
        match closing {
            Ok(t) => {
                let _ = t.join();
            }
            Err(e) => tracing::warn!(error = %e, "cannot close the PostgreSQL connections"),
        }
    }
}

impl PgLog {
    /// Connect, migrate (once, whoever starts first) and read the key salt.
    pub fn connect(url: &str) -> anyhow::Result<PgLog> {
        let shown = redact(url);
        let mut config: postgres::Config = url
            .parse()
            .map_err(|e| anyhow::anyhow!("rollout store {shown}: {e}"))?;
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(Duration::from_secs(10));
        }
        config.application_name("flywheel");
        let mut log = PgLog {
            config,
            shown,
            idle: Mutex::new(Vec::new()),
            salt: String::new(),
            claims: Mutex::new(std::collections::BTreeMap::new()),
        };
        let salt = log
            .migrate()
            .map_err(|e| anyhow::anyhow!("rollout store {}: {e}", log.shown))?;
        tracing::info!(store = %log.shown, "rollout log on PostgreSQL");
        log.salt = salt;
        Ok(log)
    }

    fn migrate(&self) -> Result<String, LogError> {
        let mut c = self.conn()?;
        let mut tx = c.transaction()?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS flywheel_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        )?;
        let done: usize = tx
            .query_opt(
                "SELECT value FROM flywheel_meta WHERE key = 'schema_version'",
                &[],
            )?
            .map(|r| r.get::<_, String>(0).parse().unwrap_or(usize::MAX))
            .unwrap_or(0);
        if done > MIGRATIONS.len() {
            return Err(LogError::Conflict(format!(
                "schema version {done} is newer than this build ({})",
                MIGRATIONS.len()
            )));
        }
        for m in &MIGRATIONS[done..] {
            tx.batch_execute(m)?;
        }
        tx.execute(
            "INSERT INTO flywheel_meta (key, value) VALUES ('schema_version', $1)
             ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            &[&MIGRATIONS.len().to_string()],
        )?;
        let fresh = format!(
            "{:016x}{:016x}",
            crate::util::random_u64(),
            crate::util::random_u64()
        );
        tx.execute(
            "INSERT INTO flywheel_meta (key, value) VALUES ('key_salt', $1)
             ON CONFLICT (key) DO NOTHING",
            &[&fresh],
        )?;
        let salt: String = tx
            .query_one(
                "SELECT value FROM flywheel_meta WHERE key = 'key_salt'",
                &[],
            )?
            .get(0);
        tx.commit()?;
        Ok(salt)
    }

    /// A pooled connection that still answers (one round trip: a database restarted since it
    /// was pooled must cost no call a spurious failure), or a new one.
    pub(super) fn conn(&self) -> Result<Conn<'_>, LogError> {
        let pooled = loop {
            let c = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match c {
                Some(mut c) => {
                    if !c.is_closed() && c.is_valid(VALIDATE_TIMEOUT).is_ok() {
                        break Some(c);
                    }
                }
                None => break None,
            }
        };
        let client = match pooled {
            Some(c) => c,
            None => self.config.connect(NoTls)?,
        };
        Ok(Conn {
            log: self,
            client: Some(client),
        })
    }

    /// Take or re-check this process's claim to train `adapter` (`RolloutStore::claim_trainer`).
    pub(super) fn take_claim(&self, adapter: &str) -> Result<(), LogError> {
        let mut claims = self.claims.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = claims.get_mut(adapter) {
            if !c.is_closed() && c.is_valid(VALIDATE_TIMEOUT).is_ok() {
                return Ok(());
            }
            // The connection (and with it the lock) is gone: take it again, if still free.
            claims.remove(adapter);
        }
        let mut c = self.config.connect(NoTls)?;
        let got: bool = c
            .query_one(
                "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
                &[&format!("flywheel-trainer:{adapter}")],
            )?
            .get(0);
        if !got {
            return Err(LogError::Conflict(format!(
                "another trainer holds '{adapter}' in {} (one trainer per adapter)",
                self.shown
            )));
        }
        claims.insert(adapter.to_string(), c);
        Ok(())
    }

    /// A thread that LISTENs on `channel` and calls `wake` for each notification, and once
    /// after each (re)connection (`RolloutStore::subscribe`).
    pub(super) fn listen(&self, channel: &'static str, wake: Box<dyn Fn() + Send + Sync>) {
        let config = self.config.clone();
        let shown = self.shown.clone();
        let listen = move || loop {
            match config.connect(NoTls) {
                Ok(mut c) => match c.batch_execute(&format!("LISTEN {channel}")) {
                    Ok(()) => {
                        // Catch up on whatever was announced while not listening.
                        wake();
                        let mut n = c.notifications();
                        let mut it = n.blocking_iter();
                        while let Ok(Some(_)) = it.next() {
                            wake();
                        }
                        tracing::warn!(store = %shown, "lost the LISTEN connection: reconnecting");
                    }
                    Err(e) => tracing::warn!(store = %shown, error = %e, "LISTEN failed"),
                },
                Err(e) => tracing::warn!(store = %shown, error = %e, "cannot connect to LISTEN"),
            }
            std::thread::sleep(Duration::from_secs(1));
        };
        if let Err(e) = std::thread::Builder::new()
            .name("flywheel-pg-listen".into())
            .spawn(listen)
        {
            tracing::error!(error = %e, channel, "no LISTEN thread: what it announces is found by polling");
        }
    }
}

/// A `ChoiceInfo` from the `CHOICE_INFO` columns of `r`, the first at index `at`.
pub(super) fn choice_info(r: &Row, at: usize) -> ChoiceInfo {
    ChoiceInfo {
        choice: r.get::<_, i32>(at) as u32,
        adapter: r.get(at + 1),
        adapter_version: r.get::<_, i64>(at + 2) as u64,
        group: r.get(at + 3),
        finish_reason: r.get(at + 4),
        reward: r.get(at + 5),
        trained_step: r.get::<_, Option<i64>>(at + 6).map(|s| s as u64),
        dropped: r.get(at + 7),
        adapter_versions: ChoiceInfo::spans(r.get::<_, i64>(at + 2) as u64, r.get(at + 8)),
    }
}
