//! The tracing subscriber: structured logs to stdout, text or JSON, and,
//! when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set,
//! spans exported over OTLP (HTTP/JSON) to a collector.
//!
//! Log lines are formatted on the thread that logs and written to stdout by
//! a thread of their own, in batches ([`crate::log_writer`]): a request
//! never waits for stdout, nor wakes a thread per line. [`shutdown`] writes
//! out what is queued.
//!
//! One trace follows a request across processes: W3C `traceparent` is
//! read from the incoming HTTP request, carried in gRPC metadata
//! ([`inject`] on the client side, [`extract`] on the server side) and in
//! NATS message headers. `RUST_LOG` overrides the configured level. Secrets
//! never reach a log line or a span: they are `secrecy` types and are not
//! recorded as fields.

use std::fmt::Write as _;
use std::io::Stdout;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::fmt::writer::EitherWriter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

pub use opentelemetry::Context;

use crate::log_writer::{self, LogWriter, LogWriterGuard};

/// The exporter's provider, flushed by [`shutdown`].
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// The log writer's thread, kept for the process's life: dropping its guard
/// (in [`shutdown`]) writes out the queued lines and stops it.
static LOG_WORKER: Mutex<Option<LogWorker>> = Mutex::new(None);

/// Set by [`shutdown`]: from then on lines go to stdout synchronously, so
/// what is logged after the writer's thread stopped is not lost.
static LOG_STOPPED: AtomicBool = AtomicBool::new(false);

struct LogWorker {
    guard: LogWriterGuard,
    dropped: LogWriter,
}

/// Stdout through the log writer's thread, or directly once it stopped
/// (or could not start).
struct Logs(Option<LogWriter>);

impl<'a> MakeWriter<'a> for Logs {
    type Writer = EitherWriter<&'a LogWriter, Stdout>;

    fn make_writer(&'a self) -> Self::Writer {
        match &self.0 {
            Some(writer) if !LOG_STOPPED.load(Ordering::Acquire) => EitherWriter::A(writer),
            _ => EitherWriter::B(std::io::stdout()),
        }
    }
}

/// Whether spans are exported: the OTLP endpoint is configured.
pub fn exporting() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|name| std::env::var(name).is_ok_and(|v| !v.is_empty()))
}

/// Installs the subscriber. `service` names this process in its spans
/// (`service.name`, e.g. `rialto-gateway`); `OTEL_SERVICE_NAME` wins.
pub fn init(format: &str, level: &str, service: &str) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let otel = exporting()
        .then(|| tracer_provider(service))
        .flatten()
        .map(|provider| {
            let tracer = provider.tracer("rialto");
            let _ = PROVIDER.set(provider);
            tracing_opentelemetry::layer().with_tracer(tracer)
        });
    // Lossy: when 32 MiB of lines wait for stdout (a stalled log
    // collector), a new line is dropped rather than the logging thread (an
    // HTTP worker, serving every request on it) blocked until stdout drains:
    // a log line is not worth stalling requests. Drops are not silent: they
    // are counted in `rialto_log_lines_dropped_total` and reported on stderr
    // at exit.
    let spawned = log_writer::spawn(std::io::stdout(), "rialto-log")
        .inspect_err(|error| {
            eprintln!(
                "rialto: cannot start the log writer's thread ({error}); logging synchronously"
            )
        })
        .ok();
    let writer = spawned.as_ref().map(|(writer, _)| writer.clone());
    // Colours only for a person at a terminal: a log collector gets plain
    // text, and the escape codes cost ~1.5% of a worker's time under load.
    let colours = std::io::IsTerminal::is_terminal(&std::io::stdout());
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(colours)
        .with_timer(LineTime)
        .with_writer(Logs(writer));
    let registry = tracing_subscriber::registry().with(filter).with(otel);
    // A second init (tests) is harmless: keep the first subscriber (the new
    // writer's thread stops with its guard, dropped here).
    let installed = if format == "json" {
        let (format, slot) = WithTraceIds::new(
            tracing_subscriber::fmt::format()
                .json()
                .with_timer(LineTime),
        );
        let dispatch = tracing::Dispatch::new(
            registry.with(
                fmt.fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
                    .event_format(format),
            ),
        );
        let _ = slot.set(dispatch.downgrade());
        dispatch.try_init()
    } else if colours {
        registry.with(fmt).try_init()
    } else {
        registry.with(fmt.fmt_fields(PlainFields)).try_init()
    };
    if let (Ok(()), Some((dropped, guard))) = (installed, spawned) {
        let counter = dropped.clone();
        crate::metrics::metrics().on_scrape(move |metrics| {
            let now = counter.dropped_lines();
            let seen = metrics.log_lines_dropped.get();
            metrics.log_lines_dropped.inc_by(now.saturating_sub(seen));
        });
        *LOG_WORKER.lock().unwrap_or_else(|e| e.into_inner()) = Some(LogWorker { guard, dropped });
    }
}

