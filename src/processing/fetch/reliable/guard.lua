
local q, b = KEYS[1], KEYS[2]
local mem = redis.pcall('MEMORY', 'USAGE', b, 'SAMPLES', '0')
if not mem then return 0 end
local why = nil
if type(mem) == 'number' and mem <= tonumber(ARGV[1]) then
  local n = redis.pcall('LLEN', b)
  if type(n) == 'number' then
    local r = redis.pcall('LTRIM', q, '0', -(n + 1))
    if type(r) ~= 'table' or not r.err then
      if n > 0 then redis.pcall('SADD', KEYS[3], b) end
      return mem
    end
    why = r.err
  else
    why = n.err
  end
elseif type(mem) == 'table' then
  why = mem.err
end
redis.pcall('DEL', b)
if not why then return {'over', mem} end
local t = redis.pcall('TYPE', q)
t = type(t) == 'table' and t.ok
if t and t ~= 'list' and t ~= 'none' then return {'type', t} end
return {'refused', tostring(why)}
