//! The Lua scripts' protocol, called directly against real `redis-server` processes started by
//! the test harness: `lua/apply_window.lua` (counting, versions, offsets, the distinct bound,
//! argument checks), `lua/hold.lua`, `lua/release_hold.lua` and `lua/replay_lane.lua`.

mod support;

use std::collections::BTreeMap;

use support::RedisServer;

fn script() -> redis::Script {
    redis::Script::new(include_str!("../lua/apply_window.lua"))
}

type Reply = Vec<Vec<u8>>;

/// A window's shape as the script takes it, once per call: the aggregate's letter (and the
/// section's prefix), the buckets, the distinct bound, the TTL in ms and the deltas' stride.
type Shape = [String; 5];

/// The usual shape: `kind` over `k` buckets, a minute's TTL, deltas of `stride` values.
fn shape(kind: &str, k: i64, stride: i64) -> Shape {
    let cap = if kind.starts_with('d') { 10_000 } else { 0 };
    [
        kind.into(),
        k.to_string(),
        cap.to_string(),
        "60000".into(),
        stride.to_string(),
    ]
}

/// A shape given value by value, as the script gets it.
fn raw_shape(values: [&str; 5]) -> Shape {
    values.map(String::from)
}

/// One call of `lua/apply_window.lua` as the script reads it: the call's shapes first, then for
/// each key its shape's number and the rest of its arguments.
#[derive(Default)]
struct Call {
    keys: Vec<String>,
    shapes: Vec<Shape>,
    args: Vec<Vec<u8>>,
}

impl Call {
    /// A key of `shape` (numbered as an earlier key of the same shape); its arguments follow.
    fn key(&mut self, key: &str, shape: Shape) -> &mut Self {
        self.keys.push(key.into());
        let number = match self.shapes.iter().position(|known| *known == shape) {
            Some(at) => at + 1,
            None => {
                self.shapes.push(shape);
                self.shapes.len()
            }
        };
        self.arg(number)
    }

    fn arg<T: redis::ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    fn args<T: redis::ToRedisArgs>(&mut self, args: &[T]) -> &mut Self {
        for arg in args {
            self.arg(arg);
        }
        self
    }

    fn invoke<T: redis::FromRedisValue>(
        &self,
        conn: &mut redis::Connection,
    ) -> redis::RedisResult<T> {
        let script = script();
        let mut inv = script.prepare_invoke();
        for key in &self.keys {
            inv.key(key);
        }
        inv.arg(self.shapes.len());
        for value in self.shapes.iter().flatten() {
            inv.arg(value);
        }
        for arg in &self.args {
            inv.arg(arg.as_slice());
        }
        inv.invoke(conn)
    }

    /// The one key's reply, as text.
    fn reply(&self, conn: &mut redis::Connection) -> redis::RedisResult<Vec<String>> {
        let mut replies: Vec<Reply> = self.invoke(conn)?;
        assert_eq!(replies.len(), 1);
        Ok(replies
            .pop()
            .unwrap()
            .into_iter()
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .collect())
    }

    /// The error the call is refused with.
    fn refusal(&self, conn: &mut redis::Connection) -> String {
        self.invoke::<Vec<Reply>>(conn).unwrap_err().to_string()
    }
}

/// One key's deltas (`args`) merged without a view, answered with its window.
fn call(
    conn: &mut redis::Connection,
    key: &str,
    kind: &str,
    k: i64,
    stride: i64,
    args: &[&str],
) -> Vec<String> {
    Call::default()
        .key(key, shape(kind, k, stride))
        .arg("")
        .arg(args.len())
        .arg(0)
        .args(args)
        .reply(conn)
        .unwrap()
}

#[test]
fn one_script_call_serves_many_keys_independently() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let mut call = Call::default();
    call.key("vg:t:m1", shape("c", 3, 2))
        .arg("")
        .arg(4)
        .arg(0)
        .args(&[5, 2, 6, 1]);
    // The same shape as the first key's: sent once.
    call.key("vg:t:m2", shape("c", 3, 2)).arg("").arg(0).arg(0);
    call.key("vg:t:m3", shape("s", 2, 2))
        .arg("")
        .arg(2)
        .arg(0)
        .arg(9)
        .arg("1500000");
    assert_eq!(call.shapes.len(), 2);
    let replies: Vec<Reply> = call.invoke(&mut conn).unwrap();
    let text = |r: &Reply| {
        r.iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect::<Vec<_>>()
    };
    let first = text(&replies[0]);
    assert_eq!(first[..3], ["6", "0", "0"]);
    assert_eq!(first[4], "*");
    let window: BTreeMap<_, _> = first[5..]
        .chunks(2)
        .map(|p| (p[0].clone(), p[1].clone()))
        .collect();
    assert_eq!(
        window,
        BTreeMap::from([("b5".into(), "2".into()), ("b6".into(), "1".into())])
    );
    assert!(replies[1].is_empty(), "a key that holds nothing");
    let third = text(&replies[2]);
    assert_eq!(
        [&third[..3], &third[4..]].concat(),
        ["9", "0", "0", "*", "b9", "1500000"]
    );
}

