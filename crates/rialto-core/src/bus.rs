//! The event bus: fire-and-forget events between services.
//!
//! One interface, two transports, like the services themselves: in one
//! process the bus is a set of in-memory channels; scaled out it is NATS.
//! Subjects are `<prefix>.<service>.<event>` ([`Bus::subject`]). A
//! subscription may join a queue group, so that among the replicas of a
//! service exactly one receives each event (a log writer, say), or not, so
//! that every replica does (window updates, revocations).
//!
//! Delivery of events is at most once on both transports: events are
//! corrections and records whose loss degrades precision, never money.
//!
//! Records that bill someone go through a *durable queue* instead
//! ([`Bus::enqueue`], [`Bus::consume`]): at least once, acknowledged by the
//! consumer after it handled the record, delivered again otherwise. Scaled
//! out a queue is a JetStream stream `<prefix>-<queue>` (work-queue
//! retention, file storage, records kept up to 7 days, duplicates with the
//! same id dropped within 2 minutes) with one durable pull consumer shared by
//! the replicas; both are created on first use. In one process a queue is an
//! in-memory channel that redelivers what its consumer did not acknowledge:
//! it survives a failed handler, not a crash of the process, whose requests
//! die with it anyway.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use tokio::sync::mpsc;

/// A stream of event payloads.
pub type Events = BoxStream<'static, Bytes>;

/// The records of a durable queue, as they are delivered.
pub type Deliveries = BoxStream<'static, Delivery>;

/// One delivery of a durable queue's record. [`ack`](Self::ack) it once it is
/// handled; a delivery dropped (or [`retry_later`](Self::retry_later)) without
/// an acknowledgement is delivered again.
pub struct Delivery {
    pub payload: Bytes,
    /// The trace of whoever queued the record (NATS headers; none in
    /// process), for the consumer's span.
    pub trace: crate::telemetry::Context,
    acker: Acker,
}

enum Acker {
    /// Sends the record back to its queue unless acknowledged.
    InProcess(Option<mpsc::UnboundedSender<Bytes>>),
    Nats(Box<async_nats::jetstream::Message>),
}

impl Delivery {
    /// The record was handled: it is not delivered again.
    pub async fn ack(mut self) -> crate::Result<()> {
        match &mut self.acker {
            Acker::InProcess(requeue) => {
                requeue.take();
                Ok(())
            }
            Acker::Nats(message) => message.ack().await.map_err(|e| {
                crate::Error::new(
                    crate::ErrorCode::Unavailable,
                    format!("JetStream ack failed: {e}"),
                )
            }),
        }
    }

    /// The record could not be handled now: deliver it again after `delay`.
    pub async fn retry_later(mut self, delay: Duration) {
        match &mut self.acker {
            Acker::InProcess(requeue) => {
                if let Some(requeue) = requeue.take() {
                    let payload = self.payload.clone();
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        let _ = requeue.send(payload);
                    });
                }
            }
            Acker::Nats(message) => {
                let nak = async_nats::jetstream::AckKind::Nak(Some(delay));
                if let Err(error) = message.ack_with(nak).await {
                    // Redelivered after the consumer's ack wait anyway.
                    tracing::warn!(%error, "JetStream nak failed");
                }
            }
        }
    }
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if let Acker::InProcess(Some(requeue)) = &mut self.acker {
            let _ = requeue.send(self.payload.clone());
        }
    }
}

#[async_trait]
trait Transport: Send + Sync + 'static {
    async fn publish(&self, subject: String, payload: Bytes) -> crate::Result<()>;
    async fn subscribe(
        &self,
        subject: String,
        queue_group: Option<String>,
    ) -> crate::Result<Events>;
    async fn enqueue(&self, queue: Queue, id: &str, payload: Bytes) -> crate::Result<()>;
    async fn consume(&self, queue: Queue, consumer: &str) -> crate::Result<Deliveries>;
    async fn delete_queue(&self, queue: Queue) -> crate::Result<()>;
    /// Sends what is buffered (at shutdown).
    async fn flush(&self) -> crate::Result<()> {
        Ok(())
    }
}

