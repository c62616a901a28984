//! Which slice of the loans a replica owns: shard `s` of `n` holds the loans with `id % n = s`.

use std::fmt;

/// The largest accepted shard count; far beyond any sensible number of replicas, and small enough that shard
/// numbers fit PostgreSQL's `int` everywhere.
pub const MAX_SHARDS: i32 = 1024;

/// A valid shard assignment: `0 <= shard < shards <= MAX_SHARDS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ShardSpec {
    shard: i32,
    shards: i32,
}

/// Why a shard assignment was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    /// The shard count is below 1 or above [`MAX_SHARDS`].
    #[error("shards must be between 1 and {MAX_SHARDS}, got {0}")]
    Shards(i64),
    /// The shard number is outside `0..shards`.
    #[error("shard must satisfy 0 <= shard < shards ({shards}), got {shard}")]
    Shard { shard: i64, shards: i64 },
}

impl ShardSpec {
    pub fn new(shard: i64, shards: i64) -> Result<Self, ShardError> {
        if !(1..=i64::from(MAX_SHARDS)).contains(&shards) {
            return Err(ShardError::Shards(shards));
        }
        if !(0..shards).contains(&shard) {
            return Err(ShardError::Shard { shard, shards });
        }
        // Both fit in i32: shards <= MAX_SHARDS and shard < shards.
        Ok(ShardSpec {
            shard: shard as i32,
            shards: shards as i32,
        })
    }

    /// The whole table as one shard.
    pub const SINGLE: ShardSpec = ShardSpec { shard: 0, shards: 1 };

    pub fn shard(&self) -> i32 {
        self.shard
    }

    pub fn shards(&self) -> i32 {
        self.shards
    }
}

impl fmt::Display for ShardSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.shard, self.shards)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_only_shards_inside_the_count() {
        assert_eq!(ShardSpec::new(2, 3).map(|s| (s.shard(), s.shards())), Ok((2, 3)));
        assert_eq!(
            ShardSpec::new(3, 3),
            Err(ShardError::Shard { shard: 3, shards: 3 })
        );
        assert_eq!(
            ShardSpec::new(-1, 3),
            Err(ShardError::Shard { shard: -1, shards: 3 })
        );
        assert_eq!(ShardSpec::new(0, 0), Err(ShardError::Shards(0)));
        assert_eq!(
            ShardSpec::new(0, i64::from(MAX_SHARDS) + 1),
            Err(ShardError::Shards(1025))
        );
    }
}
