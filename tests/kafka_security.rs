//! `vigil run` against an Apache Kafka broker that takes only SASL/SCRAM over TLS (certificates
//! made here with `openssl`, the credential created by Kafka's storage format step): the worker
//! connects with the credentials from `[kafka.properties]` and its environment and decides as
//! replay does; a wrong password or a CA that did not sign the broker's certificate stops it at
//! once with an error naming the broker; no secret reaches its log.

mod support;

use std::path::Path;
use std::time::Duration;

use support::kafka::{Broker, Security, Topics, Worker};
use support::stream::{keyed, replay_lines, workload_lines};
use support::TestCertificates;
use vigil::harness::workload::WorkloadSpec;

const LONG: Duration = Duration::from_secs(120);
const USER: &str = "vigil-worker";
const PASSWORD: &str = "s3cret-Pa55-never-logged";

/// A SASL_SSL-only broker of this test's own, and the CA that signed its certificate.
fn secured_broker(dir: &Path) -> (Broker, std::path::PathBuf) {
    let certificates = TestCertificates::make(dir);
    let broker =
        Broker::start_secured(Security::scram_over_tls(dir, &certificates, USER, PASSWORD));
    (broker, certificates.ca)
}

/// A worker's config: user name and CA in `[kafka.properties]`, the password only in the
/// environment (`VIGIL_KAFKA_PROPERTIES_SASL_PASSWORD`).
fn config(broker: &Broker, topics: &Topics, ca: &Path) -> String {
    format!(
        r#"{}statistics_interval = "1s"
[kafka.properties]
"security.protocol" = "SASL_SSL"
"sasl.mechanism" = "SCRAM-SHA-256"
"sasl.username" = "{USER}"
"ssl.ca.location" = "{}"
[rules]
path = "rules"
[worker]
emit_allow = true
shutdown_timeout = "10s"
commit_interval = "200ms"
"#,
        topics.kafka_section(broker),
        ca.display()
    )
}

#[test]
fn a_worker_authenticates_with_scram_over_tls_and_no_secret_reaches_its_log() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, ca) = secured_broker(dir.path());
    let topics = broker.topics("sasl", 1);
    let spec = WorkloadSpec {
        events: 300,
        users: 40,
        ips: 20,
        rate_per_sec: 50,
        seed: 41,
        ..WorkloadSpec::default()
    };
    let mut lines = workload_lines(&spec);
    lines.insert(100, b"not json".to_vec());
    let (expected, _) = replay_lines(Path::new("rules"), &lines, true);
    broker.produce(&topics.events, &keyed(&lines), Some(0));

    // Every debug log of vigil and librdkafka on: the password must appear in none of them.
    let env = [
        ("VIGIL_KAFKA_PROPERTIES_SASL_PASSWORD", PASSWORD),
        ("RUST_LOG", "debug"),
        ("VIGIL_KAFKA_PROPERTIES_DEBUG", "security,broker,protocol"),
    ];
    let mut worker = Worker::start_with_env(dir.path(), "w", &config(&broker, &topics, &ca), &env);
    worker.wait_ready(LONG);
    let decisions = broker.read(
        &topics.decisions,
        1,
        |r| r.len() >= expected.len(),
        Duration::from_millis(500),
        LONG,
    );
    let dead = broker.read(
        &topics.dead_letters,
        1,
        |r| !r.is_empty(),
        Duration::from_millis(200),
        LONG,
    );
    assert_eq!(decisions.len(), expected.len(), "{}", worker.log_text());
    for (record, (index, want)) in decisions.iter().zip(&expected) {
        let mut got = record.json();
        assert_eq!(got["source"]["offset"], *index as u64);
        got.as_object_mut().unwrap().remove("source");
        got.as_object_mut().unwrap().remove("decision_id");
        assert_eq!(&got, want);
    }
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].payload, b"not json");
    worker.signal("TERM");
    assert!(
        worker
            .wait_exit(Duration::from_secs(20))
            .expect("exits")
            .success(),
        "{}",
        worker.log_text()
    );

    let log = worker.log_text();
    assert!(
        log.contains("SASL_SSL") && log.contains("SCRAM-SHA-256"),
        "the debug logs were on:\n{log}"
    );
    assert!(
        log.lines().count() > 100,
        "the debug logs were on: {} lines",
        log.lines().count()
    );
    assert!(
        !log.contains(PASSWORD),
        "the password is in the worker's log"
    );
    assert!(
        log.contains(r#""sasl.password": "***""#),
        "the config is logged with its secret redacted:\n{}",
        &log[..log.len().min(3000)]
    );
}

#[test]
fn a_wrong_password_or_an_untrusted_certificate_stops_the_worker_naming_the_broker() {
    let dir = tempfile::tempdir().unwrap();
    let (broker, ca) = secured_broker(dir.path());
    let topics = broker.topics("refused", 1);
    let config = config(&broker, &topics, &ca);
    let named = format!("error: kafka: broker {}: ", broker.bootstrap());

    let wrong = "not-the-password";
    let (code, took, log) = Worker::run_until_it_stops(
        dir.path(),
        "wrong-password",
        &config,
        &[("VIGIL_KAFKA_PROPERTIES_SASL_PASSWORD", wrong)],
    );
    assert_eq!(code, Some(1), "{log}");
    assert!(took < Duration::from_secs(15), "stopped after {took:?}");
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(&format!("{named}authentication failed: "))
            && last.contains("invalid credentials"),
        "last line: {last}\n{log}"
    );
    assert!(
        !log.contains(wrong) && !log.contains(PASSWORD),
        "a password is in the log:\n{log}"
    );

    // A CA that did not sign the broker's certificate: the TLS handshake fails.
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let other_ca = TestCertificates::make(&other).ca;
    let (code, took, log) = Worker::run_until_it_stops(
        dir.path(),
        "wrong-ca",
        &config.replace(&ca.display().to_string(), &other_ca.display().to_string()),
        &[("VIGIL_KAFKA_PROPERTIES_SASL_PASSWORD", PASSWORD)],
    );
    assert_eq!(code, Some(1), "{log}");
    assert!(took < Duration::from_secs(15), "stopped after {took:?}");
    let last = log.lines().last().unwrap_or_default();
    assert!(
        last.starts_with(&format!("{named}TLS handshake failed: "))
            && last.contains("certificate verify failed"),
        "last line: {last}\n{log}"
    );
    assert!(
        !log.contains(PASSWORD),
        "the password is in the log:\n{log}"
    );

    // The right credentials still get in.
    let mut worker = Worker::start_with_env(
        dir.path(),
        "right",
        &config,
        &[("VIGIL_KAFKA_PROPERTIES_SASL_PASSWORD", PASSWORD)],
    );
    worker.wait_ready(LONG);
}
