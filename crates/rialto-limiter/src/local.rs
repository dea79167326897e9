//! The limiter replica in this process: the sharded windows of the
//! principals it holds ([`Principals`]), and the tasks that connect them to
//! the bus and the rate-limit log.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use prost::Message;
use rialto_core::bus::Bus;
use rialto_core::db::{Database, now_ms};
use rialto_core::membership::Membership;

use rialto_core::{Config, Result};
use rialto_proto::limiter::v1 as pb;
use sqlx::Row;
use tokio::sync::mpsc;

use crate::principals::{Admit, Commit, HitSink, Principals, spawn_sweeper};
use crate::{
    COMMITS_SUBJECT, HITS_SUBJECT, LOG_PAGE, LOG_PAGE_ALL, LOG_WRITERS, LimiterService,
    REPLICATION_SUBJECT,
};

/// How long rate-limit log entries are kept.
const LOG_RETENTION_MS: i64 = 30 * 86_400_000;
/// Entries kept per account (the endpoint shows the newest 50).
const LOG_KEPT_PER_ACCOUNT: i64 = 200;
/// Hits waiting to be published before new ones are dropped.
const HIT_QUEUE: usize = 10_000;

/// One limiter replica. Its decisions ([`decide`](Self::decide),
/// [`apply`](Self::apply)) are synchronous and run on the caller's thread;
/// the [`LimiterService`] methods wrap them for the trait and gRPC.
#[derive(Clone)]
pub struct LocalLimiter {
    principals: Arc<Principals>,
    hits: HitSink,
    db: Database,
    /// One replica of several: what it decides is published for the next
    /// replica of each principal.
    replication: Option<Arc<Replication>>,
}

/// Where a replica publishes its decisions, and who it is.
struct Replication {
    bus: Bus,
    membership: Membership,
    me: usize,
    /// `<prefix>.limiter.replication.<index>` of each replica: what each
    /// hears (the principals it is first or second in line for).
    subjects: Vec<String>,
}

/// How long an admission waits for its event to be taken by the bus client
/// (normally at once, into its buffer): a bus that is down or slow must
/// not hold admissions. An event not taken is dropped, and counted.
const REPLICATION_WAIT: std::time::Duration = std::time::Duration::from_millis(20);

impl std::fmt::Debug for LocalLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalLimiter")
            .field("principals", &self.principals.len())
            .finish()
    }
}

impl LocalLimiter {
    /// Starts a replica: the sharded windows and their idle sweeper, a task
    /// that publishes limit hits, one that applies the commits arriving on
    /// the bus, and one that writes the hits of its queue group to the log.
    /// Must run inside a Tokio runtime.
    pub async fn start(config: &Config, db: Database, bus: Bus) -> Result<Self> {
        Self::start_with(config, db, bus, None).await
    }

    /// Starts replica `membership.me()` of several: besides what
    /// [`start`](Self::start) does, it publishes each admission and release
    /// it decides (before answering) and keeps a copy of the windows of the
    /// principals it is next in line for, from the others' events, so that
    /// it takes them over where their owner left them.
    pub async fn start_replica(
        config: &Config,
        db: Database,
        bus: Bus,
        membership: Membership,
    ) -> Result<Self> {
        Self::start_with(config, db, bus, Some(membership)).await
    }

