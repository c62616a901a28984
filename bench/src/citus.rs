//! The Citus section (`scripts/bench.sh --citus`): the month's settlement of the generated loans on the Citus
//! cluster of `scripts/citus.sh` (a coordinator and two workers), by `fine-settler settle` — one replica, two at
//! once, and one replica with small batches — against the same computation as one distributed update through
//! the coordinator. Citus refuses the settlement's `update` of every shard as one statement (it calls the rule
//! functions with the row's columns: "STABLE functions used in UPDATE queries cannot be called with column
//! references"), so the yardstick is that statement run by the coordinator on every Citus shard of `loans` at
//! once (`run_command_on_shards`), and the same one shard after another.

use std::process::{Command, Stdio};
use std::time::Instant;

use sqlx::{postgres::PgPoolOptions, PgPool};

use crate::{binary, per_sec, Error, MONTH, MONTH_END};

/// The report's heading of this section.
const HEADING: &str = "## Citus";
/// The report header line that says when the section was measured.
const MEASURED: &str = "- Citus measured:";

/// The settlement's statement for one Citus shard (`%s`: the shard's table, on its worker, where the rule
/// functions read the reference tables' copies), as `fine-settler settle` computes it.
const SHARD_UPDATE: &str = "update %s l
     set fine_cents = (select f.fine_cents
                       from fine_settler_policy_of(l.fine_class, l.due_on) p
                       cross join lateral fine_settler_policy_fine(l.due_on, l.returned_on, p.daily_rate_cents,
                                                                   p.grace_days, p.cap_cents,
                                                                   p.charge_closed_days) f),
         fine_settled_at = now()
     where l.returned_on between date_trunc('month', '{MONTH_END}'::date) and '{MONTH_END}'::date
       and l.fine_settled_at is null and isfinite(l.due_on)";

/// The ways the month is settled, in the order of the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// The statement on every Citus shard at once.
    EveryShard,
    /// The statement one Citus shard after another.
    ShardByShard,
    /// `fine-settler settle` with `replicas` shards at once, batches of `batch`.
    Settle { replicas: i32, batch: u32 },
}

impl Way {
    fn name(self) -> String {
        match self {
            Way::EveryShard => {
                "one distributed update: the statement on every Citus shard at once (`run_command_on_shards`)"
                    .into()
            }
            Way::ShardByShard => "the same statement, one Citus shard after another".into(),
            Way::Settle { replicas: 1, batch } => {
                format!("`fine-settler settle`, 1 replica, batch size {batch}")
            }
            Way::Settle { replicas, batch } => {
                format!("`fine-settler settle`, {replicas} replicas at once (`--shards {replicas}`), batch size {batch}")
            }
        }
    }
}

/// One settlement of the month: loans settled, milliseconds, and the sum of their fines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    rows: i64,
    ms: u64,
    fines: i64,
}

/// The Citus database of the section, on the coordinator whose base URL (no database) is `server`.
struct Cluster {
    server: String,
    db: String,
}

impl Cluster {
    fn url(&self, db: &str) -> String {
        format!("{}/{db}?sslmode=disable", self.server)
    }

    async fn pool(&self, db: &str) -> Result<PgPool, Error> {
        Ok(PgPoolOptions::new()
            .max_connections(2)
            .connect(&self.url(db))
            .await?)
    }

