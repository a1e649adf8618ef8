//! Criterion benchmarks of the functions every event goes through, over the shipped rules and
//! the `vigil bench` workload, so a regression in one of them shows in review:
//! `cargo bench --bench hot` (a baseline: `-- --save-baseline main`, then `-- --baseline main`).
//! Throughput is per event unless a name says otherwise.

use std::hint::black_box;
use std::path::Path;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};

use vigil::event::{decode, decode_by_parser};
use vigil::harness::workload::{generate, WorkloadSpec};
use vigil::pipeline::Engine;
use vigil::rules::{EventSource, RuleSet};
use vigil::store::{CounterStore, InputPosition, MemoryStore};
use vigil::window::{Aggregate, Delta, WindowSpec, WindowState};

/// Events of the `vigil bench` workload (100 000 users, zipf 0.8), one per line.
fn workload(events: u64) -> Vec<Vec<u8>> {
    let spec = WorkloadSpec {
        events,
        late: 0.0,
        ..WorkloadSpec::default()
    };
    let mut out = Vec::new();
    generate(&spec, &mut out).expect("generating the workload");
    out.split(|&b| b == b'\n')
        .filter(|line| !line.is_empty())
        .map(<[u8]>::to_vec)
        .collect()
}

fn shipped_rules() -> RuleSet {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("rules");
    vigil::rule_files::load(&path).expect("the shipped rules load")
}

/// JSON line → the projected event the rules read.
fn decode_events(c: &mut Criterion) {
    let rules = shipped_rules();
    let lines = workload(10_000);
    let mut group = c.benchmark_group("decode");
    group.throughput(Throughput::Elements(lines.len() as u64));
    group.bench_function("shipped rules' projection", |b| {
        b.iter(|| {
            for line in &lines {
                black_box(decode(line, rules.projection()).expect("a workload line decodes"));
            }
        })
    });
    group.bench_function("shipped rules' projection, parser only", |b| {
        b.iter(|| {
            for line in &lines {
                black_box(
                    decode_by_parser(line, rules.projection()).expect("a workload line decodes"),
                );
            }
        })
    });
    group.finish();
}

/// Which counters an event feeds and their keys: every `match` and every key encoding.
fn plan_counters(c: &mut Criterion) {
    let rules = shipped_rules();
    let lines = workload(10_000);
    let events: Vec<_> = lines
        .iter()
        .map(|line| decode(line, rules.projection()).expect("decodes"))
        .collect();
    let mut memo = rules.scope_memo();
    let mut key = Vec::new();
    let mut group = c.benchmark_group("plan");
    group.throughput(Throughput::Elements(events.len() as u64));
    group.bench_function("every active counter", |b| {
        b.iter(|| {
            for event in &events {
                memo.reset();
                for position in 0..rules.active_len() {
                    black_box(rules.plan(position, event, &mut key, &mut memo));
                }
            }
        })
    });
    group.finish();
}