#[test]
fn script_counts_refuses_late_prunes_and_sets_ttl() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    // k = 3 buckets. Buckets 10, 11, 10 → head 11, window 9..=11.
    let out = call(
        &mut conn,
        "vg:t:a",
        "c",
        3,
        2,
        &["10", "2", "11", "1", "10", "1"],
    );
    assert_eq!(out[..3], ["11", "0", "0"]);
    // A new key's version starts at the server's clock in microseconds; each write adds one.
    let created: u64 = out[3].parse().unwrap();
    assert!(created > 1_700_000_000_000_000, "{created}");
    let window: BTreeMap<_, _> = out[5..]
        .chunks(2)
        .map(|p| (p[0].clone(), p[1].clone()))
        .collect();
    assert_eq!(
        window,
        BTreeMap::from([("b10".into(), "3".into()), ("b11".into(), "1".into())])
    );
    // Bucket 8 is late (8 <= 11 - 3); bucket 13 moves the head and prunes bucket 10.
    let out = call(&mut conn, "vg:t:a", "c", 3, 2, &["8", "1", "13", "5"]);
    assert_eq!(out[..5], ["13", "1", "0", &(created + 1).to_string(), "*"]);
    let window: BTreeMap<_, _> = out[5..]
        .chunks(2)
        .map(|p| (p[0].clone(), p[1].clone()))
        .collect();
    assert_eq!(
        window,
        BTreeMap::from([("b11".into(), "1".into()), ("b13".into(), "5".into())])
    );
    // Stored compactly: buckets by slot (bucket mod k), bucket 10 (slot 1) pruned.
    let stored: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg("vg:t:a")
        .query(&mut conn)
        .unwrap();
    assert_eq!(
        stored,
        BTreeMap::from([
            ("h".into(), "13".into()),
            ("v".into(), (created + 1).to_string()),
            ("2".into(), "1".into()),
            ("1".into(), "5".into())
        ])
    );
    let ttl: i64 = redis::cmd("PTTL").arg("vg:t:a").query(&mut conn).unwrap();
    assert!(ttl > 59_000 && ttl <= 60_000, "ttl {ttl}");
    // A read with no deltas returns the window and does not write.
    assert_eq!(call(&mut conn, "vg:t:a", "c", 3, 2, &[])[..1], ["13"]);
    assert!(call(&mut conn, "vg:t:missing", "c", 3, 2, &[]).is_empty());
    let exists: i64 = redis::cmd("EXISTS")
        .arg("vg:t:missing")
        .query(&mut conn)
        .unwrap();
    assert_eq!(exists, 0);
}

#[test]
fn script_sums_exact_64_bit_micro_units_and_tracks_distinct_latest() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    // Micro-units beyond 2^53 (where a Lua double stops being exact), negative amounts with
    // carries across the 10^9 limb, and saturation at the 64-bit limits, exactly as Rust adds.
    let big = "999999999999999999"; // 10^18 - 1
    let out = call(
        &mut conn,
        "vg:t:s",
        "s",
        5,
        2,
        &[
            "1",
            "100000",
            "1",
            "200000",
            "2",
            big,
            "2",
            big,
            "2",
            "7",
            "3",
            "1000000000",
            "3",
            "-1",
            "4",
            "-5000000000",
            "4",
            "4000000001",
        ],
    );
    let window: BTreeMap<_, _> = out[5..]
        .chunks(2)
        .map(|p| (p[0].clone(), p[1].clone()))
        .collect();
    assert_eq!(window["b1"], "300000");
    assert_eq!(
        window["b2"], "2000000000000000005",
        "2 × (10^18 - 1) + 7, exact"
    );
    assert_eq!(window["b3"], "999999999");
    assert_eq!(window["b4"], "-999999999");
    let rust = [big.parse::<i64>().unwrap(), big.parse().unwrap(), 7]
        .iter()
        .fold(0i64, |a, &v| a.saturating_add(v));
    assert_eq!(window["b2"], rust.to_string());
    // Saturation: 10 × (10^18 - 1) stops at i64::MAX, as the Rust side's saturating_add does.
    let many: Vec<&str> = (0..10).flat_map(|_| ["5", big]).collect();
    let out = call(&mut conn, "vg:t:sat", "s", 5, 2, &many);
    let window: BTreeMap<_, _> = out[5..]
        .chunks(2)
        .map(|p| (p[0].clone(), p[1].clone()))
        .collect();
    assert_eq!(window["b5"], i64::MAX.to_string());
    // Amounts must be integers of at most 19 digits: anything else is refused before a write.
    let error = Call::default()
        .key("vg:t:bad", shape("s", 5, 2))
        .args(&["", "2", "0", "1", "0.5"])
        .refusal(&mut conn);
    assert!(error.contains("key 1: bad amount"), "{error}");

    let (a, b) = ("aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb");
    call(&mut conn, "vg:t:d", "d", 3, 2, &["5", a, "4", b, "3", a]);
    // a's latest stays 5 (an older sighting does not move it back); head 7 drops b (latest 4).
    let out = call(&mut conn, "vg:t:d", "d", 3, 2, &["7", b]);
    let window: BTreeMap<_, _> = out[5..]
        .chunks(2)
        .map(|p| (p[0].clone(), p[1].clone()))
        .collect();
    assert_eq!(
        window,
        BTreeMap::from([(format!("d{a}"), "5".into()), (format!("d{b}"), "7".into())])
    );
}

#[test]
fn script_returns_the_window_only_when_another_writer_changed_it() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let run = |conn: &mut redis::Connection, expected: &str, args: &[&str]| -> Vec<String> {
        Call::default()
            .key("vg:t:v", shape("c", 10, 2))
            .arg(expected)
            .arg(args.len())
            .arg(0)
            .args(args)
            .reply(conn)
            .unwrap()
    };
    // A caller whose view is "the key holds nothing" (version 0) is current on a new key.
    let out = run(&mut conn, "0", &["5", "1"]);
    assert_eq!([&out[..3], &out[4..]].concat(), ["5", "0", "0", "="]);
    let v1: u64 = out[3].parse().unwrap();
    // Our view is v1 and nobody else wrote: no window comes back.
    assert_eq!(
        run(&mut conn, &v1.to_string(), &["5", "2"]),
        ["5", "0", "0", &(v1 + 1).to_string(), "="]
    );
    // Another writer moves the key on; a caller still at v1 + 1 gets the whole window.
    run(&mut conn, "", &["6", "1"]);
    let out = run(&mut conn, &(v1 + 1).to_string(), &["6", "1"]);
    assert_eq!(out[..5], ["6", "0", "0", &(v1 + 3).to_string(), "*"]);
    let window: BTreeMap<_, _> = out[5..]
        .chunks(2)
        .map(|p| (p[0].clone(), p[1].clone()))
        .collect();
    assert_eq!(
        window,
        BTreeMap::from([("b5".into(), "3".into()), ("b6".into(), "2".into())])
    );
    // A refused late delta also means the caller's view is off: the window comes back.
    let current = (v1 + 3).to_string();
    assert_eq!(
        run(&mut conn, &current, &["-20", "1"])[..5],
        ["6", "1", "0", current.as_str(), "*"]
    );
}

