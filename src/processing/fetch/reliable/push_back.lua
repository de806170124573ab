
local n = 0
local at = kind(KEYS[2])
if KEYS[2] ~= KEYS[1] and at ~= 'set' and at ~= 'none' then
  return {0, KEYS[2] .. ' is a ' .. at .. ', not a set (the acks set of ' .. KEYS[1] .. '; its jobs stay there until it is repaired)'}
end
local len = redis.call('LLEN', KEYS[1])
for i = 1, #ARGV do
  if tonumber(ARGV[i]) < len and redis.call('SISMEMBER', KEYS[2], ARGV[i]) == 0 then
    local j = redis.call('LINDEX', KEYS[1], ARGV[i])
    local r = redis.pcall('RPUSH', KEYS[3], j)
    if failed(r) then return {n, KEYS[3] .. ' is a ' .. kind(KEYS[3]) .. ', not a list: ' .. r.err} end
    redis.call('SADD', KEYS[2], ARGV[i])
    n = n + 1
  end
end
return {n, ''}
