local D, Q, P, L, I, CL, DG, EX = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local jid, pttl, ltype, limit, lscore = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]), ARGV[5]
local now, history, gem, script = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8], ARGV[9]
local function note(message, prev)
  if not history or history <= 0 then return end
  local entry = cjson.encode({digest = D, job_id = jid, script = script, message = message, time = now, prev_jid = prev})
  redis.call('ZADD', CL, now, entry)
  redis.call('ZREMRANGEBYRANK', CL, 0, -history)
  redis.call('PUBLISH', CL, entry)
end
