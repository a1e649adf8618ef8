//! Redis Lua scripts, one per file under `lua/`, compiled into the binary. Invoked by SHA
//! (EVALSHA); a NOSCRIPT reply (after a Redis restart or `SCRIPT FLUSH`) makes the caller load the
//! script and retry.

use std::sync::LazyLock;

/// Applies a key's pending deltas, refuses late ones, prunes, refreshes the TTL and returns the
/// key's window (see the header of `lua/apply_window.lua` for the protocol).
pub static APPLY_WINDOW: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(APPLY_WINDOW_SOURCE));

const APPLY_WINDOW_SOURCE: &str = include_str!("../../lua/apply_window.lua");

/// Claims an input lane's decision journal, or writes to it if still its owner (see the header of
/// `lua/journal.lua`).
pub static JOURNAL: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(JOURNAL_SOURCE));

const JOURNAL_SOURCE: &str = include_str!("../../lua/journal.lua");

/// Raises a rule's hold on one key to a later time (see the header of `lua/hold.lua`).
pub static HOLD: LazyLock<redis::Script> = LazyLock::new(|| redis::Script::new(HOLD_SOURCE));

const HOLD_SOURCE: &str = include_str!("../../lua/hold.lua");

/// Ends a rule's hold on one key, leaving a marker that refuses raises made before (see the
/// header of `lua/release_hold.lua`). Rare: sent as EVAL, with its source.
pub(super) const RELEASE_HOLD_SOURCE: &str = include_str!("../../lua/release_hold.lua");

/// Claims an input lane for one replay at a time and records how far a finished one got (see
/// the header of `lua/replay_lane.lua`).
pub static REPLAY_LANE: LazyLock<redis::Script> =
    LazyLock::new(|| redis::Script::new(REPLAY_LANE_SOURCE));

const REPLAY_LANE_SOURCE: &str = include_str!("../../lua/replay_lane.lua");

/// The source of every script, for SCRIPT LOAD.
pub(super) const SOURCES: [&str; 4] = [
    APPLY_WINDOW_SOURCE,
    JOURNAL_SOURCE,
    HOLD_SOURCE,
    REPLAY_LANE_SOURCE,
];

/// One EVALSHA of `lua/apply_window.lua` over many keys, built in flat buffers: a flush carries
/// tens of thousands of arguments, and one allocation each would dominate the client's time.
#[derive(Default)]
pub(super) struct ScriptCall {
    keys: Vec<u8>,
    key_ends: Vec<usize>,
    /// What the keys of one counter have in common, sent once per call before the keys' own
    /// arguments (Redis parses and the script checks each argument: most keys of a call share a
    /// few shapes).
    shapes: Vec<Shape>,
    args: Vec<u8>,
    arg_ends: Vec<usize>,
}

/// A window's shape, as the script's call-wide table holds it.
#[derive(PartialEq, Eq)]
pub(super) struct Shape {
    /// The aggregate's letter, then the section's field prefix (none for a hash of its own).
    pub(super) head: smallvec::SmallVec<[u8; 20]>,
    pub(super) buckets: i64,
    pub(super) max_distinct: i64,
    pub(super) ttl_ms: i64,
    pub(super) stride: i64,
}

impl Shape {
    const ARGS: usize = 5;

    fn each_arg(&self, mut push: impl FnMut(&[u8])) {
        push(&self.head);
        for n in [self.buckets, self.max_distinct, self.ttl_ms, self.stride] {
            push(itoa::Buffer::new().format(n).as_bytes());
        }
    }
}

/// Width of a count written before what it counts is known (Lua's tonumber reads leading zeros).
const PLACEHOLDER: usize = 10;

impl ScriptCall {
    pub(super) fn key(&mut self, name: &[u8]) {
        self.keys.extend_from_slice(name);
        self.key_ends.push(self.keys.len());
    }

    /// The shape's number in the call's table (from 1), added if it is new.
    pub(super) fn shape(&mut self, shape: Shape) -> usize {
        match self.shapes.iter().position(|known| *known == shape) {
            Some(at) => at + 1,
            None => {
                self.shapes.push(shape);
                self.shapes.len()
            }
        }
    }

    /// Every argument in order: the shapes' count, the shapes, then the keys' arguments.
    fn each_arg(&self, mut push: impl FnMut(&[u8])) {
        push(itoa::Buffer::new().format(self.shapes.len()).as_bytes());
        for shape in &self.shapes {
            shape.each_arg(&mut push);
        }
        let mut start = 0;
        for &end in &self.arg_ends {
            push(&self.args[start..end]);
            start = end;
        }
    }

    fn arg_count(&self) -> usize {
        1 + Shape::ARGS * self.shapes.len() + self.arg_ends.len()
    }

    pub(super) fn arg(&mut self, bytes: &[u8]) {
        self.args.extend_from_slice(bytes);
        self.arg_ends.push(self.args.len());
    }

    /// A hash field: `prefix` (the window's section of a shared hash, or empty) then `name`.
    pub(super) fn field(&mut self, prefix: &[u8], name: &[u8]) {
        self.args.extend_from_slice(prefix);
        self.arg(name);
    }

    /// A hash field named by a number (a bucket's slot), after `prefix`.
    pub(super) fn field_int(&mut self, prefix: &[u8], n: i64) {
        self.field(prefix, itoa::Buffer::new().format(n).as_bytes());
    }

    pub(super) fn int(&mut self, n: i64) {
        self.arg(itoa::Buffer::new().format(n).as_bytes());
    }

    pub(super) fn uint(&mut self, n: u64) {
        self.arg(itoa::Buffer::new().format(n).as_bytes());
    }