    /// A new database with the Citus extension on every node and the workers (the two ports after the
    /// coordinator's, as `scripts/citus.sh` runs them) added, migrated by `fine-settler migrate`
    /// (`database.engine = "citus"`), with `loans` generated loans.
    async fn create(&self, loans: u64) -> Result<PgPool, Error> {
        let admin = self.pool("postgres").await?;
        for sql in [
            format!("drop database if exists {} with (force)", self.db),
            format!("create database {}", self.db),
            format!("alter database {} set citus.enable_unsafe_triggers = on", self.db),
        ] {
            sqlx::query(&sql).execute(&admin).await?;
        }
        admin.close().await;
        let port: i32 = self
            .server
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse().ok())
            .ok_or("the Citus URL has no port")?;
        let pool = self.pool(&self.db).await?;
        sqlx::raw_sql("create extension citus").execute(&pool).await?;
        sqlx::query(
            "select master_run_on_worker(array['127.0.0.1', '127.0.0.1'], array[$1, $2],
                    array['create extension if not exists citus', 'create extension if not exists citus'], true)",
        )
        .bind(port + 1)
        .bind(port + 2)
        .execute(&pool)
        .await?;
        sqlx::query("select citus_set_coordinator_host('127.0.0.1', $1)")
            .bind(port)
            .execute(&pool)
            .await?;
        for worker in [port + 1, port + 2] {
            sqlx::query("select citus_add_node('127.0.0.1', $1)")
                .bind(worker)
                .execute(&pool)
                .await?;
        }
        self.fine_settler(&["migrate"], &[])?;
        let out = self.fine_settler(
            &[
                "demo-data",
                "--loans",
                &loans.to_string(),
                "--seed",
                "42",
                "--month",
                MONTH,
                "--first-id",
                "1",
            ],
            &[],
        )?;
        let report: serde_json::Value = serde_json::from_slice(&out)?;
        if report["inserted"].as_u64() != Some(loans) {
            return Err(format!("demo-data inserted {} of {loans} loans", report["inserted"]).into());
        }
        sqlx::raw_sql("vacuum analyze loans").execute(&pool).await?;
        Ok(pool)
    }

    /// `fine-settler ARGS` on the section's database with the Citus engine and `env`; its standard output.
    fn fine_settler(&self, args: &[&str], env: &[(&str, String)]) -> Result<Vec<u8>, Error> {
        let out = self.command(args, env).stderr(Stdio::inherit()).output()?;
        if !out.status.success() {
            return Err(format!("fine-settler {} failed: {}", args.join(" "), out.status).into());
        }
        Ok(out.stdout)
    }

    fn command(&self, args: &[&str], env: &[(&str, String)]) -> Command {
        let mut cmd = Command::new(binary().unwrap_or_else(|_| "fine-settler".into()));
        cmd.args(args)
            .env("DATABASE_URL", self.url(&self.db))
            .env("FINE_SETTLER__DATABASE__ENGINE", "citus")
            .env("FINE_SETTLER__LOG__LEVEL", "error")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())));
        cmd
    }

    /// Every loan unsettled again and no key: the month as it was before any settlement, written to disk on
    /// every node, so that no earlier round's pages are written during the next.
    async fn reset(&self, pool: &PgPool) -> Result<(), Error> {
        sqlx::raw_sql(
            "update loans set fine_cents = 0, fine_settled_at = null where fine_settled_at is not null;
             delete from job_run_attempts;
             delete from job_runs;",
        )
        .execute(pool)
        .await?;
        sqlx::raw_sql("vacuum analyze loans").execute(pool).await?;
        sqlx::raw_sql("select run_command_on_workers('checkpoint'); checkpoint")
            .execute(pool)
            .await?;
        Ok(())
    }

    async fn settled(&self, pool: &PgPool) -> Result<(i64, i64), Error> {
        Ok(sqlx::query_as(
            "select count(*), coalesce(sum(fine_cents), 0)::bigint from loans where fine_settled_at is not null",
        )
        .fetch_one(pool)
        .await?)
    }

    /// The month settled once by `way`, from a reset database.
    async fn run(&self, pool: &PgPool, way: Way) -> Result<Run, Error> {
        self.reset(pool).await?;
        let statement = SHARD_UPDATE.replace("{MONTH_END}", MONTH_END);
        let started = Instant::now();
        match way {
            Way::EveryShard | Way::ShardByShard => {
                let failed: Vec<String> = sqlx::query_scalar(
                    "select result from run_command_on_shards('loans', $1, $2) where not success",
                )
                .bind(&statement)
                .bind(way == Way::EveryShard)
                .fetch_all(pool)
                .await?;
                if let Some(e) = failed.first() {
                    return Err(format!("the statement failed on a shard: {e}").into());
                }
            }
            Way::Settle { replicas, batch } => {
                let mut children = Vec::new();
                for shard in 0..replicas {
                    let args = [
                        "settle",
                        "--business-date",
                        MONTH_END,
                        "--shard",
                        &shard.to_string(),
                        "--shards",
                        &replicas.to_string(),
                    ];
                    let env = [("FINE_SETTLER__SETTLEMENT__BATCH_SIZE", batch.to_string())];
                    children.push(self.command(&args, &env).stdout(Stdio::piped()).spawn()?);
                }
                for child in children {
                    let out = child.wait_with_output()?;
                    let report: serde_json::Value = serde_json::from_slice(&out.stdout)?;
                    if !out.status.success() || report["outcome"] != "settled" {
                        return Err(format!("settle did not settle: {report}").into());
                    }
                }
            }
        }
        let ms = started.elapsed().as_millis() as u64;
        let (rows, fines) = self.settled(pool).await?;
        Ok(Run { rows, ms, fines })
    }
}

