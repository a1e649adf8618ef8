//! `vigil gen`: synthetic events (the harness's workload) as JSON lines to stdout, or produced to
//! a Kafka topic.

use std::io::{self, BufWriter, Write};
use std::process::ExitCode;

use anyhow::Context;

use vigil::harness::kafka_bench;
use vigil::harness::workload::{self, WorkloadSpec};

/// Writes `spec`'s events to stdout, or produces them to `kafka`'s (brokers, topic).
pub fn gen(spec: WorkloadSpec, kafka: Option<(String, String)>) -> anyhow::Result<ExitCode> {
    if let Some((brokers, topic)) = kafka {
        let produced =
            kafka_bench::produce_generated(&brokers, &topic, &spec).map_err(anyhow::Error::msg)?;
        eprintln!("gen: produced {produced} events to {topic}");
        return Ok(ExitCode::SUCCESS);
    }
    let mut out = BufWriter::with_capacity(1 << 16, io::stdout().lock());
    match workload::generate(&spec, &mut out).and_then(|()| out.flush()) {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(e).context("writing events"),
        _ => Ok(ExitCode::SUCCESS),
    }
}