/// A durable queue's names on the transport.
#[derive(Debug, Clone)]
struct Queue {
    /// JetStream stream name: `<prefix>-<queue>`, dots and wildcards replaced.
    stream: String,
    /// `<prefix>.<queue>`.
    subject: String,
}

/// How long a queue keeps a record nobody acknowledged.
const QUEUE_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// How long a consumer has to acknowledge a delivery before it is
/// delivered again.
const QUEUE_ACK_WAIT: Duration = Duration::from_secs(30);

/// A cloneable handle on the bus.
#[derive(Clone)]
pub struct Bus {
    transport: Arc<dyn Transport>,
    prefix: Arc<str>,
    /// Whether events reach other processes.
    shared: bool,
}

impl std::fmt::Debug for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bus")
            .field("prefix", &self.prefix)
            .field("shared", &self.shared)
            .finish()
    }
}

impl Bus {
    /// Sends every event still buffered; call before the process exits.
    pub async fn flush(&self) -> crate::Result<()> {
        self.transport.flush().await
    }

    /// The bus of one process.
    pub fn in_process(prefix: &str) -> Self {
        Self {
            transport: Arc::new(InProcess::default()),
            prefix: prefix.into(),
            shared: false,
        }
    }

    /// The bus on the NATS server at `url`.
    pub async fn nats(url: &str, prefix: &str) -> crate::Result<Self> {
        let client = async_nats::ConnectOptions::new()
            .name("rialto")
            .retry_on_initial_connect()
            .connect(url)
            .await
            .map_err(|e| {
                crate::Error::new(
                    crate::ErrorCode::Unavailable,
                    // The URL may carry a user and password or a token.
                    format!("cannot reach NATS at {}: {e}", crate::db::redacted(url)),
                )
            })?;
        Ok(Self {
            transport: Arc::new(Nats {
                jetstream: async_nats::jetstream::new(client.clone()),
                client,
                streams: Default::default(),
            }),
            prefix: prefix.into(),
            shared: true,
        })
    }

    /// From `[bus]`: NATS when a URL is set, else in-process.
    pub async fn from_config(
        config: &crate::config::BusConfig,
        brand: &str,
    ) -> crate::Result<Self> {
        let prefix = if config.subject_prefix.is_empty() {
            brand
        } else {
            &config.subject_prefix
        };
        if config.url.is_empty() {
            Ok(Self::in_process(prefix))
        } else {
            Self::nats(&config.url, prefix).await
        }
    }

    /// Whether events published here reach other processes.
    pub fn is_shared(&self) -> bool {
        self.shared
    }

    /// `<prefix>.<name>`, e.g. `rialto.limiter.commits`.
    pub fn subject(&self, name: &str) -> String {
        format!("{}.{name}", self.prefix)
    }

    /// Publishes `payload` on `subject`; returns once the transport took it.
    pub async fn publish(&self, subject: String, payload: Bytes) -> crate::Result<()> {
        self.transport.publish(subject, payload).await
    }

    /// The JetStream stream name of durable queue `queue` (e.g. `usage`):
    /// `<prefix>-<queue>`, for operators and for tests that clean up.
    pub fn queue_stream(&self, queue: &str) -> String {
        self.queue(queue).stream
    }

    fn queue(&self, queue: &str) -> Queue {
        let stream = format!("{}-{queue}", self.prefix)
            .chars()
            .map(|c| {
                if matches!(c, '.' | '*' | '>' | ' ') {
                    '_'
                } else {
                    c
                }
            })
            .collect();
        Queue {
            stream,
            subject: self.subject(queue),
        }
    }

    /// Appends `payload` to durable queue `queue`; returns once it is stored
    /// (by the JetStream server, when scaled out). Records with the same `id`
    /// enqueued within two minutes are stored once.
    pub async fn enqueue(&self, queue: &str, id: &str, payload: Bytes) -> crate::Result<()> {
        self.transport.enqueue(self.queue(queue), id, payload).await
    }

    /// The records of durable queue `queue`, shared among every consumer of
    /// that name (the replicas of one service).
    pub async fn consume(&self, queue: &str, consumer: &str) -> crate::Result<Deliveries> {
        self.transport.consume(self.queue(queue), consumer).await
    }

