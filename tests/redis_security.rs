//! Security of the Redis path against real `redis-server` processes started by the test harness:
//! ACL users and redacted passwords, verified TLS, and hostile keys and values (dimension values
//! that cannot steer Redis keys, a million distinct values on one key staying bounded).

mod support;

use std::process::Command;

use support::store_replay::{replay_with, workload, RULES};
use support::RedisServer;
use vigil::pipeline::{replay, Engine, ReplayOptions};
use vigil::store::{MemoryStore, RedisStore, RedisStoreConfig};

#[test]
fn acl_users_and_redacted_passwords() {
    let redis = RedisServer::start();
    let mut admin = redis.connection();
    // The ACL the operations guide tells operators to create, word for word.
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .unwrap();
    let acl = guide
        .lines()
        .find(|l| l.starts_with("ACL SETUSER vigil "))
        .expect("the guide's ACL line");
    let mut setuser = redis::cmd("ACL");
    for word in acl.split_whitespace().skip(1) {
        setuser.arg(if word == ">PASSWORD" { ">s3cret" } else { word });
    }
    let _: () = setuser.query(&mut admin).unwrap();
    let url = |password: &str| format!("redis://vigil:{password}@127.0.0.1:{}/", redis.port);
    let events = "{\"ts\":1,\"type\":\"login\",\"result\":\"fail\",\"user_id\":\"u\"}\n";
    let run = |url: &str| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_vigil"))
            .args(["replay", "--rules", RULES, "--input", "-", "--redis", url])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        let _ = child.stdin.take().unwrap().write_all(events.as_bytes());
        child.wait_with_output().unwrap()
    };
    let ok = run(&url("s3cret"));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    let keys: Vec<String> = redis::cmd("KEYS").arg("vg:*").query(&mut admin).unwrap();
    assert!(!keys.is_empty(), "counted through the ACL user");

    let refused = run(&url("wrong-password"));
    assert_eq!(refused.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("redis://vigil:***@127.0.0.1"), "{stderr}");
    assert!(
        !stderr.contains("wrong-password"),
        "password leaked: {stderr}"
    );
}

#[test]
fn rediss_urls_verify_the_server_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (tls, ca) = RedisServer::start_tls(dir.path());
    let url = format!("rediss://127.0.0.1:{}/", tls.port);
    let input = workload(2_000);
    let (memory, _) = replay_with(MemoryStore::new(), &input);
    let config = RedisStoreConfig {
        tls_ca_file: Some(ca),
        ..RedisStoreConfig::default()
    };
    let (over_tls, _) = replay_with(RedisStore::connect(&url, config).unwrap(), &input);
    assert_eq!(over_tls, memory);
    // Without the CA the self-signed certificate is refused.
    let untrusted = RedisStore::connect(
        &url,
        RedisStoreConfig {
            attempts: 1,
            ..RedisStoreConfig::default()
        },
    );
    assert!(
        untrusted.is_err(),
        "an unverified certificate must be refused"
    );
}

