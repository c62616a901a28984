//! Which slice of the loans a replica owns: shard `s` of `n` holds the loans whose id's non-negative remainder
//! by `n` is `s` ([`ShardSpec::owns`]) — every id, negative ones included, belongs to exactly one shard. For
//! `id >= 0` that is `id % n = s`; PostgreSQL's `%` keeps the dividend's sign (`-3 % 2 = -1`), so the SQL side is
//! the function `fine_settler_shard_of(id, shards)` (migration `20261202000030`), which every query uses and which
//! a test checks against [`shard_of`].

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

    /// Whether loan `id` belongs to this shard: `shard_of(id, shards) == shard`.
    pub fn owns(&self, id: i64) -> bool {
        shard_of(id, self.shards) == self.shard
    }

    pub fn shard(&self) -> i32 {
        self.shard
    }

    pub fn shards(&self) -> i32 {
        self.shards
    }
}

/// The shard of `shards` that loan `id` belongs to, in `0..shards` for every id (`shards` must be positive):
/// the Euclidean remainder, what `fine_settler_shard_of(id, shards)` computes in SQL as
/// `((id % shards) + shards) % shards`.
pub fn shard_of(id: i64, shards: i32) -> i32 {
    // The remainder lies in 0..shards, so it fits in i32.
    id.rem_euclid(i64::from(shards)) as i32
}

impl fmt::Display for ShardSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.shard, self.shards)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn negative_ids_belong_to_a_shard_too() {
        let two = |shard| ShardSpec::new(shard, 2).expect("shard");
        assert!(two(1).owns(-3) && !two(0).owns(-3));
        assert!(two(0).owns(-4) && !two(1).owns(-4));
        assert_eq!(shard_of(i64::MIN, 3), 1);
        assert_eq!(shard_of(i64::MAX, 1024), 1023);
        assert_eq!(shard_of(-1, MAX_SHARDS), MAX_SHARDS - 1);
    }

    proptest! {
        /// Every id belongs to exactly one shard of any count, and to shard `id % n` when it is not negative —
        /// the loans of every existing key keep their shard.
        #[test]
        fn every_id_has_exactly_one_shard(id in any::<i64>(), shards in 1..=MAX_SHARDS) {
            let owners: Vec<i32> = (0..shards)
                .filter(|&s| ShardSpec::new(i64::from(s), i64::from(shards)).expect("shard").owns(id))
                .collect();
            prop_assert_eq!(owners, vec![shard_of(id, shards)]);
            // SQL's definition, in its own arithmetic: a remainder with the dividend's sign, shifted into range.
            let n = i64::from(shards);
            prop_assert_eq!(i64::from(shard_of(id, shards)), ((id % n) + n) % n);
            if id >= 0 {
                prop_assert_eq!(i64::from(shard_of(id, shards)), id % n);
            }
        }
    }

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
