//! The replay driver: JSON lines in (bounded per line and per batch), one decision record per
//! line out, the bad lines on the diagnostics stream, and a summary; the store prefetches each
//! batch's keys and is flushed at the end.

use std::io::{self, BufRead, Write};
use std::time::{Duration, Instant};

use super::engine::{Engine, EvalCounts};
use crate::event::{decode, BadEvent, Event};
use crate::rules::{record, EventSource};
use crate::store::{CounterStore, HoldSpace, InputPosition, StateStats, StoreError, WindowId};

/// Longest input line read by default (as `worker.max_event_bytes`): 1 MiB.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1 << 20;

/// Options of `vigil replay`.
#[derive(Debug, Clone, Copy)]
pub struct ReplayOptions {
    /// Longer lines are bad lines (`too_large`), skipped without being held in memory.
    pub max_event_bytes: usize,
    /// Also print a record (action `allow`, no hits) for events without any hit.
    pub emit_allow: bool,
    /// The input's lane: observations are tagged with it and their line number, so a store that
    /// records applied positions counts each line once however often its flush is retried or the
    /// same input replayed (see [`input_lane`]).
    pub lane: u64,
    /// At the end, how long to keep trying a shared store that is unavailable, so that what was
    /// counted locally meanwhile reaches it.
    pub store_wait: Duration,
    /// The input is a live stream (a pipe): each line is judged as soon as it is read and its
    /// record written out at once, instead of waiting for a batch of lines to fill.
    pub live: bool,
    /// Events after this time (epoch ms) are read and neither counted nor judged (`vigil
    /// inspect --input --at`: the state as it stood then).
    pub until_ms: Option<i64>,
}

impl Default for ReplayOptions {
    fn default() -> Self {
        ReplayOptions {
            max_event_bytes: DEFAULT_MAX_EVENT_BYTES,
            emit_allow: false,
            lane: 0,
            store_wait: Duration::ZERO,
            live: false,
            until_ms: None,
        }
    }
}

/// One line as [`read_line_bounded`] read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineRead {
    /// The input ended: nothing was read.
    End,
    /// A line (with its newline, if any) was appended.
    Line,
    /// A line of this many bytes (newline excluded) was longer than the limit: it was consumed
    /// and nothing was appended.
    TooLarge(usize),
}

/// Appends the next line of `input` to `out` unless it is longer than `limit` bytes, in which
/// case it is read through and dropped: memory stays bounded whatever the input (a stream
/// without a single newline included).
pub fn read_line_bounded(
    input: &mut impl BufRead,
    out: &mut Vec<u8>,
    limit: usize,
) -> io::Result<LineRead> {
    let start = out.len();
    let mut size = 0usize;
    let mut too_large = false;
    loop {
        let buf = match input.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buf.is_empty() {
            break;
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        let content = if done { take - 1 } else { take };
        size = size.saturating_add(content);
        if !too_large && size > limit {
            too_large = true;
            out.truncate(start);
        }
        if !too_large {
            out.extend_from_slice(&buf[..take]);
        }
        input.consume(take);
        if done {
            return Ok(if too_large {
                LineRead::TooLarge(size)
            } else {
                LineRead::Line
            });
        }
    }
    Ok(match (too_large, out.len() > start) {
        (true, _) => LineRead::TooLarge(size),
        (false, true) => LineRead::Line,
        (false, false) => LineRead::End,
    })
}

/// The lane of a replay input with identity `identity` (its content digest, or a name the user
/// chose): the top bit is set, so it never equals a Kafka partition's lane.
pub fn input_lane(identity: &[u8]) -> u64 {
    let digest = blake3::hash(identity);
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest.as_bytes()[..8]);
    u64::from_le_bytes(first) | (1 << 63)
}

/// What a replay did.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplaySummary {
    pub lines: u64,
    pub bad_lines: u64,
    pub counts: EvalCounts,
    pub elapsed: Duration,
    /// (counter, key) states held at the end, and the most held after any batch: the state a
    /// replay keeps (bounded by the lateness bound, not by the input's length).
    pub live_keys: usize,
    pub peak_live_keys: usize,
    /// The most bytes of local state estimated after any batch (in-process store; 0 otherwise).
    pub peak_state_bytes: usize,
    /// What the store dropped to stay within its bound of keys.
    pub state: StateStats,
    /// Events after `ReplayOptions::until_ms`, not judged.
    pub after_until: u64,
}

