local holds = redis.call('HEXISTS', L, jid) == 1
local function busy()
  return redis.call('LLEN', Q) > 0 or redis.call('LLEN', P) > 0 or redis.call('HLEN', L) > 0
end
local function holders()
  return L .. ' (' .. table.concat(redis.call('HKEYS', L), ',') .. ',)'
end
if gem == '71' then
  if not holds and busy() then note('Yielding to: ' .. holders()) return false end
  redis.call('LREM', Q, -1, jid)
  redis.call('LREM', P, -1, jid)
else
  if gem == '80' or not holds then
    redis.call('LREM', Q, -1, jid)
    redis.call('LREM', P, -1, jid)
  end
  if not holds and busy() then
    if gem == '80' then note('Yielding to: ' .. holders()) return jid end
    note('Yielding to other lock holders') return false
  end
end
if gem == '81' then
  if ltype == 'until_expired' then
    redis.call('ZREM', DG, D)
  elseif limit > 1 then
    redis.call('HDEL', L, jid)
    local left = redis.call('HLEN', L)
    redis.call('UNLINK', D, I)
    if left < 1 then
      redis.call('UNLINK', L, P)
      redis.call('ZREM', DG, D)
    elseif redis.call('LLEN', P) == 0 then
      redis.call('UNLINK', P)
    end
  else
    redis.call('HDEL', L, jid)
    redis.call('UNLINK', D, I, L, P)
    redis.call('ZREM', DG, D)
  end
else
  if ltype ~= 'until_expired' then
    redis.call('UNLINK', D, I)
    redis.call('HDEL', L, jid)
  end
  local left = redis.call('HLEN', L)
  if left < 1 then redis.call('UNLINK', L) end
  if redis.call('LLEN', P) == 0 then redis.call('UNLINK', P) end
  if limit <= 1 and left <= 1 then redis.call('ZREM', DG, D) end
end
redis.call('LPUSH', Q, '1')
redis.call('PEXPIRE', Q, 5000)
note('Unlocked')
return jid
