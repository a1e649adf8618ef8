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

-- The shortest of %.15g, %.16g, %.17g that reads back as exactly x.
local function exact(x)
  for digits = 15, 17 do
    local text = string.format('%.' .. digits .. 'g', x)
    if tonumber(text) == x then return text end
  end
  return string.format('%.17g', x)
end

-- The bucket a hash field stands for: "b<bucket>" → bucket, "d<digest>" → its latest bucket.
local function bucket_of(field, value)
  local tag = string.sub(field, 1, 1)
  if tag == 'b' then return tonumber(string.sub(field, 2)) end
  if tag == 'd' then return tonumber(value) end
  return nil
end

local function apply(key, kind, k, ttl, stride, first, last)
  -- One read of the whole hash; everything else is computed here and written back at once.
  local flat = redis.call('HGETALL', key)
  local fields = {}
  for j = 1, #flat, 2 do fields[flat[j]] = flat[j + 1] end
  local head = tonumber(fields['h'])
  local late, skipped = 0, 0
  local recorded, newest = {}, {}
  local written = {}

  for i = first, last, stride do
    local bucket = tonumber(ARGV[i])
    local fresh = true
    if stride == 4 then
      local partition, offset = ARGV[i + 2], tonumber(ARGV[i + 3])
      if recorded[partition] == nil then
        recorded[partition] = tonumber(fields['o' .. partition]) or -1
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
        local value = ARGV[i + 1]
        if kind == 'd' then
          local field = 'd' .. value
          local latest = tonumber(fields[field])
          if latest == nil or bucket > latest then
            fields[field] = ARGV[i]
            written[field] = true
          end
        else
          local field = 'b' .. ARGV[i]
          local current = tonumber(fields[field])
          local total = tonumber(value)
          if current ~= nil then total = current + total end
          -- Sums keep every bit: the caller reads back exactly what was added, in order.
          fields[field] = (kind == 'c') and string.format('%.0f', total) or exact(total)
          written[field] = true
        end
      end
    end
  end

  if head == nil then
    return {}
  end

  local head_text = string.format('%.0f', head)
  local oldest_live = head - k + 1
  local out = {head_text, tostring(late), tostring(skipped)}
  local sets, dead = {}, {}
  if next(written) ~= nil and fields['h'] ~= head_text then
    sets[#sets + 1] = 'h'
    sets[#sets + 1] = head_text
  end
  for partition, offset in pairs(newest) do
    sets[#sets + 1] = 'o' .. partition
    sets[#sets + 1] = string.format('%.0f', offset)
  end
  for field, value in pairs(fields) do
    local bucket = bucket_of(field, value)
    if bucket ~= nil then
      if bucket < oldest_live then
        -- Only what Redis holds needs deleting; a field written and outdated in this same call
        -- is simply not written.
        if not written[field] then dead[#dead + 1] = field end
      else
        out[#out + 1] = field
        out[#out + 1] = value
        if written[field] then
          sets[#sets + 1] = field
          sets[#sets + 1] = value
        end
      end
    end
  end
  -- Writes and deletes in chunks: unpack() of a very long list would overflow Lua's C stack.
  for j = 1, #sets, 1000 do
    redis.call('HSET', key, unpack(sets, j, math.min(j + 999, #sets)))
  end
  for j = 1, #dead, 1000 do
    redis.call('HDEL', key, unpack(dead, j, math.min(j + 999, #dead)))
  end
  if #sets > 0 or #dead > 0 then
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