#[test]
fn script_takes_the_callers_writes_only_at_the_callers_version() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let run = |conn: &mut redis::Connection,
               expected: &str,
               deltas: &[&str],
               writes: &[&str]|
     -> Vec<String> {
        Call::default()
            .key("vg:t:w", shape("c", 4, 2))
            .arg(expected)
            .arg(deltas.len())
            .arg(writes.len())
            .args(deltas)
            .args(writes)
            .reply(conn)
            .unwrap()
    };
    let stored = |conn: &mut redis::Connection| -> BTreeMap<String, String> {
        redis::cmd("HGETALL").arg("vg:t:w").query(conn).unwrap()
    };
    let map = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(f, v)| (f.to_string(), v.to_string()))
            .collect()
    };
    // A new key and a caller whose view is "nothing" (version 0): its writes are taken as they are
    // (refresh the TTL; one field/value entry after the next version (v) and the head (h):
    // bucket 10 in slot 2).
    let out = run(
        &mut conn,
        "0",
        &["10", "2"],
        &["1", "2", "500", "10", "2", "2"],
    );
    // Taken as they are: the reply is the version they left, alone.
    assert_eq!(out, ["500"]);
    assert_eq!(
        stored(&mut conn),
        map(&[("v", "500"), ("h", "10"), ("2", "2")])
    );
    let ttl: i64 = redis::cmd("PTTL").arg("vg:t:w").query(&mut conn).unwrap();
    assert!(ttl > 59_000, "ttl {ttl}");
    // At version 500: bucket 15 (slot 3) moves the head on and bucket 10 (slot 2) slides out.
    // No refresh asked: the TTL is left as it is.
    let _: () = redis::cmd("PEXPIRE")
        .arg("vg:t:w")
        .arg(5_000)
        .query(&mut conn)
        .unwrap();
    let out = run(
        &mut conn,
        "500",
        &["15", "1"],
        &["0", "2", "501", "15", "3", "1", "2"],
    );
    assert_eq!(out, ["501"]);
    assert_eq!(
        stored(&mut conn),
        map(&[("v", "501"), ("h", "15"), ("3", "1")])
    );
    let ttl: i64 = redis::cmd("PTTL").arg("vg:t:w").query(&mut conn).unwrap();
    assert!(ttl <= 5_000, "ttl {ttl}");
    // A caller at a stale version: its writes are ignored, its deltas merged, the window returned,
    // and the TTL refreshed.
    let out = run(
        &mut conn,
        "499",
        &["15", "2"],
        &["0", "2", "500", "15", "3", "99"],
    );
    assert_eq!(out, ["15", "0", "0", "502", "*", "b15", "3"]);
    assert_eq!(
        stored(&mut conn),
        map(&[("v", "502"), ("h", "15"), ("3", "3")])
    );
    let ttl: i64 = redis::cmd("PTTL").arg("vg:t:w").query(&mut conn).unwrap();
    assert!(ttl > 59_000, "ttl {ttl}");
    // Writes alone (no deltas to merge) for a stale version: nothing is written, "!" comes back.
    let out = run(&mut conn, "501", &[], &["1", "2", "502", "15", "3", "7"]);
    assert_eq!(out, ["!"]);
    assert_eq!(
        stored(&mut conn),
        map(&[("v", "502"), ("h", "15"), ("3", "3")])
    );
    // Writes carry the highest offset applied per partition.
    let out = run(
        &mut conn,
        "502",
        &[],
        &["0", "4", "503", "15", "3", "4", "o:2", "41"],
    );
    assert_eq!(out, ["503"]);
    assert_eq!(
        stored(&mut conn),
        map(&[("v", "503"), ("h", "15"), ("3", "4"), ("o:2", "41")])
    );
}

#[test]
fn script_skips_deltas_at_or_below_the_recorded_offset() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    // (bucket, value, partition, offset)
    let out = call(
        &mut conn,
        "vg:t:o",
        "c",
        10,
        4,
        &["1", "1", "3", "100", "1", "1", "3", "101"],
    );
    assert_eq!(
        [&out[..3], &out[4..7]].concat(),
        ["1", "0", "0", "*", "b1", "2"]
    );
    // After a crash the same events are replayed, followed by a new one.
    let out = call(
        &mut conn,
        "vg:t:o",
        "c",
        10,
        4,
        &[
            "1", "1", "3", "100", "1", "1", "3", "101", "1", "1", "3", "102", "1", "1", "0", "7",
        ],
    );
    assert_eq!(
        [&out[..3], &out[4..7]].concat(),
        ["1", "0", "2", "*", "b1", "4"]
    );
    let recorded: Vec<String> = redis::cmd("HMGET")
        .arg("vg:t:o")
        .arg("o:3")
        .arg("o:0")
        .query(&mut conn)
        .unwrap();
    assert_eq!(recorded, ["102", "7"]);
}

/// Counting ahead ("<" instead of a version): the deltas are merged as ever, and the window as
/// it stood before them comes back, with the version after them.
#[test]
fn counting_ahead_returns_the_window_as_it_was_before_the_deltas() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let ahead = |conn: &mut redis::Connection, kind: &str, args: &[&str]| -> Vec<String> {
        Call::default()
            .key("vg:t:ahead", shape(kind, 3, 4))
            .arg("<")
            .arg(args.len())
            .arg(0)
            .args(args)
            .reply(conn)
            .unwrap()
    };
    // A key that held nothing: no head before.
    let out = ahead(&mut conn, "c", &["10", "1", "0", "5", "11", "1", "0", "6"]);
    assert_eq!([&out[..3], &out[4..]].concat(), ["", "0", "0", "<"]);
    let created: u64 = out[3].parse().unwrap();
    // Another worker's step: it sees the first one's window, and the key gets both.
    let out = ahead(
        &mut conn,
        "c",
        &["11", "1", "1", "40", "13", "1", "1", "41"],
    );
    assert_eq!(out[..5], ["11", "0", "0", &(created + 1).to_string(), "<"]);
    let before: BTreeMap<_, _> = out[5..]
        .chunks(2)
        .map(|p| (p[0].clone(), p[1].clone()))
        .collect();
    assert_eq!(
        before,
        BTreeMap::from([
            ("b10".into(), "1".into()),
            ("b11".into(), "1".into()),
            ("o:0".into(), "6".into())
        ]),
        "the window and offsets before this step"
    );
    // A step replayed (the same offsets) skips what it applied and a late delta is refused:
    // nothing changes (the version neither), and what comes back is the window before it.
    let out = ahead(&mut conn, "c", &["11", "1", "1", "40", "9", "1", "1", "42"]);
    assert_eq!(out[..5], ["13", "1", "1", &(created + 1).to_string(), "<"]);
    let stored: BTreeMap<String, String> = redis::cmd("HGETALL")
        .arg("vg:t:ahead")
        .query(&mut conn)
        .unwrap();
    assert_eq!(stored["h"], "13");
    assert_eq!(
        (stored["2"].as_str(), stored["1"].as_str()),
        ("2", "1"),
        "buckets 11 (one of each step) and 13; 10 slid out"
    );
    assert_eq!(
        (stored["o:0"].as_str(), stored["o:1"].as_str()),
        ("6", "41")
    );
    // Writes with "<" are refused before anything is written.
    let error = Call::default()
        .key("vg:t:ahead", shape("c", 3, 4))
        .args(&["<", "0", "4", "1", "0", "9", "13"])
        .refusal(&mut conn);
    assert!(error.contains("writes with"), "{error}");
}