    /// Deletes durable queue `queue` and what it holds (tests clean up the
    /// shared server with it).
    pub async fn delete_queue(&self, queue: &str) -> crate::Result<()> {
        self.transport.delete_queue(self.queue(queue)).await
    }

    /// Every event on `subject`, or with a `queue_group`, the share of them
    /// this member of the group is given.
    pub async fn subscribe(
        &self,
        subject: String,
        queue_group: Option<&str>,
    ) -> crate::Result<Events> {
        self.transport
            .subscribe(subject, queue_group.map(str::to_owned))
            .await
    }
}

/// In-memory channels keyed by subject.
#[derive(Default)]
struct InProcess {
    subscribers: Mutex<HashMap<String, Vec<Subscriber>>>,
    queues: Mutex<HashMap<String, LocalQueue>>,
}

/// An in-process durable queue: records wait in the channel until its one
/// consumer takes the receiver.
struct LocalQueue {
    sender: mpsc::UnboundedSender<Bytes>,
    receiver: Option<mpsc::UnboundedReceiver<Bytes>>,
}

impl InProcess {
    fn local_queue<T>(
        &self,
        name: &str,
        use_it: impl FnOnce(&mut LocalQueue) -> T,
    ) -> crate::Result<T> {
        let mut queues = self
            .queues
            .lock()
            .map_err(|_| crate::Error::internal("bus lock poisoned"))?;
        let queue = queues.entry(name.to_owned()).or_insert_with(|| {
            let (sender, receiver) = mpsc::unbounded_channel();
            LocalQueue {
                sender,
                receiver: Some(receiver),
            }
        });
        Ok(use_it(queue))
    }
}

struct Subscriber {
    queue_group: Option<String>,
    sender: mpsc::Sender<Bytes>,
}

/// Events waiting for one in-process subscriber; past it, new events are
/// dropped (at most once, like NATS with a slow consumer) rather than
/// buffered without bound.
const SUBSCRIBER_QUEUE: usize = 10_000;

#[async_trait]
impl Transport for InProcess {
    async fn publish(&self, subject: String, payload: Bytes) -> crate::Result<()> {
        let mut subscribers = self
            .subscribers
            .lock()
            .map_err(|_| crate::Error::internal("bus lock poisoned"))?;
        let Some(list) = subscribers.get_mut(&subject) else {
            return Ok(());
        };
        list.retain(|s| !s.sender.is_closed());
        let mut served_groups: Vec<&str> = Vec::new();
        for subscriber in list.iter() {
            match subscriber.queue_group.as_deref() {
                None => deliver(&subscriber.sender, &subject, &payload),
                // One member of each queue group gets the event.
                Some(group) if !served_groups.contains(&group) => {
                    served_groups.push(group);
                    deliver(&subscriber.sender, &subject, &payload);
                }
                Some(_) => {}
            }
        }
        Ok(())
    }

    async fn subscribe(
        &self,
        subject: String,
        queue_group: Option<String>,
    ) -> crate::Result<Events> {
        let (sender, receiver) = mpsc::channel(SUBSCRIBER_QUEUE);
        self.subscribers
            .lock()
            .map_err(|_| crate::Error::internal("bus lock poisoned"))?
            .entry(subject)
            .or_default()
            .push(Subscriber {
                queue_group,
                sender,
            });
        Ok(
            futures_util::stream::unfold(receiver, |mut receiver| async move {
                receiver.recv().await.map(|event| (event, receiver))
            })
            .boxed(),
        )
    }

    async fn enqueue(&self, queue: Queue, _id: &str, payload: Bytes) -> crate::Result<()> {
        self.local_queue(&queue.stream, |q| q.sender.send(payload))?
            .map_err(|_| crate::Error::internal("in-process queue closed"))
    }

