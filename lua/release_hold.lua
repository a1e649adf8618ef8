#!lua
-- Ends a rule's hold on one hold key (support released it). The key keeps a marker
-- `r<held_until>` for the rest of its TTL instead of vanishing: a raise made before the release
-- (by an event judged while the hold stood, still on its way from a worker) for no later a time
-- is then refused by `hold.lua` rather than setting the released hold again.
--
-- KEYS[1]  the hold: vg:h:<rule id>:<digest of the hold key>
-- ARGV[1]  held_until as the releasing process knows it (its own raises not yet written), a
--          decimal integer, or "" when it knows none
-- Returns  the held_until released (the later of Redis' and ARGV[1]), or nil when the key was
--          not held.

local key, known = KEYS[1], ARGV[1]
if #KEYS ~= 1 or (known ~= '' and not string.match(known, '^%d+$')) then
  return redis.error_reply('release_hold: bad arguments')
end
local current = redis.call('GET', key)
local held = current and tonumber(current)
local released = held
if known ~= '' and (released == nil or tonumber(known) > released) then
  released = tonumber(known)
end
if released == nil then
  return false
end
local text = (held ~= nil and held == released) and current or known
local ttl = redis.call('PTTL', key)
if ttl < 1 then
  -- Not in Redis yet (the releasing process's raise was not written): keep the marker a day.
  ttl = 86400000
end
redis.call('SET', key, 'r' .. text, 'PX', ttl)
return text
