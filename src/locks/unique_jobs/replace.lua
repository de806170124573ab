local d = ARGV[1]
local found = nil
local len = redis.call('LLEN', KEYS[1])
local i = 0
while i < len and not found do
  for _, item in ipairs(redis.call('LRANGE', KEYS[1], i, i + 49)) do
    if string.find(item, d, 1, true) then
      redis.call('LREM', KEYS[1], 1, item)
      found = item
      break
    end
  end
  i = i + 50
end
for _, set in ipairs({KEYS[2], KEYS[3]}) do
  if found then break end
  local cursor = '0'
  -- The digest matched as it is: its glob characters escaped (a '?' or '*' in it matched other jobs).
  local pattern = '*' .. string.gsub(d, '([%*%?%[%]\\])', '\\%1') .. '*'
  repeat
    local r = redis.call('ZSCAN', set, cursor, 'MATCH', pattern, 'COUNT', 100)
    cursor = r[1]
    if #r[2] > 0 then
      redis.call('ZREM', set, r[2][1])
      found = r[2][1]
    end
  until found or cursor == '0'
end
if not found then return false end
redis.call('UNLINK', d, d .. ':QUEUED', d .. ':PRIMED', d .. ':LOCKED')
redis.call('ZREM', KEYS[4], d)
return found
