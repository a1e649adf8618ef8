"""Replays recorded script calls (capture.sh) against variants of a Lua script.

  lab.py extract MONITOR_OUT SCRIPT CALLS   the recorded calls of SCRIPT (by its SHA1) into CALLS
  lab.py subset CALLS FIRST COUNT OUT       COUNT calls from the FIRST-th
  lab.py run CALLS PORT VARIANT...          each variant on a flushed Redis, alternating
                                            (ROUNDS, default 3): EVALSHA time per variant

Each variant replays the same calls in order on an empty Redis, so keys reach the same versions
and the script takes the same paths. Needs redis-py.
"""
import hashlib, os, pickle, sys

import redis


def parse_repr(s):
    """The quoted arguments of a MONITOR line (Redis' sdscatrepr escapes)."""
    out, i, n = [], 0, len(s)
    while i < n:
        if s[i] != '"':
            i += 1
            continue
        i += 1
        b = bytearray()
        while s[i] != '"':
            c = s[i]
            if c == '\\':
                d = s[i + 1]
                if d == 'x':
                    b.append(int(s[i + 2:i + 4], 16))
                    i += 4
                    continue
                b.append({'n': 10, 'r': 13, 't': 9, 'a': 7, 'b': 8, '\\': 92, '"': 34}[d])
                i += 2
                continue
            b.append(ord(c))
            i += 1
        out.append(bytes(b))
        i += 1
    return out


def extract(monitor, script, out):
    sha = hashlib.sha1(open(script, 'rb').read()).hexdigest().encode()
    calls = []
    for line in open(monitor, encoding='latin-1'):
        if '[0 lua]' in line or '"EVALSHA"' not in line:
            continue
        args = parse_repr(line[line.index('"'):].rstrip('\n'))[1:]
        if args[0] == sha:
            calls.append(args[1:])  # numkeys, keys…, argv…
    pickle.dump(calls, open(out, 'wb'))
    print(f"{len(calls)} calls, {sum(int(c[0]) for c in calls)} keys")


def run(calls_file, port, variants):
    calls = pickle.load(open(calls_file, 'rb'))
    r = redis.Redis(port=int(port))
    seconds = {v: [] for v in variants}
    for _ in range(int(os.environ.get('ROUNDS', '3'))):
        for variant in variants:
            r.flushall()
            r.script_flush()
            sha = r.script_load(open(variant, 'rb').read())
            r.config_resetstat()
            errors = 0
            for start in range(0, len(calls), 8):
                p = r.pipeline(transaction=False)
                for call in calls[start:start + 8]:
                    p.execute_command('EVALSHA', sha, *call)
                errors += sum(isinstance(x, Exception) for x in p.execute(raise_on_error=False))
            usec = r.info('commandstats')['cmdstat_evalsha']['usec']
            seconds[variant].append(usec / 1e6)
            if errors:
                print(f"{variant}: {errors} calls failed")
    keys = sum(int(c[0]) for c in calls)
    for variant, s in seconds.items():
        s.sort()
        print(f"{os.path.basename(variant):28s} EVALSHA min {s[0]:.3f} s, median {s[len(s) // 2]:.3f} s"
              f" ({s[len(s) // 2] / keys * 1e6:.2f} us per key)")


if __name__ == '__main__':
    command, args = sys.argv[1], sys.argv[2:]
    if command == 'extract':
        extract(*args)
    elif command == 'subset':
        calls = pickle.load(open(args[0], 'rb'))
        first, count = int(args[1]), int(args[2])
        pickle.dump(calls[first:first + count], open(args[3], 'wb'))
    elif command == 'run':
        run(args[0], args[1], args[2:])
    else:
        sys.exit(__doc__)
