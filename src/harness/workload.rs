//! Deterministic synthetic events: users, IPs, devices and cards drawn with a zipf skew, nested
//! fields, a little out-of-order and late traffic. Used by `vigil bench` and the tests.

use std::io::Write;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Zipf};

/// Shape of a generated workload.
#[derive(Debug, Clone)]
pub struct WorkloadSpec {
    pub events: u64,
    pub users: u64,
    pub ips: u64,
    /// Zipf exponent of user and IP popularity.
    pub skew: f64,
    /// Event-time rate: events per second of event time.
    pub rate_per_sec: u64,
    /// Start of event time, epoch ms.
    pub start_ms: i64,
    /// Share of events whose time is jittered back by up to 5 s (out of order).
    pub out_of_order: f64,
    /// Share of events sent two days late (late for every rule window up to 24 h).
    pub late: f64,
    /// Share of events that belong to injected fraud patterns (see [`Pattern`]); each injected
    /// event carries `"fraud":"<pattern>"` so a backtest can tell what a rule caught.
    pub fraud: f64,
    pub seed: u64,
}

/// Fraud patterns `vigil gen` injects, each as a burst of consecutive events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// 30 failed logins from one IP against as many different users.
    CredentialStuffing,
    /// 12 small payments on one card, mostly declined.
    CardTesting,
    /// 8 successful logins to one account from 8 new devices.
    AccountTakeover,
}

impl Pattern {
    pub const ALL: [Pattern; 3] = [
        Pattern::CredentialStuffing,
        Pattern::CardTesting,
        Pattern::AccountTakeover,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Pattern::CredentialStuffing => "credential_stuffing",
            Pattern::CardTesting => "card_testing",
            Pattern::AccountTakeover => "account_takeover",
        }
    }

    fn burst(self) -> u64 {
        match self {
            Pattern::CredentialStuffing => 30,
            Pattern::CardTesting => 12,
            Pattern::AccountTakeover => 8,
        }
    }
}

impl Default for WorkloadSpec {
    fn default() -> Self {
        WorkloadSpec {
            events: 1_000_000,
            users: 100_000,
            ips: 50_000,
            skew: 0.8,
            rate_per_sec: 2_000,
            start_ms: 1_700_000_000_000,
            out_of_order: 0.02,
            late: 0.001,
            fraud: 0.0,
            seed: 7,
        }
    }
}

const COUNTRIES: [&str; 8] = ["US", "FR", "DE", "GB", "BR", "IN", "JP", "NG"];
const OSES: [&str; 4] = ["ios", "android", "windows", "macos"];

