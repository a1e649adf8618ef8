//! The replay driver: JSON lines in (bounded per line and per batch), one decision record per
//! line out, the bad lines on the diagnostics stream, and a summary; the store prefetches each
//! batch's keys and is flushed at the end.

use std::io::{self, BufRead, Write};
use std::time::{Duration, Instant};

use super::engine::{Engine, EvalCounts};
use super::touched::Touched;
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
        let (take, done) = match memchr::memchr(b'\n', buf) {
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
/// input line to `diagnostics`. Streams in batches of lines: memory is bounded by two batches,
/// the longest line and the live keys.
pub fn replay<S: CounterStore>(
    engine: &mut Engine<S>,
    mut input: impl BufRead,
    output: impl Write,
    diagnostics: impl Write,
    options: ReplayOptions,
) -> Result<ReplaySummary, ReplayError> {
    let started = Instant::now();
    skip_byte_order_mark(&mut input)?;
    let mut run = Run {
        input,
        output,
        diagnostics,
        options,
        summary: ReplaySummary::default(),
        evictions_said: None,
        touched: Touched::default(),
        touched_holds: Vec::new(),
        record: Vec::with_capacity(1024),
        planned_ahead: false,
        next_touched: Touched::default(),
        next_holds: Vec::new(),
        ahead_holds: Vec::new(),
    };
    // Two buffers take turns: while one batch's lines are judged, the next batch is read into
    // the other and decoded once, for the store's read ahead and for its own judging (decoded
    // events borrow their buffer, hence the loop over both).
    let mut first = LineBatch::default();
    let mut second = LineBatch::default();
    let mut lines = run.read(engine, &mut first)?;
    while !lines.is_empty() {
        let next = run.batch(engine, lines, &mut second)?;
        if next.is_empty() {
            break;
        }
        lines = run.batch(engine, next, &mut first)?;
    }
    run.finish(engine, started)
}

/// A batch of input lines: their bytes, and the end of each line in them (or the size of a line
/// too large to keep).
#[derive(Default)]
struct LineBatch {
    bytes: Vec<u8>,
    ends: Vec<Result<usize, usize>>,
}

/// A batch's lines: none for a blank line, else its event (not yet admitted) or why it gave none.
type Lines<'b> = Vec<Option<Result<Event<'b>, Rejected>>>;

/// What a replay carries from one batch to the next.
struct Run<I, O, D> {
    input: I,
    output: O,
    diagnostics: D,
    options: ReplayOptions,
    summary: ReplaySummary,
    evictions_said: Option<Instant>,
    /// The windows and holds the batch being judged touches.
    touched: Touched,
    touched_holds: Vec<(HoldSpace, Vec<u8>)>,
    record: Vec<u8>,
    /// The batch about to be judged was read ahead: what its events touch was planned then, into
    /// `next_touched` and `next_holds`, and its prefetch takes that instead of planning again.
    planned_ahead: bool,
    next_touched: Touched,
    next_holds: Vec<(HoldSpace, Vec<u8>)>,
    /// The next batch's holds: read half way through this one, so that the reads are still
    /// within a flush interval (fresh) when the next batch starts.
    ahead_holds: Vec<(HoldSpace, Vec<u8>)>,
}

impl<I: BufRead, O: Write, D: Write> Run<I, O, D> {
    /// Reads the next batch into `into` and decodes it: a live input one line at a time, so that
    /// each line is judged as soon as it comes. No lines: the input ended.
    fn read<'n, S: CounterStore>(
        &mut self,
        engine: &Engine<S>,
        into: &'n mut LineBatch,
    ) -> Result<Lines<'n>, ReplayError> {
        let max_lines = if self.options.live { 1 } else { REPLAY_BATCH };
        if let Err(e) = read_batch(
            &mut self.input,
            into,
            self.options.max_event_bytes,
            max_lines,
        ) {
            // What was judged before stays delivered.
            self.output.flush()?;
            return Err(e.into());
        }
        Ok(decode_batch(engine, into))
    }

    /// Judges `lines` and returns the next batch's, read into `next`: before judging when the
    /// store reads ahead (it loads their windows meanwhile), after judging otherwise.
    fn batch<'n, S: CounterStore>(
        &mut self,
        engine: &mut Engine<S>,
        lines: Lines<'_>,
        next: &'n mut LineBatch,
    ) -> Result<Lines<'n>, ReplayError> {
        wait_while_saturated(engine.store_mut())?;
        let first_line = self.summary.lines + 1;
        self.summary.lines += lines.len() as u64;
        let prefetches = engine.store().prefetches();
        if prefetches {
            if std::mem::take(&mut self.planned_ahead) {
                std::mem::swap(&mut self.touched, &mut self.next_touched);
                std::mem::swap(&mut self.touched_holds, &mut self.next_holds);
                prefetch_planned(engine, self.touched.keys(), &self.touched_holds)?;
            } else {
                prefetch(engine, &lines, &mut self.touched, &mut self.touched_holds)?;
            }
        }
        if !prefetches || self.options.live {
            self.judge(engine, &lines, first_line)?;
            return self.read(engine, next);
        }
        // Reading the next batch failed: said once this batch's decisions are out.
        let read = read_batch(
            &mut self.input,
            next,
            self.options.max_event_bytes,
            REPLAY_BATCH,
        );
        let next_lines = match read {
            Ok(()) => {
                let next_lines = decode_batch(engine, next);
                self.read_ahead(engine, &next_lines);
                Ok(next_lines)
            }
            Err(e) => Err(e),
        };
        self.judge(engine, &lines, first_line)?;
        match next_lines {
            Ok(next_lines) => Ok(next_lines),
            Err(e) => {
                self.output.flush()?;
                Err(e.into())
            }
        }
    }

    /// Tells the store which windows the next batch's lines will touch, and keeps the plan for
    /// that batch's prefetch.
    fn read_ahead<S: CounterStore>(&mut self, engine: &mut Engine<S>, lines: &Lines<'_>) {
        self.next_touched.clear();
        self.next_holds.clear();
        if lines.is_empty() {
            return;
        }
        for event in lines.iter().flatten().flatten() {
            engine.touched_keys(event, &mut self.next_touched);
            engine.touched_holds(event, &mut self.next_holds);
        }
        engine.store_mut().read_ahead(self.next_touched.keys());
        self.ahead_holds.clone_from(&self.next_holds);
        self.planned_ahead = true;
    }

    /// Judges a batch's lines, the first of them line `first_line` of the input, and writes
    /// their records and bad lines out.
    fn judge<S: CounterStore>(
        &mut self,
        engine: &mut Engine<S>,
        lines: &Lines<'_>,
        first_line: u64,
    ) -> Result<(), ReplayError> {
        let read_holds_at = first_line + lines.len() as u64 / 2;
        for (line, entry) in (first_line..).zip(lines) {
            if line == read_holds_at && !self.ahead_holds.is_empty() {
                engine.store_mut().read_holds_ahead(&self.ahead_holds);
                self.ahead_holds.clear();
            }
            let event = match entry {
                None => continue,
                Some(Ok(event)) => event,
                Some(Err(rejected)) => {
                    self.bad_line(line, rejected)?;
                    continue;
                }
            };
            // Admitted now rather than when decoded: a line read ahead is judged after the batch
            // before it, against the clock as it is then.
            match engine.admit(event) {
                Ok(()) => self.evaluate(engine, event, line)?,
                Err(bad) => self.bad_line(line, &Rejected::Bad(bad))?,
            }
        }
        self.summary.peak_live_keys = self.summary.peak_live_keys.max(engine.store().live_keys());
        self.summary.peak_state_bytes = self
            .summary
            .peak_state_bytes
            .max(engine.store().state_stats().bytes);
        warn_on_evictions(
            &mut self.diagnostics,
            engine.store().state_stats(),
            &mut self.summary.state,
            &mut self.evictions_said,
        )?;
        if self.options.live {
            self.output.flush()?;
        }
        Ok(())
    }

    /// Reports line `line` of the input as bad.
    fn bad_line(&mut self, line: u64, rejected: &Rejected) -> io::Result<()> {
        self.summary.bad_lines += 1;
        match rejected {
            Rejected::Bad(bad) => report_bad_line(&mut self.diagnostics, line, bad),
            Rejected::TooLarge(size) => writeln!(
                self.diagnostics,
                "line {line}: bad event (too_large): line of {size} bytes is longer than max_event_bytes ({})",
                self.options.max_event_bytes
            ),
        }
    }

    /// Counts and judges one admitted event, line `line` of the input, and writes its record.
    fn evaluate<S: CounterStore>(
        &mut self,
        engine: &mut Engine<S>,
        event: &Event<'_>,
        line: u64,
    ) -> Result<(), ReplayError> {
        if self.options.until_ms.is_some_and(|until| event.ts > until) {
            self.summary.after_until += 1;
            return Ok(());
        }
        let decision = engine.evaluate(
            event,
            InputPosition {
                lane: self.options.lane,
                offset: line as i64,
            },
        )?;
        engine.store_mut().tick()?;
        if !decision.is_empty() || self.options.emit_allow {
            self.record.clear();
            record::write_record(
                &mut self.record,
                engine.rules(),
                event,
                &decision,
                EventSource::Line(line),
            );
            self.record.push(b'\n');
            self.output.write_all(&self.record)?;
        }
        Ok(())
    }

    /// Writes out what is left, flushes the store, and sums up.
    fn finish<S: CounterStore>(
        mut self,
        engine: &mut Engine<S>,
        started: Instant,
    ) -> Result<ReplaySummary, ReplayError> {
        self.output.flush()?;
        flush_within(engine.store_mut(), self.options.store_wait)?;
        let mut summary = self.summary;
        summary.counts = engine.counts();
        summary.live_keys = engine.store().live_keys();
        summary.peak_live_keys = summary.peak_live_keys.max(summary.live_keys);
        summary.state = engine.store().state_stats();
        summary.peak_state_bytes = summary.peak_state_bytes.max(summary.state.bytes);
        summary.elapsed = started.elapsed();
        Ok(summary)
    }
}

