-- Applies pending deltas to sliding windows and returns the windows (DESIGN §3, §5). One call
-- serves many keys, each applied, pruned and read back atomically on its own.
--
-- KEYS[n]  the n-th key's hash: vg:<rule_id>:<digest>
-- ARGV     for each key in order, a header of five values followed by its deltas:
--            aggregate: "c" (count), "s" (sum) or "d" (distinct)
--            k, the number of buckets in the window
--            TTL in milliseconds (at least 2 x window), refreshed on every write
--            stride: 2 for (bucket, value) deltas, 4 for (bucket, value, partition, offset)
--            how many ARGV entries of deltas follow (a multiple of the stride; 0 to just read)
--          deltas in the order they were counted: count → value is an integer increment;
--          sum → a number, added in order; distinct → the value's digest (16 raw bytes)
--
-- Hash fields: "h" head bucket; "b<bucket>" count or sum of a bucket; "d<digest>" a distinct
-- value's latest bucket; "o<partition>" the highest offset applied from that partition. A delta
-- whose offset is at or below its partition's recorded one was applied before (replay after a
-- crash) and is skipped; a delta whose bucket is at or below head - k is late and refused.
--
-- Returns one reply per key: {head, late, skipped, field, value, …} with the live "b"/"d"
-- fields, or {} for a key that holds nothing. Numbers are strings: Lua numbers would be
-- truncated to integers.

local function apply(key, kind, k, ttl, stride, first, last)
  local head = tonumber(redis.call('HGET', key, 'h'))
  local late, skipped = 0, 0
  local recorded, newest = {}, {}
  local changed = false

  for i = first, last, stride do
    local bucket = tonumber(ARGV[i])
    local fresh = true
    if stride == 4 then
      local partition, offset = ARGV[i + 2], tonumber(ARGV[i + 3])
      if recorded[partition] == nil then
        recorded[partition] = tonumber(redis.call('HGET', key, 'o' .. partition)) or -1
      end
      if offset <= recorded[partition] then
        fresh = false
        skipped = skipped + 1
      elseif newest[partition] == nil or offset > newest[partition] then
        newest[partition] = offset
      end
    end
    if fresh then
      if head ~= nil and bucket <= head - k then
        late = late + 1
      else
        if head == nil or bucket > head then head = bucket end
        changed = true
        local value = ARGV[i + 1]
        if kind == 'c' then
          redis.call('HINCRBY', key, 'b' .. ARGV[i], value)
        elseif kind == 's' then
          local field = 'b' .. ARGV[i]
          local current = tonumber(redis.call('HGET', key, field))
          local total = tonumber(value)
          if current ~= nil then total = current + total end
          -- %.17g round-trips every double, so the caller reads back exactly what was summed.
          redis.call('HSET', key, field, string.format('%.17g', total))
        else
          local field = 'd' .. value
          local latest = tonumber(redis.call('HGET', key, field))
          if latest == nil or bucket > latest then
            redis.call('HSET', key, field, ARGV[i])
          end
        end
      end
    end
  end

  if head == nil then
    return {}
  end

  local head_text = string.format('%.0f', head)
  if changed then
    redis.call('HSET', key, 'h', head_text)
  end
  for partition, offset in pairs(newest) do
    redis.call('HSET', key, 'o' .. partition, string.format('%.0f', offset))
  end

  -- Prune what slid out and collect the live window in the same pass.
  local oldest_live = head - k + 1
  local out = {head_text, tostring(late), tostring(skipped)}
  local dead = {}
  local fields = redis.call('HGETALL', key)
  for j = 1, #fields, 2 do
    local field, value = fields[j], fields[j + 1]
    local tag = string.sub(field, 1, 1)
    local bucket = nil
    if tag == 'b' then
      bucket = tonumber(string.sub(field, 2))
    elseif tag == 'd' then
      bucket = tonumber(value)
    end
    if bucket ~= nil then
      if bucket < oldest_live then
        dead[#dead + 1] = field
      else
        out[#out + 1] = field
        out[#out + 1] = value
      end
    end
  end
  -- HDEL in chunks: unpack() of a very long list would overflow Lua's C stack.
  for j = 1, #dead, 1000 do
    redis.call('HDEL', key, unpack(dead, j, math.min(j + 999, #dead)))
  end
  if changed or #dead > 0 or next(newest) ~= nil then
    redis.call('PEXPIRE', key, ttl)
  end
  return out
end

local replies = {}
local at = 1
for n = 1, #KEYS do
  local count = tonumber(ARGV[at + 4])
  replies[n] = apply(KEYS[n], ARGV[at], tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]),
                     tonumber(ARGV[at + 3]), at + 5, at + 4 + count)
  at = at + 5 + count
end
return replies
