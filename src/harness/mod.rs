//! Off the product path (cargo feature `harness`, on by default): what exercises and measures
//! vigil rather than runs it — the synthetic workload, the fuzz targets' bodies, and the
//! benchmarks behind `vigil bench` (in process, Redis, Kafka). The product's modules never import
//! from here.

pub mod divergence;
pub mod fuzzing;
pub mod kafka_bench;
pub mod redis_bench;
pub mod replay_bench;
pub mod workload;
