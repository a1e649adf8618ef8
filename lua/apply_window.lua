#!lua
-- Applies pending deltas to sliding windows and returns the windows (the window semantics are in
-- the README). One call serves many keys, each applied, pruned and read back atomically on its own.
--
-- The shebang (Redis 7+) makes Redis refuse the whole call before it runs when it is out of
-- memory, and every argument is checked before the first write: a call either fails before it
-- changes anything, or it runs to the end. (Redis does not undo a script's writes when it fails
-- half way, and a caller that retries such a failure would apply the first half twice.)
--
-- KEYS[n]  the n-th window's hash: vg:<counter>:<digest>, or vg:_:<digest> shared by the counters
--          over the same dimensions (each window a section of it; a key may then come several
--          times, once per section)
-- ARGV     first the call's shapes: their number, then five values for each (the counters of a
--          call are few, its keys many, so what is the same for every key of a counter is sent,
--          and checked, once per call):
--            aggregate: "c" (count), "s" (sum), "d" (distinct), "x" (max), "n" (min) or "l" (last),
--            followed by the section's field prefix in a shared hash (at most 16 bytes, ending
--            in its only "."; none when the hash is the window's own): every field named below
--            is then that prefix followed by the name, and the script reads and deletes no other
--            field but those of sections past their expiry ("e", below)
--            k, the number of buckets in the window
--            the most distinct values the window records (distinct: 1..=1000000; "0" otherwise):
--            a new value that would exceed it, once the window has slid, is not recorded, so no
--            key's hash grows past it whatever the input
--            TTL in milliseconds, set by every write but the caller's writes below, which say when
--            stride: 2 for (bucket, value) deltas, 4 for (bucket, value, partition, offset);
--            "partition" is any short name of an ordered input (vigil: the Kafka partition, or a
--            replayed input)
--          then for each key in order, a header of four values followed by its deltas and writes:
--            the key's shape (1 for the first above)
--            the version the caller's view is based on ("0": the key held nothing), or "" if
--            it has none, or "<" to have the window as it was before these deltas back (the
--            caller counts a batch ahead on it; no writes then)
--            how many ARGV entries of deltas follow (a multiple of the stride; 0 to just read)
--            how many ARGV entries of writes follow the deltas (0: none)
--          deltas in the order they were counted: count → value is an integer increment;
--          sum → an integer of micro-units (up to 19 digits), added in order and saturating at
--          the 64-bit limits; max / min → an integer of micro-units, the bucket keeping the
--          larger / smaller; distinct → the value's digest (16 raw bytes); last → the event's
--          "<time>:<tag><text>" (tag s, n or b), kept when its time is at least the kept one's
--          (or that one slid out), so of equal times the later delta wins
--          writes: "1" to refresh the TTL or "0" (the caller refreshed it less than a window
--          ago, so it is still above its floor); how many field/value entries follow the next
--          two values; the next version "v" (one more than the caller's, or a random one below
--          2^52 for a new key) and the head "h"; the entries: the buckets or values by slot, and
--          "o:<partition>" with the highest offset the writes cover; then the fields to delete.
--          The caller computes them from its view with its deltas applied. They are used only
--          if the key is still at the caller's version (that view is then exactly what Redis
--          holds plus the deltas), which costs two or three hash operations instead of decoding
--          the whole hash. Otherwise the deltas are merged field by field; a caller that sent
--          writes without deltas is answered {"!"} and sends its deltas next time.
--
-- Hash fields (compact, so small windows stay in Redis' listpack encoding): "h" the head bucket;
-- "<slot>" (digits only) the count, sum, max or min of the live bucket whose index mod k is slot;
-- "d<digest>" a distinct value's latest bucket, also as its slot; "l" a last window's event with
-- the greatest time, as "<bucket>:<time>:<tag><text>"; "o:<partition>" the highest
-- offset applied from that partition. In a shared hash, every write sets the key's TTL to its
-- own only if that is longer than the TTL the key has (another section may need a longer one),
-- and "e" is when the section would have expired on its own (server time in ms): a section past
-- it is deleted by the next write of any section that reads the hash (a merge, or a write that
-- refreshes the TTL of a section written before), as its own hash would have expired. Live
-- buckets are head-k+1 ..= head, so a slot names exactly one of them. A delta whose offset is at or below its partition's recorded one was applied
-- before (replay after a crash, or a flush sent again after its reply was lost) and is skipped;
-- a delta whose bucket is at or below head - k is late and refused.
--
-- "v" is the key's version: it starts at a value no earlier incarnation of the key is likely to
-- have reached (the server's clock in microseconds, or the writer's random pick) when the key is
-- created and grows by one per write, so a key that expired and was created again never comes
-- back to a version a caller saw before. When it still equals the caller's version, nobody else
-- wrote since the caller's view, which with its own deltas is then exact: the window is not sent
-- back. When the caller knew the key at a version and the key no longer exists, its data was
-- lost (a restart without persistence, FLUSHALL, a failover to a stale replica) or it expired:
-- nothing is written and {"?"} comes back, and the caller writes its whole view again.
--
-- Returns one reply per key: {head, late, skipped, version, "<", field, value, …} for "<": the
-- window (head "" if the key held nothing) and recorded offsets as they were before the deltas,
-- with the version after them; otherwise the new version alone (a string, not a table) when the
-- caller's writes were taken as they are; {head, late, skipped, version, "="} when its deltas
-- were merged and its view is current,
-- else {head, late, skipped, version, "*", field, value, …} with the live window as "b<bucket>" →
-- count/sum and "d<digest>" → latest bucket (absolute indices) and the recorded offsets
-- "o:<partition>" → offset; {} for a key that holds nothing; {"!"} when the caller sent writes
-- but no deltas and the key is no longer at its version (nothing was written); {"?"} when the key
-- the caller knew at a version is gone (nothing was written).
-- Numbers are strings: Lua numbers would be truncated to integers.

-- Globals read once into locals: a global is a table lookup on every use, and the script reads
-- ARGV and calls these once or more per argument.
local ARGV, KEYS = ARGV, KEYS
local tonumber, tostring, type, pairs, unpack = tonumber, tostring, type, pairs, unpack
local byte, sub, match, find, format = string.byte, string.sub, string.match, string.find, string.format
local call = redis.call

-- The longest TTL accepted: ten years, far below what PEXPIRE can hold.
local MAX_TTL = 315360000000

-- A whole number a double holds exactly, from tonumber (nil if it was not a number).
local LIMIT = 2 ^ 53
local function whole(n)
  return n ~= nil and n % 1 == 0 and n < LIMIT and n > -LIMIT
end

-- Sums are 64-bit integers of micro-units, beyond what a Lua double holds exactly (2^53), so
-- they are added as two limbs, hi * 10^9 + lo, both of the value's sign (each limb is exact).
local BASE = 1000000000
local MAX_HI, MAX_LO = 9223372036, 854775807

local function is_amount(s)
  return type(s) == 'string' and #s <= 20 and match(s, '^%-?%d+$') ~= nil and #match(s, '%d+') <= 19
end

local function limbs(s)
  local negative = byte(s, 1) == 45 -- '-'
  local digits = negative and sub(s, 2) or s
  local n = #digits
  local lo = tonumber(sub(digits, math.max(1, n - 8)))
  local hi = n > 9 and tonumber(sub(digits, 1, n - 9)) or 0
  if negative then return {-hi, -lo} end
  return {hi, lo}
end

-- a + b, saturating at the limits of a 64-bit integer, exactly as the caller adds.
local function add_limbs(a, b)
  local hi, lo = a[1] + b[1], a[2] + b[2]
  local carry = math.floor(lo / BASE)
  lo = lo - carry * BASE
  hi = hi + carry
  if hi > MAX_HI or (hi == MAX_HI and lo > MAX_LO) then return {MAX_HI, MAX_LO} end
  if hi < 0 and lo > 0 then hi, lo = hi + 1, lo - BASE end
  if hi < -MAX_HI or (hi == -MAX_HI and lo < -MAX_LO - 1) then return {-MAX_HI, -MAX_LO - 1} end
  return {hi, lo}
end

-- The larger (`larger`) or smaller of two limb pairs: both limbs share the value's sign, so
-- comparing hi then lo orders them.
local function extreme_limbs(a, b, larger)
  local a_first = a[1] > b[1] or (a[1] == b[1] and a[2] >= b[2])
  if a_first == larger then return a end
  return b
end

local function limbs_text(v)
  local hi, lo = v[1], v[2]
  if hi == 0 then return format('%.0f', lo) end
  if hi < 0 or lo < 0 then return '-' .. format('%.0f', -hi) .. format('%09.0f', -lo) end
  return format('%.0f', hi) .. format('%09.0f', lo)
end

-- A section's field names, built once per call and prefix (each concatenation makes a string).
local names = {}
local function names_of(prefix)
  local own = names[prefix]
  if own == nil then
    own = {v = prefix .. 'v', h = prefix .. 'h', e = prefix .. 'e'}
    names[prefix] = own
  end
  return own
end

-- Each key's shape, read once by `invalid` (numbers as numbers): the script runs on these.
local key_shapes, expecteds, expected_numbers, firsts, lasts, writes_lasts, sets_ends = {}, {}, {}, {}, {}, {}, {}

-- A count of arguments (deltas, writes, field/value entries) as a number, or nil unless it is a
-- whole number of at least 0. The same few counts come back key after key, and tonumber parses
-- a double each time (its most expensive step here), so each text is converted once per call.
local counts = {}
local function count_of(text)
  if text == nil then return nil end
  local n = counts[text]
  if n == nil then
    n = tonumber(text)
    if not whole(n) or n < 0 then n = false end
    counts[text] = n
  end
  return n or nil
end

-- Digits with an optional sign, at most 16 bytes (Lua's doubles hold it exactly): for the values
-- written into the hash as they come ("v", "h"), whose text must be what the caller decodes.
local function int_text(s)
  return #s <= 16 and find(s, '^%-?%d+$') ~= nil
end

-- The shape at ARGV[at..at+4] checked and read, or nil and what is wrong with it.
local function read_shape(at)
  local head, k_text, cap_text, ttl_text, stride_text = ARGV[at], ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4]
  local kind, prefix = sub(head, 1, 1), ''
  if #head > 1 then
    prefix = sub(head, 2)
    if #prefix > 16 then return nil, 'section prefix too long' end
    if find(prefix, '^[^.]+%.$') == nil then return nil, 'bad section prefix' end
  end
  if kind ~= 'c' and kind ~= 's' and kind ~= 'd' and kind ~= 'x' and kind ~= 'n' and kind ~= 'l' then return nil, 'unknown aggregate' end
  local k, cap, ttl = count_of(k_text), count_of(cap_text), tonumber(ttl_text)
  if k == nil or k < 1 then return nil, 'bad bucket count' end
  if cap == nil or cap > 1000000 or (kind == 'd') ~= (cap > 0) then return nil, 'bad distinct bound' end
  -- Digits as Redis reads them (PEXPIRE gets this text): no sign, exponent or leading zero.
  if not whole(ttl) or ttl < 1 or ttl > MAX_TTL or find(ttl_text, '^[1-9]%d*$') == nil then return nil, 'bad TTL' end
  local stride
  if stride_text == '2' then stride = 2 elseif stride_text == '4' then stride = 4 else return nil, 'bad stride' end
  return {kind = kind, prefix = prefix, k = k, cap = cap, ttl = ttl, stride = stride, names = names_of(prefix),
          ttl_text = ttl_text}
end

-- Every argument of every key, before anything is written; nil if they are well formed. Each
-- value is converted once (the conversions are most of what this costs) and the shapes kept.
local function invalid()
  local count = #ARGV
  local shape_count = count_of(ARGV[1])
  if shape_count == nil or 1 + 5 * shape_count > count then return 'apply_window: shapes cut short' end
  local shapes = {}
  for s = 1, shape_count do
    local shape, problem = read_shape(2 + 5 * (s - 1))
    if shape == nil then return 'apply_window: shape ' .. s .. ': ' .. problem end
    shapes[s] = shape
  end
  local at = 2 + 5 * shape_count
  local n = 0
  -- Not a closure per key: building one for each key costs more than its checks.
  local function bad(what) return 'apply_window: key ' .. n .. ': ' .. what end
  for key = 1, #KEYS do
    n = key
    if at + 3 > count then return bad('header cut short') end
    local number = count_of(ARGV[at])
    local shape = number and shapes[number]
    if not shape then return bad('no such shape') end
    local kind, stride = shape.kind, shape.stride
    local expected = ARGV[at + 1]
    local expected_number
    -- "0" (the key held nothing) is the usual version: taken without converting it.
    if expected == '0' then
      expected_number = 0
    elseif expected ~= '' and expected ~= '<' then
      expected_number = tonumber(expected)
      if not whole(expected_number) then return bad('bad version') end
    end
    local deltas, writes = count_of(ARGV[at + 2]), count_of(ARGV[at + 3])
    if deltas == nil or writes == nil or deltas % stride ~= 0 then return bad('bad counts') end
    local first = at + 4
    local deltas_end = first + deltas - 1
    local writes_end = deltas_end + writes
    if writes_end > count then return bad('arguments cut short') end
    for i = first, deltas_end, stride do
      local value = ARGV[i + 1]
      if not whole(tonumber(ARGV[i])) then return bad('bad bucket') end
      if kind == 'c' then
        if not whole(tonumber(value)) then return bad('bad increment') end
      elseif kind == 'd' then
        if #value ~= 16 then return bad('bad digest') end
      elseif kind == 'l' then
        if #value > 300 or not whole(tonumber(match(value, '^(%-?%d+):[snb]'))) then return bad('bad last value') end
      elseif not is_amount(value) then
        return bad('bad amount')
      end
      if stride == 4 and (ARGV[i + 2] == '' or not whole(tonumber(ARGV[i + 3]))) then return bad('bad position') end
    end
    if writes > 0 then
      if expected == '<' then return bad('writes with "<"') end
      local refresh, sets = ARGV[deltas_end + 1], count_of(ARGV[deltas_end + 2])
      if (refresh ~= '0' and refresh ~= '1') or sets == nil then return bad('bad writes') end
      if sets % 2 ~= 0 or deltas_end + 4 + sets > writes_end then return bad('bad writes') end
      -- The next version and the head go into the hash as they come: the caller decodes them.
      if not int_text(ARGV[deltas_end + 3]) or not int_text(ARGV[deltas_end + 4]) then return bad('bad writes') end
      sets_ends[key] = deltas_end + 4 + sets
    end
    key_shapes[key], expecteds[key], expected_numbers[key] = shape, expected, expected_number
    firsts[key], lasts[key], writes_lasts[key] = first, deltas_end, writes_end
    at = writes_end + 1
  end
  if at ~= count + 1 then return 'apply_window: arguments left over' end
  return nil
end

-- The version after a write to a key at `version` (0: the key is new).
local function next_version(version)
  if version ~= 0 then return version + 1 end
  local now = call('TIME')
  return tonumber(now[1]) * 1000000 + tonumber(now[2])
end

-- Writes in chunks: unpack() of a very long list would overflow Lua's C stack.
local function write(command, key, list, first, last)
  for j = first, last, 1000 do
    call(command, key, unpack(list, j, math.min(j + 999, last)))
  end
end

-- The live bucket held in `slot` when the head is `head`.
local function unslot(slot, head, k)
  return head - ((head - slot) % k)
end

-- The server's time in milliseconds, read once per call.
local now
local function now_ms()
  if now == nil then
    local t = call('TIME')
    now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return now
end

-- Sets the key's TTL. In a shared hash (`shared`) only if that makes it longer (another section
-- may need the longer one): GT, and NX for a key without a TTL yet (GT leaves such a key as it
-- is); `existed` tells which is likely, to try it first (one call then, most of the time), as
-- does a section of the same key this call wrote before (`timed`). The TTL goes to Redis as the
-- caller's text (`ttl_text`): a number would be formatted again on every call.
local timed = {}
local function expire(key, ttl, ttl_text, shared, existed)
  if not shared then
    call('PEXPIRE', key, ttl_text)
    return
  end
  -- Another section of the key gave it a TTL earlier in this call (the time stands still while
  -- a script runs): nothing to do unless this one is longer, and then GT takes it.
  local before = timed[key]
  if before ~= nil and before >= ttl then return end
  timed[key] = ttl
  if before ~= nil or existed then
    if call('PEXPIRE', key, ttl_text, 'GT') == 0 then call('PEXPIRE', key, ttl_text, 'NX') end
  elseif call('PEXPIRE', key, ttl_text, 'NX') == 0 then
    call('PEXPIRE', key, ttl_text, 'GT')
  end