/// Reads the next batch of lines into `batch`. A batch ends at `max_lines` lines or
/// REPLAY_BATCH_BYTES bytes, whichever comes first: with lines of up to `max_event_bytes`,
/// memory per batch stays bounded.
fn read_batch(
    input: &mut impl BufRead,
    batch: &mut LineBatch,
    max_event_bytes: usize,
    max_lines: usize,
) -> io::Result<()> {
    batch.bytes.clear();
    batch.ends.clear();
    while batch.ends.len() < max_lines && batch.bytes.len() < REPLAY_BATCH_BYTES {
        match read_line_bounded(input, &mut batch.bytes, max_event_bytes)? {
            LineRead::End => break,
            LineRead::Line => batch.ends.push(Ok(batch.bytes.len())),
            LineRead::TooLarge(size) => batch.ends.push(Err(size)),
        }
    }
    Ok(())
}

/// Decodes the batch's lines; blank lines give none. Admission (an event too far in the future)
/// is judged later, with the clock of the moment.
fn decode_batch<'b, S: CounterStore>(engine: &Engine<S>, batch: &'b LineBatch) -> Lines<'b> {
    let mut events = Vec::with_capacity(batch.ends.len());
    let mut start = 0;
    for end in &batch.ends {
        let end = match end {
            Ok(end) => *end,
            Err(size) => {
                events.push(Some(Err(Rejected::TooLarge(*size))));
                continue;
            }
        };
        let text = trim_line(&batch.bytes[start..end]);
        start = end;
        events.push(if text.iter().all(u8::is_ascii_whitespace) {
            None
        } else {
            Some(decode(text, engine.rules().projection()).map_err(Rejected::Bad))
        });
    }
    events
}

/// Loads the windows and holds the batch's events touch, in one round trip each.
fn prefetch<S: CounterStore>(
    engine: &mut Engine<S>,
    events: &Lines<'_>,
    touched: &mut Touched,
    touched_holds: &mut Vec<(HoldSpace, Vec<u8>)>,
) -> Result<(), StoreError> {
    touched.clear();
    touched_holds.clear();
    for event in events.iter().flatten().flatten() {
        engine.touched_keys(event, touched);
        engine.touched_holds(event, touched_holds);
    }
    prefetch_planned(engine, touched.keys(), touched_holds)
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
