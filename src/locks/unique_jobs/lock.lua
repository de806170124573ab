local single = gem == '81' and limit <= 1
local function clear_waits()
  if single then
    redis.call('UNLINK', Q, P)
  else
    redis.call('LREM', Q, -1, jid)
    redis.call('LREM', P, 1, jid)
  end
end
if redis.call('HEXISTS', L, jid) == 1 then note('Duplicate') clear_waits() return jid end
if redis.call('HLEN', L) >= limit then note('Limited') return false end
if ltype == 'until_expired' and pttl and pttl > 0 then
  redis.call('ZADD', EX, now + pttl, D)
else
  local score = now
  if gem ~= '71' and #lscore > 0 then score = lscore end
  redis.call('ZADD', DG, score, D)
end
redis.call('HSET', L, jid, now)
clear_waits()
if pttl and pttl > 0 then
  redis.call('PEXPIRE', D, pttl)
  redis.call('PEXPIRE', L, pttl)
  redis.call('PEXPIRE', I, pttl)
end
if gem ~= '81' then
  redis.call('PEXPIRE', Q, 1000)
  redis.call('PEXPIRE', P, 1000)
end
note('Locked')
return jid