impl ReplaySummary {
    pub fn events_per_second(&self) -> f64 {
        self.counts.events as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

impl std::fmt::Display for ReplaySummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.counts;
        write!(
            f,
            "replay: {} events read, {} decisions, {} bad lines, {} late ({} events behind the watermark), \
             {} skipped ({} dimension, {} sum field, {} sum range, {} distinct field{}), {} counter reads, \
             {} distinct values over max_distinct, {} live keys (peak {}{}), {:.3}s, {:.0} events/s",
            c.events,
            c.decisions,
            self.bad_lines,
            c.late,
            c.behind_watermark,
            c.skipped(),
            c.skipped_dimension,
            c.skipped_sum_field,
            c.skipped_sum_range,
            c.skipped_distinct_field,
            if c.skipped_last_field > 0 {
                format!(", {} last field", c.skipped_last_field)
            } else {
                String::new()
            },
            c.reads,
            c.capped,
            self.live_keys,
            self.peak_live_keys,
            PeakState(self),
            self.elapsed.as_secs_f64(),
            self.events_per_second(),
        )
    }
}

/// ", ~12.5 MiB of state", and the keys the bound evicted, if any.
struct PeakState<'s>(&'s ReplaySummary);

impl std::fmt::Display for PeakState<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.0;
        if s.peak_state_bytes > 0 {
            write!(
                f,
                ", ~{:.1} MiB of state",
                s.peak_state_bytes as f64 / 1_048_576.0
            )?;
        }
        if s.state.evicted_keys > 0 || s.state.evicted_holds > 0 {
            write!(
                f,
                "; {} keys and {} holds evicted at the bound, {} rule judgements on dropped state",
                s.state.evicted_keys, s.state.evicted_holds, s.counts.on_dropped_state
            )?;
        }
        Ok(())
    }
}

/// An error that stops a replay: the output or input failed, or the store did.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("i/o: {0}")]
    Io(#[from] io::Error),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ReplayError {
    pub fn code(&self) -> &'static str {
        match self {
            ReplayError::Io(_) => "io",
            ReplayError::Store(e) => e.code(),
        }
    }
}

/// Lines read and decoded together, so a store can load the keys they touch in one round trip.
const REPLAY_BATCH: usize = 1024;

/// A batch stops taking lines past this many bytes (plus one line of at most `max_event_bytes`).
const REPLAY_BATCH_BYTES: usize = 4 << 20;

/// Why a replay line gave no event.
enum Rejected {
    Bad(BadEvent),
    TooLarge(usize),
}

