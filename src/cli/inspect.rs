//! `vigil inspect` (one key as the engine sees it, in Redis or after replaying a file) and
//! `vigil hold release` (support ends a hold, with an audit record on the decisions topic).

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;

use vigil::config::{redact_url, Config, KafkaConfig, StoreSetup};
use vigil::pipeline::inspect::{self, CounterView, HoldRelease, KeyFields, RuleCounter, RuleView};
use vigil::pipeline::{self, ReplayOptions};
use vigil::store::{AnyStore, CounterStore};

use super::{load_rules, open_input, InputBounds};

/// Where `inspect` looks.
pub enum InspectFrom {
    /// The Redis the workers count in.
    Redis { url: String, ca: Option<PathBuf> },
    /// A JSON-lines file replayed in process.
    Input(PathBuf),
}

/// Looks up `id` (a counter or a rule) for the key `fields` make, at `at_ms` (default: now;
/// after replaying a file, the time of its newest event).
pub fn inspect(
    rules_path: &Path,
    from: InspectFrom,
    id: &str,
    fields: &[String],
    at_ms: Option<i64>,
    json: bool,
    bounds: InputBounds,
) -> anyhow::Result<ExitCode> {
    let Some(fields) = key_fields(fields) else {
        return Ok(ExitCode::from(2));
    };
    let Some(rules) = load_rules(rules_path) else {
        return Ok(ExitCode::from(1));
    };
    if let Err(e) = inspect::find(&rules, id) {
        eprintln!("error: {e}");
        return Ok(ExitCode::from(1));
    }
    // A time given as the event's time field is the moment looked at, as --at.
    let at_ms = match fields.stated_time(&bounds.time) {
        Ok(stated) => stated.or(at_ms),
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(2));
        }
    };
    let (mut engine, newest) = match from {
        InspectFrom::Redis { url, ca } => {
            let Some(store) = open_redis(&url, ca, &bounds) else {
                return Ok(ExitCode::from(1));
            };
            (bounds.engine(rules, store), None)
        }
        InspectFrom::Input(path) => {
            let Some(reader) = open_input(&path) else {
                return Ok(ExitCode::from(1));
            };
            let mut engine =
                bounds.engine(rules, AnyStore::Memory(bounds.store_setup().memory_store()));
            let options = ReplayOptions {
                until_ms: at_ms,
                ..ReplayOptions::default()
            };
            let summary = pipeline::replay(&mut engine, reader, io::sink(), io::sink(), options)
                .with_context(|| format!("{}: replay failed", path.display()))?;
            eprintln!(
                "inspect: replayed {} events of {} ({} bad lines, {} after --at not counted)",
                summary.counts.events,
                path.display(),
                summary.bad_lines,
                summary.after_until
            );
            let newest = engine.newest(0);
            (engine, newest)
        }
    };
    let at_ms = at_ms.or(newest).unwrap_or_else(now_ms);
    let view = match engine.inspect(id, &fields, at_ms) {
        Ok(view) => view,
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(1));
        }
    };
    let mut out = io::stdout().lock();
    let written = match (&view, json) {
        (Ok(counter), true) => {
            serde_json::to_writer_pretty(&mut out, counter).map_err(io::Error::from)
        }
        (Err(rule), true) => serde_json::to_writer_pretty(&mut out, rule).map_err(io::Error::from),
        (Ok(counter), false) => write_counter(&mut out, counter, ""),
        (Err(rule), false) => write_rule(&mut out, rule),
    };
    match written.and_then(|()| writeln!(out)) {
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {}
        other => other?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Ends `rule`'s hold on the key `fields` make, in the Redis at `url`, and writes the audit
/// record to the decisions topic (printed on stdout as well).
pub fn hold_release(
    rules_path: &Path,
    redis: Option<(String, Option<PathBuf>)>,
    config: Option<&Path>,
    brokers: Option<(String, String)>,
    rule: &str,
    fields: &[String],
    reason: &str,
) -> anyhow::Result<ExitCode> {
    let Some(fields) = key_fields(fields) else {
        return Ok(ExitCode::from(2));
    };
    let config = config
        .map(|path| Config::load(path).with_context(|| format!("{}", path.display())))
        .transpose()?;
    let Some((url, ca)) = redis.or_else(|| {
        let redis = &config.as_ref()?.redis;
        Some((redis.url.clone()?, redis.tls_ca_file.clone()))
    }) else {
        eprintln!("error: hold release needs the Redis the workers count in: --redis URL, or --config with redis.url");
        return Ok(ExitCode::from(2));
    };
    // Where the audit record goes: --brokers, else --config's Kafka section, else the workers'
    // VIGIL_KAFKA_* environment; with none of them it is printed only (and said so).
    let kafka = match (brokers, &config) {
        (Some((brokers, topic)), _) => Some(KafkaConfig {
            decisions_topic: topic,
            ..KafkaConfig::for_brokers(&brokers)
        }),
        (None, Some(config)) => Some(config.kafka.clone()),
        (None, None) if std::env::var_os("VIGIL_KAFKA_BROKERS").is_some() => {
            match Config::parse("the environment", "", std::env::vars()) {
                Ok(config) => Some(config.kafka),
                Err(e) => {
                    eprintln!("error: {e}");
                    return Ok(ExitCode::from(2));
                }
            }
        }
        (None, None) => None,
    };
    let Some(rules) = load_rules(rules_path) else {
        return Ok(ExitCode::from(1));
    };
    let bounds = InputBounds::default();
    let Some(store) = open_redis(&url, ca, &bounds) else {
        return Ok(ExitCode::from(1));
    };
    let mut engine = bounds.engine(rules, store);
    let release = match engine.release_hold(rule, &fields, reason, now_ms()) {
        Ok(release) => release,
        Err(e) => {
            eprintln!("error: {e}");
            return Ok(ExitCode::from(1));
        }
    };
    engine
        .store_mut()
        .flush()
        .context("writing the release to Redis")?;
    let record = release.record();
    println!("{record}");
    let Some(kafka) = kafka else {
        eprintln!("{}", released_line(&release));
        eprintln!(
            "warning: no decisions topic given (--config, --brokers or VIGIL_KAFKA_BROKERS): the audit record above was not written to Kafka"
        );
        return Ok(ExitCode::SUCCESS);
    };
    match vigil::sink::audit::write_audit_record(
        &kafka,
        release.key.get().as_bytes(),
        record.as_bytes(),
        Duration::from_secs(30),
    ) {
        Ok(()) => {
            eprintln!("{}", released_line(&release));
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            eprintln!(
                "error: the hold is released, but its audit record could not be written to {} at {}: {e} (the record is above)",
                kafka.decisions_topic, kafka.brokers
            );
            Ok(ExitCode::from(1))
        }
    }
}

/// One line for the operator: what was released.
pub fn released_line(release: &HoldRelease) -> String {
    match release.released_until {
        Some(until) => format!(
            "released: {} on {} was held until {}",
            release.rule,
            release.key.get(),
            time(until)
        ),
        None => format!(
            "{} on {} was not held (audit record written all the same)",
            release.rule,
            release.key.get()
        ),
    }
}

/// The `FIELD=VALUE` arguments, or `None` after saying what is wrong (exit 2).
fn key_fields(args: &[String]) -> Option<KeyFields> {
    KeyFields::parse(args.iter().map(String::as_str))
        .map_err(|e| eprintln!("error: {e}"))
        .ok()
}

fn open_redis(url: &str, ca: Option<PathBuf>, bounds: &InputBounds) -> Option<AnyStore> {
    let mut setup: StoreSetup = bounds.store_setup();
    setup.redis.url = Some(url.to_owned());
    setup.redis.tls_ca_file = ca;
    // A lookup writes no count: an evicting Redis is worth a warning elsewhere, not a refusal.
    setup.redis.allow_eviction = true;
    match setup.open() {
        Ok((store, _)) => Some(store),
        Err(e) => {
            eprintln!("error: {}: {e}", redact_url(url));
            None
        }
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// An event time in UTC with milliseconds.
fn time(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms).map_or_else(
        || format!("{ms} ms"),
        |t| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    )
}

fn duration(ms: i64) -> String {
    humantime::format_duration(Duration::from_millis(ms.max(0) as u64)).to_string()
}

fn write_counter(out: &mut impl Write, c: &CounterView, indent: &str) -> io::Result<()> {
    writeln!(
        out,
        "{indent}counter  {} ({} over {}, buckets of {})",
        c.counter,
        c.aggregate,
        duration(c.window_ms),
        duration(c.bucket_ms)
    )?;
    writeln!(out, "{indent}key      {}", c.key.get())?;
    writeln!(out, "{indent}at       {}", time(c.at_ms))?;
    let value = match (c.state, c.value_time_ms) {
        ("late", _) => "late: the window has moved past this time".to_owned(),
        ("empty", _) => "unknown: nothing in the window".to_owned(),
        (_, Some(t)) => format!("{} (from the event at {})", c.value.get(), time(t)),
        _ => c.value.get().to_owned(),
    };
    writeln!(out, "{indent}value    {value}")?;
    if let Some(n) = c.distinct_values {
        writeln!(out, "{indent}distinct {n} values in the window")?;
    }
    match c.head_ms {
        Some(head) => writeln!(
            out,
            "{indent}head     {} (newest bucket counted)",
            time(head)
        )?,
        None => writeln!(out, "{indent}head     never counted")?,
    }
    if !c.buckets.is_empty() {
        let (label, width) = if c.aggregate == "last" {
            ("kept", 36)
        } else {
            ("value", 12)
        };
        writeln!(
            out,
            "{indent}buckets  {:<26}{:<26}{label:<width$}in window",
            "from", "to"
        )?;
        for b in &c.buckets {
            let value = if c.aggregate == "last" {
                format!("event at {}", time(b.value.get().parse().unwrap_or(0)))
            } else {
                b.value.get().to_owned()
            };
            writeln!(
                out,
                "{indent}         {:<26}{:<26}{value:<width$}{}",
                time(b.from_ms),
                time(b.to_ms),
                if b.in_window { "yes" } else { "no" }
            )?;
        }
    }
    if !c.offsets.is_empty() {
        let offsets: Vec<String> = c
            .offsets
            .iter()
            .map(|o| format!("lane {}: {}", o.lane, o.offset))
            .collect();
        writeln!(
            out,
            "{indent}offsets  {} (highest applied)",
            offsets.join(", ")
        )?;
    }
    if let Some(name) = &c.redis_key {
        match &c.redis_field_prefix {
            Some(prefix) => writeln!(out, "{indent}redis    {name} (fields {prefix}*)")?,
            None => writeln!(out, "{indent}redis    {name}")?,
        }
        match c.ttl_ms {
            Some(ttl) => writeln!(out, "{indent}ttl      {}", duration(ttl))?,
            None => writeln!(out, "{indent}ttl      none (not in Redis)")?,
        }
    }
    if c.unflushed {
        writeln!(
            out,
            "{indent}note     counted here and not yet written to Redis"
        )?;
    }
    Ok(())
}

fn write_rule(out: &mut impl Write, r: &RuleView) -> io::Result<()> {
    writeln!(out, "rule     {} ({}, {})", r.rule, r.action, r.mode)?;
    writeln!(out, "at       {}", time(r.at_ms))?;
    if let Some(hold) = &r.hold {
        match (&hold.key, hold.held_until_ms) {
            (None, _) => writeln!(
                out,
                "hold     {}: the hold key cannot be formed from the fields given",
                duration(hold.hold_ms)
            )?,
            (Some(key), None) => writeln!(
                out,
                "hold     {} on {}: not held",
                duration(hold.hold_ms),
                key.get()
            )?,
            (Some(key), Some(until)) => writeln!(
                out,
                "hold     {} on {}: held until {} (set by an event at {}){}",
                duration(hold.hold_ms),
                key.get(),
                time(until),
                time(until - hold.hold_ms),
                if hold.held_at {
                    ""
                } else {
                    "; over at this time"
                }
            )?,
        }
    }
    for counter in &r.counters {
        writeln!(out)?;
        match counter {
            RuleCounter::Window(view) => write_counter(out, view, "  ")?,
            RuleCounter::NotFormed {
                counter,
                not_formed,
            } => writeln!(
                out,
                "  counter  {counter}: key not formed from the fields given ({not_formed})"
            )?,
        }
    }
    Ok(())
}

/// `--at`: RFC 3339 or epoch milliseconds.
pub fn parse_at(text: &str) -> Result<i64, String> {
    if let Ok(ms) = text.parse::<i64>() {
        return Ok(ms);
    }
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| t.timestamp_millis())
        .map_err(|_| {
            format!("{text:?} is not a time: give RFC 3339 (2026-11-26T10:00:00Z) or epoch milliseconds")
        })
}