/// What the section measured.
struct CitusLeg {
    loans: u64,
    shards: i64,
    citus: String,
    postgres: String,
    ways: Vec<(Way, Vec<Run>)>,
}

fn median(runs: &[Run]) -> Run {
    let mut runs = runs.to_vec();
    runs.sort_by_key(|r| r.ms);
    runs[(runs.len().max(1) - 1) / 2]
}

impl CitusLeg {
    fn report(&self) -> String {
        let base = self
            .ways
            .first()
            .map(|(_, runs)| median(runs))
            .expect("the distributed update was measured");
        let rounds = self.ways.first().map_or(0, |(_, runs)| runs.len());
        let mut r = format!("{HEADING}\n\n");
        r.push_str(&format!(
            "The month's settlement ({MONTH_END}) of {} generated loans (seed 42) on the Citus cluster of \
             `scripts/citus.sh`: Citus {} on {}, a coordinator and two workers on this one machine, `loans` in {} \
             Citus shards. Each way from the same unsettled month, {rounds} rounds taken in turn, the median \
             reported; every round of every way settled the same loans with the same sum of fines. Citus refuses the \
             settlement's `update` of every shard as one statement (it calls the rule functions with the row's \
             columns), so the yardstick is that statement sent by the coordinator to every Citus shard at once.\n\n",
            self.loans, self.citus, self.postgres, self.shards
        ));
        r.push_str("| way | loans | ms | rows/s | against the distributed update |\n| --- | ---: | ---: | ---: | ---: |\n");
        for (way, runs) in &self.ways {
            let m = median(runs);
            r.push_str(&format!(
                "| {} | {} | {} | {:.0} | {:.2} |\n",
                way.name(),
                m.rows,
                m.ms,
                per_sec(m.rows, m.ms),
                base.ms.max(1) as f64 / m.ms.max(1) as f64
            ));
        }
        let settle = |replicas: i32| {
            self.ways
                .iter()
                .find(|(w, _)| matches!(w, Way::Settle { replicas: n, batch: 10_000 } if *n == replicas))
                .map(|(_, runs)| median(runs))
        };
        if let (Some(one), Some(two)) = (settle(1), settle(2)) {
            r.push_str(&format!(
                "\nTarget: `settle` at least 0.8× the distributed update. One replica: {:.2} — {}; two replicas: \
                 {:.2} — {}. Two replicas against one: {:.2}×.\n",
                base.ms as f64 / one.ms.max(1) as f64,
                if base.ms as f64 / one.ms.max(1) as f64 >= 0.8 { "met" } else { "not met" },
                base.ms as f64 / two.ms.max(1) as f64,
                if base.ms as f64 / two.ms.max(1) as f64 >= 0.8 { "met" } else { "not met" },
                one.ms as f64 / two.ms.max(1) as f64,
            ));
        }
        r
    }
}