/// A log line's time as tracing-subscriber's default writes it (RFC 3339,
/// UTC, microseconds: `2026-12-02T16:40:01.123456Z`), with the date and the
/// time of day formatted once a second by each thread that logs: formatting
/// the whole time for each line is ~1% of a priced chat's instructions.
struct LineTime;

thread_local! {
    /// The second last formatted here, and its text up to the seconds.
    static LINE_SECOND: std::cell::RefCell<(u64, String)> =
        const { std::cell::RefCell::new((u64::MAX, String::new())) };
}

impl tracing_subscriber::fmt::time::FormatTime for LineTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
            Ok(since_epoch) if since_epoch.as_secs() < YEAR_10000 => {
                write_line_time(w, since_epoch)
            }
            // A clock before 1970 or past year 9999: as the default has it.
            _ => tracing_subscriber::fmt::time::SystemTime.format_time(w),
        }
    }
}

/// 10000-01-01T00:00:00Z in seconds since the Unix epoch.
const YEAR_10000: u64 = 253_402_300_800;

fn write_line_time(
    w: &mut impl std::fmt::Write,
    since_epoch: std::time::Duration,
) -> std::fmt::Result {
    use std::fmt::Write as _;
    let seconds = since_epoch.as_secs();
    LINE_SECOND.with_borrow_mut(|(second, text)| {
        if *second != seconds {
            text.clear();
            let time = i64::try_from(seconds)
                .ok()
                .and_then(|s| chrono::DateTime::from_timestamp(s, 0))
                .unwrap_or_default();
            write!(text, "{}", time.format("%Y-%m-%dT%H:%M:%S"))?;
            *second = seconds;
        }
        w.write_str(text)
    })?;
    let mut fraction = *b".000000Z";
    let mut micros = since_epoch.subsec_micros();
    for digit in fraction[1..7].iter_mut().rev() {
        *digit = b'0' + (micros % 10) as u8;
        micros /= 10;
    }
    // ASCII digits: always UTF-8.
    w.write_str(std::str::from_utf8(&fraction).unwrap_or(".000000Z"))
}

/// Span and event fields as the default text formatter writes them without
/// colours (`name=value`, space-separated, `message` bare, `log.*` left
/// out), without its styling: it styles every name and `=` even when the
/// style is none, and that was a sixth of a request's instructions. A
/// field's value is written as the default's `{value:?}` writes it, with
/// the common kinds written directly: a number by `itoa`, and a string of
/// printable ASCII with nothing to escape between its quotes as it is.
/// Through `Debug` each string went through `char::escape_debug` a
/// character at a time, and each number through `fmt::write`: ~9,000
/// instructions of a priced chat's line and span (callgrind).
#[derive(Clone, Copy, Debug, Default)]
struct PlainFields;

impl<'writer>
    tracing_subscriber::field::MakeVisitor<tracing_subscriber::fmt::format::Writer<'writer>>
    for PlainFields
{
    type Visitor = PlainVisitor<'writer>;

    fn make_visitor(
        &self,
        writer: tracing_subscriber::fmt::format::Writer<'writer>,
    ) -> Self::Visitor {
        PlainVisitor {
            writer,
            first: true,
            result: Ok(()),
        }
    }
}

/// Writes one span's or event's fields (see [`PlainFields`]).
struct PlainVisitor<'writer> {
    writer: tracing_subscriber::fmt::format::Writer<'writer>,
    /// No field written yet: no delimiter before the next.
    first: bool,
    result: std::fmt::Result,
}

