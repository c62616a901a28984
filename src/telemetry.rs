//! Structured logs on stderr (stdout is for reports): one JSON object per line with every field — the event's
//! and those of the spans it happened in (`job`, `business_date`, `shard`, `shards`, `epoch`, `owner`) — at the
//! top level, for log shippers; or a human format. `RUST_LOG` overrides the configured level.

use std::{fmt, io::IsTerminal};

use serde_json::{Map, Value};
use tracing::{
    field::{Field, Visit},
    Event, Subscriber,
};
use tracing_subscriber::{
    fmt::{
        format::{JsonFields, Writer},
        FmtContext, FormatEvent, FormatFields, FormattedFields,
    },
    registry::LookupSpan,
    EnvFilter,
};

use crate::config::{LogFilter, LogFormat};

/// Installs the global subscriber. Call once, after the configuration is valid.
pub fn init(format: LogFormat, level: &LogFilter) {
    // PostgreSQL's NOTICEs ("column already exists, skipping" from idempotent migrations) are not news.
    let quiet = "sqlx::postgres::notice=warn";
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(format!("{},{quiet}", level.as_str())))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    // A log line that cannot be written (stderr closed: a pipe whose reader went away) is dropped. Reporting that
    // failure would itself write to stderr — with `eprintln!`, which panics — and a panic in the signal task
    // would leave the replica deaf to SIGTERM.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| crate::progress::LogWriter)
        .log_internal_errors(false);
    let _ = match format {
        LogFormat::Json => builder
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .try_init(),
        LogFormat::Pretty => builder.with_ansi(std::io::stderr().is_terminal()).try_init(),
    };
}

/// A JSON event format with span fields merged into the top level (innermost span wins on a clash; event
/// fields win over span fields). `span` names the innermost span.
#[derive(Debug, Clone, Copy)]
pub struct FlatJson;

impl<S, N> FormatEvent<S, N> for FlatJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut map = Map::new();
        map.insert(
            "timestamp".into(),
            Value::String(chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
        );
        map.insert(
            "level".into(),
            Value::String(meta.level().as_str().to_ascii_lowercase()),
        );
        map.insert("target".into(), Value::String(meta.target().to_string()));
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                map.insert("span".into(), Value::String(span.name().to_string()));
                let extensions = span.extensions();
                if let Some(fields) = extensions.get::<FormattedFields<N>>() {
                    if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(fields.as_str()) {
                        map.extend(fields);
                    }
                }
            }
        }
        event.record(&mut FieldVisitor(&mut map));
        writeln!(writer, "{}", Value::Object(map))
    }
}

struct FieldVisitor<'a>(&'a mut Map<String, Value>);

impl Visit for FieldVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), Value::String(value.into()));
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), Value::from(value));
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), Value::from(value));
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), Value::from(value));
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), Value::Bool(value));
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), Value::String(format!("{value:?}")));
    }
}

#[cfg(test)]
mod tests {
    use std::{
        io,
        sync::{Arc, Mutex},
    };

    use tracing_subscriber::fmt::MakeWriter;

    use super::*;

    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl io::Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0
                .lock()
                .map_err(|_| io::Error::other("poisoned"))?
                .extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Buffer {
        type Writer = Buffer;
        fn make_writer(&'a self) -> Buffer {
            self.clone()
        }
    }

    #[test]
    fn span_and_event_fields_are_at_the_top_level() {
        let buffer = Buffer::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(buffer.clone())
            .fmt_fields(JsonFields::new())
            .event_format(FlatJson)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!(
                "run",
                job = "fine-settlement",
                shard = 2,
                epoch = tracing::field::Empty
            );
            span.record("epoch", 7);
            span.in_scope(|| tracing::info!(scanned = 10, outcome = "settled", "run finished"));
        });
        let text = String::from_utf8(buffer.0.lock().expect("lock").clone()).expect("utf8");
        let line: Value = serde_json::from_str(text.trim()).expect("one JSON line");
        assert_eq!(line["job"], "fine-settlement");
        assert_eq!(line["shard"], 2);
        assert_eq!(line["epoch"], 7);
        assert_eq!(line["scanned"], 10);
        assert_eq!(line["outcome"], "settled");
        assert_eq!(line["message"], "run finished");
        assert_eq!(line["level"], "info");
        assert_eq!(line["span"], "run");
    }
}