/// The attack of one IP with a million distinct users: its Redis hash stays at `max_distinct`
/// values (default 10 000), no script call scans a million fields, and the decisions are those
/// of the in-process store.
#[test]
fn a_million_distinct_values_on_one_key_stay_bounded_in_redis() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("ip.toml"),
        "[[counter]]\nid = \"users-per-ip\"\ndimensions = [\"ip\"]\nwindow = \"1h\"\naggregate = \"distinct\"\nfield = \"user_id\"\n\n\
         [[rule]]\nid = \"shared-ip\"\naction = \"review\"\nwhen = \"$users-per-ip >= 10000\"\n",
    )
    .unwrap();
    let rules = || vigil::rule_files::load(dir.path()).unwrap();
    let mut input = Vec::new();
    for i in 0..1_000_000u64 {
        // 100 events per second: the attack spans 2.8 hours, so the window slides through it.
        input.extend_from_slice(
            format!(
                "{{\"ts\":{},\"ip\":\"203.0.113.9\",\"user_id\":\"u-{i}\"}}\n",
                1_700_000_000_000 + i * 10
            )
            .as_bytes(),
        );
    }
    let run = |store| {
        let mut engine = Engine::new(rules(), store);
        let mut out = Vec::new();
        replay(
            &mut engine,
            &input[..],
            &mut out,
            std::io::sink(),
            ReplayOptions::default(),
        )
        .unwrap();
        (out, engine)
    };
    let memory = run(vigil::store::AnyStore::Memory(MemoryStore::new())).0;
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let _: () = redis::cmd("SLOWLOG").arg("RESET").query(&mut conn).unwrap();
    let started = std::time::Instant::now();
    let (from_redis, _engine) = run(vigil::store::AnyStore::Redis(Box::new(
        RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap(),
    )));
    let elapsed = started.elapsed();
    assert_eq!(from_redis.len(), memory.len());
    assert!(
        from_redis == memory,
        "Redis and the in-process store decide alike"
    );
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("vg:users-per-ip:*")
        .query(&mut conn)
        .unwrap();
    assert_eq!(keys.len(), 1);
    let fields: usize = redis::cmd("HLEN").arg(&keys[0]).query(&mut conn).unwrap();
    // 10 000 values plus the head, the version and the recorded offset.
    assert!(fields <= 10_003, "{fields} fields");
    let bytes: u64 = redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(&keys[0])
        .query(&mut conn)
        .unwrap();
    assert!(bytes < 2 << 20, "{bytes} bytes");
    let slow: Vec<redis::Value> = redis::cmd("SLOWLOG")
        .arg("GET")
        .arg(1000)
        .query(&mut conn)
        .unwrap();
    let durations: Vec<i64> = slow
        .iter()
        .filter_map(|entry| match entry {
            redis::Value::Array(items) => match items.get(2) {
                Some(redis::Value::Int(us)) => Some(*us),
                _ => None,
            },
            _ => None,
        })
        .collect();
    let slowest_us = durations.iter().copied().max().unwrap_or(0);
    let over_100ms = durations.iter().filter(|&&us| us > 100_000).count();
    let decisions = memory.iter().filter(|&&b| b == b'\n').count();
    eprintln!(
        "1M distinct on one key: {fields} fields, {bytes} bytes, replay through Redis {elapsed:?}, \
         {} slowlog entries over 10 ms ({over_100ms} over 100 ms), slowest {slowest_us} µs, {decisions} decisions",
        slow.len()
    );
}
/// Dimension values an attacker controls (braces that would pick a Cluster hash slot,
/// separators, NUL, a megabyte, numbers that look like strings) never reach a Redis key: every
/// key is `vg:<counter>:<32 hex digits>`, distinct tuples get distinct keys, and the key of an
/// honest value is the same whatever hostile values came before it.
#[test]
fn hostile_dimension_values_cannot_steer_redis_keys() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("steer.toml"),
        "[[counter]]\nid = \"pair\"\ndimensions = [\"user_id\", \"ip\"]\nwindow = \"1h\"\n\n\
         [[rule]]\nid = \"many\"\naction = \"alert\"\nwhen = \"$pair > 100\"\n",
    )
    .unwrap();
    let megabyte = "{".repeat(1 << 20);
    let hostile: Vec<(String, String)> = vec![
        (r#""{victim}""#.into(), r#""1.2.3.4""#.into()),
        (r#""victim""#.into(), r#""{1.2.3.4}""#.into()),
        (r#""{""#.into(), r#""}""#.into()),
        (r#""a:b""#.into(), r#""c""#.into()),
        (r#""a""#.into(), r#""b:c""#.into()),
        (r#""a\u0000b""#.into(), r#""c""#.into()),
        (r#""a""#.into(), r#""\u0000bc""#.into()),
        (r#""17""#.into(), r#""x""#.into()),
        ("17".into(), r#""x""#.into()),
        ("17.0".into(), r#""x""#.into()),
        ("true".into(), r#""x""#.into()),
        (r#""true""#.into(), r#""x""#.into()),
        (format!("\"{megabyte}\""), r#""x""#.into()),
        (format!("\"{megabyte}\""), r#""y""#.into()),
    ];
    // 17 and 17.0 are one key (numbers by value): 13 distinct tuples.
    let distinct = hostile.len() - 1;
    let victim = r#"{"ts":1700000000500,"user_id":"victim","ip":"1.2.3.4"}"#;
    let mut with_hostile = String::new();
    for (i, (user, ip)) in hostile.iter().enumerate() {
        with_hostile.push_str(&format!(
            "{{\"ts\":{},\"user_id\":{user},\"ip\":{ip}}}\n",
            1_700_000_000_000u64 + i as u64
        ));
    }
    // A lone surrogate is not a string JSON can carry: a bad line, counted nowhere.
    with_hostile.push_str("{\"ts\":1700000000100,\"user_id\":\"\\ud800\",\"ip\":\"x\"}\n");
    with_hostile.push_str(victim);
    with_hostile.push('\n');

    let keys_after = |input: &str| {
        let redis = RedisServer::start();
        let rules = vigil::rule_files::load(dir.path()).unwrap();
        let store = RedisStore::connect(&redis.url(), RedisStoreConfig::default()).unwrap();
        let mut engine = Engine::new(rules, store);
        let mut out = Vec::new();
        // Lines of a megabyte and more are allowed here (the default limit is 1 MiB per line).
        let options = ReplayOptions {
            max_event_bytes: 4 << 20,
            ..ReplayOptions::default()
        };
        let summary = replay(
            &mut engine,
            input.as_bytes(),
            &mut out,
            std::io::sink(),
            options,
        )
        .unwrap();
        let mut conn = redis.connection();
        // A count over (user_id, ip): a section of the hash the counters over them share.
        let keys: Vec<String> = redis::cmd("KEYS").arg("vg:_:*").query(&mut conn).unwrap();
        (keys, summary.bad_lines)
    };
    let (keys, bad) = keys_after(&with_hostile);
    assert_eq!(bad, 1);
    assert_eq!(keys.len(), distinct + 1, "{keys:?}");
    for key in &keys {
        let digest = key.strip_prefix("vg:_:").unwrap();
        assert_eq!(digest.len(), 32, "{key}");
        assert!(
            digest
                .bytes()
                .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
            "{key}"
        );
    }
    let (alone, _) = keys_after(&format!("{victim}\n"));
    assert_eq!(alone.len(), 1);
    assert!(
        keys.contains(&alone[0]),
        "the victim's key does not depend on what came before"
    );
}
