//! The deployment files cannot be run here (no Docker engine, no cluster), so they are checked
//! structurally: everything they reference exists in the repository or is an official image, the
//! config and rules they carry are valid for this vigil, and the dashboard and scrape configs name
//! metrics and ports the worker really exports.

use std::collections::BTreeSet;
use std::path::Path;

use yaml_rust2::{Yaml, YamlLoader};

use vigil::config::Config;
use vigil::rules::RuleSet;

fn load(path: &str) -> Vec<Yaml> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn str_of<'y>(yaml: &'y Yaml, what: &str) -> &'y str {
    yaml.as_str()
        .unwrap_or_else(|| panic!("{what}: expected a string, found {yaml:?}"))
}

/// Official images the stack may pull; anything else must be built from this repository.
const OFFICIAL: [&str; 4] = [
    "apache/kafka:",
    "redis:",
    "prom/prometheus:",
    "grafana/grafana:",
];

/// Every metric family the worker exports, by the names Prometheus sees (families appear once
/// they have a series, so each gets one).
fn exported_metrics() -> BTreeSet<String> {
    use vigil::telemetry::*;
    let metrics = Metrics::new();
    metrics.inc_events("allowed", 1);
    metrics
        .decisions
        .get_or_create(&ActionLabels { action: "allow" })
        .inc();
    metrics
        .rule_hits
        .get_or_create(&RuleHitLabels {
            rule: "r".into(),
            mode: "enforce",
            action: "block",
        })
        .inc();
    metrics
        .late_events
        .get_or_create(&CounterLabels {
            counter: "r".into(),
        })
        .inc();
    metrics
        .skipped_events
        .get_or_create(&SkipLabels {
            counter: "r".into(),
            reason: "sum_range",
        })
        .inc();
    metrics
        .dead_letters
        .get_or_create(&ReasonLabels {
            reason: "missing_ts",
        })
        .inc();
    metrics
        .redis_errors
        .get_or_create(&CodeLabels { code: "retry" })
        .inc();
    metrics
        .delivery_errors
        .get_or_create(&CodeLabels { code: "broker" })
        .inc();
    metrics
        .consumer_lag
        .get_or_create(&PartitionLabels {
            topic: "events".into(),
            partition: 0,
        })
        .set(1);
    metrics
        .committed_offset
        .get_or_create(&PartitionLabels {
            topic: "events".into(),
            partition: 0,
        })
        .set(1);
    metrics
        .rule_reloads
        .get_or_create(&ResultLabels { result: "ok" })
        .inc();
    metrics
        .encode()
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

/// `vigil_*` names in a PromQL expression, with histogram/counter suffixes folded to the family.
fn metric_names(expr: &str) -> Vec<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("vigil_"))
        .map(|w| {
            let w = w.strip_suffix("_bucket").unwrap_or(w);
            w.strip_suffix("_total").unwrap_or(w).to_owned()
        })
        .collect()
}

