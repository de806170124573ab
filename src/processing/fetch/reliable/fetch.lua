
-- MEMORY USAGE before a write needs effects replication (the only mode from Redis 7; the default
-- from 5, opt-in before).
if redis.replicate_commands then redis.replicate_commands() end
local max = tonumber(ARGV[1])
local limit = tonumber(ARGV[2])
local budget = tonumber(ARGV[3])
local nonce = ARGV[4]
local score, failed_at, trim_before, dead_max = ARGV[5], ARGV[6], ARGV[7], tonumber(ARGV[8])
local ratio = tonumber(ARGV[9])
local dead = KEYS[1]
local index = KEYS[#KEYS]
local ns = (#KEYS - 2) / 2
local out = {}
local taken, bytes = 0, 0
local cap = budget
if limit > 0 and limit < cap then cap = limit end
local skip, seen = 0, 0
for i = 1, ns do
  if taken >= max or bytes >= budget then break end
  seen = i
  if i ~= skip then
  local src, dest = KEYS[2 * i], KEYS[2 * i + 1]
  local want = max - taken
  local err, kept, tag, slow = nil, 0, 's', false
  -- The copy, then its size: every job in it is at most the copy's size, so a copy within the limit
  -- (and the budget) holds no job over the limit. A SORT or MEMORY refused (an ACL: SORT is
  -- @dangerous) must neither stop the fetch nor abort the script with the copy made and the source
  -- untrimmed (a push-back of that copy would queue every job twice): the copy is undone and the
  -- source read job by job below, sizes measured in Lua.
  local c = redis.pcall('SORT', src, 'BY', 'nosort', 'DESC', 'LIMIT', '0', want, 'STORE', dest)
  if failed(c) then
    -- A hash or a string (SORT refuses them), else a refusal.
    local t = kind(src)
    if t == 'list' then slow = true elseif t ~= 'none' then err = src .. ' is a ' .. t .. ', not a list: ' .. c.err end
  elseif c > 0 then
    local mem = redis.pcall('MEMORY', 'USAGE', dest, 'SAMPLES', '0')
    -- A compressed node counts its compressed bytes: the bound of what it holds is ratio times that.
    if type(mem) == 'number' then mem = mem * ratio end
    if type(mem) == 'number' and mem <= cap and bytes + mem <= budget then
      local r = redis.pcall('LTRIM', src, '0', -(c + 1))
      if failed(r) then
        -- A set or a sorted set: SORT copied its members, which are no jobs of ours.
        redis.call('DEL', dest)
        err = src .. ' is a ' .. kind(src) .. ', not a list: ' .. r.err
      else
        kept, taken, bytes = c, taken + c, bytes + mem
        if c == want then tag = 'n' else tag = 'p' end
      end
    else
      redis.call('DEL', dest)
      local t = kind(src)
      if t == 'list' then slow = true else err = src .. ' is a ' .. t .. ', not a list' end
    end
  end
  -- The rare way: read from the tail (RPOP's end, served first) in chunks sized by the largest job seen
  -- so far, so a run of huge payloads is read one at a time, never all at once.
  local read, biggest, more, done = 0, 0, slow, 0
  while more and not err and taken < max and bytes < budget do
    local chunk = max - taken
    if biggest == 0 then chunk = 1
    else chunk = math.max(1, math.min(chunk, math.floor((budget - bytes) / biggest))) end
    local jobs = redis.call('LRANGE', src, -(read + chunk), -(read + 1))
    if #jobs < chunk then more = false end
    read = read + #jobs
    for j = #jobs, 1, -1 do
      local job = jobs[j]
      local size = #job
      if size > biggest then biggest = size end
      taken = taken + 1
      bytes = bytes + size
      if limit > 0 and size > limit then
        local msg = 'payload of ' .. size .. ' bytes is over the ' .. limit .. '-byte limit (fetch ' .. nonce .. '.' .. taken .. ')'
        err = to_dead(dead, annotate(job, 'Oxidekiq::InvalidPayload', msg, failed_at), score, trim_before, dead_max)
        if err then break end
        out[#out + 1] = i; out[#out + 1] = 'dead'; out[#out + 1] = size
      else
        local r = redis.pcall('RPUSH', dest, job)
        if failed(r) then err = dest .. ' is a ' .. kind(dest) .. ', not a list: ' .. r.err; break end
        kept = kept + 1
      end
      done = done + 1
      if bytes >= budget then break end
    end
  end
  if done > 0 then redis.call('LTRIM', src, '0', -(done + 1)) end
  if kept > 0 then
    redis.pcall('SADD', index, dest)
    out[#out + 1] = i; out[#out + 1] = tag; out[#out + 1] = kept
  end
  if err then
    out[#out + 1] = i; out[#out + 1] = 'err'; out[#out + 1] = err
    -- A landing list that fails skips its queue too (as one error of the queue).
    if i % 2 == 1 then skip = i + 1 end
  end
  end
end
out[#out + 1] = 0; out[#out + 1] = 'seen'; out[#out + 1] = seen
return out
