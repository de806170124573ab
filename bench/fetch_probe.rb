# What fetching and acknowledging a job costs Redis, by design of the working copy, counted by callgrind on
# redis-server itself: the evidence for a choice of reliable-fetch design, not a benchmark of oxidekiq (a Ruby
# client plays the fetcher, so only Redis's count means anything).
#
#   ruby bench/fetch_probe.rb                    # DESIGN=script KIND=noop JOBS=20000
#   DESIGN=lmove KIND=activejob ruby bench/fetch_probe.rb
#
# DESIGN=script: oxidekiq's reliable fetch as it is. The batch script is read from src/lua.rs and
#   src/fetch/reliable.rs (so it is the one in this tree), run with EVALSHA for 50 jobs at a time into the
#   working hash; every 200 jobs one HDEL of their ids acknowledges them (as oxidekiq's acker batches).
# DESIGN=lmove: working lists the payloads reach without Lua (the shape of Sidekiq Pro's super_fetch, with one
#   list per batch so that an acknowledgement scans at most a batch): MULTI, 50 LMOVE queue -> the batch's
#   list, EXEC; every 200 jobs one pipeline of LREM <its list> -1 <payload> per job (the last one of a list
#   deletes it). Acknowledged in fetch order here, the best case for LREM.
#
# A private redis-server on a free port (never 6379), under `valgrind --tool=callgrind --instr-atstart=no`;
# JOBS jobs enqueued with Ruby Sidekiq's client (KIND=noop: NoopJob, KIND=activejob: NoopActiveJob as
# bench/driver.rb enqueues them); the count covers the fetch-and-ack loop only. Prints Redis's instructions
# per job.
require_relative "probe_support"
include ProbeSupport

DESIGN = ENV.fetch("DESIGN", "script")
KIND = ENV.fetch("KIND", "noop")
JOBS = Integer(ENV.fetch("JOBS", "20000"))
BATCH = 50
ACK_EVERY = 200
WORK = Dir.mktmpdir("oxidekiq-fetch-probe")
OUT = ENV.fetch("OUT", File.join(WORK, "callgrind.out"))
abort "DESIGN is script or lmove" unless %w[script lmove].include?(DESIGN)
abort "KIND is noop or activejob" unless %w[noop activejob].include?(KIND)

# The raw string literal (r#"..."#) that follows `marker` in a Rust source file.
def rust_raw(path, marker)
  src = File.read(File.join(ROOT, path))
  from = src.index(marker) or raise "#{marker} not found in #{path}"
  start = src.index('r#"', from) + 3
  src[start...src.index('"#', start)]
end

fetch_lua = rust_raw("src/lua.rs", "macro_rules! lua_common") + rust_raw("src/fetch/reliable.rs", "const FETCH_LUA")

redis_pid, _url, redis = start_redis(WORK, callgrind(OUT))
begin
  enqueue(redis, KIND, JOBS)
  bytes = redis.lrange("queue:default", 0, 0).first.bytesize

  queue = "queue:default"
  working = "oxidekiq:working:probe:default"
  sha = DESIGN == "script" ? redis.script(:load, fetch_lua) : nil
  callgrind_on(redis_pid)
  t0 = now
  done = 0
  next_id = 1
  held = []
  loop do
    got =
      if DESIGN == "script"
        # KEYS: dead set, then working hash, landing list, queue; ARGV as oxidekiq sends them (no size limit
        # reached, a 32 MB batch budget).
        flat = redis.evalsha(sha, keys: ["dead", working, "oxidekiq:landing:probe:default", queue],
                                  argv: [BATCH, next_id, 16 * 1024 * 1024, 32 * 1024 * 1024, "probe",
                                         Time.now.to_f.to_s, Time.now.to_f.to_s, "0", 10_000])
        next_id += BATCH
        jobs = []
        while (q = flat.shift)
          first = flat.shift
          count = Integer(flat.shift)
          raise "unexpected record #{q} #{first}" if %w[dead err].include?(first)
          count.times { |k| jobs << [Integer(first) + k, flat.shift] }
        end
        jobs
      else
        list = "#{working}:#{next_id}"
        next_id += BATCH
        redis.multi { |m| BATCH.times { m.lmove(queue, list, "RIGHT", "LEFT") } }.compact.map { |j| [list, j] }
      end
    break if got.empty?
    held.concat(got)
    done += got.size
    next if held.size < ACK_EVERY && done < JOBS

    if DESIGN == "script"
      redis.hdel(working, held.map { |id, _| id.to_s })
    else
      redis.pipelined { |p| held.each { |list, j| p.lrem(list, -1, j) } }
    end
    held.clear
  end
  secs = now - t0
  dumped, total = callgrind_dump(redis_pid, OUT)
  left = redis.llen(queue) + (DESIGN == "script" ? redis.hlen(working) : redis.keys("#{working}:*").size)
  raise "#{left} jobs left in Redis after the probe" unless left.zero?
  raise "fetched #{done} of #{JOBS}" unless done == JOBS

  printf("%s, %s (%d-byte payloads): %d jobs, Redis %.0f instructions/job (%.1f s under valgrind)\n",
         DESIGN, KIND, bytes, JOBS, total.to_f / JOBS, secs)
  puts "profile: #{dumped}"
ensure
  stop_all([redis_pid])
end