#[test]
fn compose_references_only_what_exists() {
    let docs = load("docker-compose.yml");
    let compose = &docs[0];
    let services = compose["services"].as_hash().expect("services");
    let names: BTreeSet<&str> = services.keys().map(|k| str_of(k, "service name")).collect();
    for wanted in [
        "kafka",
        "kafka-init",
        "redis",
        "vigil-1",
        "vigil-2",
        "prometheus",
        "grafana",
        "generator",
        "producer",
    ] {
        assert!(names.contains(wanted), "service {wanted} missing");
    }
    let volumes: BTreeSet<&str> = compose["volumes"]
        .as_hash()
        .map(|v| v.keys().map(|k| str_of(k, "volume")).collect())
        .unwrap_or_default();
    let built: BTreeSet<&str> = services
        .values()
        .filter(|s| !s["build"].is_badvalue())
        .map(|s| str_of(&s["image"], "image"))
        .collect();
    for (name, service) in services {
        let name = str_of(name, "service name");
        let image = str_of(&service["image"], &format!("{name}.image"));
        if !service["build"].is_badvalue() {
            let context = str_of(&service["build"]["context"], "build.context");
            let dockerfile = str_of(&service["build"]["dockerfile"], "build.dockerfile");
            assert!(
                Path::new(context).join(dockerfile).is_file(),
                "{name}: {dockerfile} not found"
            );
        } else {
            assert!(
                built.contains(image) || OFFICIAL.iter().any(|o| image.starts_with(o)),
                "{name}: image {image} is neither built here nor official"
            );
        }
        if image.starts_with("redis:") {
            let version: Vec<u32> = image
                .strip_prefix("redis:")
                .unwrap()
                .split('.')
                .map(|p| p.parse().unwrap())
                .collect();
            assert!(
                version >= vec![7, 4],
                "{name}: Redis 7.4 or newer, not {image}"
            );
        }
        for volume in service["volumes"].as_vec().into_iter().flatten() {
            let volume = str_of(volume, "volume");
            let source = volume.split(':').next().unwrap();
            if source.starts_with("./") {
                assert!(
                    Path::new(source).exists(),
                    "{name}: {source} does not exist"
                );
            } else {
                assert!(
                    volumes.contains(source),
                    "{name}: volume {source} is not declared"
                );
            }
        }
        let depends: Vec<&str> = match &service["depends_on"] {
            Yaml::Array(list) => list.iter().map(|d| str_of(d, "depends_on")).collect(),
            Yaml::Hash(map) => map.keys().map(|d| str_of(d, "depends_on")).collect(),
            _ => Vec::new(),
        };
        for dependency in depends {
            assert!(
                names.contains(dependency),
                "{name} depends on unknown service {dependency}"
            );
        }
        for port in service["ports"].as_vec().into_iter().flatten() {
            let (host, container) = str_of(port, "port")
                .split_once(':')
                .expect("host:container");
            host.parse::<u16>().unwrap();
            container.parse::<u16>().unwrap();
        }
    }
    // The workers' environment is a valid override of the config file they mount.
    for worker in ["vigil-1", "vigil-2"] {
        let service = services
            .iter()
            .find(|(k, _)| k.as_str() == Some(worker))
            .unwrap()
            .1;
        let env: Vec<(String, String)> = service["environment"]
            .as_hash()
            .expect("environment")
            .iter()
            .map(|(k, v)| (str_of(k, "env").to_owned(), str_of(v, "env").to_owned()))
            .collect();
        let dockerfile_env = [
            ("VIGIL_RULES_PATH", "/etc/vigil/rules"),
            ("VIGIL_HTTP_LISTEN", "0.0.0.0:9464"),
            ("VIGIL_LOG_FORMAT", "json"),
        ];
        let env = env
            .into_iter()
            .chain(dockerfile_env.map(|(k, v)| (k.to_owned(), v.to_owned())));
        let config = Config::parse(
            "deploy/config/vigil.toml",
            include_str!("../deploy/config/vigil.toml"),
            env,
        )
        .unwrap();
        assert_eq!(config.kafka.brokers, "kafka:9092");
        assert_eq!(config.redis.url.as_deref(), Some("redis://redis:6379/"));
        assert_eq!(config.http.listen.port(), 9464);
    }
    // Prometheus scrapes the workers on their metrics port.
    let prometheus = &load("deploy/prometheus/prometheus.yml")[0];
    let targets: Vec<&str> = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|t| str_of(t, "target"))
        .collect();
    assert_eq!(targets, ["vigil-1:9464", "vigil-2:9464"]);
    for target in targets {
        assert!(names.contains(target.split(':').next().unwrap()));
    }
}

#[test]
fn the_dockerfile_copies_what_exists_and_runs_as_non_root() {
    let text = std::fs::read_to_string("deploy/Dockerfile").unwrap();
    for line in text
        .lines()
        .filter(|l| l.starts_with("COPY ") && !l.contains("--from="))
    {
        let parts: Vec<&str> = line.split_whitespace().collect();
        for source in &parts[1..parts.len() - 1] {
            assert!(
                Path::new(source).exists(),
                "Dockerfile copies {source}, which does not exist"
            );
        }
    }
    let user = text
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER line");
    assert_ne!(user.split(':').next(), Some("0"));
    assert_ne!(user, "root");
    assert!(text.contains(r#"CMD ["run", "--config", "/etc/vigil/vigil.toml"]"#));
}

#[test]
fn the_dashboard_shows_only_exported_metrics() {
    let exported = exported_metrics();
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string("deploy/grafana/dashboards/vigil.json").unwrap(),
    )
    .unwrap();
    let mut shown = BTreeSet::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            for name in metric_names(target["expr"].as_str().unwrap()) {
                assert!(
                    exported.contains(&name),
                    "panel {} uses {name}, which vigil does not export",
                    panel["title"]
                );
                shown.insert(name);
            }
        }
    }
    for needed in [
        "vigil_events",
        "vigil_decisions",
        "vigil_consumer_lag",
        "vigil_flush_batch_keys",
        "vigil_flush_duration_seconds",
        "vigil_redis_errors",
        "vigil_dead_letters",
    ] {
        assert!(shown.contains(needed), "the dashboard lacks {needed}");
    }
    let provisioning = &load("deploy/grafana/provisioning/dashboards/vigil.yml")[0];
    assert_eq!(
        provisioning["providers"][0]["options"]["path"].as_str(),
        Some("/var/lib/grafana/dashboards")
    );
}

