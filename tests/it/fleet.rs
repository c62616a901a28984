//! A shard nobody runs, seen from the replicas that do run: three shards, replicas for shards 0 and 1 only. Both
//! replicas count shard 2's due key in `fine_settler_keys_unclaimed` and list it on `/status.json`, until a row
//! of it appears. And the status statement's rule, row by row: a lease that ended within the grace, a pause, and
//! a key this shard has only just claimed are not counted.

use serde_json::Value;
use sqlx::PgPool;
use std::time::Duration;

use crate::{
    daemon::http_get,
    helpers::{daemon, database_url, due_now, free_port, insert, loan, stop, wait_until},
};

/// The value of `fine_settler_keys_unclaimed` for `job` on the replica listening on `port` (`None`: no series).
async fn unclaimed(port: u16, job: &str) -> Option<f64> {
    let (code, body) = http_get(port, "/metrics").await;
    assert_eq!(code, 200, "{body}");
    body.lines()
        .filter(|l| l.starts_with("fine_settler_keys_unclaimed{"))
        .find(|l| l.contains(&format!("job=\"{job}\"")))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

async fn settlement_status(port: u16) -> Value {
    let (code, body) = http_get(port, "/status.json").await;
    assert_eq!(code, 200, "{body}");
    let status: Value = serde_json::from_str(&body).expect("JSON");
    status["jobs"][0].clone()
}

#[sqlx::test(fixtures("default_policy"))]
async fn the_due_key_of_a_shard_nobody_runs_is_counted_and_listed(pool: PgPool) {
    let month = due_now(&pool, 1).await[0];
    let returned = (month - chrono::Duration::days(1)).to_string();
    let due = (month - chrono::Duration::days(4)).to_string();
    let loans: Vec<_> = (1..=30).map(|id| loan(id, &due, Some(&returned))).collect();
    insert(&pool, &loans).await;
    let url = database_url(&pool);
    let ports = [free_port(), free_port()];
    let replicas: Vec<_> = (0..2)
        .map(|s| {
            let listen = format!("127.0.0.1:{}", ports[s as usize]);
            daemon(
                &url,
                s,
                3,
                &[
                    ("FINE_SETTLER__HTTP__LISTEN", &listen),
                    ("FINE_SETTLER__SETTLEMENT__CATCH_UP_MONTHS", "1"),
                ],
            )
        })
        .collect();

    wait_until("shards 0 and 1 SUCCESS", Duration::from_secs(30), || async {
        let done: i64 = sqlx::query_scalar(
            "select count(*) from job_runs where shards = 3 and status = 'SUCCESS' and business_date = $1",
        )
        .bind(month)
        .fetch_one(&pool)
        .await
        .expect("count");
        done == 2
    })
    .await;
    for port in ports {
        wait_until(
            "the metric counts shard 2's key",
            Duration::from_secs(10),
            || async { unclaimed(port, "fine-settlement").await == Some(1.0) },
        )
        .await;
        assert_eq!(
            unclaimed(port, "overdue-accrual").await,
            Some(0.0),
            "accrual is off"
        );
        let settlement = settlement_status(port).await;
        let columns: Vec<i64> = settlement["shards"]
            .as_array()
            .expect("shards")
            .iter()
            .filter(|c| c["shards"] == 3)
            .map(|c| c["shard"].as_i64().expect("shard"))
            .collect();
        assert_eq!(columns, [0, 1, 2], "every shard is a column: {settlement}");
        assert_eq!(
            settlement["unclaimed_shards"],
            serde_json::json!([2]),
            "{settlement}"
        );
        let cell = settlement["keys"]
            .as_array()
            .expect("keys")
            .iter()
            .find(|k| k["shards"] == 3 && k["shard"] == 2 && k["business_date"] == month.to_string())
            .cloned()
            .unwrap_or(Value::Null);
        assert_eq!(
            (&cell["status"], &cell["unclaimed"]),
            (&Value::Null, &Value::from(true)),
            "{cell}"
        );
    }
    let unsettled: i64 =
        sqlx::query_scalar("select count(*) from loans where fine_settled_at is null and id % 3 = 2")
            .fetch_one(&pool)
            .await
            .expect("count");
    assert_eq!(unsettled, 10, "shard 2's loans wait for a replica");

    // A replica of shard 2 claimed it an hour ago and its host died mid-run: still nobody runs it, and the page
    // says so (the lease ended long ago).
    sqlx::query(
        "insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch, started_at, lease_until)
         values ('fine-settlement', $1, 3, 2, 'RUNNING', 'shard-2', 1, now() - interval '1 hour',
                 now() - interval '1 hour')",
    )
    .bind(month)
    .execute(&pool)
    .await
    .expect("shard 2's row");
    for port in ports {
        wait_until(
            "the key of a host down listed",
            Duration::from_secs(10),
            || async {
                let settlement = settlement_status(port).await;
                let running = settlement["keys"].as_array().is_some_and(|keys| {
                    keys.iter().any(|k| {
                        k["shards"] == 3
                            && k["shard"] == 2
                            && k["status"] == "RUNNING"
                            && k["unclaimed"] == true
                    })
                });
                running && settlement["unclaimed_shards"] == serde_json::json!([2])
            },
        )
        .await;
        assert_eq!(unclaimed(port, "fine-settlement").await, Some(1.0));
    }

    // A replica of shard 2 ran it (its row is SUCCESS): nothing is unclaimed any more.
    sqlx::query("update job_runs set status = 'SUCCESS', lease_until = now() where shards = 3 and shard = 2")
        .execute(&pool)
        .await
        .expect("shard 2's run");
    for port in ports {
        wait_until("the metric back at 0", Duration::from_secs(10), || async {
            unclaimed(port, "fine-settlement").await == Some(0.0)
        })
        .await;
        assert_eq!(
            settlement_status(port).await["unclaimed_shards"],
            serde_json::json!([])
        );
    }
    for r in replicas {
        stop(r).await;
    }
}

/// Runs `sql` (a fixture) on `pool`.
async fn exec(pool: &PgPool, sql: &str) {
    sqlx::query(sql).execute(pool).await.expect(sql);
}

#[sqlx::test(fixtures("default_policy"))]
async fn the_status_statement_counts_keys_without_a_live_owner_beyond_the_grace(pool: PgPool) {
    use fine_settler::{
        shard::ShardSpec,
        store::job_runs::{tick_status, DueKeys, LateProbe},
    };
    let month = crate::helpers::d("2026-10-31");
    let probe = LateProbe {
        settlement_since: None,
        due: DueKeys {
            settlement: Some((month, month)),
            accrual: None,
            grace: Duration::from_secs(120),
        },
    };
    let shard0 = ShardSpec::new(0, 3).expect("shard");
    let count = || async {
        let mut conn = pool.acquire().await.expect("connection");
        let status = tick_status(&mut conn, shard0, crate::helpers::d("2026-01-01"), probe)
            .await
            .expect("status");
        (status.unclaimed.settlement, status.unclaimed.accrual)
    };
    let row = |shard: i32, status: &str, epoch: i32, started: &str, lease: &str| {
        format!(
            "insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch, started_at, lease_until)
             values ('fine-settlement', '2026-10-31', 3, {shard}, '{status}', 'o{shard}', {epoch},
                     now() - interval '{started}', now() - interval '{lease}')"
        )
    };
    // This shard claimed the month just now: its peers may be claiming theirs at the same moment.
    exec(&pool, &row(0, "SUCCESS", 1, "1 second", "0 seconds")).await;
    exec(&pool, &row(1, "RUNNING", 1, "1 hour", "1 hour")).await;
    assert_eq!(count().await, (0, 0));
    // Claimed an hour ago: shard 1's lease ended an hour ago (a host down), shard 2 has no row.
    exec(
        &pool,
        "update job_runs set started_at = now() - interval '1 hour' where shard = 0",
    )
    .await;
    assert_eq!(count().await, (2, 0));
    // A lease that ended within the grace is a replica between two ticks, not a host down.
    exec(
        &pool,
        "update job_runs set lease_until = now() - interval '30 seconds' where shard = 1",
    )
    .await;
    assert_eq!(count().await, (1, 0));
    // Shard 2's replica is busy with another key (a long month-end run, its lease live): it runs, it has just
    // not claimed this one yet.
    exec(
        &pool,
        "insert into job_runs (job_name, business_date, shards, shard, status, owner, epoch, lease_until)
         values ('overdue-accrual', '2026-10-30', 3, 2, 'RUNNING', 'o2', 1, now() + interval '1 minute')",
    )
    .await;
    assert_eq!(count().await, (0, 0));
    exec(
        &pool,
        "update job_runs set lease_until = now() - interval '1 hour' where job_name = 'overdue-accrual'",
    )
    .await;
    assert_eq!(count().await, (1, 0));
    // A pause of shard 2 is the operator's choice, shown by its own gauge.
    exec(
        &pool,
        "insert into job_pauses (job_name, shards, shard, paused_by, reason)
         values ('fine-settlement', 3, 2, 'ops', 'test')",
    )
    .await;
    assert_eq!(count().await, (0, 0));
}
