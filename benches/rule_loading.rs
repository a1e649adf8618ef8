//! Rule loading against the set's size: `cargo bench --bench rule_loading`. Each size reports its
//! throughput in rules per second; loading is linear when the three figures agree (a quadratic
//! step shows as throughput falling fourfold per size). Figures: BENCHMARKS.md, "Rule loading".

use std::fmt::Write as _;
use std::hint::black_box;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

use vigil::rules::compile::{compile_sources, no_files};

/// `n` counters, each read by one rule, plus `n` v1-form rules with their own counters, as one
/// file: `3 n` tables in all.
fn many_rules(n: usize) -> String {
    let mut text = String::new();
    for i in 0..n {
        write!(
            text,
            "[[counter]]\nid = \"c{i}\"\nmatch = \"type == 'login' && result != 'ok'\"\ndimensions = [\"user_id\"]\nwindow = \"15m\"\n\n\
             [[rule]]\nid = \"r{i}\"\naction = \"block\"\nwhen = \"$c{i} > 5 && amount > {i}\"\n\n\
             [[rule]]\nid = \"v{i}\"\naction = \"review\"\nmatch = {{ type = \"payment\", country = [\"US\", \"CA\"] }}\n\
             dimensions = [\"card.id\"]\nwindow = \"1h\"\nlimit = {i}\n\n"
        )
        .expect("writing to a String");
    }
    text
}

fn rule_loading(c: &mut Criterion) {
    let mut group = c.benchmark_group("rule_loading");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(8));
    for n in [2_500, 10_000, 40_000] {
        let text = many_rules(n);
        group.throughput(Throughput::Elements(3 * n as u64));
        group.bench_with_input(BenchmarkId::from_parameter(3 * n), &text, |b, text| {
            b.iter(|| {
                let set = compile_sources(&[("many.toml", text.as_str())], &no_files)
                    .expect("the generated rules load");
                assert_eq!(set.rules.len(), 2 * n);
                black_box(set)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, rule_loading);
criterion_main!(benches);
