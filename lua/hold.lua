#!lua
-- Raises a rule's hold on one hold key (a penalty box): held_until = max(held_until, ARGV[1]).
--
-- KEYS[1]  the hold: vg:h:<rule id>:<digest of the hold key>, a string holding held_until
-- ARGV[1]  the wanted held_until: epoch milliseconds of event time, a decimal integer
-- ARGV[2]  TTL in milliseconds (at least the hold's length), set whenever the hold is raised
-- Returns  held_until as it stands after the call, as a decimal string; or `r<time>` when the
--          hold was released (`release_hold.lua`) and the wanted time is not later than it was.
--
-- Times are integers below 2^53, which Lua's doubles hold exactly; they are compared as numbers
-- and stored as the caller's own text, never as a number Lua printed.

local MAX_TTL = 315360000000
local MAX_TIME = 9007199254740991
local key, wanted, ttl = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
if #KEYS ~= 1 or wanted == nil or wanted ~= math.floor(wanted) or wanted < 0 or wanted > MAX_TIME
    or not string.match(ARGV[1], '^%d+$') or ttl == nil or ttl < 1 or ttl > MAX_TTL then
  return redis.error_reply('hold: bad arguments')
end
local current = redis.call('GET', key)
if current then
  local held = tonumber(current)
  if held ~= nil and held >= wanted then
    return current
  end
  if held == nil and string.sub(current, 1, 1) == 'r' then
    local released = tonumber(string.sub(current, 2))
    if released ~= nil and released >= wanted then
      return current
    end
  end
end
redis.call('SET', key, ARGV[1], 'PX', ttl)
return ARGV[1]
