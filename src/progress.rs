//! Progress bars on stderr for the operator's one-shot commands (`settle`, `accrue`, `backfill`,
//! `pending retry`, `migrate`), drawn only when stderr is a terminal: the CLI decides that and asks for a bar;
//! nothing here is touched otherwise, so a pipe, a journal or a container log sees exactly the JSON lines it
//! always did.
//!
//! While a bar shows, log lines go through [`LogWriter`], which clears the bar, writes the line and redraws the
//! bar below it, so neither garbles the other.

use std::{
    io::{IsTerminal, Write},
    sync::{Arc, Mutex},
    time::Duration,
};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::store::{IndexBuild, IndexBuildObserver};

/// The bars being drawn, if any (at most one at a time in practice).
static ACTIVE: Mutex<Option<MultiProgress>> = Mutex::new(None);

/// Whether a command run now would draw bars: stderr is a terminal.
pub fn wanted() -> bool {
    std::io::stderr().is_terminal()
}

/// Called once per committed batch with the rows it scanned and updated.
#[derive(Clone)]
pub struct RowsHook(Arc<dyn Fn(i64, i64) + Send + Sync>);

impl RowsHook {
    pub fn call(&self, scanned: i64, updated: i64) {
        (self.0)(scanned, updated)
    }
}

impl std::fmt::Debug for RowsHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RowsHook")
    }
}

/// One bar of rows done / to do with the rate, on stderr. Dropped or finished, it leaves its last state on the
/// screen and log lines go straight to stderr again.
#[derive(Debug)]
pub struct Bar {
    bar: ProgressBar,
}

impl Bar {
    /// A bar titled `what` over `total` `unit` (rows, blocks).
    pub fn new(what: &str, total: u64, unit: &str) -> Bar {
        let mut active = ACTIVE.lock().unwrap_or_else(|e| e.into_inner());
        let multi = active
            .get_or_insert_with(|| MultiProgress::with_draw_target(ProgressDrawTarget::stderr()))
            .clone();
        drop(active);
        let template = format!("{{msg}} [{{bar:40}}] {{pos}}/{{len}} {unit} ({{per_sec}}, {{eta}} left)");
        let style = ProgressStyle::with_template(&template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
        let bar = multi.add(
            ProgressBar::new(total)
                .with_style(style)
                .with_message(what.to_owned()),
        );
        bar.enable_steady_tick(Duration::from_millis(250));
        Bar { bar }
    }

    /// A hook that moves the bar by the rows each batch scanned.
    pub fn rows_hook(&self) -> RowsHook {
        let bar = self.bar.clone();
        RowsHook(Arc::new(move |scanned, _updated| {
            bar.inc(u64::try_from(scanned).unwrap_or(0))
        }))
    }

    /// Moves the bar to `done` of `total` (a value polled from elsewhere).
    pub fn set(&self, done: u64, total: u64) {
        self.bar.set_length(total);
        self.bar.set_position(done);
    }

    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        self.bar.finish();
        let mut active = ACTIVE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(multi) = active.as_ref() {
            multi.remove(&self.bar);
        }
        // One bar at a time: with it gone, logs write straight to stderr again.
        *active = None;
    }
}

/// Draws the index builds of a migration as [`crate::store::migrate`] reports them a few times a second: blocks
/// done / total while the table is scanned, tuples while they are sorted, loaded and validated. One bar per index
/// and unit, replaced when either changes.
pub fn index_build_bars() -> IndexBuildObserver {
    let mut shown: Option<(String, &'static str, Bar)> = None;
    Box::new(move |build: Option<&IndexBuild>| {
        let Some(b) = build else {
            shown = None;
            return;
        };
        let (unit, done, total) = if b.blocks_total > 0 {
            ("blocks", b.blocks_done, b.blocks_total)
        } else {
            ("tuples", b.tuples_done, b.tuples_total)
        };
        let same = shown
            .as_ref()
            .is_some_and(|(index, u, _)| *index == b.index && *u == unit);
        if !same {
            // The old bar goes first: one bar at a time.
            drop(shown.take());
            let bar = Bar::new(&format!("index {}", b.index), 0, unit);
            shown = Some((b.index.clone(), unit, bar));
        }
        if let Some((_, _, bar)) = &shown {
            bar.bar.set_message(format!("index {} ({})", b.index, b.phase));
            bar.set(
                u64::try_from(done).unwrap_or(0),
                u64::try_from(total).unwrap_or(0),
            );
        }
    })
}

/// The log writer: stderr, through the bars while any is drawn.
#[derive(Debug, Clone, Copy, Default)]
pub struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let multi = ACTIVE.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match multi {
            Some(multi) => multi
                .suspend(|| std::io::stderr().write_all(buf))
                .map(|()| buf.len()),
            None => std::io::stderr().write(buf),
        }
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        let multi = ACTIVE.lock().unwrap_or_else(|e| e.into_inner()).clone();
        match multi {
            Some(multi) => multi.suspend(|| std::io::stderr().write_all(buf)),
            None => std::io::stderr().write_all(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}