impl PlainVisitor<'_> {
    /// Writes what comes before `field`'s value: the delimiter, and its
    /// name and `=` unless it is the message. False when the field is not
    /// written (a `log.*` field, or an earlier write failed).
    fn begin(&mut self, field: &tracing::field::Field) -> bool {
        let name = field.name();
        if self.result.is_err() || name.starts_with("log.") {
            return false;
        }
        if !std::mem::take(&mut self.first) {
            self.result = self.writer.write_char(' ');
        }
        if name != "message" {
            // The name as it is, not through `{}` (which looks for padding).
            self.result = self
                .result
                .and_then(|()| {
                    self.writer
                        .write_str(name.strip_prefix("r#").unwrap_or(name))
                })
                .and_then(|()| self.writer.write_char('='));
        }
        self.result.is_ok()
    }

    fn write(&mut self, text: &str) {
        if self.result.is_ok() {
            self.result = self.writer.write_str(text);
        }
    }

    /// Writes `text` as the default writes a message or an error: with a
    /// terminal's control characters escaped, when the writer asks for it.
    fn write_sanitized(&mut self, text: std::fmt::Arguments<'_>) {
        if self.result.is_err() {
            return;
        }
        self.result = if self.writer.sanitizes_ansi_escapes() {
            Sanitized(&mut self.writer).write_fmt(text)
        } else {
            self.writer.write_fmt(text)
        };
    }
}

impl tracing::field::Visit for PlainVisitor<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if !self.begin(field) {
            return;
        }
        if field.name() == "message" {
            self.write_sanitized(format_args!("{value:?}"));
        } else {
            self.result = write!(self.writer, "{value:?}");
        }
    }

    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if !self.begin(field) {
            return;
        }
        if field.name() == "message" {
            // The default writes a message given as a string bare.
            self.write_sanitized(format_args!("{value}"));
        } else if value
            .bytes()
            .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
        {
            // What `{:?}` makes of it: nothing in it is escaped.
            self.write("\"");
            self.write(value);
            self.write("\"");
        } else {
            self.result = write!(self.writer, "{value:?}");
        }
    }

    /// As the default: the error, then ` <name>.sources=[...]` listing its
    /// source and theirs, each sanitised as a message is.
    fn record_error(
        &mut self,
        field: &tracing::field::Field,
        value: &(dyn std::error::Error + 'static),
    ) {
        if !self.begin(field) {
            return;
        }
        self.write_sanitized(format_args!("{value}"));
        let Some(source) = value.source() else {
            return;
        };
        self.write(" ");
        self.write(field.name());
        self.write(".sources=[");
        let mut next = Some(source);
        let mut first = true;
        while let Some(error) = next {
            if !std::mem::take(&mut first) {
                self.write(", ");
            }
            self.write_sanitized(format_args!("{error}"));
            next = error.source();
        }
        self.write("]");
    }

    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        if self.begin(field) {
            self.write(itoa::Buffer::new().format(value));
        }
    }

    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        if self.begin(field) {
            self.write(itoa::Buffer::new().format(value));
        }
    }

    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        if self.begin(field) {
            self.write(if value { "true" } else { "false" });
        }
    }
}

/// A message as the default writes it: the control characters a terminal
/// reads as the start of an escape sequence (ESC, BEL, BS, FF, DEL, and
/// U+0080 to U+009F) written as escapes, so a message cannot move a
/// terminal's cursor or recolour it.
struct Sanitized<'w, W>(&'w mut W);

impl<W: std::fmt::Write> std::fmt::Write for Sanitized<'_, W> {
    fn write_str(&mut self, text: &str) -> std::fmt::Result {
        // U+0080 to U+009F are 0xC2 0x80-0x9F in UTF-8.
        if !text
            .bytes()
            .any(|b| matches!(b, 0x1b | 0x07 | 0x08 | 0x0c | 0x7f | 0xc2))
        {
            return self.0.write_str(text);
        }
        for ch in text.chars() {
            match ch {
                '\x1b' | '\x07' | '\x08' | '\x0c' | '\x7f' => {
                    write!(self.0, "\\x{:02x}", ch as u32)?;
                }
                '\u{80}'..='\u{9f}' => write!(self.0, "\\u{{{:x}}}", ch as u32)?,
                _ => self.0.write_char(ch)?,
            }
        }
        Ok(())
    }
}

impl tracing_subscriber::field::VisitOutput<std::fmt::Result> for PlainVisitor<'_> {
    fn finish(self) -> std::fmt::Result {
        self.result
    }
}

impl tracing_subscriber::field::VisitFmt for PlainVisitor<'_> {
    fn writer(&mut self) -> &mut dyn std::fmt::Write {
        &mut self.writer
    }
}

/// A JSON line formatter that puts the current span's `trace_id` and
/// `span_id` first, when spans are exported: a log line leads to its trace
/// in the tracing backend. Without an exporter the line is the inner
/// format's, unchanged.
pub struct WithTraceIds<F> {
    inner: F,
    /// The subscriber this formatter is part of, where the spans' trace
    /// contexts are (a formatter cannot ask for the current dispatcher: it
    /// runs inside it).
    dispatch: std::sync::Arc<OnceLock<tracing::dispatcher::WeakDispatch>>,
}