#[test]
fn the_script_checks_every_argument_before_its_first_write() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    // Two keys: the first well formed, the second of `second_shape` with the arguments given.
    // When the second is refused, nothing may be written.
    let refused_second =
        |conn: &mut redis::Connection, second_shape: Shape, second: &[&str]| -> String {
            let mut call = Call::default();
            call.key("vg:t:first", shape("c", 3, 2))
                .args(&["", "2", "0", "5", "1"]);
            call.key("vg:t:second", second_shape).args(second);
            let error = call.refusal(conn);
            let exists: i64 = redis::cmd("EXISTS").arg("vg:t:first").query(conn).unwrap();
            assert_eq!(exists, 0, "the first key was not written");
            error
        };
    // The second key with `ttl` and `bucket` as given.
    let refused = |conn: &mut redis::Connection, ttl: &str, bucket: &str| -> String {
        refused_second(
            conn,
            raw_shape(["c", "3", "0", ttl, "2"]),
            &["", "2", "0", bucket, "1"],
        )
    };
    // A shape is checked once per call, before any key: the second key's is the call's second.
    let error = refused(&mut conn, "0", "5");
    assert!(error.contains("shape 2: bad TTL"), "{error}");
    // A TTL goes to PEXPIRE as it came: only the digits Redis reads as an integer pass.
    for ttl in ["6e4", "0x10", " 60000", "060000", "60000.0", "+60000"] {
        let error = refused(&mut conn, ttl, "5");
        assert!(error.contains("shape 2: bad TTL"), "{ttl:?}: {error}");
    }
    // Every value of a shape, and each key's number of its shape.
    for (values, expected) in [
        (["q", "3", "0", "60000", "2"], "shape 2: unknown aggregate"),
        (["c", "0", "0", "60000", "2"], "shape 2: bad bucket count"),
        (["c", "3", "5", "60000", "2"], "shape 2: bad distinct bound"),
        (["d", "3", "0", "60000", "2"], "shape 2: bad distinct bound"),
        (
            ["d", "3", "1000001", "60000", "2"],
            "shape 2: bad distinct bound",
        ),
        (["c", "3", "0", "60000", "3"], "shape 2: bad stride"),
    ] {
        let error = refused_second(&mut conn, raw_shape(values), &["", "2", "0", "5", "1"]);
        assert!(error.contains(expected), "{values:?}: {error}");
    }
    for number in ["3", "0", "-1", "1.5", "x", ""] {
        let mut call = Call::default();
        call.key("vg:t:first", shape("c", 3, 2))
            .args(&["", "2", "0", "5", "1"]);
        // The second key names, in place of its shape's number, one the call's table lacks.
        call.keys.push("vg:t:second".into());
        call.args(&[number, "", "2", "0", "5", "1"]);
        let error = call.refusal(&mut conn);
        assert!(
            error.contains("key 2: no such shape"),
            "{number:?}: {error}"
        );
    }
    let exists: i64 = redis::cmd("EXISTS")
        .arg("vg:t:first")
        .query(&mut conn)
        .unwrap();
    assert_eq!(exists, 0, "the first key was not written");
    // Numbers the script computes with must be integers a double holds exactly.
    for bucket in ["1.5", "x", "", "1e300", "nan", "inf", "9007199254740993"] {
        let error = refused(&mut conn, "60000", bucket);
        assert!(error.contains("key 2: bad bucket"), "{bucket:?}: {error}");
    }
    // Counts of arguments must be whole and not negative, and a write needs its entries: each
    // refused before the first key is written (counts are converted once per text and call, so
    // the same bad text is refused for a second key as for a first).
    for (deltas, writes, expected) in [
        ("-2", "0", "bad counts"),
        ("1.5", "0", "bad counts"),
        ("x", "0", "bad counts"),
        ("1", "0", "bad counts"),
        ("0", "-1", "bad counts"),
        ("0", "0.5", "bad counts"),
        ("0", "1", "bad writes"),
    ] {
        let mut second = vec!["0", deltas, writes];
        if writes == "1" {
            // One write entry, cut short of its count of field/value entries.
            second.push("1");
        }
        let error = refused_second(&mut conn, shape("c", 3, 2), &second);
        assert!(
            error.contains(&format!("key 2: {expected}")),
            "{deltas:?} {writes:?}: {error}"
        );
    }
    // Writes whose next version or head is not a whole number, or whose entries run past them.
    for writes in [
        ["1", "0", "1.5", "7"],
        ["1", "0", "9", "h"],
        ["1", "0", "99999999999999999", "7"],
        ["1", "2", "9", "7"],
        ["1", "1", "9", "7"],
        ["2", "0", "9", "7"],
    ] {
        let mut second = vec!["0", "0", "4"];
        second.extend(writes);
        let error = refused_second(&mut conn, shape("c", 3, 2), &second);
        assert!(error.contains("key 2: bad writes"), "{writes:?}: {error}");
    }
    let error = Call::default()
        .key("vg:t:first", shape("c", 3, 2))
        .args(&["", "2", "0", "5", "0.5"])
        .refusal(&mut conn);
    assert!(error.contains("key 1: bad increment"), "{error}");
    let exists: i64 = redis::cmd("EXISTS")
        .arg("vg:t:first")
        .query(&mut conn)
        .unwrap();
    assert_eq!(exists, 0, "nothing was written");
    // A key known at a version that is gone: "?" and nothing written.
    let replies: Vec<Reply> = Call::default()
        .key("vg:t:gone", shape("c", 3, 2))
        .args(&["12345", "2", "0", "5", "1"])
        .invoke(&mut conn)
        .unwrap();
    assert_eq!(replies, [vec![b"?".to_vec()]]);
    let exists: i64 = redis::cmd("EXISTS")
        .arg("vg:t:gone")
        .query(&mut conn)
        .unwrap();
    assert_eq!(exists, 0);
    // Out of memory: Redis refuses the whole call before it runs (the script declares itself).
    let _: () = redis::cmd("SET")
        .arg("filler")
        .arg("x".repeat(1 << 20))
        .query(&mut conn)
        .unwrap();
    let used: String = redis::cmd("INFO").arg("memory").query(&mut conn).unwrap();
    let used: u64 = used
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(used / 2)
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory-policy")
        .arg("noeviction")
        .query(&mut conn)
        .unwrap();
    let error = Call::default()
        .key("vg:t:oom", shape("c", 3, 2))
        .args(&["", "2", "0", "5", "1"])
        .refusal(&mut conn);
    assert!(error.contains("OOM"), "{error}");
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg(0)
        .query(&mut conn)
        .unwrap();
    let exists: i64 = redis::cmd("EXISTS")
        .arg("vg:t:oom")
        .query(&mut conn)
        .unwrap();
    assert_eq!(exists, 0);
}

