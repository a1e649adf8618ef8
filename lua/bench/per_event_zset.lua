-- Baseline for benchmarks only: the classic per-event sliding-window counter, one call per event
-- per rule, one ZSET member per event.
-- KEYS[1] the counter; ARGV[1] event time (ms), ARGV[2] window (ms), ARGV[3] a unique member.
-- Returns the number of events in (now - window, now].
local now, window = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
redis.call('ZADD', KEYS[1], now, ARGV[3])
local n = redis.call('ZCARD', KEYS[1])
redis.call('PEXPIRE', KEYS[1], window)
return n
