#!lua
-- Who replays an input lane into this Redis now, and how far an earlier replay of it got.
--
-- KEYS[1]  the lane's claim: vg:r:<lane>:claim (a string: the holder's token and description)
-- KEYS[2]  the lane's record: vg:r:<lane> (a hash: "lines" applied by the last replay that
--          finished, "at" when, in epoch ms)
-- ARGV[1]  "claim", "take", "keep", "finish" or "release"
-- ARGV[2]  the caller's claim value (a random token, then a description of the holder)
-- claim:   ARGV[3] the claim's TTL in ms. Returns {"held", value} if another caller holds the
--          lane, else takes it and returns {"ok", lines, at} ("" for each when never finished).
-- take:    ARGV[3] TTL, ARGV[4] the value of a claim whose holder is known dead: takes the lane
--          as "claim" does if that claim still stands (or none does), else {"held", value}.
-- keep:    ARGV[3] TTL in ms: refreshes the caller's claim; 1, or 0 if another caller holds it
--          (it expired and was taken).
-- finish:  ARGV[3] lines applied, ARGV[4] now (ms), ARGV[5] the record's TTL in ms: records
--          them and ends the claim unless another caller holds it; 1, else 0.
-- release: ends the caller's claim (nothing recorded); 1, else 0.
-- A claim that is gone altogether is nobody else's, so keep, finish and release take it as the
-- caller's: a failover to a replica that never got it, or a restart without persistence, loses
-- it while the caller runs (keep sets it again).

local claim, record, op, value = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
if #KEYS ~= 2 or value == nil or value == '' then
  return redis.error_reply('replay_lane: bad arguments')
end
local current = redis.call('GET', claim)
local mine = current == value
if op == 'claim' or op == 'take' then
  local ttl = tonumber(ARGV[3])
  if ttl == nil or ttl < 1 then return redis.error_reply('replay_lane: bad ttl') end
  if op == 'take' and current == ARGV[4] then
    redis.call('SET', claim, value, 'PX', ttl)
  elseif not redis.call('SET', claim, value, 'NX', 'PX', ttl) and not mine then
    return {'held', redis.call('GET', claim) or ''}
  end
  redis.call('PEXPIRE', claim, ttl)
  return {'ok', redis.call('HGET', record, 'lines') or '', redis.call('HGET', record, 'at') or ''}
end
if current and not mine then return 0 end
if op == 'keep' then
  local ttl = tonumber(ARGV[3])
  if ttl == nil or ttl < 1 then return redis.error_reply('replay_lane: bad ttl') end
  redis.call('SET', claim, value, 'PX', ttl)
  return 1
end
if op == 'finish' then
  local lines, now, ttl = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
  if lines == nil or now == nil or ttl == nil or ttl < 1 then
    return redis.error_reply('replay_lane: bad arguments')
  end
  redis.call('HSET', record, 'lines', ARGV[3], 'at', ARGV[4])
  redis.call('PEXPIRE', record, ttl)
  redis.call('DEL', claim)
  return 1
end
if op == 'release' then
  redis.call('DEL', claim)
  return 1
end
return redis.error_reply('replay_lane: unknown operation')