fn hold_script() -> redis::Script {
    redis::Script::new(include_str!("../lua/hold.lua"))
}

#[test]
fn hold_script_keeps_the_later_time_and_refuses_bad_arguments() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let raise =
        |conn: &mut redis::Connection, until: &str, ttl: i64| -> redis::RedisResult<String> {
            hold_script()
                .key("vg:h:r:k")
                .arg(until)
                .arg(ttl)
                .invoke(conn)
        };
    assert_eq!(
        raise(&mut conn, "1700000600000", 3_600_000).unwrap(),
        "1700000600000"
    );
    assert_eq!(
        raise(&mut conn, "1700000500000", 3_600_000).unwrap(),
        "1700000600000",
        "never shortened"
    );
    assert_eq!(
        raise(&mut conn, "1700000900000", 7_200_000).unwrap(),
        "1700000900000"
    );
    let ttl: i64 = redis::cmd("PTTL").arg("vg:h:r:k").query(&mut conn).unwrap();
    assert!(
        ttl > 7_100_000 && ttl <= 7_200_000,
        "the raise set its TTL: {ttl}"
    );
    // Times past 2^53 or not integers would not be exact in Lua: refused, nothing written.
    for bad in ["9007199254740993", "1.5", "-1", "1e3", ""] {
        assert!(raise(&mut conn, bad, 1000).is_err(), "{bad:?}");
    }
    assert!(raise(&mut conn, "1", 0).is_err(), "a TTL of zero");
    let stored: String = redis::cmd("GET").arg("vg:h:r:k").query(&mut conn).unwrap();
    assert_eq!(stored, "1700000900000");
}

fn release_script() -> redis::Script {
    redis::Script::new(include_str!("../lua/release_hold.lua"))
}

#[test]
fn a_released_hold_refuses_raises_made_before_it_and_takes_later_ones() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    // A raise at the generation its raiser read the hold at.
    let raise = |conn: &mut redis::Connection, until: &str, generation: u64| -> String {
        hold_script()
            .key("vg:h:r:k")
            .arg(until)
            .arg(3_600_000)
            .arg(generation)
            .invoke(conn)
            .unwrap()
    };
    let release = |conn: &mut redis::Connection, known: &str| -> (String, String) {
        release_script()
            .key("vg:h:r:k")
            .arg(known)
            .invoke(conn)
            .unwrap()
    };
    let get = |conn: &mut redis::Connection| -> Option<String> {
        redis::cmd("GET").arg("vg:h:r:k").query(conn).unwrap()
    };
    // Nothing held: nothing released, but a marker refuses raises read before it.
    assert_eq!(release(&mut conn, ""), ("".into(), "1".into()));
    assert_eq!(get(&mut conn).as_deref(), Some("r1"));
    let ttl: i64 = redis::cmd("PTTL").arg("vg:h:r:k").query(&mut conn).unwrap();
    assert!(
        ttl > 86_000_000,
        "a marker without a hold lasts a day: {ttl}"
    );
    assert_eq!(
        raise(&mut conn, "1700000600000", 0),
        "r1",
        "made before the release: refused"
    );
    assert_eq!(
        raise(&mut conn, "1700000600000", 1),
        "1700000600000:1",
        "made after it: held"
    );
    assert_eq!(
        raise(&mut conn, "1700000500000", 1),
        "1700000600000:1",
        "never shortened"
    );
    let ttl: i64 = redis::cmd("PTTL").arg("vg:h:r:k").query(&mut conn).unwrap();
    assert!(ttl > 3_500_000 && ttl <= 3_600_000, "{ttl}");
    // Released: until when it held, and the new generation; the marker keeps the hold's TTL.
    assert_eq!(release(&mut conn, ""), ("1700000600000".into(), "2".into()));
    let ttl: i64 = redis::cmd("PTTL").arg("vg:h:r:k").query(&mut conn).unwrap();
    assert!(
        ttl > 3_500_000 && ttl <= 3_600_000,
        "the marker keeps the hold's TTL: {ttl}"
    );
    // An extension made before the release (a later time, the older generation): refused.
    assert_eq!(raise(&mut conn, "1700000900000", 1), "r2");
    // A firing judged after the release, even for an earlier event time: held anew.
    assert_eq!(raise(&mut conn, "1700000550000", 2), "1700000550000:2");
    // The releasing process's own raise, not yet written, is released with the hold.
    assert_eq!(
        release(&mut conn, "1700000700000"),
        ("1700000700000".into(), "3".into())
    );
    // A hold never released keeps the plain format older versions wrote and read.
    redis::cmd("DEL").arg("vg:h:r:k").exec(&mut conn).unwrap();
    assert_eq!(raise(&mut conn, "1700000600000", 0), "1700000600000");
    assert_eq!(
        release(&mut conn, "1700000500000"),
        ("1700000600000".into(), "1".into())
    );
    for bad in ["x", "1.5", "-1"] {
        assert!(
            release_script()
                .key("vg:h:r:k")
                .arg(bad)
                .invoke::<(String, String)>(&mut conn)
                .is_err(),
            "{bad:?}"
        );
        assert!(
            hold_script()
                .key("vg:h:r:k")
                .arg("1")
                .arg(1000)
                .arg(bad)
                .invoke::<String>(&mut conn)
                .is_err(),
            "generation {bad:?}"
        );
    }
}

