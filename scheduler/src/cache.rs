//! Small in-memory caches that keep database round trips and repeated estimates off the
//! submit path.
//!
//! The store stays the truth. Two kinds of cache live here:
//!
//! - [`ShortLivedCache`]: copies of rows (tokens, tenants, peak corrections) kept for a
//!   short time to live. A change made through this scheduler process invalidates the
//!   entry at once; a change made elsewhere (another replica on the same PostgreSQL, or
//!   SQL typed by an operator) is seen at the latest when the entry expires, so the time
//!   to live is the bound on how stale a read can be.
//! - [`BoundedCache`]: results of pure functions (the validated spec and its estimate,
//!   keyed by the spec's exact text), which never go stale and only need a size bound.

use std::borrow::Borrow;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a token, tenant or peak correction read from the store is used without
/// reading it again. A revoke, quota change or measured peak recorded by this scheduler
/// takes effect on the next call; one made through another replica takes effect within
/// this time.
pub const LOOKUP_TIME_TO_LIVE: Duration = Duration::from_secs(2);

/// How often a token's last use is written to the store, at most, per token and
/// scheduler. Every call authenticates, and writing the time each time would put a
/// database write (SQLite's one write lock, a PostgreSQL row lock) on every read-only
/// call; "last used" is for people deciding which tokens are stale, for whom a minute is
/// precise enough.
pub const TOKEN_USE_RECORD_INTERVAL: Duration = Duration::from_secs(60);

/// How many entries a lookup cache holds before it drops expired ones (and, if that is
/// not enough, everything): tokens and tenants are few; this only stops a pathological
/// number of distinct keys from growing memory without end.
pub const LOOKUP_CAPACITY: usize = 10_000;

/// Proof that a fill began before any invalidation that followed it: a value read from
/// the store before an invalidation must not be put back after it, or a revoked token
/// could be cached as valid for a whole time to live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FillTicket(u64);

#[derive(Debug)]
struct ShortLivedEntries<K, V> {
    entries: HashMap<K, (V, Instant)>,
    /// Bumped by every invalidation; a fill whose ticket is older is dropped.
    generation: u64,
}

/// Key → value copies that expire `time_to_live` after they were read from the store.
#[derive(Debug)]
pub struct ShortLivedCache<K, V> {
    inner: Mutex<ShortLivedEntries<K, V>>,
    time_to_live: Duration,
    capacity: usize,
}

