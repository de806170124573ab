local n = 0
for _, d in ipairs({KEYS[1], KEYS[1] .. ':RUN'}) do
  if redis.call('GET', d) == ARGV[1] or redis.call('HEXISTS', d .. ':LOCKED', ARGV[1]) == 1 then
    n = n + redis.call('UNLINK', d, d .. ':QUEUED', d .. ':PRIMED', d .. ':LOCKED', d .. ':INFO')
    redis.call('ZREM', KEYS[2], d)
    redis.call('ZREM', KEYS[3], d)
  end
end
return n