/// Writes `spec.events` JSON lines to `out`.
pub fn generate(spec: &WorkloadSpec, out: &mut impl Write) -> std::io::Result<()> {
    let mut rng = SmallRng::seed_from_u64(spec.seed);
    let invalid = |what: &str, e: rand_distr::ZipfError| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{what}: {e} (need at least 1, and skew >= 0)"),
        )
    };
    let users = Zipf::new(spec.users as f64, spec.skew).map_err(|e| invalid("users/skew", e))?;
    let ips = Zipf::new(spec.ips as f64, spec.skew).map_err(|e| invalid("ips/skew", e))?;
    let mut line = Vec::with_capacity(512);
    // The burst in progress: its pattern, its events left, and its actor (IP, card or user).
    let mut burst: Option<(Pattern, u64, u64)> = None;
    let mut bursts = 0u64;
    for n in 0..spec.events {
        line.clear();
        let mut ts = spec.start_ms + (n as i64 * 1000) / spec.rate_per_sec.max(1) as i64;
        if burst.is_none() && spec.fraud > 0.0 {
            // A burst starts with the probability that makes `fraud` the share of burst events.
            let pattern = Pattern::ALL[(bursts % 3) as usize];
            if rng.random_bool((spec.fraud / pattern.burst() as f64).clamp(0.0, 1.0)) {
                bursts += 1;
                burst = Some((pattern, pattern.burst(), rng.random_range(0..1u64 << 20)));
            }
        }
        if let Some((pattern, left, actor)) = burst {
            write_fraud(&mut line, &mut rng, pattern, n, ts, actor, spec.users)?;
            out.write_all(&line)?;
            burst = if left > 1 {
                Some((pattern, left - 1, actor))
            } else {
                None
            };
            continue;
        }
        let roll: f64 = rng.random();
        if roll < spec.late {
            ts -= 2 * 86_400_000;
        } else if roll < spec.late + spec.out_of_order {
            ts -= rng.random_range(0..5_000);
        }
        let user = users.sample(&mut rng) as u64;
        // Users mostly come from their home address; one in ten from a popular shared one
        // (carrier NAT, office, VPN exit).
        let ip = if rng.random_ratio(1, 10) {
            ips.sample(&mut rng) as u64
        } else {
            spec.ips + user.wrapping_mul(2_654_435_761) % (1 << 24)
        };
        let country =
            COUNTRIES[(user % 7 + u64::from(rng.random_ratio(1, 50))) as usize % COUNTRIES.len()];
        let device = user * 4 + u64::from(rng.random_ratio(1, 20)) * rng.random_range(1..4u64);
        let os = OSES[(device % 4) as usize];
        write!(
            line,
            r#"{{"event_id":"e-{n}","ts":{ts},"user_id":"u-{user}","ip":"10.{}.{}.{}","device":{{"id":"d-{device}","os":"{os}"}},"geo":{{"country":"{country}","city_id":{}}}"#,
            (ip >> 16) & 255,
            (ip >> 8) & 255,
            ip & 255,
            user % 1000,
        )?;
        let kind: u32 = rng.random_range(0..100);
        if kind < 50 {
            let result = match rng.random_range(0..100) {
                0..=84 => "ok",
                85..=97 => "fail",
                _ => "locked",
            };
            write!(line, r#","type":"login","result":"{result}""#)?;
        } else if kind < 90 {
            let card = user * 2 + u64::from(rng.random_ratio(1, 50));
            let cents: u64 = rng.random_range(100..50_000);
            let result = if rng.random_ratio(1, 10) {
                "declined"
            } else {
                "approved"
            };
            write!(
                line,
                r#","type":"payment","result":"{result}","merchant_id":"m-{}","card":{{"id":"c-{card}","bin":"4{:05}"}},"amount":{}.{:02}"#,
                card % 500,
                card % 100_000,
                cents / 100,
                cents % 100,
            )?;
        } else {
            write!(
                line,
                r#","type":"signup","email_domain":"example{}.com""#,
                user % 50
            )?;
        }
        line.extend_from_slice(b"}\n");
        out.write_all(&line)?;
    }
    Ok(())
}

/// One event of an injected burst, on its own actor (an attacker IP, a stolen card, a taken-over
/// account) so that the burst alone trips the matching rule.
fn write_fraud(
    line: &mut Vec<u8>,
    rng: &mut SmallRng,
    pattern: Pattern,
    n: u64,
    ts: i64,
    actor: u64,
    users: u64,
) -> std::io::Result<()> {
    let tag = pattern.as_str();
    match pattern {
        Pattern::CredentialStuffing => {
            let user = rng.random_range(0..users.max(1));
            write!(
                line,
                r#"{{"event_id":"f-{n}","ts":{ts},"user_id":"u-{user}","ip":"172.16.{}.{}","device":{{"id":"x-{actor}","os":"linux"}},"geo":{{"country":"NG","city_id":999}},"type":"login","result":"fail","fraud":"{tag}"}}"#,
                (actor >> 8) & 255,
                actor & 255,
            )?;
        }
        Pattern::CardTesting => {
            let cents: u64 = rng.random_range(50..300);
            let result = if rng.random_ratio(4, 5) {
                "declined"
            } else {
                "approved"
            };
            write!(
                line,
                r#"{{"event_id":"f-{n}","ts":{ts},"user_id":"m-{actor}","ip":"192.168.{}.{}","device":{{"id":"x-{actor}","os":"linux"}},"geo":{{"country":"BR","city_id":998}},"type":"payment","result":"{result}","merchant_id":"m-t{}","card":{{"id":"s-{actor}","bin":"400000"}},"amount":{}.{:02},"fraud":"{tag}"}}"#,
                (actor >> 8) & 255,
                actor & 255,
                actor % 16,
                cents / 100,
                cents % 100,
            )?;
        }
        Pattern::AccountTakeover => {
            let device: u64 = rng.random();
            write!(
                line,
                r#"{{"event_id":"f-{n}","ts":{ts},"user_id":"t-{actor}","ip":"10.250.{}.{}","device":{{"id":"n-{device}","os":"android"}},"geo":{{"country":"GB","city_id":997}},"type":"login","result":"ok","fraud":"{tag}"}}"#,
                (device >> 8) & 255,
                device & 255,
            )?;
        }
    }
    line.push(b'\n');
    Ok(())
}
