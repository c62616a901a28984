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

use crate::helpers::{free_port, pg_bin};

/// A scratch checkout holding only `scripts/pg.sh` and the `scripts/pg-bin.sh` it asks for the binaries,
/// readable by the `postgres` user (the server's, as root).
fn scratch_checkout() -> tempfile::TempDir {
    let root = tempfile::tempdir().expect("tempdir");
    std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::create_dir(root.path().join("scripts")).expect("mkdir");
    for script in ["scripts/pg.sh", "scripts/pg-bin.sh"] {
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR")).join(script),
            root.path().join(script),
        )
        .unwrap_or_else(|e| panic!("copy {script}: {e}"));
    }
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

/// `pg.sh start test`, which must succeed: the guard that stops the cluster again, and its URL.
fn start<'a>(root: &'a Path, bin: &Path, port: u16) -> (Started<'a>, String) {
    let out = pg_sh(root, bin, port, &["start", "test"]);
    let started = Started {
        root,
        bin: bin.to_path_buf(),
        port,
    };
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (started, String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// initdb's identifier of the cluster serving `url`: the same value means the same data folder.
async fn cluster_id(url: &str) -> i64 {
    let mut conn = PgConnection::connect(url).await.expect("connect");
    let id = sqlx::query_scalar!(r#"select system_identifier as "id!" from pg_control_system()"#)
        .fetch_one(&mut conn)
        .await
        .expect("system identifier");
    conn.close().await.expect("close");
    id
}

/// `pg.sh start test` initialises `target/pg-test-MAJOR` for the binaries' major version, serves it on the port
/// asked for, and the server there is of that version; `stop` stops it.
#[tokio::test]
async fn pg_sh_keeps_the_cluster_of_each_major_version_in_its_own_folder() {
    let root = scratch_checkout();
    let bin = pg_bin();
    let major = major_of(&bin);
    let port = free_port();

    let (started, url) = start(root.path(), &bin, port);
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

/// A cluster made before the folders carried the version (`target/pg-test`) is still used by binaries of its own
/// version — the same cluster, not a fresh one beside it — and ignored by binaries of another version.
#[tokio::test]
async fn pg_sh_keeps_using_a_folder_made_before_the_version_suffix() {
    let root = scratch_checkout();
    let bin = pg_bin();
    let major = major_of(&bin);
    let port = free_port();
    let versioned = root.path().join(format!("target/pg-test-{major}"));
    let legacy = root.path().join("target/pg-test");

    let (started, url) = start(root.path(), &bin, port);
    let made = cluster_id(&url).await;
    drop(started);
    std::fs::rename(&versioned, &legacy).expect("rename to the old folder name");

    let (started, url) = start(root.path(), &bin, port);
    assert_eq!(cluster_id(&url).await, made, "the old folder's cluster serves");
    assert!(!versioned.exists(), "no fresh cluster beside the old one");
    assert!(
        legacy.join("data/postmaster.pid").exists(),
        "the server runs on the old folder"
    );
    drop(started);

    // An old folder of another version is not this version's.
    let root = scratch_checkout();
    let legacy_data = root.path().join("target/pg-test/data");
    std::fs::create_dir_all(&legacy_data).expect("mkdir");
    std::fs::write(legacy_data.join("PG_VERSION"), format!("{}\n", major - 1)).expect("stamp");
    let (started, url) = start(root.path(), &bin, port);
    assert_ne!(cluster_id(&url).await, made);
    assert!(
        root.path()
            .join(format!("target/pg-test-{major}/data/PG_VERSION"))
            .exists(),
        "a cluster of its own for this version"
    );
    let left: Vec<_> = std::fs::read_dir(&legacy_data)
        .expect("read old folder")
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert_eq!(left, ["PG_VERSION"], "the old folder is untouched");
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

/// `scripts/pg-bin.sh`, the one rule for the PostgreSQL programs: `FINE_SETTLER_PG_BIN` as given, `PG_BIN` (its
/// older name) when that is unset or empty, and otherwise a folder found on this machine that holds an `initdb`.
#[test]
fn pg_bin_sh_takes_the_folder_given_first_and_otherwise_finds_one() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/pg-bin.sh");
    let run = |vars: &[(&str, &str)]| {
        let mut cmd = Command::new(&script);
        cmd.env_remove("FINE_SETTLER_PG_BIN").env_remove("PG_BIN");
        cmd.envs(vars.iter().copied());
        let out = cmd.output().expect("run pg-bin.sh");
        assert_eq!(out.status.code(), Some(0), "{vars:?}: {:?}", stderr_lines(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(
        run(&[
            ("FINE_SETTLER_PG_BIN", "/opt/pg-a/bin"),
            ("PG_BIN", "/opt/pg-b/bin")
        ]),
        "/opt/pg-a/bin"
    );
    assert_eq!(
        run(&[("FINE_SETTLER_PG_BIN", ""), ("PG_BIN", "/opt/pg-b/bin")]),
        "/opt/pg-b/bin"
    );
    let found = PathBuf::from(run(&[]));
    assert!(
        found.join("initdb").is_file(),
        "{} has no initdb",
        found.display()
    );
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