/// `--citus-only URL`: builds the section's database on the coordinator at `url` (its path is ignored), settles
/// the month by every way `rounds` times, and returns the section.
pub(crate) async fn section(url: &str, loans: u64, rounds: u32) -> Result<String, Error> {
    let server = url
        .split('?')
        .next()
        .and_then(|u| u.rsplit_once('/'))
        .map(|(base, _)| base.to_string())
        .ok_or("the Citus URL has no database path")?;
    let cluster = Cluster {
        server,
        db: "fsb_citus".into(),
    };
    eprintln!("Citus: {loans} loans on the coordinator {}", cluster.server);
    let pool = cluster.create(loans).await?;
    let (shards, citus, postgres): (i64, String, String) = sqlx::query_as(
        "select (select count(*) from pg_dist_shard where logicalrelid = 'loans'::regclass),
                (select extversion from pg_extension where extname = 'citus'),
                split_part(version(), ' on ', 1)",
    )
    .fetch_one(&pool)
    .await?;
    let ways = [
        Way::EveryShard,
        Way::ShardByShard,
        Way::Settle {
            replicas: 1,
            batch: 10_000,
        },
        Way::Settle {
            replicas: 2,
            batch: 10_000,
        },
        Way::Settle {
            replicas: 1,
            batch: 1_000,
        },
    ];
    let mut measured: Vec<(Way, Vec<Run>)> = ways.iter().map(|w| (*w, Vec::new())).collect();
    let mut expected: Option<(i64, i64)> = None;
    for round in 1..=rounds {
        for (way, runs) in measured.iter_mut() {
            let run = cluster.run(&pool, *way).await?;
            eprintln!(
                "   round {round}: {}: {} loans in {} ms",
                way.name(),
                run.rows,
                run.ms
            );
            match expected {
                None => expected = Some((run.rows, run.fines)),
                Some(e) if e != (run.rows, run.fines) => {
                    return Err(format!(
                        "{} settled {} loans with fines of {} where the first way settled {} with {}",
                        way.name(),
                        run.rows,
                        run.fines,
                        e.0,
                        e.1
                    )
                    .into())
                }
                Some(_) => {}
            }
            runs.push(run);
        }
    }
    pool.close().await;
    let admin = cluster.pool("postgres").await?;
    sqlx::query(&format!("drop database if exists {} with (force)", cluster.db))
        .execute(&admin)
        .await?;
    admin.close().await;
    Ok(CitusLeg {
        loans,
        shards,
        citus,
        postgres,
        ways: measured,
    }
    .report())
}

/// The header line for a section measured at `date`, commit `commit`.
pub(crate) fn measured(date: &str, commit: &str) -> String {
    format!("{MEASURED} {date} at commit {commit} (`scripts/bench.sh --citus`)")
}

/// `existing` with its Citus section replaced by `section` and its header line by `measured`.
pub(crate) fn merge(existing: &str, section: &str, measured: &str) -> String {
    crate::accrual::merge_section(existing, (HEADING, section), (MEASURED, measured))
}

/// The Citus section of a report and its header line, when it has them.
pub(crate) fn kept(report: &str) -> Option<(String, String)> {
    let lines: Vec<&str> = report.lines().collect();
    let start = lines.iter().position(|l| *l == HEADING)?;
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.starts_with("## "))
        .map_or(lines.len(), |i| start + 1 + i);
    let measured = lines.iter().find(|l| l.starts_with(MEASURED))?;
    Some((lines[start..end].join("\n"), measured.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_report_keeps_the_citus_section_it_had() {
        let old = "# Settlement benchmark\n\n- commit: a\n- Citus measured: then\n\n## Throughput\n\nold\n\n\
                   ## Citus\n\nfigures\n\n## Targets\n\nt\n";
        let new = "# Settlement benchmark\n\n- commit: b\n\n## Throughput\n\nnew\n\n## Targets\n\nu\n";
        let (section, measured) = kept(old).expect("a Citus section");
        let merged = merge(new, &section, &measured);
        assert_eq!(
            merged,
            "# Settlement benchmark\n\n- commit: b\n- Citus measured: then\n\n## Throughput\n\nnew\n\n\
             ## Citus\n\nfigures\n\n## Targets\n\nu\n"
        );
        assert_eq!(kept(new), None);
    }
}