/// The script's `max_distinct` against the in-process window on random sequences (values coming
/// back, out-of-order and late buckets, slides that make room), sent in random chunks so every
/// call merges into what the previous calls stored.
#[test]
fn the_script_bounds_distinct_values_exactly_as_the_window_does() {
    use vigil::window::{Aggregate, Applied, Delta, WindowSpec, WindowState};
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut capped_somewhere = false;
    for case in 0..60 {
        let cap = 1 + next(6) as u32;
        let k = 1 + next(5) as i64;
        let spec = WindowSpec {
            max_distinct: cap,
            ..WindowSpec::new(1_000, k, Aggregate::Distinct)
        };
        let mut state = WindowState::new(Aggregate::Distinct);
        let key = format!("vg:t:cap{case}");
        let mut newest = 10i64;
        let mut sent = 0;
        while sent < 80 {
            let chunk = 1 + next(8) as usize;
            let mut args: Vec<String> = Vec::new();
            for _ in 0..chunk {
                newest += next(3) as i64;
                let bucket = newest - next(k as u64 + 2) as i64;
                let value = next(12) as u128;
                if matches!(state.apply(&spec, bucket, Delta::Distinct(value)), Applied::Counted(n) if n == i64::from(cap))
                {
                    capped_somewhere = true;
                }
                args.push(bucket.to_string());
                args.push(format!("{value:016}"));
            }
            sent += chunk;
            let distinct = [
                "d".to_string(),
                k.to_string(),
                cap.to_string(),
                "60000".into(),
                "2".into(),
            ];
            let reply = Call::default()
                .key(&key, distinct)
                .arg("")
                .arg(args.len())
                .arg(0)
                .args(&args)
                .reply(&mut conn)
                .unwrap();
            let from_script: BTreeMap<String, i64> = reply[5..]
                .chunks(2)
                .map(|p| (p[0].clone(), p[1].parse().unwrap()))
                .collect();
            let WindowState::Distinct(set) = &state else {
                unreachable!("a distinct window")
            };
            let expected: BTreeMap<String, i64> = set
                .live_values(&spec)
                .map(|(v, b)| (format!("d{v:016}"), b))
                .collect();
            assert_eq!(
                from_script, expected,
                "case {case}: cap {cap}, k {k}, after {sent} deltas"
            );
            assert!(from_script.len() <= cap as usize);
        }
    }
    assert!(capped_somewhere, "the sequences must reach the bound");
}

/// The per-event baselines `vigil bench --redis` compares against (`lua/bench/`): the ring
/// returns, call for call, the same window totals as the hash script and as the exact window
/// (count of events in buckets `head-k+1 ..= head`) on in-order input with gaps of any size; an
/// out-of-order event within the window is counted, one behind the window is not.
#[test]
fn the_per_event_ring_baseline_counts_exactly_like_the_hash_baseline() {
    use vigil::harness::redis_bench::PerEvent;
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let (ring, hash) = (
        redis::Script::new(PerEvent::Ring.script()),
        redis::Script::new(PerEvent::Hash.script()),
    );
    let k = 6i64;
    let mut bucket = 1_000i64;
    let mut seen: Vec<i64> = Vec::new();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    for step in 0..600 {
        // xorshift: gaps 0 (same bucket) to 2k (the whole window slides out), mostly small.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        bucket += [0, 0, 0, 1, 1, 2, 3, k, 2 * k][(state % 9) as usize];
        seen.push(bucket);
        let exact = seen
            .iter()
            .filter(|&&b| b > bucket - k && b <= bucket)
            .count() as i64;
        let r: i64 = ring
            .key("ring")
            .arg(bucket)
            .arg(k)
            .arg(600_000)
            .invoke(&mut conn)
            .unwrap();
        let h: i64 = hash
            .key("hash")
            .arg(bucket)
            .arg(k)
            .arg(600_000)
            .invoke(&mut conn)
            .unwrap();
        assert_eq!((r, h), (exact, exact), "step {step}, bucket {bucket}");
    }
    // Out of order: one bucket back is still in the window and counted; k buckets back is not.
    let r: i64 = ring
        .key("ring")
        .arg(bucket - 1)
        .arg(k)
        .arg(600_000)
        .invoke(&mut conn)
        .unwrap();
    seen.push(bucket - 1);
    assert_eq!(
        r,
        seen.iter()
            .filter(|&&b| b > bucket - k && b <= bucket)
            .count() as i64
    );
    let before: i64 = ring
        .key("ring")
        .arg(bucket)
        .arg(k)
        .arg(600_000)
        .invoke(&mut conn)
        .unwrap();
    let late: i64 = ring
        .key("ring")
        .arg(bucket - k)
        .arg(k)
        .arg(600_000)
        .invoke(&mut conn)
        .unwrap();
    assert_eq!(
        late,
        before + 1,
        "a late event reads the window plus itself, uncounted"
    );
    let after: i64 = ring
        .key("ring")
        .arg(bucket)
        .arg(k)
        .arg(600_000)
        .invoke(&mut conn)
        .unwrap();
    assert_eq!(after, before + 1, "the late event was not counted");
}

/// Max ("x") and min ("n") windows: each bucket keeps its largest or smallest amount, exactly
/// beyond 2^53 and across signs, merged call after call (as another writer's deltas are).
#[test]
fn script_keeps_each_buckets_largest_and_smallest_amount() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let window = |out: Vec<String>| -> BTreeMap<String, String> {
        out[5..]
            .chunks(2)
            .map(|p| (p[0].clone(), p[1].clone()))
            .collect()
    };
    // 2^53 + 1 and 2^53 + 2 differ only past a double's precision.
    let (a, b) = ("9007199254740993", "9007199254740994");
    let deltas = [
        "1",
        a,
        "1",
        b,
        "1",
        "5",
        "2",
        "-1000000001",
        "2",
        "-999999999",
    ];
    let max = window(call(&mut conn, "vg:t:x", "x", 5, 2, &deltas));
    let min = window(call(&mut conn, "vg:t:n", "n", 5, 2, &deltas));
    assert_eq!((max["b1"].as_str(), max["b2"].as_str()), (b, "-999999999"));
    assert_eq!(
        (min["b1"].as_str(), min["b2"].as_str()),
        ("5", "-1000000001")
    );
    // A later call merges into what the hash holds; bucket 1 slides out at head 6.
    let max = window(call(&mut conn, "vg:t:x", "x", 5, 2, &["2", "7", "6", "3"]));
    assert_eq!(
        max,
        BTreeMap::from([("b2".into(), "7".into()), ("b6".into(), "3".into())])
    );
    let min = window(call(
        &mut conn,
        "vg:t:n",
        "n",
        5,
        2,
        &["2", "7", "3", "-2000000000000"],
    ));
    assert_eq!(
        (min["b2"].as_str(), min["b3"].as_str()),
        ("-1000000001", "-2000000000000")
    );
}

