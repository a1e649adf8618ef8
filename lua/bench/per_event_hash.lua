-- Baseline for benchmarks only: a per-event hash-bucket counter, one call per event per rule.
-- KEYS[1] the counter; ARGV[1] bucket index, ARGV[2] buckets per window, ARGV[3] TTL (ms).
-- Returns the sum over the live buckets after counting the event.
local bucket, k = tonumber(ARGV[1]), tonumber(ARGV[2])
local fields = redis.call('HGETALL', KEYS[1])
local total, dead = 1, {}
for i = 1, #fields, 2 do
  if tonumber(fields[i]) <= bucket - k then
    dead[#dead + 1] = fields[i]
  else
    total = total + tonumber(fields[i + 1])
  end
end
if #dead > 0 then redis.call('HDEL', KEYS[1], unpack(dead)) end
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return total
