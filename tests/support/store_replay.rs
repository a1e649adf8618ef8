//! The shipped rules replayed over a generated workload with any store: what the Redis tests
//! compare against the in-process store.

use vigil::harness::workload::{generate, WorkloadSpec};
use vigil::pipeline::{replay, Engine, ReplayOptions};
use vigil::store::CounterStore;

/// The shipped rule sets.
pub const RULES: &str = "rules";

/// `events` generated events with a few bad lines in the middle.
pub fn workload(events: u64) -> Vec<u8> {
    let spec = WorkloadSpec {
        events,
        users: 5_000,
        ips: 2_000,
        rate_per_sec: 200,
        late: 0.01,
        out_of_order: 0.05,
        seed: 3,
        ..WorkloadSpec::default()
    };
    let mut out = Vec::new();
    generate(&spec, &mut out).unwrap();
    // Bad lines in the middle: skipped by both stores alike.
    let mut text = String::from_utf8(out).unwrap();
    text.insert_str(text.len() / 2, "not json\n[1]\n{\"no\":\"ts\"}\n");
    text.into_bytes()
}

/// Replays `input` through the shipped rules with `store`: the decision records and the engine.
pub fn replay_with<S: CounterStore>(store: S, input: &[u8]) -> (Vec<u8>, Engine<S>) {
    let (out, _diagnostics, engine) = replay_rules(
        std::path::Path::new(RULES),
        store,
        input,
        ReplayOptions::default(),
    );
    (out, engine)
}

/// Replays `input` through the rules at `rules` with `store`: the decision records, replay's
/// diagnostics and the engine.
pub fn replay_rules<S: CounterStore>(
    rules: &std::path::Path,
    store: S,
    input: &[u8],
    options: ReplayOptions,
) -> (Vec<u8>, Vec<u8>, Engine<S>) {
    let mut engine = Engine::new(vigil::rule_files::load(rules).unwrap(), store);
    let (mut out, mut diagnostics) = (Vec::new(), Vec::new());
    replay(&mut engine, input, &mut out, &mut diagnostics, options).unwrap();
    (out, diagnostics, engine)
}
