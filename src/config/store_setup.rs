//! Where a command counts and where a worker journals: the one wiring of the counter store and
//! the decision journal, used by `vigil replay`, `vigil run` and the benchmarks alike, so they
//! cannot drift apart in how a URL and its settings become a store.

use super::{InputConfig, MemoryConfig, RedisConfig};
use crate::store::{AnyStore, JournalWriter, MemoryStore, RedisStore, StoreError};

/// What to open: the in-process store (no `redis.url`) or the Redis store, plus the journal.
#[derive(Debug, Clone)]
pub struct StoreSetup {
    /// The Redis settings; without a `url`, counting is in process.
    pub redis: RedisConfig,
    /// The in-process store's bound on (counter, key) windows and holds.
    pub max_keys: usize,
    /// The bound on the local state's estimated bytes (in process; with Redis, its views and
    /// unacknowledged deltas).
    pub max_state_bytes: usize,
    /// The input's lateness bound in ms: how long Redis keeps a key past its window.
    pub max_lateness_ms: Option<i64>,
    /// With Redis: the namespace (consumer group) of the decision journal to open; `None` opens
    /// none (replay and the benchmarks do not journal).
    pub journal_namespace: Option<String>,
}

/// The built-in defaults (`config_defaults.toml`): in process, no journal.
impl Default for StoreSetup {
    fn default() -> Self {
        StoreSetup {
            redis: RedisConfig::default(),
            max_keys: MemoryConfig::default().max_keys,
            max_state_bytes: MemoryConfig::default().max_state_bytes,
            max_lateness_ms: InputConfig::default().time_bounds().max_lateness_ms,
            journal_namespace: None,
        }
    }
}

impl StoreSetup {
    /// The defaults, counting in the Redis at `url`.
    pub fn redis_at(url: &str) -> StoreSetup {
        let mut setup = StoreSetup::default();
        setup.redis.url = Some(url.to_owned());
        setup
    }

    /// The in-process store within these bounds (whatever `redis.url` says).
    pub fn memory_store(&self) -> MemoryStore {
        MemoryStore::new()
            .with_max_keys(self.max_keys)
            .with_max_state_bytes(self.max_state_bytes)
    }

    /// Opens the store and, with Redis and a namespace, the journal. The errors are the store's;
    /// callers name the (redacted) URL in their message.
    pub fn open(&self) -> Result<(AnyStore, Option<JournalWriter>), StoreError> {
        let Some(url) = &self.redis.url else {
            return Ok((AnyStore::Memory(self.memory_store()), None));
        };
        let mut config = self.redis.store_config(self.max_lateness_ms);
        config.max_state_bytes = self.max_state_bytes;
        let store = RedisStore::connect(url, config.clone())?;
        let journal = match &self.journal_namespace {
            Some(namespace) => Some(JournalWriter::connect(url, &config, namespace)?),
            None => None,
        };
        Ok((AnyStore::Redis(Box::new(store)), journal))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_url_the_store_is_in_process_with_its_bound_and_no_journal() {
        let setup = StoreSetup {
            max_keys: 7,
            ..StoreSetup::default()
        };
        let (store, journal) = setup.open().unwrap();
        assert!(matches!(store, AnyStore::Memory(_)));
        assert!(journal.is_none());
    }

    #[test]
    fn a_run_config_opens_its_group_s_journal_with_its_bounds() {
        let text = "[kafka]\nbrokers = \"k\"\ngroup_id = \"g\"\n[memory]\nmax_keys = 9\n[input]\nmax_lateness = \"off\"\n";
        let setup = super::super::Config::parse("vigil.toml", text, [])
            .unwrap()
            .store_setup();
        assert_eq!(setup.journal_namespace.as_deref(), Some("g"));
        assert_eq!((setup.max_keys, setup.max_lateness_ms), (9, None));
        assert_eq!(
            StoreSetup::redis_at("redis://r/").redis.url.as_deref(),
            Some("redis://r/")
        );
    }
}