    async fn start_with(
        config: &Config,
        db: Database,
        bus: Bus,
        membership: Option<Membership>,
    ) -> Result<Self> {
        let (hits, mut hit_events) = mpsc::channel::<pb::LimitHit>(HIT_QUEUE);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let span_ms = (config.limits.window_secs as i64).saturating_mul(1000);
        let idle_ms = (config.limits.idle_secs as i64).saturating_mul(1000);
        let principals = Arc::new(Principals::new(
            Principals::shards_for(cores),
            span_ms,
            idle_ms,
            hits.clone(),
        ));
        spawn_sweeper(&principals);

        let hits_subject = bus.subject(HITS_SUBJECT);
        let mut written = bus
            .subscribe(hits_subject.clone(), Some(LOG_WRITERS))
            .await?;
        let mut commits = bus.subscribe(bus.subject(COMMITS_SUBJECT), None).await?;

        let publisher = bus.clone();
        tokio::spawn(async move {
            while let Some(hit) = hit_events.recv().await {
                let payload = Bytes::from(hit.encode_to_vec());
                if let Err(error) = publisher.publish(hits_subject.clone(), payload).await {
                    tracing::warn!(%error, "cannot publish a limit hit");
                }
            }
        });

        let writer_db = db.clone();
        tokio::spawn(async move {
            let mut written_since_prune = 0u32;
            while let Some(payload) = written.next().await {
                let Ok(hit) = pb::LimitHit::decode(payload) else {
                    tracing::warn!("undecodable limit hit on the bus");
                    continue;
                };
                if let Err(error) = insert_hit(&writer_db, &hit).await {
                    tracing::warn!(%error, "cannot write a limit hit");
                }
                written_since_prune += 1;
                if written_since_prune >= 1000 {
                    written_since_prune = 0;
                    if let Err(error) = prune(&writer_db).await {
                        tracing::warn!(%error, "cannot prune the rate-limit log");
                    }
                }
            }
        });

        // Every replica hears every commit and applies those of principals
        // it holds; the others have nothing to do.
        let commit_principals = principals.clone();
        tokio::spawn(async move {
            while let Some(payload) = commits.next().await {
                match pb::CommitRequest::decode(payload) {
                    Ok(request) => commit_principals.commit(&Commit::of(&request)),
                    Err(_) => tracing::warn!("undecodable commit on the bus"),
                }
            }
            // The transport closes a subscription only when it shuts down.
            tracing::error!(
                "the limiter's commit subscription ended: commits are no longer applied"
            );
        });

        let replication = match membership {
            Some(membership) => {
                let me = membership.me().ok_or_else(|| {
                    rialto_core::Error::invalid("a replica must know its own name")
                })?;
                let subjects: Vec<String> = (0..membership.len())
                    .map(|index| bus.subject(&format!("{REPLICATION_SUBJECT}.{index}")))
                    .collect();
                // Only the events of principals this replica is first or
                // second in line for are sent to it.
                let mut events = bus.subscribe(subjects[me].clone(), None).await?;
                let copies = principals.clone();
                tokio::spawn(async move {
                    while let Some(payload) = events.next().await {
                        match pb::WindowEvent::decode(payload) {
                            Ok(event) => copies.replay(&event),
                            Err(_) => tracing::warn!("undecodable window event on the bus"),
                        }
                    }
                    tracing::error!("the limiter's replication subscription ended");
                });
                Some(Arc::new(Replication {
                    bus,
                    membership,
                    me,
                    subjects,
                }))
            }
            None => None,
        };
        Ok(Self {
            principals,
            hits,
            db,
            replication,
        })
    }

    /// Publishes what this replica just decided, for the replica next in
    /// the principal's line. Awaited before the answer, so the event is on
    /// its way before anyone acts on the decision.
    /// It goes to the other of the principal's first two replicas (to
    /// both when this one is neither: two are down).
    async fn replicate(&self, event: pb::WindowEvent) {
        let Some(replication) = &self.replication else {
            return;
        };
        let (first, second) = replication.membership.first_two(&event.principal);
        let payload = Bytes::from(event.encode_to_vec());
        for target in [Some(first), second].into_iter().flatten() {
            if target == replication.me {
                continue;
            }
            let publish = replication
                .bus
                .publish(replication.subjects[target].clone(), payload.clone());
            match tokio::time::timeout(REPLICATION_WAIT, publish).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::warn!(%error, "cannot publish a window event"),
                Err(_) => tracing::warn!("the bus did not take a window event in time: dropped"),
            }
        }
    }

    /// Decides one admission (or peek) now, on this thread: one short
    /// critical section on the principal's shard.
    pub fn decide(&self, request: &Admit<'_>) -> pb::AdmitResponse {
        self.principals.admit(request)
    }

    /// Applies a commit or a release now, on this thread, where this replica
    /// holds the principal's windows.
    pub fn apply(&self, commit: &Commit<'_>) {
        self.principals.commit(commit);
    }

    /// The windows this replica holds, for tests and metrics.
    pub fn principals(&self) -> &Arc<Principals> {
        &self.principals
    }
}

