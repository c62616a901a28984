//! The fleet in the status grid: every shard of this replica's shard count is a column, whether or not any
//! replica ever wrote a row for it, and a due key nobody runs is marked `unclaimed` — by the rule the tick's
//! status statement counts for `fine_settler_keys_unclaimed` (see `store::job_runs::Unclaimed`): a key of
//! another shard of this shard count in the catch-up window with no row, or with a row that is not SUCCESS whose
//! lease ended more than the grace ([`due::unclaimed_grace`](crate::schedule::due::unclaimed_grace)) ago, that no
//! pause covers, on a business date this replica's own shard has a row of, of a shard whose replica is not
//! running another key of the count right now (a long run, before it claims the newer keys). This replica's own
//! shard is never unclaimed: it runs it. (The metric also waits a grace after its own claim; the page, a
//! snapshot an operator reads, does not.)

use std::time::Duration;

use super::{JobStatus, KeyStatus, ShardColumn};
use crate::{
    shard::ShardSpec,
    store::{job_runs::RunStatus, pauses::Pause, status::KeyRow},
};

/// Every shard `0..shards` of `own`'s shard count, as grid columns.
pub(super) fn every_shard(own: ShardSpec) -> impl Iterator<Item = ShardColumn> {
    (0..own.shards()).map(move |shard| ShardColumn {
        shards: own.shards(),
        shard,
    })
}

/// The shards of `own`'s shard count with a key RUNNING under a live lease, of any job: their replicas run.
pub(super) fn busy_shards(own: ShardSpec, keys: &[KeyRow]) -> Vec<i32> {
    keys.iter()
        .filter(|k| k.shards == own.shards() && k.status == RunStatus::Running && k.lease_left_s > 0.0)
        .map(|k| k.shard)
        .collect()
}

/// Marks the job's unclaimed cells and lists their shards (`unclaimed_shards`), for a replica running `own`;
/// a shard in `busy` ([`busy_shards`]) has none.
pub(super) fn mark(job: &mut JobStatus, own: ShardSpec, grace: Duration, pauses: &[Pause], busy: &[i32]) {
    let name = job.job.as_str();
    let claimed_here: Vec<_> = job
        .keys
        .iter()
        .filter(|k| k.shards == own.shards() && k.shard == own.shard() && k.status.is_some())
        .map(|k| k.business_date)
        .collect();
    for cell in &mut job.keys {
        let paused = pauses.iter().any(|p| {
            p.job_name == name
                && ShardSpec::new(cell.shard.into(), cell.shards.into()).is_ok_and(|s| p.scope.covers(s))
        });
        cell.unclaimed = job.enabled
            && !paused
            && !busy.contains(&cell.shard)
            && claimed_here.contains(&cell.business_date)
            && unclaimed(own, grace, cell);
    }
    let mut shards: Vec<i32> = job.keys.iter().filter(|k| k.unclaimed).map(|k| k.shard).collect();
    shards.sort_unstable();
    shards.dedup();
    job.unclaimed_shards = shards;
}

/// Whether `cell` is a key nobody runs (see the module's rule; pauses aside).
fn unclaimed(own: ShardSpec, grace: Duration, cell: &KeyStatus) -> bool {
    let another_of_mine = cell.shards == own.shards() && cell.shard != own.shard();
    cell.in_window
        && another_of_mine
        && match cell.status {
            None => true,
            Some(RunStatus::Success) => false,
            Some(_) => cell
                .lease_ended_s
                .is_some_and(|ended| ended > grace.as_secs_f64()),
        }
}
