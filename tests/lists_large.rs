//! A million-entry list of each kind, from files: loaded in well under the time a rule reload may
//! take, and tested exactly (first, middle and last entries in, neighbours out; networks by their
//! longest prefix). Load time is asserted loosely (shared CI machine, test profile); the measured
//! figures are in BENCHMARKS.md.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use vigil::pipeline::{replay, Engine, ReplayOptions};
use vigil::store::MemoryStore;

const ENTRIES: u32 = 1_000_000;

fn write_lists(dir: &Path) {
    let lists = dir.join("lists");
    std::fs::create_dir_all(&lists).unwrap();
    let mut cards = String::with_capacity(ENTRIES as usize * 11);
    let mut nets = String::with_capacity(ENTRIES as usize * 18);
    let mut amounts = String::with_capacity(ENTRIES as usize * 10);
    let mut limits = String::with_capacity(ENTRIES as usize * 18);
    limits.push_str("# merchant,limit\n");
    cards.push_str("# stolen cards, one per line\n\n");
    for i in 0..ENTRIES {
        writeln!(cards, "  c-{i:07}  ").unwrap();
        // Half bare addresses (/32) in 10.0.0.0/12, half /24 networks from 32.0.0.0/24 on.
        if i < ENTRIES / 2 {
            writeln!(
                nets,
                "10.{}.{}.{}",
                (i >> 16) & 0x0f,
                (i >> 8) & 0xff,
                i & 0xff
            )
            .unwrap();
        } else {
            let j = i - ENTRIES / 2;
            writeln!(
                nets,
                "{}.{}.{}.0/24",
                32 + (j >> 16),
                (j >> 8) & 0xff,
                j & 0xff
            )
            .unwrap();
        }
        writeln!(amounts, "{}.{:02}", i / 100, i % 100).unwrap();
        // Every tenth merchant has no numeric limit.
        if i % 10 == 9 {
            writeln!(limits, "m-{i:07},\"manual\"").unwrap();
        } else {
            writeln!(limits, "m-{i:07},{}", 20_000 + i % 1000).unwrap();
        }
    }
    std::fs::write(lists.join("cards.txt"), cards).unwrap();
    std::fs::write(lists.join("nets.txt"), nets).unwrap();
    std::fs::write(lists.join("amounts.txt"), amounts).unwrap();
    std::fs::write(lists.join("limits.csv"), limits).unwrap();
    std::fs::write(
        dir.join("lists.toml"),
        r#"
[[list]]
id = "cards"
file = "lists/cards.txt"

[[list]]
id = "nets"
kind = "cidr"
file = "lists/nets.txt"

[[list]]
id = "amounts"
kind = "number"
file = "lists/amounts.txt"

[[list]]
id = "limits"
kind = "map"
file = "lists/limits.csv"

[[rule]]
id = "stolen-card"
action = "block"
when = "card in @cards"

[[rule]]
id = "over-limit"
action = "challenge"
when = "amount > @limits[merchant]"

[[rule]]
id = "listed-net"
action = "review"
when = "ip in @nets"

[[rule]]
id = "listed-amount"
action = "alert"
when = "amount in @amounts"
"#,
    )
    .unwrap();
}

#[test]
fn million_entry_lists_load_fast_and_test_exactly() {
    let dir = tempfile::tempdir().unwrap();
    write_lists(dir.path());
    let started = Instant::now();
    let rules = vigil::rule_files::load(dir.path()).unwrap();
    let loaded = started.elapsed();
    eprintln!("four lists of {ENTRIES} entries loaded in {loaded:?}");
    assert!(
        loaded < Duration::from_secs(40),
        "four million-entry lists took {loaded:?}"
    );
    let sizes: Vec<(String, usize)> = rules
        .lists()
        .map(|(id, set)| (id.to_owned(), set.len()))
        .collect();
    assert_eq!(
        sizes,
        [
            ("cards".to_owned(), 1_000_000),
            ("nets".to_owned(), 1_000_000),
            ("amounts".to_owned(), 1_000_000),
            ("limits".to_owned(), 1_000_000)
        ]
    );

    let probes: [(&str, &[&str]); 19] = [
        // m-0000123's limit is 20 123; m-0999999's is "manual" (a string: never compared).
        (r#""merchant":"m-0000123","amount":20124"#, &["over-limit"]),
        (r#""merchant":"m-0000123","amount":20123"#, &[]),
        (
            r#""merchant":"m-0999998","amount":20998.5"#,
            &["over-limit"],
        ),
        (r#""merchant":"m-0999999","amount":1e9"#, &[]),
        (r#""merchant":"m-1000000","amount":1e9"#, &[]),
        (r#""card":"c-0000000""#, &["stolen-card"]),
        (r#""card":"c-0500000""#, &["stolen-card"]),
        (r#""card":"c-0999999""#, &["stolen-card"]),
        (r#""card":"c-1000000""#, &[]),
        (r#""card":"c-000000""#, &[]),
        (r#""card":0"#, &[]),
        (r#""ip":"10.7.161.31""#, &["listed-net"]),
        (r#""ip":"10.7.161.32""#, &[]),
        (r#""ip":"32.1.44.250""#, &["listed-net"]),
        (r#""ip":"40.0.0.1""#, &[]),
        (r#""ip":"::ffff:32.1.44.250""#, &[]),
        (r#""amount":9999.99"#, &["listed-amount"]),
        (r#""amount":1234.50"#, &["listed-amount"]),
        (r#""amount":10000"#, &[]),
    ];
    let input: String = probes
        .iter()
        .enumerate()
        .map(|(i, (fields, _))| {
            format!("{{\"ts\":{},{fields}}}\n", 1_700_000_000_000i64 + i as i64)
        })
        .collect();
    let mut engine = Engine::new(rules, MemoryStore::new());
    let mut out = Vec::new();
    let started = Instant::now();
    replay(
        &mut engine,
        input.as_bytes(),
        &mut out,
        std::io::sink(),
        ReplayOptions::default(),
    )
    .unwrap();
    eprintln!("{} probes judged in {:?}", probes.len(), started.elapsed());
    let records: Vec<serde_json::Value> = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (i, (fields, want)) in probes.iter().enumerate() {
        let line = i as u64 + 1;
        let got: Vec<&str> = records
            .iter()
            .filter(|r| r["source"]["line"] == line)
            .flat_map(|r| r["hits"].as_array().unwrap())
            .map(|h| h["rule_id"].as_str().unwrap())
            .collect();
        assert_eq!(&got, want, "{fields}");
    }
}
