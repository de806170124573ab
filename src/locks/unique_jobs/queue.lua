if redis.call('HEXISTS', L, jid) == 1 then note('Duplicate') return jid end
local prev = redis.call('GET', D)
if not prev then
  redis.call('SET', D, jid)
elseif prev == jid then
  note('Duplicate')
  -- Unlike the gem: the digest names this jid, which holds no lock (a run cut short between its
  -- queue and lock steps, recovered). Its token in :QUEUED may be gone (a wake-up push's 5 s TTL
  -- took the list) or already moved to :PRIMED (cut after the move), and without it in :QUEUED the
  -- move finds nothing and the job would be dropped: it goes back to :QUEUED.
  if not redis.call('LPOS', Q, jid) then
    redis.call('LREM', P, 0, jid)
    redis.call('LPUSH', Q, jid)
  end
  return jid
elseif limit > redis.call('HLEN', L) and redis.call('LLEN', Q) < limit then
  redis.call('SET', D, jid)
else
  note('Limit exceeded', prev) return prev
end
redis.call('LPUSH', Q, jid)
if pttl and pttl > 0 then
  redis.call('PEXPIRE', D, pttl)
  redis.call('PEXPIRE', Q, pttl)
end
note('Queued')
return jid