impl<F> WithTraceIds<F> {
    /// The formatter, and the slot to put its subscriber's dispatcher in
    /// once built.
    pub fn new(
        inner: F,
    ) -> (
        Self,
        std::sync::Arc<OnceLock<tracing::dispatcher::WeakDispatch>>,
    ) {
        let dispatch = std::sync::Arc::new(OnceLock::new());
        (
            Self {
                inner,
                dispatch: dispatch.clone(),
            },
            dispatch,
        )
    }
}

impl<S, N, F> tracing_subscriber::fmt::FormatEvent<S, N> for WithTraceIds<F>
where
    F: tracing_subscriber::fmt::FormatEvent<S, N>,
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        use opentelemetry::trace::TraceContextExt as _;
        // No span, or no exporter: nothing to link to.
        let ids = ctx.lookup_current().and_then(|span| {
            let dispatch = self.dispatch.get()?.upgrade()?;
            let context = tracing_opentelemetry::get_otel_context(&span.id(), &dispatch)?;
            let span = context.span();
            let ids = span.span_context();
            ids.is_valid().then(|| (ids.trace_id(), ids.span_id()))
        });
        let Some((trace_id, span_id)) = ids else {
            return self.inner.format_event(ctx, writer, event);
        };
        let mut line = String::with_capacity(256);
        self.inner.format_event(
            ctx,
            tracing_subscriber::fmt::format::Writer::new(&mut line),
            event,
        )?;
        match line.strip_prefix('{') {
            Some(rest) => write!(
                writer,
                "{{\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\",{rest}"
            ),
            None => writer.write_str(&line),
        }
    }
}

fn tracer_provider(service: &str) -> Option<SdkTracerProvider> {
    // The endpoint, headers, timeout and batching come from the standard
    // OTEL_* variables.
    use opentelemetry_otlp::WithExportConfig as _;
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(opentelemetry_otlp::Protocol::HttpJson)
        .build()
    {
        Ok(exporter) => exporter,
        Err(error) => {
            eprintln!("rialto: OTLP exporter not started: {error}");
            return None;
        }
    };
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_owned());
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(name)
        .build();
    Some(
        SdkTracerProvider::builder()
            .with_resource(resource)
            .with_batch_exporter(exporter)
            .build(),
    )
}

/// Flushes the spans not yet exported and writes out the queued log lines
/// (waiting up to about a second for stdout); call once before the process
/// exits. Lines logged afterwards are written synchronously.
pub fn shutdown() {
    if let Some(provider) = PROVIDER.get() {
        let _ = provider.shutdown();
    }
    flush_logs();
}

/// Writes out the queued log lines and stops the writer's thread; later
/// lines go to stdout synchronously.
pub fn flush_logs() {
    let worker = LOG_WORKER.lock().unwrap_or_else(|e| e.into_inner()).take();
    let Some(LogWorker { guard, dropped }) = worker else {
        return;
    };
    LOG_STOPPED.store(true, Ordering::Release);
    guard.stop();
    let lost = dropped.dropped_lines();
    if lost > 0 {
        eprintln!("rialto: {lost} log lines dropped (stdout fell behind)");
    }
}

/// The trace context a carrier (HTTP headers, gRPC metadata, NATS headers)
/// brings, through `get`.
pub fn extract(get: impl Fn(&str) -> Option<String>) -> Context {
    struct Carrier {
        traceparent: Option<String>,
        tracestate: Option<String>,
    }
    impl Extractor for Carrier {
        fn get(&self, key: &str) -> Option<&str> {
            match key {
                "traceparent" => self.traceparent.as_deref(),
                "tracestate" => self.tracestate.as_deref(),
                _ => None,
            }
        }
        fn keys(&self) -> Vec<&str> {
            vec!["traceparent", "tracestate"]
        }
    }
    // No `tracestate` without a `traceparent` to go with: not looked up.
    let Some(traceparent) = get("traceparent") else {
        return Context::new();
    };
    let carrier = Carrier {
        traceparent: Some(traceparent),
        tracestate: get("tracestate"),
    };
    opentelemetry::global::get_text_map_propagator(|propagator| propagator.extract(&carrier))
}