/// A last ("l") window keeps one event: the one with the greatest time (of equal times the later
/// delta), replaced once it slides out; a bad value is refused before any write.
#[test]
fn script_keeps_a_last_windows_latest_event() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let last = |out: &[String]| -> Option<String> {
        out[5..]
            .chunks(2)
            .find(|p| p[0] == "l")
            .map(|p| p[1].clone())
    };
    // Buckets of 1 000 ms, k = 60: (bucket, "<ts>:<tag><text>").
    let out = call(
        &mut conn,
        "vg:t:l",
        "l",
        60,
        2,
        &[
            "10",
            "10000:sUS",
            "20",
            "20500:sFR",
            "15",
            "15000:sDE",
            "20",
            "20500:sGB",
        ],
    );
    assert_eq!(last(&out).as_deref(), Some("20:20500:sGB"));
    // An older event does not replace it; a newer one does.
    let out = call(&mut conn, "vg:t:l", "l", 60, 2, &["19", "19999:n12.5"]);
    assert_eq!(last(&out).as_deref(), Some("20:20500:sGB"));
    let out = call(&mut conn, "vg:t:l", "l", 60, 2, &["21", "21000:b1"]);
    assert_eq!(last(&out).as_deref(), Some("21:21000:b1"));
    // Past the window the kept event slid out: the next one replaces it whatever its time.
    let out = call(&mut conn, "vg:t:l", "l", 60, 2, &["90", "90000:sES"]);
    assert_eq!(last(&out).as_deref(), Some("90:90000:sES"));
    let error = Call::default()
        .key("vg:t:l2", shape("l", 60, 2))
        .args(&["", "2", "0", "1", "US"])
        .refusal(&mut conn);
    assert!(error.contains("bad last value"), "{error}");
    let exists: bool = redis::cmd("EXISTS")
        .arg("vg:t:l2")
        .query(&mut conn)
        .unwrap();
    assert!(!exists);
}

