#!lua
-- The decision journal of one input lane (a Kafka partition), with owner fencing.
--
-- KEYS[1]  the lane's journal hash: vg:j:<digest>
-- ARGV[1]  "claim" or "write"
-- ARGV[2]  claim: a random token (per partition assignment); write: the owner value the claim
--          set ("<generation> <token>", in the hash it returned)
-- ARGV[3]  TTL in milliseconds, refreshed by every call
-- claim:   makes the caller the owner and returns the whole hash (field, value, …): from now
--          on, writes by an earlier owner are refused. The claim's generation is above every
--          earlier claim's: the last one's plus one, and at least Redis' clock in ms, so a claim
--          made after the hash was lost still ranks above the claims made before.
-- write:   ARGV[4] how many field/value entries follow, then those entries, then the fields to
--          delete. Made only if the caller is still the owner: returns "ok", or "fenced" (nothing
--          written: another worker took the lane over). A claim lost with the hash or its
--          owner field (a failover to a replica that never got it, a restart without
--          persistence) is still the caller's unless a later claim stands: the write sets it
--          again.
--
-- Fields: "owner" the owner value; "n" the highest offset whose outcome is recorded;
-- "w<offset>" the lane's newest event time after that offset (a batch end); "<offset>" the
-- record that event produced (none: it produced no record).

local MAX_TTL = 315360000000
local key, op, token, ttl = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
if #KEYS ~= 1 or token == nil or token == '' or ttl == nil or ttl < 1 or ttl > MAX_TTL then
  return redis.error_reply('journal: bad arguments')
end
local function generation(owner)
  return owner and tonumber(string.match(owner, '^(%d+) '))
end
if op == 'claim' then
  local now = redis.call('TIME')
  local ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  local last = generation(redis.call('HGET', key, 'owner')) or 0
  redis.call('HSET', key, 'owner', string.format('%.0f', math.max(last + 1, ms)) .. ' ' .. token)
  redis.call('PEXPIRE', key, ttl)
  return redis.call('HGETALL', key)
end
if op ~= 'write' then return redis.error_reply('journal: unknown operation') end
local sets = tonumber(ARGV[4])
if sets == nil or sets < 0 or sets % 2 ~= 0 or 4 + sets > #ARGV then
  return redis.error_reply('journal: bad entry count')
end
local owner = redis.call('HGET', key, 'owner')
if owner ~= token then
  local mine, theirs = generation(token), generation(owner)
  if mine == nil or (owner and (theirs == nil or theirs >= mine)) then return 'fenced' end
  redis.call('HSET', key, 'owner', token)
end
for j = 5, 4 + sets, 1000 do
  redis.call('HSET', key, unpack(ARGV, j, math.min(j + 999, 4 + sets)))
end
for j = 5 + sets, #ARGV, 1000 do
  redis.call('HDEL', key, unpack(ARGV, j, math.min(j + 999, #ARGV)))
end
redis.call('PEXPIRE', key, ttl)
return 'ok'
