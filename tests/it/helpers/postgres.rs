//! Which PostgreSQL programs the tests that start servers of their own run ([`crate::server::PrivateServer`],
//! [`super::Cluster`], the scripts' tests): the folder `scripts/pg-bin.sh` names. The rule (`FINE_SETTLER_PG_BIN`,
//! else the newest `/usr/lib/postgresql/*/bin`, else `pg_config --bindir`) is written once, in that script, and
//! run here rather than copied; `scripts/test.sh` exports its answer as `FINE_SETTLER_PG_BIN`, so a run on another
//! major version (`scripts/test.sh --pg 18`) starts these servers on it too.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::OnceLock,
};

/// The folder of the PostgreSQL programs (`initdb`, `pg_ctl`, `postgres`, …), asked of `scripts/pg-bin.sh` once
/// per test binary. Fails the test with the script's message when it finds none.
pub fn pg_bin() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg-bin.sh");
        let out = Command::new(&script)
            .output()
            .unwrap_or_else(|e| panic!("run {}: {e}", script.display()));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && !stdout.trim().is_empty(),
            "{} found no PostgreSQL programs: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        PathBuf::from(stdout.trim())
    })
    .clone()
}

/// The PostgreSQL program `name` (`initdb`, `pg_ctl`, `pg_recvlogical`, …) of [`pg_bin`].
pub fn program(name: &str) -> PathBuf {
    pg_bin().join(name)
}