async fn insert_hit(db: &Database, hit: &pb::LimitHit) -> Result<()> {
    sqlx::query(
        "INSERT INTO rate_limit_logs \
         (id, account_id, api_key_id, model_id, tier, limit_type, at_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(rialto_core::ids::request_id())
    .bind(&hit.account_id)
    .bind(&hit.api_key_id)
    .bind(&hit.model_id)
    .bind(&hit.tier)
    .bind(&hit.limit_type)
    .bind(hit.at_ms)
    .execute(db.pool())
    .await?;
    // Keep the newest entries of the account only: the log answers "what
    // was refused lately", and a hammering client must not grow it forever.
    sqlx::query(
        "DELETE FROM rate_limit_logs WHERE account_id = $1 AND at_ms < \
         (SELECT at_ms FROM rate_limit_logs WHERE account_id = $1 \
          ORDER BY at_ms DESC LIMIT 1 OFFSET $2)",
    )
    .bind(&hit.account_id)
    .bind(LOG_KEPT_PER_ACCOUNT - 1)
    .execute(db.pool())
    .await?;
    Ok(())
}

async fn prune(db: &Database) -> Result<()> {
    sqlx::query("DELETE FROM rate_limit_logs WHERE at_ms < $1")
        .bind(now_ms() - LOG_RETENTION_MS)
        .execute(db.pool())
        .await?;
    Ok(())
}

#[async_trait]
impl LimiterService for LocalLimiter {
    async fn admit(&self, request: pb::AdmitRequest) -> Result<pb::AdmitResponse> {
        let response = self.decide(&Admit::of(&request));
        if response.admitted && !request.peek {
            // The owner's count of the day, so that a copy that missed some
            // (it started mid-day) still refuses past the daily limit.
            let day_count = if request.limit.is_some_and(|l| l.requests_per_day > 0) {
                self.principals.day_count(
                    &request.principal,
                    &request.window,
                    crate::clock::now_ms(),
                )
            } else {
                0
            };
            self.replicate(pb::WindowEvent {
                day_count,
                estimated_tokens: request.estimated_tokens,
                request_id: request.request_id,
                principal: request.principal,
                window: request.window,
                release: false,
            })
            .await;
        }
        Ok(response)
    }

    async fn commit(&self, request: pb::CommitRequest) -> Result<pb::CommitResponse> {
        self.apply(&Commit::of(&request));
        if request.release {
            // Commits travel on the bus to every replica; releases come
            // here alone, so they are passed on.
            self.replicate(pb::WindowEvent {
                estimated_tokens: request.estimated_tokens,
                request_id: request.request_id,
                principal: request.principal,
                window: request.window,
                release: true,
                ..Default::default()
            })
            .await;
        }
        Ok(pb::CommitResponse {})
    }

    async fn record_hits(&self, request: pb::RecordHitsRequest) -> Result<pb::RecordHitsResponse> {
        for hit in request.hits {
            let _ = self.hits.try_send(hit);
        }
        Ok(pb::RecordHitsResponse {})
    }

    async fn recent_hits(&self, request: pb::RecentHitsRequest) -> Result<pb::RecentHitsResponse> {
        let since = now_ms() - LOG_RETENTION_MS;
        let rows = if request.all_accounts {
            // Every account's: a backward walk of the log's at_ms index.
            let limit = i64::from(request.limit.clamp(1, LOG_PAGE_ALL));
            sqlx::query(
                "SELECT account_id, api_key_id, model_id, tier, limit_type, at_ms \
                 FROM rate_limit_logs WHERE at_ms >= $2 \
                 ORDER BY at_ms DESC, id DESC LIMIT $1",
            )
            .bind(limit)
            .bind(since)
            .fetch_all(self.db.pool())
            .await?
        } else {
            let limit = i64::from(request.limit.clamp(1, LOG_PAGE));
            sqlx::query(
                "SELECT account_id, api_key_id, model_id, tier, limit_type, at_ms \
                 FROM rate_limit_logs WHERE account_id = $1 AND at_ms >= $3 \
                 ORDER BY at_ms DESC, id DESC LIMIT $2",
            )
            .bind(&request.account_id)
            .bind(limit)
            .bind(since)
            .fetch_all(self.db.pool())
            .await?
        };
        let hits = rows
            .iter()
            .map(|row| {
                Ok(pb::LimitHit {
                    account_id: row.try_get("account_id")?,
                    api_key_id: row.try_get("api_key_id")?,
                    model_id: row.try_get("model_id")?,
                    tier: row.try_get("tier")?,
                    limit_type: row.try_get("limit_type")?,
                    at_ms: row.try_get("at_ms")?,
                })
            })
            .collect::<std::result::Result<Vec<_>, sqlx::Error>>()?;
        Ok(pb::RecentHitsResponse { hits })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::{Caller, LimiterClient, RateLimiter, Target};

    const CONFIG: &str = r#"
[limits]
idle_secs = 1
[[limits.overrides]]
account = "acct"
rpm = 50
tpm = 10000
[[models]]
id = "chat"
"#;

    async fn limiter(dir: &tempfile::TempDir) -> (Config, LocalLimiter, RateLimiter) {
        limiter_reached(dir, Reached::InPlace).await
    }

    /// How the gateway's `RateLimiter` reaches the replica.
    #[derive(Clone, Copy, Debug)]
    enum Reached {
        /// As in `rialto serve`: decided and committed in place.
        InPlace,
        /// Through `LimiterService` messages, commits on the bus, as a
        /// replica in another process is reached (minus the network).
        Messages,
    }

    /// The replica behind the trait only, as gRPC would see it; with the
    /// number of commits each commit call carried.
    struct Messages(LimiterClient, Arc<std::sync::Mutex<Vec<usize>>>);

    #[async_trait]
    impl LimiterService for Messages {
        async fn admit(&self, request: pb::AdmitRequest) -> Result<pb::AdmitResponse> {
            self.0.admit(request).await
        }
        async fn commit(&self, request: pb::CommitRequest) -> Result<pb::CommitResponse> {
            self.1.lock().unwrap().push(1);
            self.0.commit(request).await
        }
        async fn commit_many(&self, batch: pb::CommitBatch) -> Result<pb::CommitResponse> {
            self.1.lock().unwrap().push(batch.commits.len());
            self.0.commit_many(batch).await
        }
        async fn record_hits(
            &self,
            request: pb::RecordHitsRequest,
        ) -> Result<pb::RecordHitsResponse> {
            self.0.record_hits(request).await
        }
        async fn recent_hits(
            &self,
            request: pb::RecentHitsRequest,
        ) -> Result<pb::RecentHitsResponse> {
            self.0.recent_hits(request).await
        }
    }

    async fn limiter_reached(
        dir: &tempfile::TempDir,
        reached: Reached,
    ) -> (Config, LocalLimiter, RateLimiter) {
        let config = Config::from_toml(CONFIG).unwrap();
        let url = format!("sqlite://{}/limiter.db", dir.path().display());
        let db = Database::connect(&url, 2).await.unwrap();
        let bus = Bus::in_process("test");
        let local = LocalLimiter::start(&config, db, bus.clone()).await.unwrap();
        let client = LimiterClient::new(local.clone());
        assert!(client.local().is_some());
        let client = match reached {
            Reached::InPlace => client,
            Reached::Messages => {
                let messages = LimiterClient::new(Messages(client, Default::default()));
                assert!(messages.local().is_none());
                messages
            }
        };
        let rate = RateLimiter::new(&config, vec![("local".into(), client)], Some(bus));
        (config, local, rate)
    }

    /// `tasks` concurrent admissions of key `k1` through `rate`; how many
    /// were admitted.
    async fn race(rate: &RateLimiter, config: &Config, tasks: usize) -> usize {
        let model = config.model("chat").unwrap().clone();
        let mut handles = Vec::new();
        for i in 0..tasks {
            let rate = rate.clone();
            let model = model.clone();
            handles.push(tokio::spawn(async move {
                let admission = rate
                    .admit(caller("k1"), Target::model(&model), &format!("r{i}"), 10)
                    .await
                    .unwrap();
                admission.refusal.is_none()
            }));
        }
        let mut admitted = 0;
        for handle in handles {
            admitted += usize::from(handle.await.unwrap());
        }
        admitted
    }

    fn caller(key_id: &str) -> Caller<'_> {
        Caller {
            account_id: "acct",
            key_id,
            tier: "standard",
        }
    }

    #[tokio::test]
    async fn two_hundred_concurrent_requests_against_50_rpm_admit_exactly_50() {
        let dir = tempfile::tempdir().unwrap();
        let (config, _local, rate) = limiter(&dir).await;
        let model = config.model("chat").unwrap().clone();
        assert_eq!(race(&rate, &config, 200).await, 50);
        // Another key of the same account has its own window.
        let other = rate
            .admit(caller("k2"), Target::model(&model), "other", 10)
            .await
            .unwrap();
        assert!(other.refusal.is_none());
        let headers = other.headers.unwrap();
        assert_eq!(headers.limit_requests, 50);
        assert_eq!(headers.remaining_requests, 49);
        assert_eq!(headers.tokens.unwrap().remaining, 9990);
    }

    #[tokio::test]
    async fn a_reload_changes_the_limits_and_keeps_the_windows() {
        let dir = tempfile::tempdir().unwrap();
        let (config, _local, rate) = limiter(&dir).await;
        let model = config.model("chat").unwrap().clone();
        let admit = |id: String| {
            let (rate, model) = (rate.clone(), model.clone());
            async move {
                rate.admit(caller("k1"), Target::model(&model), &id, 10)
                    .await
                    .unwrap()
            }
        };
        for i in 0..10 {
            assert!(admit(format!("before-{i}")).await.refusal.is_none());
        }
        // The account's override drops to 12 (and the file asks for a
        // 1 s window, which needs a restart): the 10 already taken count.
        let lowered = Config::from_toml(&CONFIG.replace("rpm = 50", "rpm = 12").replace(
            "[limits]\n",
            "[limits]\nwindow_secs = 1\ndefault_completion_tokens = 77\n",
        ))
        .unwrap();
        let before = rate.policy();
        rate.reload(&lowered);
        assert_eq!(rate.policy().default_completion_tokens, 77);
        assert_eq!(rate.policy().span_ms, 60_000, "the window keeps its span");
        assert_eq!(
            before.default_completion_tokens, 1024,
            "a snapshot stays as it was"
        );
        let mut admitted = 0;
        for i in 0..5 {
            let admission = admit(format!("after-{i}")).await;
            if admission.refusal.is_none() {
                admitted += 1;
            } else {
                assert_eq!(admission.headers.unwrap().limit_requests, 12);
            }
        }
        assert_eq!(
            admitted, 2,
            "12 per window, 10 of them taken before the reload"
        );
        // Raised again: the same window, 12 requests in it.
        rate.reload(&config);
        let admission = admit("raised".into()).await;
        assert!(admission.refusal.is_none());
        assert_eq!(admission.headers.unwrap().remaining_requests, 50 - 13);
    }

    #[tokio::test]
    async fn commits_correct_the_estimate_and_refusals_reach_the_log() {
        commits_correct_the_estimate(Reached::InPlace).await;
    }

    #[tokio::test]
    async fn commits_on_the_bus_correct_the_estimate_and_refusals_reach_the_log() {
        commits_correct_the_estimate(Reached::Messages).await;
    }

    #[tokio::test]
    async fn without_a_bus_commits_are_gathered_into_one_call_per_replica() {
        let dir = tempfile::tempdir().unwrap();
        let (config, local, _) = limiter(&dir).await;
        let batches = Arc::new(std::sync::Mutex::new(Vec::new()));
        let remote = LimiterClient::new(Messages(LimiterClient::new(local), batches.clone()));
        let rate = RateLimiter::new(&config, vec![("remote".into(), remote)], None);
        let model = config.model("chat").unwrap();
        let mut admissions = Vec::new();
        for i in 0..20 {
            let admission = rate
                .admit(caller("k1"), Target::model(model), &format!("r{i}"), 100)
                .await
                .unwrap();
            assert!(admission.refusal.is_none());
            admissions.push(admission);
        }
        // Nineteen commits of 1 token each and one release.
        let last = admissions.pop().unwrap();
        for admission in admissions {
            rate.commit(admission.ticket, 1);
        }
        rate.release(last.ticket);
        let remaining = || async {
            let headers = rate
                .peek(caller("k1"), Target::model(model))
                .await
                .unwrap()
                .unwrap();
            (
                headers.remaining_requests,
                headers.tokens.unwrap().remaining,
            )
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while remaining().await != (31, 10_000 - 19) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{:?}",
                remaining().await
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let batches = batches.lock().unwrap().clone();
        assert_eq!(batches.iter().sum::<usize>(), 20);
        assert!(batches.len() <= 2, "{batches:?}");
    }

    async fn commits_correct_the_estimate(reached: Reached) {
        let dir = tempfile::tempdir().unwrap();
        let (config, local, rate) = limiter_reached(&dir, reached).await;
        let model = config.model("chat").unwrap();
        let first = rate
            .admit(caller("k1"), Target::model(model), "r1", 9000)
            .await
            .unwrap();
        assert_eq!(
            first
                .headers
                .as_ref()
                .unwrap()
                .tokens
                .as_ref()
                .unwrap()
                .remaining,
            1000
        );
        let refused = rate
            .admit(caller("k1"), Target::model(model), "r2", 5000)
            .await
            .unwrap();
        let refusal = refused.refusal.unwrap();
        assert_eq!(refusal.code, rialto_core::ErrorCode::RateLimited);
        assert!(
            refusal.message.contains("10000 tokens per minute"),
            "{}",
            refusal.message
        );
        // The first request used 100 tokens: the commit is applied in place,
        // or travels on the bus to the replica holding the principal.
        rate.commit(first.ticket, 100);
        let mut remaining = 0;
        for _ in 0..100 {
            let probe = rate
                .admit(caller("k1"), Target::model(model), "probe", 0)
                .await
                .unwrap();
            remaining = probe.headers.unwrap().tokens.unwrap().remaining;
            if remaining == 9900 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(remaining, 9900);
        // The TPM refusal was logged once.
        let mut hits = Vec::new();
        for _ in 0..100 {
            hits = local
                .recent_hits(pb::RecentHitsRequest {
                    account_id: "acct".into(),
                    limit: 50,
                    all_accounts: false,
                })
                .await
                .unwrap()
                .hits;
            if !hits.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(hits.len(), 1);
        assert_eq!(hits[0].limit_type, "TPM");
        assert_eq!(hits[0].api_key_id, "k1");
        assert_eq!(hits[0].model_id, "chat");
    }

    #[tokio::test]
    async fn the_log_keeps_the_newest_200_entries_of_an_account() {
        let dir = tempfile::tempdir().unwrap();
        let (_, local, _) = limiter(&dir).await;
        let base = now_ms() - 10_000;
        let hit = |i: i64| pb::LimitHit {
            account_id: "acct".into(),
            api_key_id: "k".into(),
            model_id: "chat".into(),
            tier: "standard".into(),
            limit_type: "RPM".into(),
            at_ms: base + i,
        };
        let hits = (0..230).map(hit).collect();
        local
            .record_hits(pb::RecordHitsRequest { hits })
            .await
            .unwrap();
        let mut count = 0;
        for _ in 0..200 {
            let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM rate_limit_logs")
                .fetch_one(local.db.pool())
                .await
                .unwrap();
            count = n;
            let newest = local
                .recent_hits(pb::RecentHitsRequest {
                    account_id: "acct".into(),
                    limit: 50,
                    all_accounts: false,
                })
                .await
                .unwrap()
                .hits;
            if count == 200 && newest.first().is_some_and(|h| h.at_ms == base + 229) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(count, 200);
    }

    /// Every account's newest hits, through the replica and through the
    /// gateway's `RateLimiter`; hits past the retention are not shown.
    #[tokio::test]
    async fn the_log_of_every_account_is_newest_first() {
        let dir = tempfile::tempdir().unwrap();
        let (_, local, rate) = limiter(&dir).await;
        let now = now_ms();
        let hit = |account: &str, at_ms: i64| pb::LimitHit {
            account_id: account.into(),
            api_key_id: "k".into(),
            model_id: "chat".into(),
            tier: "standard".into(),
            limit_type: "RPM".into(),
            at_ms,
        };
        let hits = vec![
            hit("a", now - 3_000),
            hit("b", now - 2_000),
            hit("a", now - 1_000),
            hit("c", now - LOG_RETENTION_MS - 1_000),
        ];
        local
            .record_hits(pb::RecordHitsRequest { hits })
            .await
            .unwrap();
        let all = |limit| pb::RecentHitsRequest {
            account_id: "a".into(),
            limit,
            all_accounts: true,
        };
        let mut newest = Vec::new();
        for _ in 0..200 {
            newest = local.recent_hits(all(50)).await.unwrap().hits;
            if newest.len() == 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let accounts: Vec<&str> = newest.iter().map(|h| h.account_id.as_str()).collect();
        assert_eq!(accounts, ["a", "b", "a"]);
        assert_eq!(newest[0].at_ms, now - 1_000);
        let first = local.recent_hits(all(1)).await.unwrap().hits;
        assert_eq!(first, newest[..1]);
        assert_eq!(rate.recent_hits_all(10).await.unwrap(), newest);
        // One account's alone without `all_accounts`.
        assert_eq!(rate.recent_hits("b").await.unwrap().len(), 1);
    }

    #[tokio::test]
    async fn idle_principals_are_dropped_and_come_back_on_use() {
        let dir = tempfile::tempdir().unwrap();
        let config = Config::from_toml(
            "[limits]\nwindow_secs = 1\nidle_secs = 1\n[[models]]\nid = \"chat\"\n",
        )
        .unwrap();
        let url = format!("sqlite://{}/limiter.db", dir.path().display());
        let db = Database::connect(&url, 2).await.unwrap();
        let local = LocalLimiter::start(&config, db, Bus::in_process("t"))
            .await
            .unwrap();
        let request = pb::AdmitRequest {
            request_id: "r".into(),
            principal: "key:idle".into(),
            window: "chat".into(),
            limit: Some(pb::Limit {
                requests: 1,
                tokens: 0,
                requests_per_day: 0,
            }),
            ..Default::default()
        };
        assert!(local.admit(request.clone()).await.unwrap().admitted);
        assert!(!local.admit(request.clone()).await.unwrap().admitted);
        assert_eq!(local.principals().len(), 1);
        // Until its admitted request commits, its windows wait for it.
        local
            .commit(pb::CommitRequest {
                request_id: "r".into(),
                principal: "key:idle".into(),
                window: "chat".into(),
                used_tokens: 0,
                release: false,
                estimated_tokens: 0,
            })
            .await
            .unwrap();
        // Window (1 s) and idle time (1 s) pass: the sweeper drops them.
        tokio::time::sleep(Duration::from_millis(2600)).await;
        assert_eq!(local.principals().len(), 0);
        assert!(local.admit(request).await.unwrap().admitted);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn two_hundred_concurrent_requests_on_four_threads_admit_exactly_50() {
        for reached in [Reached::InPlace, Reached::Messages] {
            let dir = tempfile::tempdir().unwrap();
            let (config, local, rate) = limiter_reached(&dir, reached).await;
            assert_eq!(race(&rate, &config, 200).await, 50, "{reached:?}");
            assert_eq!(local.principals().len(), 1);
        }
    }

    /// Many OS threads deciding at once on one principal, with no runtime
    /// between them and the windows: exactly the limit is admitted, and
    /// releases made concurrently give back exactly the slots taken.
    #[test]
    fn many_threads_racing_on_one_principal_admit_exactly_the_limit() {
        const THREADS: usize = 16;
        const ATTEMPTS: usize = 40;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let local = runtime.block_on(async {
            let config = Config::from_toml(CONFIG).unwrap();
            let url = format!("sqlite://{}/limiter.db", dir.path().display());
            let db = Database::connect(&url, 2).await.unwrap();
            LocalLimiter::start(&config, db, Bus::in_process("t"))
                .await
                .unwrap()
        });
        let limit = pb::Limit {
            requests: 50,
            tokens: 0,
            requests_per_day: 0,
        };
        // Each thread's admitted request ids.
        let race = |round: usize| -> Vec<Vec<String>> {
            let start = std::sync::Barrier::new(THREADS);
            std::thread::scope(|scope| {
                let threads: Vec<_> = (0..THREADS)
                    .map(|t| {
                        let (local, start) = (&local, &start);
                        scope.spawn(move || {
                            start.wait();
                            (0..ATTEMPTS)
                                .map(|i| format!("r{round}-{t}-{i}"))
                                .filter(|id| {
                                    local
                                        .decide(&Admit {
                                            request_id: id,
                                            principal: "key:hot",
                                            window: "chat",
                                            limit,
                                            estimated_tokens: 10,
                                            account_id: "acct",
                                            key_id: "hot",
                                            tier: "standard",
                                            peek: false,
                                        })
                                        .admitted
                                })
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                threads.into_iter().map(|t| t.join().unwrap()).collect()
            })
        };
        let peek = || {
            local
                .decide(&Admit {
                    request_id: "",
                    principal: "key:hot",
                    window: "chat",
                    limit,
                    estimated_tokens: 0,
                    account_id: "",
                    key_id: "",
                    tier: "",
                    peek: true,
                })
                .state
                .unwrap()
        };

        let first = race(0);
        assert_eq!(first.iter().map(Vec::len).sum::<usize>(), 50);
        let state = peek();
        assert_eq!(state.remaining_requests, 0);

        // Every thread releases what it was admitted, all at once.
        let start = std::sync::Barrier::new(THREADS);
        std::thread::scope(|scope| {
            for ids in &first {
                let (local, start) = (&local, &start);
                scope.spawn(move || {
                    start.wait();
                    for id in ids {
                        local.apply(&Commit {
                            request_id: id,
                            principal: "key:hot",
                            window: "chat",
                            estimated_tokens: 10,
                            used_tokens: 0,
                            release: true,
                        });
                    }
                });
            }
        });
        assert_eq!(peek().remaining_requests, 50);

        // The same race again: exactly the limit once more.
        let second = race(1);
        assert_eq!(second.iter().map(Vec::len).sum::<usize>(), 50);
        assert_eq!(peek().remaining_requests, 0);
        drop(runtime);
    }

    /// Of three replicas, b (second in the principal's line) hears what a
    /// (its owner) admits and releases, and c hears nothing of it; b
    /// decides the principal from the same window once it is the one asked
    /// (a died): no request beyond the limit, none lost to a release.
    #[tokio::test]
    async fn the_next_replica_decides_from_the_owners_window() {
        use rialto_core::membership::{Membership, Timing};

        let dir = tempfile::tempdir().unwrap();
        let config = Config::from_toml(CONFIG).unwrap();
        let bus = Bus::in_process("replication");
        let names: Vec<String> = ["a", "b", "c"]
            .iter()
            .map(|n| format!("http://{n}:9090"))
            .collect();
        let timing = Timing::from_config(&config.failover);
        // A principal a owns, with b next in line.
        let line = Membership::fixed("limiter", names.clone());
        let principal = (0..)
            .map(|i| format!("key:{i}"))
            .find(|key| line.first_two(key) == (0, Some(1)))
            .unwrap();
        let mut replicas = Vec::new();
        for me in 0..3 {
            let url = format!("sqlite://{}/limiter-{me}.db", dir.path().display());
            let db = Database::connect(&url, 2).await.unwrap();
            let membership = Membership::track("limiter", names.clone(), Some(me), timing, &bus)
                .await
                .unwrap();
            replicas.push(
                LocalLimiter::start_replica(&config, db, bus.clone(), membership)
                    .await
                    .unwrap(),
            );
        }
        let (a, b, c) = (&replicas[0], &replicas[1], &replicas[2]);
        let five = pb::Limit {
            requests: 5,
            tokens: 0,
            requests_per_day: 0,
        };
        let admit = |id: &str| pb::AdmitRequest {
            request_id: id.to_owned(),
            principal: principal.clone(),
            window: "chat".into(),
            limit: Some(five),
            estimated_tokens: 1,
            ..Default::default()
        };
        for i in 0..5 {
            assert!(a.admit(admit(&format!("r{i}"))).await.unwrap().admitted);
        }
        assert!(!a.admit(admit("r5")).await.unwrap().admitted);
        // One is given back: a later window refused its request.
        a.commit(pb::CommitRequest {
            request_id: "r4".into(),
            principal: principal.clone(),
            window: "chat".into(),
            release: true,
            estimated_tokens: 1,
            used_tokens: 0,
        })
        .await
        .unwrap();
        let remaining = |replica: &LocalLimiter| {
            let peek = pb::AdmitRequest {
                peek: true,
                ..admit("")
            };
            replica
                .decide(&Admit::of(&peek))
                .state
                .unwrap()
                .remaining_requests
        };
        let started = std::time::Instant::now();
        while remaining(b) != 1 {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "b holds {} remaining",
                remaining(b)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            c.principals().is_empty(),
            "c is not in the principal's line"
        );
        // a is gone; b decides: one more, then refusals.
        assert!(b.admit(admit("r6")).await.unwrap().admitted);
        let refused = b.admit(admit("r7")).await.unwrap();
        assert!(!refused.admitted);
        assert_eq!(refused.refused_by, "RPM");
    }
}