#[test]
fn kubernetes_manifests_are_complete_and_consistent() {
    let mut documents = Vec::new();
    for file in [
        "configmap.yaml",
        "deployment.yaml",
        "pdb.yaml",
        "hpa.yaml",
        "service.yaml",
    ] {
        documents.extend(load(&format!("deploy/k8s/{file}")));
    }
    let find = |kind: &str, name: &str| -> &Yaml {
        documents
            .iter()
            .find(|d| {
                d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name)
            })
            .unwrap_or_else(|| panic!("{kind}/{name} missing"))
    };
    for document in &documents {
        assert!(
            document["apiVersion"].as_str().is_some() && document["kind"].as_str().is_some(),
            "{document:?}"
        );
    }
    let deployment = find("Deployment", "vigil");
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    assert_eq!(deployment["spec"]["selector"]["matchLabels"], *labels);
    let pod = &deployment["spec"]["template"]["spec"];
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
    let annotations = &deployment["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(annotations["prometheus.io/scrape"].as_str(), Some("true"));
    assert_eq!(annotations["prometheus.io/port"].as_str(), Some("9464"));
    let container = &pod["containers"][0];
    assert_eq!(
        container["readinessProbe"]["httpGet"]["path"].as_str(),
        Some("/readyz")
    );
    assert_eq!(
        container["livenessProbe"]["httpGet"]["path"].as_str(),
        Some("/healthz")
    );
    assert_eq!(container["ports"][0]["containerPort"].as_i64(), Some(9464));
    for kind in ["requests", "limits"] {
        for resource in ["cpu", "memory"] {
            assert!(
                !container["resources"][kind][resource].is_badvalue(),
                "resources.{kind}.{resource}"
            );
        }
    }
    let secrets: Vec<&str> = container["env"]
        .as_vec()
        .unwrap()
        .iter()
        .filter_map(|e| e["valueFrom"]["secretKeyRef"]["name"].as_str())
        .collect();
    assert_eq!(secrets, ["vigil-kafka", "vigil-redis"]);
    // The config it mounts is valid with the environment it gets, and the grace period covers the
    // shutdown bound.
    let config_map = find("ConfigMap", "vigil-config");
    let env = [
        ("VIGIL_KAFKA_PROPERTIES_SASL_PASSWORD", "x"),
        ("VIGIL_REDIS_URL", "redis://vigil:x@redis:6379/0"),
    ]
    .map(|(k, v)| (k.to_owned(), v.to_owned()));
    let config = Config::parse(
        "vigil-config",
        config_map["data"]["vigil.toml"].as_str().unwrap(),
        env,
    )
    .unwrap();
    let grace = pod["terminationGracePeriodSeconds"].as_i64().unwrap();
    assert!(
        config.worker.shutdown_timeout.as_secs() + 5 < grace as u64,
        "shutdown_timeout must end before SIGKILL"
    );
    let mounts = container["volumeMounts"].as_vec().unwrap();
    let mount_of = |volume: &str| {
        mounts
            .iter()
            .find(|m| m["name"].as_str() == Some(volume))
            .unwrap()["mountPath"]
            .as_str()
            .unwrap()
    };
    assert_eq!(Path::new(mount_of("rules")), config.rules.path);
    let args: Vec<&str> = container["args"]
        .as_vec()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        args,
        [
            "run",
            "--config",
            &format!("{}/vigil.toml", mount_of("config"))
        ]
    );
    let volumes = pod["volumes"].as_vec().unwrap();
    for (volume, map) in [("config", "vigil-config"), ("rules", "vigil-rules")] {
        assert!(volumes
            .iter()
            .any(|v| v["name"].as_str() == Some(volume)
                && v["configMap"]["name"].as_str() == Some(map)));
        find("ConfigMap", map);
    }
    let rules = find("ConfigMap", "vigil-rules")["data"].as_hash().unwrap();
    let sources: Vec<(&str, &str)> = rules
        .iter()
        .map(|(k, v)| (k.as_str().unwrap(), v.as_str().unwrap()))
        .collect();
    RuleSet::from_sources(sources).expect("the rules ConfigMap holds valid rules");
    // The disruption budget and the autoscaler point at the Deployment.
    assert_eq!(
        find("PodDisruptionBudget", "vigil")["spec"]["selector"]["matchLabels"],
        *labels
    );
    let hpa = find("HorizontalPodAutoscaler", "vigil");
    assert_eq!(
        hpa["spec"]["scaleTargetRef"]["kind"].as_str(),
        Some("Deployment")
    );
    assert_eq!(
        hpa["spec"]["scaleTargetRef"]["name"].as_str(),
        Some("vigil")
    );
    assert_eq!(
        find("Service", "vigil-metrics")["spec"]["selector"],
        *labels
    );
}