end

-- The "e" field of a section written with a TTL of `ttl`: when it would have expired on its own
-- (the time stands still while a script runs: one text per TTL).
local expiries = {}
local function expiry(ttl)
  local text = expiries[ttl]
  if text == nil then
    text = format('%.0f', now_ms() + ttl)
    expiries[ttl] = text
  end
  return text
end

-- Of a shared hash's fields `all` (HGETALL), deletes those of every section whose own expiry
-- passed — a counter removed or reshaped, which its siblings' writes would otherwise keep alive
-- (and its offsets with it) — as its own hash would have expired. Returns whether `own`'s did.
local function prune(key, all, own)
  local stale, any = {}, false
  for j = 1, #all, 2 do
    local field = all[j]
    -- Only a field ending in "e" can be a section's expiry (checked first: it is cheaper).
    if byte(field, -1) == 101 then
      local section = match(field, '^([^.]+%.)e$')
      if section ~= nil and (tonumber(all[j + 1]) or 0) < now_ms() then
        stale[section] = true
        any = true
      end
    end
  end
  if not any then return false end
  local dead = {}
  for j = 1, #all, 2 do
    local section = match(all[j], '^([^.]+%.)')
    if section ~= nil and stale[section] then dead[#dead + 1] = all[j] end
  end
  write('HDEL', key, dead, 1, #dead)
  return stale[own] == true
end

local function apply(key, shape, expected, expected_number, first, last, sets_end, writes_last)
  local kind, prefix, k, cap, ttl, stride = shape.kind, shape.prefix, shape.k, shape.cap, shape.ttl, shape.stride
  local has_writes = writes_last > last
  local before = expected == '<'
  local shared = prefix ~= ''
  if expected ~= '' and not before then
    local version
    if shared then
      -- A section past its own expiry is gone, as its own hash would be: deleted first, so the
      -- caller is answered as for an expired key (and never told its writes landed on it).
      local got = call('HMGET', key, shape.names.v, shape.names.e)
      -- The same text is the same number (the conversion is most of what comparing costs).
      version = got[1] == expected and expected_number or tonumber(got[1]) or 0
      if version ~= 0 then
        local expires = tonumber(got[2])
        if expires ~= nil and expires < now_ms() then
          prune(key, call('HGETALL', key), prefix)
          version = 0
        end
      end
    else
      local got = call('HGET', key, 'v')
      version = got == expected and expected_number or tonumber(got) or 0
    end
    if version == expected_number and has_writes then
      -- The caller's view is current: its writes are exactly what the key becomes.
      local w = last + 1
      local refresh = ARGV[w] == '1'
      local names, v_text, h_text = shape.names, ARGV[w + 2], ARGV[w + 3]
      if sets_end - w <= 1000 then
        -- One HSET (unpack() is safe for this many, and must come last). The section's expiry
        -- goes first, with its writes: vigil never writes "e" itself, a caller that did would win.
        if shared and refresh then
          call('HSET', key, names.e, expiry(ttl), names.v, v_text, names.h, h_text, unpack(ARGV, w + 4, sets_end))
        else
          call('HSET', key, names.v, v_text, names.h, h_text, unpack(ARGV, w + 4, sets_end))
        end
      else
        local sets = {names.v, v_text, names.h, h_text}
        if shared and refresh then sets[5], sets[6] = names.e, expiry(ttl) end
        for j = w + 4, sets_end do sets[#sets + 1] = ARGV[j] end
        write('HSET', key, sets, 1, #sets)
      end
      if writes_last > sets_end then write('HDEL', key, ARGV, sets_end + 1, writes_last) end
      if refresh then
        expire(key, ttl, shape.ttl_text, shared, version ~= 0)
        -- At most once per window of a key this caller wrote before: drop its siblings'
        -- expired sections.
        if shared and version ~= 0 then prune(key, call('HGETALL', key), prefix) end
      end
      -- The reply is the next version alone (a table per key costs more than the rest of this
      -- path).
      return v_text
    end
    if version == 0 and expected_number ~= 0 then
      return {'?'}
    end
  end
  -- Writes for a version the key is no longer at, and no deltas to merge instead: the caller
  -- sends its deltas again.
  if last < first and has_writes then return {'!'} end
  -- Decode the whole hash once into absolute buckets; apply; encode back what changed.
  local flat = call('HGETALL', key)
  local existed = #flat > 0
  if shared then
    -- This section's fields only, by their names within it (none if it expired).
    local all, n = flat, #prefix
    flat = {}
    if prune(key, all, prefix) then all = {} end
    for j = 1, #all, 2 do
      local field = all[j]
      if sub(field, 1, n) == prefix then
        flat[#flat + 1] = sub(field, n + 1)
        flat[#flat + 1] = all[j + 1]
      end
    end
  end
  local stored = {}
  for j = 1, #flat, 2 do stored[flat[j]] = flat[j + 1] end
  local head = tonumber(stored['h'])
  local stored_head = head
  local buckets, latest = {}, {}
  -- Last: the kept event, {bucket, time, text} (text "<time>:<tag><text>").
  local last_kept
  local last_touched = false
  if kind == 'l' and stored['l'] ~= nil then
    local b, rest = match(stored['l'], '^(%-?%d+):(.*)$')
    if b ~= nil then last_kept = {tonumber(b), tonumber(match(rest, '^(%-?%d+):')), rest} end
  end
  -- Distinct: how many values have each live bucket as their latest, and how many are live.
  local per_bucket, live = {}, 0
  if head ~= nil then
    for j = 1, #flat, 2 do
      local field, value = flat[j], flat[j + 1]
      local slot = tonumber(field)
      if slot ~= nil then
        if kind == 's' then
          -- Versions before exact sums stored units as doubles: read them as micro-units.
          if not is_amount(value) then value = format('%.0f', (tonumber(value) or 0) * 1000000) end
          buckets[unslot(slot, head, k)] = limbs(value)
        elseif kind == 'x' or kind == 'n' then
          buckets[unslot(slot, head, k)] = limbs(is_amount(value) and value or '0')
        else
          buckets[unslot(slot, head, k)] = tonumber(value)
        end
      elseif byte(field, 1) == 100 then -- 'd'
        local bucket = unslot(tonumber(value), head, k)
        latest[sub(field, 2)] = bucket
        per_bucket[bucket] = (per_bucket[bucket] or 0) + 1
        live = live + 1
      end
    end
  end
  local touched_buckets, touched_values = {}, {}
  -- "<": the window before the deltas, in the reply's form.
  local prior
  if before then
    prior = {head and format('%.0f', head) or ''}
    for bucket, value in pairs(buckets) do
      prior[#prior + 1] = 'b' .. format('%.0f', bucket)
      prior[#prior + 1] = (kind == 's' or kind == 'x' or kind == 'n') and limbs_text(value) or format('%.0f', value)
    end
    for digest, bucket in pairs(latest) do
      prior[#prior + 1] = 'd' .. digest
      prior[#prior + 1] = format('%.0f', bucket)
    end
    if last_kept ~= nil then
      prior[#prior + 1] = 'l'
      prior[#prior + 1] = stored['l']
    end
    for field, value in pairs(stored) do
      if sub(field, 1, 2) == 'o:' then
        prior[#prior + 1] = field
        prior[#prior + 1] = value
      end
    end
  end

  local late, skipped = 0, 0
  local recorded, newest = {}, {}
  local changed = false
  for i = first, last, stride do
    local bucket = tonumber(ARGV[i])
    local fresh = true
    if stride == 4 then
      local partition, offset = ARGV[i + 2], tonumber(ARGV[i + 3])
      if recorded[partition] == nil then
        recorded[partition] = tonumber(stored['o:' .. partition]) or -1
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
        if head == nil or bucket > head then
          if kind == 'd' and head ~= nil then
            -- The window slides first, so values that fell out make room.
            for b = head - k + 1, math.min(bucket - k, head) do
              live = live - (per_bucket[b] or 0)
              per_bucket[b] = nil
            end
          end
          head = bucket
        end
        changed = true
        local value = ARGV[i + 1]
        if kind == 'd' then
          local previous = latest[value]
          local was_live = previous ~= nil and previous > head - k
          if previous ~= nil and previous >= bucket then
            -- Already recorded at this bucket or a later one.
          elseif not was_live and live >= cap then
            -- The window is full: a value it does not hold is not recorded.
          else
            if was_live then
              per_bucket[previous] = per_bucket[previous] - 1
            else
              live = live + 1
            end
            latest[value] = bucket
            per_bucket[bucket] = (per_bucket[bucket] or 0) + 1
            touched_values[value] = true
          end
        elseif kind == 's' then
          buckets[bucket] = add_limbs(buckets[bucket] or {0, 0}, limbs(value))
          touched_buckets[bucket] = true
        elseif kind == 'l' then
          local ts = tonumber(match(value, '^(%-?%d+):'))
          if last_kept == nil or last_kept[1] <= head - k or ts >= last_kept[2] then
            last_kept = {bucket, ts, value}
            last_touched = true
          end
        elseif kind == 'x' or kind == 'n' then
          local amount = limbs(value)
          local held = buckets[bucket]
          buckets[bucket] = held and extreme_limbs(held, amount, kind == 'x') or amount
          touched_buckets[bucket] = true
        else
          buckets[bucket] = (buckets[bucket] or 0) + tonumber(value)
          touched_buckets[bucket] = true
        end
      end
    end
  end

  if head == nil then
    return {}
  end

  -- Encode the live window; collect what differs from what Redis holds.
  local head_text = format('%.0f', head)
  local oldest_live = head - k + 1
  local version = tonumber(stored['v']) or 0
  -- A refused or skipped delta means the caller's view counted something Redis did not.
  local current = expected_number == version and late == 0 and skipped == 0
  if changed then version = next_version(version) end
  local version_text = format('%.0f', version)
  local out = {head_text, tostring(late), tostring(skipped), version_text, current and '=' or '*'}
  if before then
    out = {prior[1], tostring(late), tostring(skipped), version_text, '<'}
    for j = 2, #prior do out[#out + 1] = prior[j] end
    current = true
  end
  local function text(value)
    if kind == 's' or kind == 'x' or kind == 'n' then return limbs_text(value) end
    return format('%.0f', value)
  end
  if not current then
    for bucket, value in pairs(buckets) do
      if bucket >= oldest_live then
        out[#out + 1] = 'b' .. format('%.0f', bucket)
        out[#out + 1] = text(value)
      end
    end
    for digest, bucket in pairs(latest) do
      if bucket >= oldest_live then
        out[#out + 1] = 'd' .. digest
        out[#out + 1] = format('%.0f', bucket)
      end
    end
    if last_kept ~= nil and last_kept[1] >= oldest_live then
      out[#out + 1] = 'l'
      out[#out + 1] = format('%.0f', last_kept[1]) .. ':' .. last_kept[3]
    end
    for field, value in pairs(stored) do
      if sub(field, 1, 2) == 'o:' and newest[sub(field, 3)] == nil then
        out[#out + 1] = field
        out[#out + 1] = value
      end
    end
    for partition, offset in pairs(newest) do
      out[#out + 1] = 'o:' .. partition
      out[#out + 1] = format('%.0f', offset)
    end
  end
  if not changed then
    return out
  end

  -- Write only what this call changed; delete what slid out (only possible if the head moved),
  -- unless a bucket that is live now took over the slot.
  local sets, setting = {}, {}
  local function set(field, value)
    sets[#sets + 1] = prefix .. field
    sets[#sets + 1] = value
    setting[field] = true
  end
  set('h', head_text)
  set('v', version_text)
  for partition, offset in pairs(newest) do
    set('o:' .. partition, format('%.0f', offset))
  end
  for bucket, _ in pairs(touched_buckets) do
    if bucket >= oldest_live then set(format('%.0f', bucket % k), text(buckets[bucket])) end
  end
  for digest, _ in pairs(touched_values) do
    local bucket = latest[digest]
    if bucket >= oldest_live then set('d' .. digest, format('%.0f', bucket % k)) end
  end
  if last_touched then set('l', format('%.0f', last_kept[1]) .. ':' .. last_kept[3]) end
  if shared then set('e', expiry(ttl)) end
  local dead = {}
  if stored_head ~= nil and head > stored_head then
    for j = 1, #flat, 2 do
      local field, value = flat[j], flat[j + 1]
      if not setting[field] then
        local slot, bucket = tonumber(field), nil
        if slot ~= nil then
          bucket = unslot(slot, stored_head, k)
        elseif byte(field, 1) == 100 then -- 'd'
          bucket = unslot(tonumber(value), stored_head, k)
        end
        if bucket ~= nil and bucket < oldest_live then dead[#dead + 1] = prefix .. field end
      end
    end
  end
  write('HSET', key, sets, 1, #sets)
  write('HDEL', key, dead, 1, #dead)
  expire(key, ttl, shape.ttl_text, shared, existed)
  return out
end

local problem = invalid()
if problem then return redis.error_reply(problem) end
local replies = {}
for n = 1, #KEYS do
  replies[n] = apply(KEYS[n], key_shapes[n], expecteds[n], expected_numbers[n], firsts[n], lasts[n], sets_ends[n],
                     writes_lasts[n])
end
return replies
