#!/usr/bin/env python3
"""compare.py EXPECTED.jsonl ACTUAL.jsonl -- compare vigil decision records.

Records are matched by `event_id`. Records without a non-empty `hits` array (e.g. emit_allow
records) and lines that are not JSON objects are ignored on both sides.

Compared, per decision: `action`; per hit, both sides sorted by `rule_id`:
  rule_id, mode, action;
  reason      -- when the expected hit has one;
  value       -- when the expected hit has one (v1-form hits): exact decimal equality of the
                 JSON numbers (2711.64 == 2711.640, no tolerance); null == null;
  counters    -- when the expected hit has them: a set of (id, value) pairs, values exact;
  held_until  -- must equal the expected one; where the expected hit has none, the actual one
                 must be absent or null.
  entity, score, rollout -- when the expected hit has them (rules v3); the record's score likewise.
Ignored: decision_id, rules_version, source, ts, key, limit, window_ms, and any other field.

Prints at most 10 mismatches and a last line `N/M decisions match` (M counts every event_id
that has a decision on either side). Exit 0 when all match, 1 on any mismatch, missing or
unexpected decision, 2 on bad usage. Python 3 standard library only.
"""
import json
import sys
from decimal import Decimal

ABSENT = object()
MAX_REPORTS = 10


def parse(raw):
    return json.loads(raw, parse_float=Decimal, parse_int=Decimal)


def norm(v):
    """JSON value with numbers as normalised Decimals (so 2711.64 and 2711.640 are equal)."""
    if isinstance(v, Decimal):
        return Decimal(0) if v == 0 else v.normalize()
    if isinstance(v, list):
        return [norm(x) for x in v]
    if isinstance(v, dict):
        return {k: norm(x) for k, x in v.items()}
    return v


def same(a, b):
    """Exact equality of JSON values; a number never equals a string or a bool."""
    a, b = norm(a), norm(b)
    if isinstance(a, Decimal) or isinstance(b, Decimal):
        return isinstance(a, Decimal) and isinstance(b, Decimal) and a == b
    return type(a) is type(b) and a == b