    async fn consume(&self, queue: Queue, _consumer: &str) -> crate::Result<Deliveries> {
        let (requeue, receiver) =
            self.local_queue(&queue.stream, |q| (q.sender.clone(), q.receiver.take()))?;
        let receiver = receiver.ok_or_else(|| {
            crate::Error::internal(format!(
                "in-process queue {} has a consumer already",
                queue.stream
            ))
        })?;
        Ok(futures_util::stream::unfold(receiver, move |mut receiver| {
            let requeue = requeue.clone();
            async move {
                let payload = receiver.recv().await?;
                let delivery = Delivery {
                    payload,
                    trace: crate::telemetry::Context::new(),
                    acker: Acker::InProcess(Some(requeue)),
                };
                Some((delivery, receiver))
            }
        })
        .boxed())
    }

    async fn delete_queue(&self, queue: Queue) -> crate::Result<()> {
        self.queues
            .lock()
            .map_err(|_| crate::Error::internal("bus lock poisoned"))?
            .remove(&queue.stream);
        Ok(())
    }
}

fn deliver(sender: &mpsc::Sender<Bytes>, subject: &str, payload: &Bytes) {
    if let Err(mpsc::error::TrySendError::Full(_)) = sender.try_send(payload.clone()) {
        tracing::warn!(subject, "bus subscriber lagging: event dropped");
    }
}

struct Nats {
    client: async_nats::Client,
    jetstream: async_nats::jetstream::Context,
    /// Streams this process created or found already.
    streams: tokio::sync::Mutex<HashMap<String, async_nats::jetstream::stream::Stream>>,
}

fn unavailable(what: &str, error: impl std::fmt::Display) -> crate::Error {
    crate::Error::new(crate::ErrorCode::Unavailable, format!("{what}: {error}"))
}

impl Nats {
    /// The queue's stream, created on first use with the same configuration
    /// in every process (creating it again is a no-op).
    async fn stream(&self, queue: &Queue) -> crate::Result<async_nats::jetstream::stream::Stream> {
        use async_nats::jetstream::stream;
        let mut streams = self.streams.lock().await;
        if let Some(found) = streams.get(&queue.stream) {
            return Ok(found.clone());
        }
        let created = self
            .jetstream
            .get_or_create_stream(stream::Config {
                name: queue.stream.clone(),
                subjects: vec![queue.subject.clone()],
                retention: stream::RetentionPolicy::WorkQueue,
                storage: stream::StorageType::File,
                max_age: QUEUE_MAX_AGE,
                duplicate_window: Duration::from_secs(120),
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable(&format!("cannot create stream {}", queue.stream), e))?;
        streams.insert(queue.stream.clone(), created.clone());
        Ok(created)
    }
}

#[async_trait]
impl Transport for Nats {
    async fn publish(&self, subject: String, payload: Bytes) -> crate::Result<()> {
        self.client.publish(subject, payload).await.map_err(|e| {
            crate::Error::new(
                crate::ErrorCode::Unavailable,
                format!("NATS publish failed: {e}"),
            )
        })
    }

    async fn subscribe(
        &self,
        subject: String,
        queue_group: Option<String>,
    ) -> crate::Result<Events> {
        let subscriber = match queue_group {
            Some(group) => self.client.queue_subscribe(subject, group).await,
            None => self.client.subscribe(subject).await,
        }
        .map_err(|e| {
            crate::Error::new(
                crate::ErrorCode::Unavailable,
                format!("NATS subscribe failed: {e}"),
            )
        })?;
        Ok(subscriber.map(|message| message.payload).boxed())
    }

    async fn enqueue(&self, queue: Queue, id: &str, payload: Bytes) -> crate::Result<()> {
        use async_nats::jetstream::message::PublishMessage;
        self.stream(&queue).await?;
        let mut message = PublishMessage::build().payload(payload).message_id(id);
        // The enqueuer's trace goes on in whoever settles the record.
        for (name, value) in crate::telemetry::inject_current() {
            message = message.header(name, value.as_str());
        }
        self.jetstream
            .send_publish(queue.subject, message)
            .await
            .map_err(|e| unavailable("JetStream publish failed", e))?
            // The server's acknowledgement: the record is stored.
            .await
            .map_err(|e| unavailable("JetStream did not store the record", e))?;
        Ok(())
    }

