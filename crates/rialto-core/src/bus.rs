//! The event bus: fire-and-forget events between services.
//!
//! One interface, two transports, like the services themselves: in one
//! process the bus is a set of in-memory channels; scaled out it is NATS.
//! Subjects are `<prefix>.<service>.<event>` ([`Bus::subject`]). A
//! subscription may join a queue group, so that among the replicas of a
//! service exactly one receives each event (a log writer, say), or not, so
//! that every replica does (window updates, revocations).
//!
//! Delivery is at most once on both transports: events here are corrections
//! and records whose loss degrades precision, never money. Events that bill
//! someone go through the database or JetStream instead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use futures_util::stream::BoxStream;
use tokio::sync::mpsc;

/// A stream of event payloads.
pub type Events = BoxStream<'static, Bytes>;

#[async_trait]
trait Transport: Send + Sync + 'static {
    async fn publish(&self, subject: String, payload: Bytes) -> crate::Result<()>;
    async fn subscribe(
        &self,
        subject: String,
        queue_group: Option<String>,
    ) -> crate::Result<Events>;
}

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
                    format!("cannot reach NATS at {url}: {e}"),
                )
            })?;
        Ok(Self {
            transport: Arc::new(Nats(client)),
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
}

fn deliver(sender: &mpsc::Sender<Bytes>, subject: &str, payload: &Bytes) {
    if let Err(mpsc::error::TrySendError::Full(_)) = sender.try_send(payload.clone()) {
        tracing::warn!(subject, "bus subscriber lagging: event dropped");
    }
}

struct Nats(async_nats::Client);

#[async_trait]
impl Transport for Nats {
    async fn publish(&self, subject: String, payload: Bytes) -> crate::Result<()> {
        self.0.publish(subject, payload).await.map_err(|e| {
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
            Some(group) => self.0.queue_subscribe(subject, group).await,
            None => self.0.subscribe(subject).await,
        }
        .map_err(|e| {
            crate::Error::new(
                crate::ErrorCode::Unavailable,
                format!("NATS subscribe failed: {e}"),
            )
        })?;
        Ok(subscriber.map(|message| message.payload).boxed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