/// Sets `span`'s parent to the context a carrier brought (no-op when it
/// brought none).
pub fn set_parent(span: &tracing::Span, parent: Context) {
    let _ = span.set_parent(parent);
}

/// Whether this process exports its spans (OTLP). Without an exporter a
/// span only gives the lines logged inside it their context, so a span
/// that no line needs can be left out ([`tracing::Span::none`]).
pub fn spans_exported() -> bool {
    PROVIDER.get().is_some()
}

/// The current span's trace context as `(name, value)` pairs to send
/// (`traceparent`, `tracestate`): nothing when spans are not exported.
pub fn inject_current() -> Vec<(&'static str, String)> {
    struct Pairs(Vec<(&'static str, String)>);
    impl Injector for Pairs {
        fn set(&mut self, key: &str, value: String) {
            let key = match key {
                "traceparent" => "traceparent",
                "tracestate" => "tracestate",
                _ => return,
            };
            self.0.push((key, value));
        }
    }
    if !spans_exported() {
        return Vec::new();
    }
    let context = tracing::Span::current().context();
    let mut pairs = Pairs(Vec::new());
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut pairs);
    });
    pairs.0
}

/// The machine's host name, for `x-<brand>-host-name`.
pub fn host_name() -> String {
    gethostname::gethostname().to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_time_is_rfc_3339_with_microseconds_and_follows_the_second() {
        use std::time::Duration;
        let line = |since_epoch| {
            let mut text = String::new();
            super::write_line_time(&mut text, since_epoch).unwrap();
            text
        };
        let at = Duration::from_secs(1_764_694_801);
        assert_eq!(
            line(at + Duration::from_micros(123)),
            "2025-12-02T17:00:01.000123Z"
        );
        assert_eq!(
            line(at + Duration::from_nanos(999_999_999)),
            "2025-12-02T17:00:01.999999Z"
        );
        // The next second (and a day later) is formatted afresh.
        assert_eq!(
            line(at + Duration::from_secs(1)),
            "2025-12-02T17:00:02.000000Z"
        );
        assert_eq!(
            line(at + Duration::from_secs(86_400)),
            "2025-12-03T17:00:01.000000Z"
        );
        assert_eq!(line(Duration::ZERO), "1970-01-01T00:00:00.000000Z");
        // What chrono makes of it is the instant it was given.
        let parsed =
            chrono::DateTime::parse_from_rfc3339(&line(at + Duration::from_micros(456_789)));
        assert_eq!(parsed.unwrap().timestamp_micros(), 1_764_694_801_456_789);
        // The same text as chrono's RFC 3339 with microseconds, over
        // instants spread across the years.
        for seconds in (0..253_402_300_799u64).step_by(9_876_543_211) {
            for micros in [0, 1, 999_999, 123_456] {
                let at = Duration::from_secs(seconds) + Duration::from_micros(micros);
                let expected =
                    chrono::DateTime::from_timestamp(seconds as i64, micros as u32 * 1_000)
                        .unwrap()
                        .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
                assert_eq!(line(at), expected);
            }
        }
    }

    /// A buffer a subscriber writes its lines into.
    #[derive(Clone, Default)]
    struct Lines(std::sync::Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Lines {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// The plain fields read as the default's without colours, for every
    /// kind of value they write in a way of their own.
    #[test]
    fn plain_fields_are_the_default_formatters_without_colours() {
        use tracing_subscriber::layer::SubscriberExt;
        #[derive(Debug)]
        struct Failed(&'static str, Option<Box<Failed>>);
        impl std::fmt::Display for Failed {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Failed {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let line = |plain: bool, log: &dyn Fn()| {
            let lines = Lines::default();
            let writer = lines.clone();
            let layer = tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .without_time()
                .with_writer(move || writer.clone());
            if plain {
                tracing::subscriber::with_default(
                    tracing_subscriber::registry().with(layer.fmt_fields(PlainFields)),
                    log,
                );
            } else {
                tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), log);
            }
            String::from_utf8(lines.0.lock().unwrap().clone()).unwrap()
        };
        let both = |log: &dyn Fn()| {
            let plain = line(true, log);
            assert_eq!(plain, line(false, log));
            plain
        };
        let served = both(&|| {
            let span =
                tracing::info_span!("request", request_id = %"r-1", status = tracing::field::Empty);
            span.record("status", 200u16);
            span.in_scope(|| {
                tracing::info!(
                    path = "/chat",
                    elapsed_us = 12u64,
                    ok = true,
                    "request served"
                )
            });
        });
        assert!(
            served.contains("request{request_id=r-1 status=200}"),
            "{served}"
        );
        assert!(
            served.contains("request served path=\"/chat\" elapsed_us=12 ok=true"),
            "{served}"
        );
        // Strings with something to escape, and without; numbers at their
        // bounds; a message with a terminal's escape in it.
        let kinds = both(&|| {
            let span = tracing::info_span!(
                "request",
                r#type = "tab\there",
                quote = "say \"hi\"",
                back = "a\\b",
                empty = "",
                unicode = "caf\u{e9} \u{1b}[31m \u{85}",
                small = i64::MIN,
                large = u64::MAX,
                no = false,
            );
            span.record("empty", "x");
            span.in_scope(|| {
                tracing::info!(
                    shape = ?("triangle", 3u8),
                    ratio = 0.25,
                    shown = %"as is",
                    "odd \u{1b}[2J \u{9b} message {}",
                    7
                );
                tracing::warn!(message = "bare \u{7}", answer = -42i64);
                let failed = Failed(
                    "outer \u{1b}[2J",
                    Some(Box::new(Failed(
                        "middle",
                        Some(Box::new(Failed("inner", None))),
                    ))),
                );
                tracing::error!(error = &failed as &dyn std::error::Error, "failed");
                let alone = Failed("alone", None);
                tracing::error!(r#error = &alone as &dyn std::error::Error);
            });
        });
        for expected in [
            "type=\"tab\\there\"",
            "quote=\"say \\\"hi\\\"\"",
            "back=\"a\\\\b\"",
            "small=-9223372036854775808",
            "large=18446744073709551615",
            "no=false",
            "shape=(\"triangle\", 3) ratio=0.25 shown=as is",
            "odd \\x1b[2J \\u{9b} message 7",
            "bare \\x07 answer=-42",
            "failed error=outer \\x1b[2J error.sources=[middle, inner]",
            "error=alone\n",
        ] {
            assert!(kinds.contains(expected), "{expected} in {kinds}");
        }
    }

    #[test]
    fn json_lines_carry_the_trace_and_span_ids_when_spans_are_exported() {
        use opentelemetry::trace::TraceContextExt as _;
        let lines = Lines::default();
        let writer = lines.clone();
        let provider = SdkTracerProvider::builder().build();
        let (format, slot) = WithTraceIds::new(
            tracing_subscriber::fmt::format()
                .json()
                .with_timer(LineTime),
        );
        let dispatch = tracing::Dispatch::new(
            tracing_subscriber::registry()
                .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")))
                .with(
                    tracing_subscriber::fmt::layer()
                        .with_writer(move || writer.clone())
                        .fmt_fields(tracing_subscriber::fmt::format::JsonFields::new())
                        .event_format(format),
                ),
        );
        let _ = slot.set(dispatch.downgrade());
        let (trace_id, span_id) = tracing::dispatcher::with_default(&dispatch, || {
            tracing::info!("outside any span");
            let span = tracing::info_span!("request");
            let _entered = span.enter();
            tracing::info!(answer = 42, "inside");
            let context = span.context();
            let ids = context.span().span_context().clone();
            (ids.trace_id().to_string(), ids.span_id().to_string())
        });
        let text = String::from_utf8(lines.0.lock().unwrap().clone()).unwrap();
        let mut parsed = text
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap());
        let outside = parsed.next().unwrap();
        assert!(outside.get("trace_id").is_none(), "{outside}");
        let inside = parsed.next().unwrap();
        assert_eq!(inside["trace_id"], trace_id.as_str(), "{inside}");
        assert_eq!(inside["span_id"], span_id.as_str());
        assert_eq!(inside["fields"]["answer"], 42);
        assert_eq!(trace_id.len(), 32);
    }

    #[test]
    fn lines_go_through_the_writer_thread_until_flushed_then_straight_to_stdout() {
        init("text", "info", "rialto-test");
        tracing::info!("queued for the writer's thread");
        assert!(
            LOG_WORKER
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
        );
        assert!(!LOG_STOPPED.load(Ordering::Acquire));
        // Nothing was dropped, and the scrape says so.
        let text = crate::metrics::metrics().render();
        assert!(text.contains("rialto_log_lines_dropped_total 0"), "{text}");
        flush_logs();
        assert!(LOG_STOPPED.load(Ordering::Acquire));
        assert!(
            LOG_WORKER
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_none()
        );
        // After the flush a line is written synchronously, not lost.
        tracing::info!("written directly");
        flush_logs();
    }
}
