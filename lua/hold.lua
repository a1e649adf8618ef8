#!lua
-- Raises a rule's hold on one hold key (a penalty box): held_until = max(held_until, ARGV[1]).
--
-- KEYS[1]  the hold: vg:h:<rule id>:<digest of the hold key>, a string holding
--          `<held_until>` (never released), `<held_until>:<generation>` (set again after
--          `generation` releases) or `r<generation>` (released: not held)
-- ARGV[1]  the wanted held_until: epoch milliseconds of event time, a decimal integer
-- ARGV[2]  TTL in milliseconds (at least the hold's length), set whenever the hold is raised
-- ARGV[3]  the generation the raiser read the hold at (absent: 0). A raise made before a release
--          it had not seen (an older generation) is refused: the release stands.
-- Returns  the hold's value as it stands after the call.
--
-- Times are integers below 2^53, which Lua's doubles hold exactly; they are compared as numbers
-- and stored as the caller's own text, never as a number Lua printed.

local MAX_TTL = 315360000000
local MAX_TIME = 9007199254740991
local key, wanted, ttl = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
local known = ARGV[3] or '0'
if #KEYS ~= 1 or wanted == nil or wanted ~= math.floor(wanted) or wanted < 0 or wanted > MAX_TIME
    or not string.match(ARGV[1], '^%d+$') or ttl == nil or ttl < 1 or ttl > MAX_TTL
    or not string.match(known, '^%d+$') then
  return redis.error_reply('hold: bad arguments')
end
-- GET answers false (not nil) for a missing key. (The value formats are read the same way in
-- hold.lua and release_hold.lua: a script cannot include another.)
local current = redis.call('GET', key)
local held, generation = nil, 0
if current then
  local released = string.match(current, '^r(%d+)$')
  if released then
    generation = tonumber(released)
  else
    local until_text, generation_text = string.match(current, '^(%d+):(%d+)$')
    if until_text then
      held, generation = tonumber(until_text), tonumber(generation_text)
    else
      held = tonumber(current)
    end
  end
end
if tonumber(known) < generation then
  return current
end
if held ~= nil and held >= wanted then
  return current
end
local value = ARGV[1]
if generation > 0 then
  value = ARGV[1] .. ':' .. generation
end
redis.call('SET', key, value, 'PX', ttl)
return value
