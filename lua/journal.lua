#!lua
-- The decision journal of one input lane (a Kafka partition), with owner fencing.
--
-- KEYS[1]  the lane's journal hash: vg:j:<digest>
-- ARGV[1]  "claim" or "write"
-- ARGV[2]  the caller's owner token (random per partition assignment)
-- ARGV[3]  TTL in milliseconds, refreshed by every call
-- claim:   makes the caller the owner and returns the whole hash (field, value, …): from now
--          on, writes by an earlier owner are refused.
-- write:   ARGV[4] how many field/value entries follow, then those entries, then the fields to
--          delete. Made only if the caller is still the owner: returns "ok", or "fenced" (nothing
--          written: another worker took the lane over).
--
-- Fields: "owner" the token; "n" the highest offset whose outcome is recorded; "w<offset>" the
-- lane's newest event time after that offset (a batch end); "<offset>" the record that event
-- produced (none: it produced no record).

local MAX_TTL = 315360000000
local key, op, token, ttl = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
if #KEYS ~= 1 or token == nil or token == '' or ttl == nil or ttl < 1 or ttl > MAX_TTL then
  return redis.error_reply('journal: bad arguments')
end
if op == 'claim' then
  redis.call('HSET', key, 'owner', token)
  redis.call('PEXPIRE', key, ttl)
  return redis.call('HGETALL', key)
end
if op ~= 'write' then return redis.error_reply('journal: unknown operation') end
local sets = tonumber(ARGV[4])
if sets == nil or sets < 0 or sets % 2 ~= 0 or 4 + sets > #ARGV then
  return redis.error_reply('journal: bad entry count')
end
if redis.call('HGET', key, 'owner') ~= token then return 'fenced' end
for j = 5, 4 + sets, 1000 do
  redis.call('HSET', key, unpack(ARGV, j, math.min(j + 999, 4 + sets)))
end
for j = 5 + sets, #ARGV, 1000 do
  redis.call('HDEL', key, unpack(ARGV, j, math.min(j + 999, #ARGV)))
end
redis.call('PEXPIRE', key, ttl)
return 'ok'