/// Replays JSON lines from `input`: one decision record per line to `output`, one line per bad
/// input line to `diagnostics`. Streams in batches of lines: memory is bounded by the batch, the
/// longest line and the live keys.
pub fn replay<S: CounterStore>(
    engine: &mut Engine<S>,
    mut input: impl BufRead,
    mut output: impl Write,
    mut diagnostics: impl Write,
    options: ReplayOptions,
) -> Result<ReplaySummary, ReplayError> {
    let started = Instant::now();
    let mut summary = ReplaySummary::default();
    let mut evictions_said = None::<Instant>;
    let mut batch = Vec::with_capacity(REPLAY_BATCH * 256);
    let mut ends = Vec::with_capacity(REPLAY_BATCH);
    let mut touched = Vec::new();
    let mut touched_holds = Vec::new();
    let mut record = Vec::with_capacity(1024);
    // The next batch of lines, read before this one is judged so that the store can read its
    // windows meanwhile (not live: a live line is judged as soon as it comes).
    let mut ahead = Vec::new();
    let mut ahead_ends = Vec::new();
    let mut have_ahead = false;
    // The next batch's holds: read half way through this one, so that the reads are still
    // within a flush interval (fresh) when the next batch starts.
    let mut ahead_holds = Vec::new();
    // What the read ahead planned for the next batch (the windows and holds its events touch):
    // its prefetch takes them instead of planning every event again.
    let mut next_touched = Vec::new();
    let mut next_holds = Vec::new();
    // Reading the next batch failed: said once this batch's decisions are out, as before.
    let mut ahead_failed = None;
    skip_byte_order_mark(&mut input)?;
    loop {
        wait_while_saturated(engine.store_mut())?;
        let planned_ahead = std::mem::take(&mut have_ahead);
        if planned_ahead {
            std::mem::swap(&mut batch, &mut ahead);
            std::mem::swap(&mut ends, &mut ahead_ends);
        } else {
            read_batch(
                &mut input,
                &mut batch,
                &mut ends,
                options.max_event_bytes,
                if options.live { 1 } else { REPLAY_BATCH },
            )?;
        }
        if ends.is_empty() {
            break;
        }
        let first_line = summary.lines + 1;
        summary.lines += ends.len() as u64;
        let events = decode_batch(engine, &batch, &ends);
        if engine.store().prefetches() {
            if planned_ahead {
                std::mem::swap(&mut touched, &mut next_touched);
                std::mem::swap(&mut touched_holds, &mut next_holds);
                prefetch_planned(engine, &touched, &touched_holds)?;
            } else {
                prefetch(engine, &events, &mut touched, &mut touched_holds)?;
            }
            if !options.live {
                match read_batch(
                    &mut input,
                    &mut ahead,
                    &mut ahead_ends,
                    options.max_event_bytes,
                    REPLAY_BATCH,
                ) {
                    Ok(()) => {
                        have_ahead = true;
                        read_ahead(
                            engine,
                            &ahead,
                            &ahead_ends,
                            &mut next_touched,
                            &mut next_holds,
                        );
                        ahead_holds.clone_from(&next_holds);
                    }
                    Err(e) => ahead_failed = Some(e),
                }
            }
        }
        let read_holds_at = first_line + events.len() as u64 / 2;
        for (line, event) in (first_line..).zip(&events) {
            if line == read_holds_at && !ahead_holds.is_empty() {
                engine.store_mut().read_holds_ahead(&ahead_holds);
                ahead_holds.clear();
            }
            let event = match event {
                None => continue,
                Some(Ok(event)) => event,
                Some(Err(rejected)) => {
                    summary.bad_lines += 1;
                    match rejected {
                        Rejected::Bad(bad) => report_bad_line(&mut diagnostics, line, bad)?,
                        Rejected::TooLarge(size) => writeln!(
                            diagnostics,
                            "line {line}: bad event (too_large): line of {size} bytes is longer than max_event_bytes ({})",
                            options.max_event_bytes
                        )?,
                    }
                    continue;
                }
            };
            if options.until_ms.is_some_and(|until| event.ts > until) {
                summary.after_until += 1;
                continue;
            }
            let decision = engine.evaluate(
                event,
                InputPosition {
                    lane: options.lane,
                    offset: line as i64,
                },
            )?;
            engine.store_mut().tick()?;
            if !decision.is_empty() || options.emit_allow {
                record.clear();
                record::write_record(
                    &mut record,
                    engine.rules(),
                    event,
                    &decision,
                    EventSource::Line(line),
                );
                record.push(b'\n');
                output.write_all(&record)?;
            }
        }
        summary.peak_live_keys = summary.peak_live_keys.max(engine.store().live_keys());
        summary.peak_state_bytes = summary
            .peak_state_bytes
            .max(engine.store().state_stats().bytes);
        warn_on_evictions(
            &mut diagnostics,
            engine.store().state_stats(),
            &mut summary.state,
            &mut evictions_said,
        )?;
        if options.live {
            output.flush()?;
        }
        if let Some(e) = ahead_failed.take() {
            output.flush()?;
            return Err(e.into());
        }
    }
    output.flush()?;
    flush_within(engine.store_mut(), options.store_wait)?;
    summary.counts = engine.counts();
    summary.live_keys = engine.store().live_keys();
    summary.peak_live_keys = summary.peak_live_keys.max(summary.live_keys);
    summary.state = engine.store().state_stats();
    summary.peak_state_bytes = summary.peak_state_bytes.max(summary.state.bytes);
    summary.elapsed = started.elapsed();
    Ok(summary)
}

/// The end of each line of a batch in its bytes, or the size of a line too large to keep.
type LineEnds = Vec<Result<usize, usize>>;

/// A batch's lines: none for a blank line, else its event or why it gave none.
type Lines<'b> = Vec<Option<Result<Event<'b>, Rejected>>>;

/// Reads the next batch of lines into `batch` (their ends into `ends`). A batch ends at
/// `max_lines` lines or REPLAY_BATCH_BYTES bytes, whichever comes first: with lines of up to
/// `max_event_bytes`, memory per batch stays bounded.
fn read_batch(
    input: &mut impl BufRead,
    batch: &mut Vec<u8>,
    ends: &mut LineEnds,
    max_event_bytes: usize,
    max_lines: usize,
) -> io::Result<()> {
    batch.clear();
    ends.clear();
    while ends.len() < max_lines && batch.len() < REPLAY_BATCH_BYTES {
        match read_line_bounded(input, batch, max_event_bytes)? {
            LineRead::End => break,
            LineRead::Line => ends.push(Ok(batch.len())),
            LineRead::TooLarge(size) => ends.push(Err(size)),
        }
    }
    Ok(())
}

/// Decodes the batch's lines and refuses events too far in the future; blank lines give none.
fn decode_batch<'b, S: CounterStore>(
    engine: &Engine<S>,
    batch: &'b [u8],
    ends: &LineEnds,
) -> Lines<'b> {
    let mut events = Vec::with_capacity(ends.len());
    let mut start = 0;
    for end in ends {
        let end = match end {
            Ok(end) => *end,
            Err(size) => {
                events.push(Some(Err(Rejected::TooLarge(*size))));
                continue;
            }
        };
        let text = trim_line(&batch[start..end]);
        start = end;
        events.push(if text.iter().all(u8::is_ascii_whitespace) {
            None
        } else {
            Some(
                decode(text, engine.rules().projection())
                    .and_then(|event| engine.admit(&event).map(|()| event))
                    .map_err(Rejected::Bad),
            )
        });
    }
    events
}

