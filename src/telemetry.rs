//! Structured logs on stderr (stdout is for reports): JSON with the fields at the top level for log shippers,
//! or a human format. `RUST_LOG` overrides the configured level.

use std::io::IsTerminal;

use tracing_subscriber::{fmt, EnvFilter};

use crate::config::LogFormat;

/// Installs the global subscriber. Call once, after the configuration is valid.
pub fn init(format: LogFormat, level: &str) {
    // PostgreSQL's NOTICEs ("column already exists, skipping" from idempotent migrations) are not news.
    let quiet = "sqlx::postgres::notice=warn";
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(format!("{level},{quiet}")))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .try_init(),
        LogFormat::Pretty => builder.try_init(),
    };
}
