//! The scripts that choose the PostgreSQL the project runs on: `scripts/pg.sh` keeps one cluster per major
//! version and never hands a data folder to binaries of another version; `scripts/test.sh --pg` accepts only the
//! versions it knows. The cluster tests run `pg.sh` from a copy in a scratch checkout (its `target/` is that
//! folder's), with the binaries the suite runs on (`FINE_SETTLER_PG_BIN`, `scripts/test.sh --pg`).

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use sqlx::{Connection, PgConnection};

use crate::{helpers::free_port, server::pg_bin};

/// A scratch checkout holding only `scripts/pg.sh`, readable by the `postgres` user (the server's, as root).
fn scratch_checkout() -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::create_dir(root.path().join("scripts")).expect("mkdir");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg.sh"),
        root.path().join("scripts/pg.sh"),
    )
    .expect("copy pg.sh");
    root
}

fn pg_sh(root: &Path, bin: &Path, port: u16, args: &[&str]) -> Output {
    Command::new(root.join("scripts/pg.sh"))
        .args(args)
        .env_remove("PG_BIN")
        .env("FINE_SETTLER_PG_BIN", bin)
        .env("FINE_SETTLER_PG_PORT", port.to_string())
        .output()
        .expect("run pg.sh")
}

/// The major version of the binaries in `bin`, as `pg_ctl --version` says it ("pg_ctl (PostgreSQL) 18.6").
fn major_of(bin: &Path) -> i32 {
    let out = Command::new(bin.join("pg_ctl"))
        .arg("--version")
        .output()
        .expect("pg_ctl --version");
    let text = String::from_utf8_lossy(&out.stdout);
    let version = text.split_whitespace().nth(2).expect("a version");
    version
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("a major version in {text:?}"))
}

fn stderr_lines(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect()
}

/// Stops the scratch cluster even when an assertion fails first.
struct Started<'a> {
    root: &'a Path,
    bin: PathBuf,
    port: u16,
}

impl Drop for Started<'_> {
    fn drop(&mut self) {
        pg_sh(self.root, &self.bin, self.port, &["stop", "test"]);
    }
}

/// `pg.sh start test` initialises `target/pg-test-MAJOR` for the binaries' major version, serves it on the port
/// asked for, and the server there is of that version; `stop` stops it.
#[tokio::test]
async fn pg_sh_keeps_the_cluster_of_each_major_version_in_its_own_folder() {
    let root = scratch_checkout();
    let bin = pg_bin();
    let major = major_of(&bin);
    let port = free_port();

    let out = pg_sh(root.path(), &bin, port, &["start", "test"]);
    let started = Started {
        root: root.path(),
        bin: bin.clone(),
        port,
    };
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let url = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(url, format!("postgres://postgres@127.0.0.1:{port}/postgres"));
    let folder = root.path().join(format!("target/pg-test-{major}"));
    let stamp = std::fs::read_to_string(folder.join("data/PG_VERSION")).unwrap_or_else(|e| {
        panic!(
            "{}/data/PG_VERSION: {e}; target/ holds {:?}",
            folder.display(),
            std::fs::read_dir(root.path().join("target")).map(|d| d
                .filter_map(|e| e.ok().map(|e| e.file_name()))
                .collect::<Vec<_>>())
        )
    });
    assert_eq!(stamp.trim(), major.to_string());

    let mut conn = PgConnection::connect(&url).await.expect("connect");
    let served =
        sqlx::query_scalar!(r#"select current_setting('server_version_num')::int / 10000 as "major!""#)
            .fetch_one(&mut conn)
            .await
            .expect("server version");
    conn.close().await.expect("close");
    assert_eq!(served, major, "the server on {url}");

    let out = pg_sh(root.path(), &bin, port, &["stop", "test"]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        PgConnection::connect(&url).await.is_err(),
        "the cluster still answers after pg.sh stop"
    );
    drop(started);
}

/// A data folder stamped with another major version than the binaries is refused in one line naming the folder
/// and both versions, exit 2, and no server is started on it.
#[test]
fn pg_sh_refuses_a_data_folder_of_another_major_version() {
    let root = scratch_checkout();
    let bin = pg_bin();
    let major = major_of(&bin);
    let other = major - 1;
    let data = root.path().join(format!("target/pg-test-{major}/data"));
    std::fs::create_dir_all(&data).expect("mkdir");
    std::fs::write(data.join("PG_VERSION"), format!("{other}\n")).expect("stamp");

    let port = free_port();
    let out = pg_sh(root.path(), &bin, port, &["start", "test"]);
    // Should it have started a server after all, it is stopped again.
    let _started = Started {
        root: root.path(),
        bin: bin.clone(),
        port,
    };
    let lines = stderr_lines(&out);
    assert_eq!(out.status.code(), Some(2), "{lines:?}");
    assert_eq!(lines.len(), 1, "{lines:?}");
    let line = &lines[0];
    assert!(line.contains(&data.display().to_string()), "{line}");
    assert!(line.contains(&format!("PostgreSQL {other}")), "{line}");
    assert!(line.contains(&format!("PostgreSQL {major}")), "{line}");
    assert!(out.stdout.is_empty(), "no URL: nothing was started");
    let left: Vec<_> = std::fs::read_dir(&data)
        .expect("read data")
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert_eq!(left, ["PG_VERSION"], "the folder is untouched");
}

/// `scripts/test.sh --pg` with an unknown version, without a version, or beside `DATABASE_URL`: one line naming
/// the problem, exit 2, before anything is installed, fetched, started or built.
#[test]
fn test_sh_accepts_only_the_versions_it_knows() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/test.sh");
    let cases: [(&[&str], Option<&str>, &str); 4] = [
        (&["--pg", "17"], None, "'17'"),
        (&["--test", "it", "--pg=9.6"], None, "'9.6'"),
        (&["--pg"], None, "--pg needs a version"),
        (
            &["--pg", "18"],
            Some("postgres://nobody@127.0.0.1:1/x"),
            "DATABASE_URL",
        ),
    ];
    for (args, database_url, named) in cases {
        let mut cmd = Command::new(&script);
        cmd.args(args).env_remove("DATABASE_URL");
        if let Some(url) = database_url {
            cmd.env("DATABASE_URL", url);
        }
        // Had the script gone on, it would fail otherwise, and never start a cluster on a port in use: no
        // server binaries, a free port, no cargo on PATH.
        cmd.env("FINE_SETTLER_PG_BIN", "/nonexistent-pg-bin")
            .env("FINE_SETTLER_PG_PORT", free_port().to_string())
            .env("PATH", "/usr/bin:/bin");
        let out = cmd.output().expect("run test.sh");
        let lines = stderr_lines(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {lines:?}");
        assert_eq!(lines.len(), 1, "{args:?}: {lines:?}");
        assert!(lines[0].starts_with("test.sh: "), "{args:?}: {lines:?}");
        assert!(lines[0].contains(named), "{args:?}: {lines:?}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}