/// Counters over the same dimensions share one hash per key, each window a section of it whose
/// fields carry the section's prefix (`c` then the prefix in the shape's first value): each
/// section counts, slides and answers on its own fields only, its writes are taken at its own
/// version, and a section never shortens the TTL another one set.
#[test]
fn sections_of_one_hash_count_apart_and_never_shorten_each_others_ttl() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let key = "vg:_:t";
    let (a, b) = ("aaaaaaaa.", "bbbbbbbb.");
    let section = |conn: &mut redis::Connection,
                   prefix: &str,
                   ttl: i64,
                   version: &str,
                   deltas: &[&str],
                   writes: &[&str]|
     -> Result<Vec<String>, redis::RedisError> {
        let section_shape = [
            format!("c{prefix}"),
            "3".into(),
            "0".into(),
            ttl.to_string(),
            "2".into(),
        ];
        Call::default()
            .key(key, section_shape)
            .arg(version)
            .arg(deltas.len())
            .arg(writes.len())
            .args(deltas)
            .args(writes)
            .reply(conn)
    };
    let window = |out: &[String]| -> BTreeMap<String, String> {
        out[5..]
            .chunks(2)
            .map(|p| (p[0].clone(), p[1].clone()))
            .collect()
    };
    let out = section(
        &mut conn,
        a,
        600_000,
        "",
        &["5", "1", "6", "1", "6", "1"],
        &[],
    )
    .unwrap();
    assert_eq!(
        window(&out),
        BTreeMap::from([("b5".into(), "1".into()), ("b6".into(), "2".into())])
    );
    // The second section sees none of the first one's buckets.
    let out = section(&mut conn, b, 60_000, "", &["6", "1"], &[]).unwrap();
    assert_eq!(window(&out), BTreeMap::from([("b6".into(), "1".into())]));
    let b_version = out[3].clone();
    let fields: BTreeMap<String, String> = redis::cmd("HGETALL").arg(key).query(&mut conn).unwrap();
    assert!(
        fields.keys().all(|f| f.starts_with(a) || f.starts_with(b)),
        "{fields:?}"
    );
    assert_eq!(fields[&format!("{a}h")], "6");
    assert_eq!(fields[&format!("{b}0")], "1", "bucket 6 in slot 0 of b");
    let ttl: i64 = redis::cmd("PTTL").arg(key).query(&mut conn).unwrap();
    assert!(ttl > 60_000, "b's shorter TTL left a's: {ttl}");
    // The first section slides past its buckets 5 and 6: only its own slots go.
    let out = section(&mut conn, a, 600_000, "", &["9", "1"], &[]).unwrap();
    assert_eq!(window(&out), BTreeMap::from([("b9".into(), "1".into())]));
    let fields: BTreeMap<String, String> = redis::cmd("HGETALL").arg(key).query(&mut conn).unwrap();
    assert!(
        !fields.contains_key(&format!("{a}2")),
        "a's bucket 5 slid out"
    );
    assert_eq!(fields[&format!("{b}0")], "1", "b's bucket 6 stays");
    // The second section's writes at its version: taken, the first section's fields untouched.
    let next = (b_version.parse::<u64>().unwrap() + 1).to_string();
    let slot1 = format!("{b}1");
    let writes = ["1", "2", &next, "7", &slot1, "4"];
    let out = section(&mut conn, b, 60_000, &b_version, &["7", "1"], &writes).unwrap();
    assert_eq!(out, [next.as_str()]);
    let fields: BTreeMap<String, String> = redis::cmd("HGETALL").arg(key).query(&mut conn).unwrap();
    assert_eq!(fields[&slot1], "4");
    assert_eq!(fields[&format!("{a}0")], "1", "a's bucket 9 in slot 0");
    let ttl: i64 = redis::cmd("PTTL").arg(key).query(&mut conn).unwrap();
    assert!(ttl > 60_000, "{ttl}");
    // Writes without a whole version, or a prefix past 16 bytes, are refused whole.
    let stray = ["1", "0", "v", "7"];
    let error = section(&mut conn, b, 60_000, &next, &[], &stray).unwrap_err();
    assert!(error.to_string().contains("bad writes"), "{error}");
    let error = section(&mut conn, &"p".repeat(17), 60_000, "", &["7", "1"], &[]).unwrap_err();
    assert!(error.to_string().contains("prefix too long"), "{error}");
    let after: BTreeMap<String, String> = redis::cmd("HGETALL").arg(key).query(&mut conn).unwrap();
    assert_eq!(after, fields);
    let error = section(&mut conn, "p:", 60_000, "", &["7", "1"], &[]).unwrap_err();
    assert!(error.to_string().contains("bad section prefix"), "{error}");

    // Each section records when it would have expired on its own; a section past that (a
    // counter removed from the rules, which its siblings' writes would keep alive) goes with the
    // next write of another section that reads the hash.
    let now_ms = |conn: &mut redis::Connection| -> i64 {
        let (s, us): (i64, i64) = redis::cmd("TIME").query(conn).unwrap();
        s * 1000 + us / 1000
    };
    let expires: i64 = redis::cmd("HGET")
        .arg(key)
        .arg(format!("{b}e"))
        .query(&mut conn)
        .unwrap();
    let now = now_ms(&mut conn);
    assert!(
        expires > now + 50_000 && expires <= now + 60_000,
        "{expires} vs {now}"
    );
    let gone = "cccccccc.";
    let _: () = redis::cmd("HSET")
        .arg(key)
        .arg(format!("{gone}e"))
        .arg(now - 1)
        .arg(format!("{gone}h"))
        .arg("9")
        .arg(format!("{gone}0"))
        .arg("5")
        .arg(format!("{gone}o:1"))
        .arg("77")
        .query(&mut conn)
        .unwrap();
    let out = section(&mut conn, a, 600_000, "", &["10", "1"], &[]).unwrap();
    assert_eq!(
        window(&out),
        BTreeMap::from([("b9".into(), "1".into()), ("b10".into(), "1".into())])
    );
    let fields: BTreeMap<String, String> = redis::cmd("HGETALL").arg(key).query(&mut conn).unwrap();
    assert!(!fields.keys().any(|f| f.starts_with(gone)), "{fields:?}");
    assert_eq!(fields[&slot1], "4", "b's live section stays");

    // A section past its own expiry is gone for its own writer too, as an expired key would be:
    // writes at the version it knew are answered "?" (its view is written again in full), not
    // taken onto the lapsed section.
    let version: String = redis::cmd("HGET")
        .arg(key)
        .arg(format!("{b}v"))
        .query(&mut conn)
        .unwrap();
    let _: () = redis::cmd("HSET")
        .arg(key)
        .arg(format!("{b}e"))
        .arg(now_ms(&mut conn) - 1)
        .query(&mut conn)
        .unwrap();
    let next = (version.parse::<u64>().unwrap() + 1).to_string();
    let writes = ["0", "2", &next, "8", &slot1, "5"];
    let out = section(&mut conn, b, 60_000, &version, &["8", "1"], &writes).unwrap();
    assert_eq!(out, ["?"]);
    let fields: BTreeMap<String, String> = redis::cmd("HGETALL").arg(key).query(&mut conn).unwrap();
    assert!(!fields.keys().any(|f| f.starts_with(b)), "{fields:?}");
    assert!(fields.keys().any(|f| f.starts_with(a)), "{fields:?}");
}

/// `lua/replay_lane.lua`: a claim another replay holds ends the keeper's run (0); a claim that
/// is gone (a failover to a replica that never got it) is still the caller's and set again.
#[test]
fn a_replay_claim_that_vanished_is_kept_and_one_taken_by_another_is_not() {
    let redis = RedisServer::start();
    let mut conn = redis.connection();
    let script = redis::Script::new(include_str!("../lua/replay_lane.lua"));
    let (claim, record) = ("vg:r:{00}:claim", "vg:r:{00}");
    let mut call = |op: &str, value: &str, args: &[&str]| -> redis::Value {
        let mut inv = script.key(claim);
        inv.key(record).arg(op).arg(value);
        for arg in args {
            inv.arg(*arg);
        }
        inv.invoke(&mut conn).unwrap()
    };
    let ok = |lines: &str, at: &str| {
        redis::Value::Array(
            ["ok", lines, at]
                .iter()
                .map(|s| redis::Value::BulkString(s.as_bytes().to_vec()))
                .collect(),
        )
    };
    assert_eq!(call("claim", "mine", &["30000"]), ok("", ""));
    let mut check = redis.connection();
    let holder = |c: &mut redis::Connection| -> Option<String> {
        redis::cmd("GET").arg(claim).query(c).unwrap()
    };
    redis::cmd("DEL").arg(claim).exec(&mut check).unwrap();
    assert_eq!(call("keep", "mine", &["30000"]), redis::Value::Int(1));
    assert_eq!(holder(&mut check).as_deref(), Some("mine"), "set again");
    let ttl: i64 = redis::cmd("PTTL").arg(claim).query(&mut check).unwrap();
    assert!((1..=30_000).contains(&ttl), "{ttl}");

    redis::cmd("SET")
        .arg(claim)
        .arg("theirs")
        .exec(&mut check)
        .unwrap();
    assert_eq!(call("keep", "mine", &["30000"]), redis::Value::Int(0));
    assert_eq!(
        call("finish", "mine", &["7", "1", "60000"]),
        redis::Value::Int(0)
    );
    assert_eq!(call("release", "mine", &[]), redis::Value::Int(0));
    assert_eq!(holder(&mut check).as_deref(), Some("theirs"), "left alone");

    // Gone when the replay finishes: what it applied is recorded all the same.
    redis::cmd("DEL").arg(claim).exec(&mut check).unwrap();
    assert_eq!(
        call("finish", "mine", &["7", "1", "60000"]),
        redis::Value::Int(1)
    );
    assert_eq!(call("claim", "next", &["30000"]), ok("7", "1"));
}