/// Loads the windows and holds the batch's events touch, in one round trip each.
fn prefetch<S: CounterStore>(
    engine: &mut Engine<S>,
    events: &Lines<'_>,
    touched: &mut Vec<(WindowId, Vec<u8>)>,
    touched_holds: &mut Vec<(HoldSpace, Vec<u8>)>,
) -> Result<(), StoreError> {
    touched.clear();
    touched_holds.clear();
    for event in events.iter().flatten().flatten() {
        engine.touched_keys(event, touched);
        engine.touched_holds(event, touched_holds);
    }
    prefetch_planned(engine, touched, touched_holds)
}

/// [`prefetch`] of what a batch's events touch, planned already.
fn prefetch_planned<S: CounterStore>(
    engine: &mut Engine<S>,
    touched: &[(WindowId, Vec<u8>)],
    touched_holds: &[(HoldSpace, Vec<u8>)],
) -> Result<(), StoreError> {
    engine.store_mut().prefetch(touched)?;
    engine.store_mut().prefetch_holds(touched_holds)
}

/// Tells the store which windows the next batch's lines will touch (decoded here for that
/// only: they are decoded again, and admitted, when their turn comes).
fn read_ahead<S: CounterStore>(
    engine: &mut Engine<S>,
    batch: &[u8],
    ends: &LineEnds,
    touched: &mut Vec<(WindowId, Vec<u8>)>,
    touched_holds: &mut Vec<(HoldSpace, Vec<u8>)>,
) {
    touched.clear();
    touched_holds.clear();
    if ends.is_empty() {
        return;
    }
    let events = decode_batch(engine, batch, ends);
    for event in events.iter().flatten().flatten() {
        engine.touched_keys(event, touched);
        engine.touched_holds(event, touched_holds);
    }
    engine.store_mut().read_ahead(touched);
}

/// Says on stderr, at most every ten seconds, that the store started evicting keys at its bound
/// (decisions on evicted keys are no longer exact).
fn warn_on_evictions(
    diagnostics: &mut impl Write,
    now: StateStats,
    known: &mut StateStats,
    said: &mut Option<Instant>,
) -> io::Result<()> {
    if (now.evicted_keys, now.evicted_holds) != (known.evicted_keys, known.evicted_holds)
        && said.is_none_or(|at| at.elapsed() >= Duration::from_secs(10))
    {
        writeln!(
            diagnostics,
            "replay: the counter state is at its bound (--max-state-bytes / --max-keys): {} keys and {} holds \
             evicted so far, those with the fewest events first; values over them are lower bounds, judged by \
             each rule's on_store_error until their windows pass",
            now.evicted_keys, now.evicted_holds
        )?;
        *known = now;
        *said = Some(Instant::now());
    }
    Ok(())
}

/// While the store's local state is at its bound (a long outage of the shared store), lets it
/// write behind instead of counting more; says so every ten seconds.
fn wait_while_saturated<S: CounterStore>(store: &mut S) -> Result<(), StoreError> {
    let mut said = None::<Instant>;
    while store.saturated() {
        if said.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
            eprintln!("replay: local counter state is full while the counter store is unavailable; waiting for it");
            said = Some(Instant::now());
        }
        store.tick()?;
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Flushes the store, trying again for up to `wait` while it is unavailable.
fn flush_within<S: CounterStore>(store: &mut S, wait: Duration) -> Result<(), StoreError> {
    let deadline = Instant::now() + wait;
    let mut said = false;
    loop {
        match store.flush() {
            Ok(()) => return Ok(()),
            Err(StoreError::Unavailable(reason)) if Instant::now() < deadline => {
                if !said {
                    eprintln!("replay: the counter store is unavailable ({reason}); waiting up to {}s to write what was counted", wait.as_secs());
                    said = true;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Skips a UTF-8 byte order mark at the start of the input (editors on Windows write one): the
/// first line is then an event like the others, not invalid JSON.
fn skip_byte_order_mark(input: &mut impl BufRead) -> io::Result<()> {
    const BOM: &[u8] = b"\xEF\xBB\xBF";
    // The first read holds the whole mark (a pipe that delivers it split leaves the first
    // line a bad line, as any other stray bytes would).
    let at_start = loop {
        match input.fill_buf() {
            Ok(buf) => break buf.starts_with(BOM),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    };
    if at_start {
        input.consume(BOM.len());
    }
    Ok(())
}

fn trim_line(line: &[u8]) -> &[u8] {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    line.strip_suffix(b"\r").unwrap_or(line)
}

fn report_bad_line(diagnostics: &mut impl Write, line: u64, bad: &BadEvent) -> io::Result<()> {
    writeln!(
        diagnostics,
        "line {line}: bad event ({}): {bad}",
        bad.code()
    )
}