/// One observation into one window: the bucket arithmetic and, for distinct, the value set.
fn window_apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("window");
    group.throughput(Throughput::Elements(1_000));
    let minute = WindowSpec::new(1_000, 60, Aggregate::Count);
    group.bench_function("count, 1 s buckets, 1 000 in order", |b| {
        b.iter_batched_ref(
            || WindowState::new(Aggregate::Count),
            |state| {
                for i in 0..1_000i64 {
                    black_box(state.apply(&minute, 1_700_000_000 + i / 4, Delta::Count));
                }
            },
            BatchSize::SmallInput,
        )
    });
    let distinct = WindowSpec::new(60_000, 60, Aggregate::Distinct);
    group.bench_function("distinct, 64 values, 1 000 in order", |b| {
        b.iter_batched_ref(
            || WindowState::new(Aggregate::Distinct),
            |state| {
                for i in 0..1_000i64 {
                    black_box(state.apply(
                        &distinct,
                        28_000_000 + i / 100,
                        Delta::Distinct(u128::from((i % 64) as u64)),
                    ));
                }
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

/// The in-process store's table at the size of the bench workload (500 000 live keys): a
/// lookup there is a memory miss, most of what counting costs.
fn memory_store(c: &mut Criterion) {
    let spec = WindowSpec::new(1_000, 60, Aggregate::Count);
    let mut store = MemoryStore::new();
    let window = store.open_window("bench", spec);
    let keys: Vec<Vec<u8>> = (0..500_000u32)
        .map(|i| format!("key-{i}").into_bytes())
        .collect();
    for key in &keys {
        store
            .apply(window, key, 1_700_000_000_000, Delta::Count)
            .expect("in-process apply");
    }
    // A fixed pseudo-random order, so every run probes the same keys.
    let order: Vec<usize> = (0..10_000u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) % keys.len() as u64) as usize)
        .collect();
    let mut group = c.benchmark_group("memory store");
    group.throughput(Throughput::Elements(order.len() as u64));
    group.bench_function("apply, 500 000 keys, random order", |b| {
        b.iter(|| {
            for &i in &order {
                black_box(
                    store
                        .apply(window, &keys[i], 1_700_000_000_000, Delta::Count)
                        .expect("in-process apply"),
                );
            }
        })
    });
    group.finish();

    // A cold start: every key new, so the key table doubles its way up from empty (the pages
    // it first touches are most of what this costs in a VM). Per key.
    let mut group = c.benchmark_group("memory store, from empty");
    group.sample_size(10);
    group.throughput(Throughput::Elements(keys.len() as u64));
    group.bench_function("apply, 500 000 new keys", |b| {
        b.iter_batched(
            || {
                let mut store = MemoryStore::new();
                let window = store.open_window("bench", spec);
                (store, window)
            },
            |(mut store, window)| {
                for key in &keys {
                    black_box(
                        store
                            .apply(window, key, 1_700_000_000_000, Delta::Count)
                            .expect("in-process apply"),
                    );
                }
                store
            },
            BatchSize::PerIteration,
        )
    });
    group.finish();
}

/// A whole event through the engine (count, judge) and its decision record, in process, on a
/// store warmed by the first half of the workload.
fn evaluate_and_record(c: &mut Criterion) {
    let rules = shipped_rules();
    let lines = workload(200_000);
    let events: Vec<_> = lines
        .iter()
        .map(|line| decode(line, rules.projection()).expect("decodes"))
        .collect();
    let (warm, measured) = events.split_at(100_000);
    let mut engine = Engine::new(rules, MemoryStore::new());
    let mut offset = 0i64;
    let mut next = || {
        offset += 1;
        InputPosition { lane: 0, offset }
    };
    for event in warm {
        engine.evaluate(event, next()).expect("in-process evaluate");
    }
    let measured = &measured[..10_000];
    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(measured.len() as u64));
    // Each iteration evaluates the same events again: later passes see them as late or
    // repeated, so this is the steady cost of counting and judging, not a replay's figure.
    group.bench_function("evaluate, shipped rules", |b| {
        b.iter(|| {
            for event in measured {
                black_box(engine.evaluate(event, next()).expect("in-process evaluate"));
            }
        })
    });
    let decisions: Vec<_> = measured
        .iter()
        .map(|event| engine.evaluate(event, next()).expect("in-process evaluate"))
        .collect();
    let mut record = Vec::with_capacity(1024);
    group.bench_function("decision records", |b| {
        b.iter(|| {
            for (line, (event, decision)) in (1..).zip(measured.iter().zip(&decisions)) {
                record.clear();
                vigil::rules::record::write_record(
                    &mut record,
                    engine.rules(),
                    event,
                    decision,
                    EventSource::Line(line),
                );
                black_box(&record);
            }
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    decode_events,
    plan_counters,
    window_apply,
    memory_store,
    evaluate_and_record
);
criterion_main!(benches);