impl<K: Eq + Hash, V: Clone> ShortLivedCache<K, V> {
    pub fn new(time_to_live: Duration, capacity: usize) -> ShortLivedCache<K, V> {
        ShortLivedCache {
            inner: Mutex::new(ShortLivedEntries {
                entries: HashMap::new(),
                generation: 0,
            }),
            time_to_live,
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ShortLivedEntries<K, V>> {
        // Every critical section is a map operation that cannot leave it half done.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The value cached for `key`, unless it expired by `now`.
    pub fn get(&self, key: &K, now: Instant) -> Option<V> {
        let inner = self.lock();
        let (value, read_at) = inner.entries.get(key)?;
        (now.saturating_duration_since(*read_at) < self.time_to_live).then(|| value.clone())
    }

    /// Take a ticket before reading the value from the store, and hand it to `insert`.
    pub fn begin_fill(&self) -> FillTicket {
        FillTicket(self.lock().generation)
    }

    /// Caches `value`, read at `read_at`, unless something was invalidated since `ticket`
    /// was taken (then the value may predate that change and is not kept).
    pub fn insert(&self, ticket: FillTicket, key: K, value: V, read_at: Instant) {
        let mut inner = self.lock();
        if inner.generation != ticket.0 {
            return;
        }
        if inner.entries.len() >= self.capacity {
            let time_to_live = self.time_to_live;
            inner
                .entries
                .retain(|_, (_, at)| read_at.saturating_duration_since(*at) < time_to_live);
            if inner.entries.len() >= self.capacity {
                inner.entries.clear();
            }
        }
        inner.entries.insert(key, (value, read_at));
    }

    /// Forgets `key`, and stops fills that began before now from caching anything.
    pub fn invalidate(&self, key: &K) {
        let mut inner = self.lock();
        inner.generation += 1;
        inner.entries.remove(key);
    }

    /// Forgets every entry that matches, and stops fills that began before now.
    pub fn invalidate_where(&self, mut matches: impl FnMut(&K, &V) -> bool) {
        let mut inner = self.lock();
        inner.generation += 1;
        inner.entries.retain(|key, (value, _)| !matches(key, value));
    }

    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Results of a pure function by key, at most `capacity` of them: when full, an
/// arbitrary entry makes room (a miss only costs recomputing it).
#[derive(Debug)]
pub struct BoundedCache<K, V> {
    entries: Mutex<HashMap<K, V>>,
    capacity: usize,
}

impl<K: Eq + Hash + Clone, V: Clone> BoundedCache<K, V> {
    pub fn new(capacity: usize) -> BoundedCache<K, V> {
        BoundedCache {
            entries: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, V>> {
        // Every critical section is a map operation that cannot leave it half done.
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn get<Q>(&self, key: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.lock().get(key).cloned()
    }

    pub fn insert(&self, key: K, value: V) {
        let mut entries = self.lock();
        if entries.len() >= self.capacity && !entries.contains_key(&key) {
            let victim = entries.keys().next().cloned();
            if let Some(victim) = victim {
                entries.remove(&victim);
            }
        }
        entries.insert(key, value);
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache() -> ShortLivedCache<&'static str, u32> {
        ShortLivedCache::new(Duration::from_secs(2), 3)
    }

    #[test]
    fn a_value_is_served_until_its_time_to_live_ends() {
        let cache = cache();
        let start = Instant::now();
        let ticket = cache.begin_fill();
        cache.insert(ticket, "a", 1, start);
        assert_eq!(
            cache.get(&"a", start + Duration::from_millis(1999)),
            Some(1)
        );
        assert_eq!(cache.get(&"a", start + Duration::from_secs(2)), None);
    }

    #[test]
    fn an_invalidated_value_is_gone_at_once() {
        let cache = cache();
        let start = Instant::now();
        cache.insert(cache.begin_fill(), "a", 1, start);
        cache.insert(cache.begin_fill(), "b", 2, start);
        cache.invalidate(&"a");
        assert_eq!(cache.get(&"a", start), None);
        assert_eq!(cache.get(&"b", start), Some(2));
        cache.invalidate_where(|_, value| *value == 2);
        assert!(cache.is_empty());
    }

    #[test]
    fn a_fill_that_began_before_an_invalidation_is_not_kept() {
        let cache = cache();
        let start = Instant::now();
        // Read from the store (the token still valid), then revoked, then cached: the
        // stale read must not be served.
        let ticket = cache.begin_fill();
        cache.invalidate(&"a");
        cache.insert(ticket, "a", 1, start);
        assert_eq!(cache.get(&"a", start), None);
        let ticket = cache.begin_fill();
        cache.insert(ticket, "a", 1, start);
        assert_eq!(cache.get(&"a", start), Some(1));
    }

    #[test]
    fn a_full_lookup_cache_drops_expired_entries_then_everything() {
        let cache = cache();
        let start = Instant::now();
        cache.insert(cache.begin_fill(), "a", 1, start);
        cache.insert(cache.begin_fill(), "b", 2, start + Duration::from_secs(1));
        cache.insert(cache.begin_fill(), "c", 3, start + Duration::from_secs(1));
        let later = start + Duration::from_millis(2500);
        cache.insert(cache.begin_fill(), "d", 4, later);
        assert_eq!(cache.len(), 3, "only the expired entry made room");
        assert_eq!(cache.get(&"b", later), Some(2));
        cache.insert(cache.begin_fill(), "e", 5, later);
        assert_eq!(cache.len(), 1, "nothing had expired, so everything went");
        assert_eq!(cache.get(&"e", later), Some(5));
    }

    #[test]
    fn a_bounded_cache_never_holds_more_than_its_capacity() {
        let cache = BoundedCache::new(2);
        for key in 0..10 {
            cache.insert(key, key * 10);
            assert!(cache.len() <= 2);
            assert_eq!(cache.get(&key), Some(key * 10));
        }
        cache.insert(9, 0);
        assert_eq!(cache.get(&9), Some(0));
        assert_eq!(cache.len(), 2);
    }
}