    /// How many of the keys' arguments so far.
    pub(super) fn args(&self) -> usize {
        self.arg_ends.len()
    }

    /// Reserves an argument for a count filled in later by `fill`.
    pub(super) fn placeholder(&mut self) -> usize {
        self.arg(&[b'0'; PLACEHOLDER]);
        self.arg_ends.len() - 1
    }

    pub(super) fn fill(&mut self, placeholder: usize, count: usize) {
        let end = self.arg_ends[placeholder];
        let mut text = itoa::Buffer::new();
        let digits = text.format(count).as_bytes();
        let field = &mut self.args[end - PLACEHOLDER..end];
        field.fill(b'0');
        field[PLACEHOLDER - digits.len()..].copy_from_slice(digits);
    }

    /// Where the arguments end now, to `truncate` back to.
    pub(super) fn mark(&self) -> (usize, usize) {
        (self.args.len(), self.arg_ends.len())
    }

    pub(super) fn truncate(&mut self, (bytes, args): (usize, usize)) {
        self.args.truncate(bytes);
        self.arg_ends.truncate(args);
    }

    /// Appends the call in RESP, as `cmd()` would encode it.
    pub(super) fn pack_into(&self, out: &mut Vec<u8>) {
        let keys = self.key_ends.len();
        let args = self.arg_count();
        out.reserve(
            self.keys.len() + self.args.len() + 16 * (keys + args) + 40 * self.shapes.len() + 80,
        );
        push_array_header(out, 3 + keys + args);
        push_bulk(out, b"EVALSHA");
        push_bulk(out, APPLY_WINDOW.get_hash().as_bytes());
        push_bulk(out, itoa::Buffer::new().format(keys).as_bytes());
        let mut start = 0;
        for &end in &self.key_ends {
            push_bulk(out, &self.keys[start..end]);
            start = end;
        }
        self.each_arg(|arg| push_bulk(out, arg));
    }

    pub(super) fn cmd(&self) -> redis::Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(APPLY_WINDOW.get_hash()).arg(self.key_ends.len());
        let mut start = 0;
        for &end in &self.key_ends {
            cmd.arg(&self.keys[start..end]);
            start = end;
        }
        self.each_arg(|arg| {
            cmd.arg(arg);
        });
        cmd
    }
}

/// RESP: the header of a command of `len` arguments.
pub(super) fn push_array_header(out: &mut Vec<u8>, len: usize) {
    out.push(b'*');
    out.extend_from_slice(itoa::Buffer::new().format(len).as_bytes());
    out.extend_from_slice(b"\r\n");
}

/// RESP: one argument of a command.
pub(super) fn push_bulk(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(b'$');
    out.extend_from_slice(itoa::Buffer::new().format(bytes.len()).as_bytes());
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(bytes);
    out.extend_from_slice(b"\r\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_filled_in_place_and_truncation_drops_arguments() {
        let mut call = ScriptCall::default();
        call.key(b"vg:r:1");
        let count = call.placeholder();
        call.int(-5);
        call.arg(b"0.1");
        let mark = call.mark();
        call.arg(b"dropped");
        call.truncate(mark);
        call.fill(count, 2);
        let args: Vec<Vec<u8>> = call
            .cmd()
            .args_iter()
            .map(|arg| match arg {
                redis::Arg::Simple(bytes) => bytes.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(args[0], b"EVALSHA");
        assert_eq!(args[1], APPLY_WINDOW.get_hash().as_bytes());
        let rest: Vec<&[u8]> = args[2..].iter().map(Vec::as_slice).collect();
        assert_eq!(
            rest,
            [&b"1"[..], b"vg:r:1", b"0", b"0000000002", b"-5", b"0.1"]
        );
    }

    fn shape(head: &[u8], ttl_ms: i64) -> Shape {
        Shape {
            head: head.into(),
            buckets: 6,
            max_distinct: 0,
            ttl_ms,
            stride: 2,
        }
    }

    #[test]
    fn each_shape_is_sent_once_before_the_keys_arguments() {
        let mut call = ScriptCall::default();
        call.key(b"vg:_:1");
        assert_eq!(call.shape(shape(b"ca.", 60_000)), 1);
        call.arg(b"first");
        call.key(b"vg:_:1");
        assert_eq!(call.shape(shape(b"cb.", 60_000)), 2);
        call.key(b"vg:_:2");
        assert_eq!(call.shape(shape(b"ca.", 60_000)), 1);
        assert_eq!(call.shape(shape(b"ca.", 120_000)), 3);
        call.arg(b"last");
        let packed = call.cmd().get_packed_command();
        let text = String::from_utf8_lossy(&packed);
        let args: Vec<&str> = text.split("\r\n").skip(2).step_by(2).collect();
        assert_eq!(
            args[3..],
            [
                "vg:_:1", "vg:_:1", "vg:_:2", "3", "ca.", "6", "0", "60000", "2", "cb.", "6", "0",
                "60000", "2", "ca.", "6", "0", "120000", "2", "first", "last"
            ]
        );
    }

    #[test]
    fn a_packed_call_is_the_command_redis_rs_would_send() {
        let mut call = ScriptCall::default();
        call.key(b"vg:r:1");
        call.key(b"vg:_:2");
        call.shape(shape(b"sa.", 1));
        call.arg(b"");
        call.arg(&[0, 13, 10, 255]);
        call.int(i64::MIN);
        call.arg(&[b'x'; 300]);
        let mut packed = b"prefix".to_vec();
        call.pack_into(&mut packed);
        assert_eq!(packed[..6], *b"prefix");
        assert_eq!(packed[6..], call.cmd().get_packed_command());
    }
}
