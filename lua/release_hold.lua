#!lua
-- Ends a rule's hold on one hold key (support released it). The key keeps a marker
-- `r<generation>` for the rest of its TTL (a day if it had none) instead of vanishing: a raise
-- made before the release — by an event judged while the hold stood, still on its way from a
-- worker — carries the older generation it read, and `hold.lua` refuses it rather than setting
-- the released hold again. A firing judged after the release reads the new generation and holds
-- the key anew.
--
-- KEYS[1]  the hold: vg:h:<rule id>:<digest of the hold key> (formats: see `hold.lua`)
-- ARGV[1]  held_until as the releasing process knows it (its own raises not yet written), a
--          decimal integer, or "" when it knows none
-- Returns  {held_until released (the later of Redis' and ARGV[1]) or "" when not held, the new
--          generation}

local key, known = KEYS[1], ARGV[1]
if #KEYS ~= 1 or (known ~= '' and not string.match(known, '^%d+$')) then
  return redis.error_reply('release_hold: bad arguments')
end
-- GET answers false (not nil) for a missing key. (The value formats are read the same way in
-- hold.lua and release_hold.lua: a script cannot include another.)
local current = redis.call('GET', key)
local held, held_text, generation = nil, nil, 0
if current then
  local released = string.match(current, '^r(%d+)$')
  if released then
    generation = tonumber(released)
  else
    local until_text, generation_text = string.match(current, '^(%d+):(%d+)$')
    if until_text then
      held_text, generation = until_text, tonumber(generation_text)
    elseif string.match(current, '^%d+$') then
      held_text = current
    end
    held = held_text and tonumber(held_text)
  end
end
local released_text = held_text
if known ~= '' and (held == nil or tonumber(known) > held) then
  released_text = known
end
local ttl = redis.call('PTTL', key)
if ttl < 1 then
  ttl = 86400000
end
generation = generation + 1
redis.call('SET', key, 'r' .. generation, 'PX', ttl)
return {released_text or '', tostring(generation)}