def show(v):
    if v is ABSENT:
        return "(absent)"
    if isinstance(v, Decimal):
        return format(norm(v), "f") if v.is_finite() else str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(show(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {show(x)}" for k, x in v.items()) + "}"
    return json.dumps(v)


def event_key(eid):
    """A hashable, type-strict key for an event_id (the string "1" and the number 1 differ)."""
    if isinstance(eid, str):
        return ("string", eid)
    return ("number" if isinstance(eid, Decimal) else "other", show(eid))


def key_text(k):
    return k[1] if k[0] == "string" else f"{k[1]} ({k[0]})"


def load(path):
    """-> {event key: record}; a repeated event_id gets '#2', '#3'... in file order."""
    out, seen = {}, {}
    with open(path, "rb") as fh:
        for raw in fh:
            try:
                rec = parse(raw)
            except (ValueError, UnicodeDecodeError, RecursionError):
                continue
            if not isinstance(rec, dict):
                continue
            hits = rec.get("hits")
            if not isinstance(hits, list) or not hits:
                continue
            k = event_key(rec.get("event_id"))
            n = seen[k] = seen.get(k, 0) + 1
            if n > 1:
                k = (k[0], f"{k[1]}#{n}")
            out[k] = rec
    return out


def counter_set(hit):
    cs = hit.get("counters", ABSENT)
    if not isinstance(cs, list) or not all(isinstance(c, dict) for c in cs):
        return None
    return sorted((show(c.get("id", ABSENT)), show(c.get("value", ABSENT))) for c in cs)


def show_counters(pairs):
    if pairs is None:
        return "(not a list of objects)"
    return "{" + ", ".join(f"{cid.strip(chr(34))}={v}" for cid, v in pairs) + "}"


def hit_problems(exp, act):
    probs = []
    for f in ("rule_id", "mode", "action"):
        if not same(exp.get(f), act.get(f, ABSENT)):
            probs.append(f"{f} is {show(act.get(f, ABSENT))}, expected {show(exp.get(f))}")
    if "reason" in exp and not same(exp["reason"], act.get("reason", ABSENT)):
        probs.append(f"reason is {show(act.get('reason', ABSENT))}, expected {show(exp['reason'])}")
    if "value" in exp and not same(exp["value"], act.get("value", ABSENT)):
        probs.append(f"value is {show(act.get('value', ABSENT))}, expected {show(exp['value'])}")
    if "counters" in exp:
        ce, ca = counter_set(exp), counter_set(act)
        if ce != ca:
            probs.append(f"counters are {show_counters(ca)}, expected {show_counters(ce)}")
    for f in ("entity", "score", "rollout"):
        if f in exp and not same(exp[f], act.get(f, ABSENT)):
            probs.append(f"{f} is {show(act.get(f, ABSENT))}, expected {show(exp[f])}")
    if "held_until" in exp:
        if not same(exp["held_until"], act.get("held_until", ABSENT)):
            probs.append(f"held_until is {show(act.get('held_until', ABSENT))}, "
                         f"expected {show(exp['held_until'])}")
    elif act.get("held_until") is not None:
        probs.append(f"held_until is {show(act['held_until'])}, expected none")
    return probs


def by_rule(hits):
    return sorted((h for h in hits if isinstance(h, dict)), key=lambda h: show(h.get("rule_id")))


def decision_problems(exp, act):
    probs = []
    if not same(exp.get("action"), act.get("action", ABSENT)):
        probs.append(f"action is {show(act.get('action', ABSENT))}, expected {show(exp.get('action'))}")
    if "score" in exp and not same(exp["score"], act.get("score", ABSENT)):
        probs.append(f"score is {show(act.get('score', ABSENT))}, expected {show(exp['score'])}")
    eh, ah = by_rule(exp["hits"]), by_rule(act["hits"])
    if len(ah) != len(act["hits"]):
        probs.append("a hit is not a JSON object")
    eids = [show(h.get("rule_id")) for h in eh]
    aids = [show(h.get("rule_id")) for h in ah]
    if len(set(aids)) != len(aids):
        probs.append(f"duplicate hits: {', '.join(aids)}")
    missing = [r for r in eids if r not in aids]
    extra = [r for r in aids if r not in eids]
    if missing:
        probs.append(f"missing hits {', '.join(missing)}")
    if extra:
        probs.append(f"unexpected hits {', '.join(extra)}")
    amap = {show(h.get("rule_id")): h for h in ah}
    for h in eh:
        a = amap.get(show(h.get("rule_id")))
        if a is not None:
            probs.extend(f"{h.get('rule_id')}: {p}" for p in hit_problems(h, a))
    return probs


def brief(rec):
    return f"{rec.get('action')} by " + ", ".join(
        str(h.get("rule_id")) for h in rec["hits"] if isinstance(h, dict))


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        exp = load(argv[0])
    except OSError as e:
        print(f"cannot read expected file: {e}")
        return 2
    try:
        act = load(argv[1])
    except OSError as e:
        print(f"cannot read actual file: {e}")
        print(f"0/{len(exp)} decisions match")
        return 1
    keys = list(exp) + [k for k in act if k not in exp]
    reports, good = [], 0
    for k in keys:
        e, a = exp.get(k), act.get(k)
        if a is None:
            reports.append(f"event {key_text(k)}: missing decision (expected {brief(e)})")
        elif e is None:
            reports.append(f"event {key_text(k)}: unexpected decision ({brief(a)})")
        else:
            probs = decision_problems(e, a)
            if probs:
                reports.append(f"event {key_text(k)}: " + "; ".join(probs))
            else:
                good += 1
    for r in reports[:MAX_REPORTS]:
        print(r)
    if len(reports) > MAX_REPORTS:
        print(f"... and {len(reports) - MAX_REPORTS} more")
    print(f"{good}/{len(keys)} decisions match")
    return 0 if good == len(keys) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