    async fn consume(&self, queue: Queue, consumer: &str) -> crate::Result<Deliveries> {
        use async_nats::jetstream::consumer::{AckPolicy, pull};
        let stream = self.stream(&queue).await?;
        let consumer = stream
            .get_or_create_consumer(
                consumer,
                pull::Config {
                    durable_name: Some(consumer.to_owned()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: QUEUE_ACK_WAIT,
                    filter_subject: queue.subject.clone(),
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| unavailable("cannot create the JetStream consumer", e))?;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| unavailable("cannot consume from JetStream", e))?;
        // The consumer's lag, refreshed every 5 s for `/metrics` while its
        // deliveries are consumed.
        let alive = Arc::new(());
        let watching = Arc::downgrade(&alive);
        let pending = crate::metrics::metrics()
            .nats_consumer_pending
            .get_or_create_owned(&crate::metrics::ConsumerLabels {
                stream: queue.stream.clone(),
                consumer: consumer.cached_info().name.clone(),
            });
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(5));
            while watching.strong_count() > 0 {
                every.tick().await;
                if let Ok(info) = consumer.get_info().await {
                    pending.set(i64::try_from(info.num_pending).unwrap_or(i64::MAX));
                }
            }
        });
        Ok(messages
            .filter_map(move |message| {
                let _alive = &alive;
                async move {
                    match message {
                        Ok(message) => Some(Delivery {
                            payload: message.payload.clone(),
                            trace: crate::telemetry::extract(|name| {
                                message
                                    .headers
                                    .as_ref()
                                    .and_then(|headers| headers.get(name))
                                    .map(|value| value.as_str().to_owned())
                            }),
                            acker: Acker::Nats(Box::new(message)),
                        }),
                        Err(error) => {
                            // The stream reconnects by itself; records not
                            // acknowledged come again.
                            tracing::warn!(%error, "JetStream consumer error");
                            None
                        }
                    }
                }
            })
            .boxed())
    }

    async fn flush(&self) -> crate::Result<()> {
        self.client
            .flush()
            .await
            .map_err(|e| unavailable("cannot flush to NATS", e))
    }

    async fn delete_queue(&self, queue: Queue) -> crate::Result<()> {
        self.streams.lock().await.remove(&queue.stream);
        match self.jetstream.delete_stream(&queue.stream).await {
            Ok(_) => Ok(()),
            Err(error) if error.to_string().contains("not found") => Ok(()),
            Err(error) => Err(unavailable("cannot delete the stream", error)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_nats_url_is_named_without_its_credentials() {
        let Err(error) = Bus::nats("nats://rialto:s3cret@[::1", "t").await else {
            panic!("a malformed URL connects")
        };
        assert!(error.message.contains("***@"), "{}", error.message);
        assert!(!error.message.contains("s3cret"), "{}", error.message);
    }

    #[tokio::test]
    async fn in_process_fans_out_and_queue_groups_share() {
        let bus = Bus::in_process("test");
        let subject = bus.subject("things");
        assert_eq!(subject, "test.things");
        let mut all_a = bus.subscribe(subject.clone(), None).await.unwrap();
        let mut all_b = bus.subscribe(subject.clone(), None).await.unwrap();
        let mut group_a = bus.subscribe(subject.clone(), Some("g")).await.unwrap();
        let group_b = bus.subscribe(subject.clone(), Some("g")).await.unwrap();
        bus.publish(subject.clone(), Bytes::from_static(b"1"))
            .await
            .unwrap();
        assert_eq!(all_a.next().await.unwrap(), "1");
        assert_eq!(all_b.next().await.unwrap(), "1");
        assert_eq!(group_a.next().await.unwrap(), "1");
        // The other member of the group got nothing; once the first leaves,
        // the group's events go to the one left.
        drop(group_a);
        bus.publish(subject, Bytes::from_static(b"2"))
            .await
            .unwrap();
        let mut group_b = group_b;
        assert_eq!(group_b.next().await.unwrap(), "2");
    }

    #[tokio::test]
    async fn in_process_queues_redeliver_what_was_not_acknowledged() {
        let bus = Bus::in_process("test");
        // Records wait for the consumer.
        bus.enqueue("work", "1", Bytes::from_static(b"a"))
            .await
            .unwrap();
        let mut records = bus.consume("work", "workers").await.unwrap();
        assert!(bus.consume("work", "workers").await.is_err());
        let first = records.next().await.unwrap();
        assert_eq!(first.payload, "a");
        // A handler that fails without acknowledging: the record comes again.
        drop(first);
        let again = records.next().await.unwrap();
        assert_eq!(again.payload, "a");
        again.retry_later(Duration::from_millis(10)).await;
        let third = records.next().await.unwrap();
        assert_eq!(third.payload, "a");
        third.ack().await.unwrap();
        bus.enqueue("work", "2", Bytes::from_static(b"b"))
            .await
            .unwrap();
        assert_eq!(records.next().await.unwrap().payload, "b");
    }

    /// A JetStream queue on the machine's NATS server: records survive their
    /// consumer (a new one, as after a crash, gets what was not
    /// acknowledged), one id is stored once, and the stream is deleted after.
    async fn next(records: &mut Deliveries) -> Delivery {
        tokio::time::timeout(Duration::from_secs(10), records.next())
            .await
            .expect("a delivery in time")
            .expect("the stream goes on")
    }

    #[tokio::test]
    async fn nats_queues_are_durable_and_at_least_once() {
        let url = std::env::var("E2E_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
        let prefix = format!("rialto-test-{}", crate::ids::request_id());
        let bus = Bus::nats(&url, &prefix).await.unwrap();
        for (id, payload) in [("r1", "one"), ("r1", "one again"), ("r2", "two")] {
            bus.enqueue("work", id, Bytes::from(payload)).await.unwrap();
        }
        {
            let mut records = bus.consume("work", "workers").await.unwrap();
            let one = next(&mut records).await;
            assert_eq!(one.payload, "one");
            one.ack().await.unwrap();
            let two = next(&mut records).await;
            assert_eq!(two.payload, "two");
            // The consumer goes away before acknowledging it.
            two.retry_later(Duration::from_millis(100)).await;
        }
        let other = Bus::nats(&url, &prefix).await.unwrap();
        let mut records = other.consume("work", "workers").await.unwrap();
        let two = next(&mut records).await;
        assert_eq!(two.payload, "two");
        two.ack().await.unwrap();
        let nothing = tokio::time::timeout(Duration::from_millis(300), records.next()).await;
        assert!(nothing.is_err(), "the duplicate id was stored once");
        assert!(other.queue_stream("work").starts_with("rialto-test-"));
        other.delete_queue("work").await.unwrap();
    }

    /// Against the NATS server of the machine (127.0.0.1:4222, or
    /// `E2E_NATS_URL`), on a subject no one else uses.
    #[tokio::test]
    async fn nats_delivers_to_subscribers_and_one_member_of_a_group() {
        let url = std::env::var("E2E_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
        let prefix = format!("rialto-test-{}", crate::ids::request_id());
        let bus = Bus::nats(&url, &prefix).await.unwrap();
        assert!(bus.is_shared());
        let subject = bus.subject("things");
        let mut all = bus.subscribe(subject.clone(), None).await.unwrap();
        let mut group_a = bus.subscribe(subject.clone(), Some("g")).await.unwrap();
        let mut group_b = bus.subscribe(subject.clone(), Some("g")).await.unwrap();
        for i in 0..10u8 {
            bus.publish(subject.clone(), Bytes::from(vec![i]))
                .await
                .unwrap();
        }
        for i in 0..10u8 {
            assert_eq!(all.next().await.unwrap(), Bytes::from(vec![i]));
        }
        let mut grouped = 0;
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        while grouped < 10 {
            tokio::select! {
                Some(_) = group_a.next() => grouped += 1,
                Some(_) = group_b.next() => grouped += 1,
                () = tokio::time::sleep_until(deadline) => break,
            }
        }
        assert_eq!(grouped, 10);
        // Nothing more: each event reached one member of the group.
        let extra = tokio::time::timeout(std::time::Duration::from_millis(200), async {
            tokio::select! {
                Some(_) = group_a.next() => true,
                Some(_) = group_b.next() => true,
            }
        })
        .await;
        assert!(extra.is_err());
    }
}
