# What fetching and acknowledging a job costs Redis, by design of the working copy, counted by callgrind on
# redis-server itself: the evidence for a choice of reliable-fetch design, not a benchmark of oxidekiq (a Ruby
# client plays the fetcher, so only Redis's count means anything).
#
#   ruby bench/fetch_probe.rb                    # DESIGN=script KIND=noop JOBS=20000
#   DESIGN=floor PAYLOAD=4 JOBS=5000 ruby bench/fetch_probe.rb
#
# DESIGN=floor: what Redis must at least do to hand a job out, with no safety at all: `RPOP queue 100`.
# DESIGN=basic: oxidekiq's basic fetch: one fetcher popping the free slots (`RPOP queue 50`), no ack.
# DESIGN=script: oxidekiq's reliable fetch through its batch script as it is in this tree
#   (src/processing/fetch/reliable.rs), which never takes a payload into Lua: it copies up to BATCH jobs into a fresh
#   batch list (`SORT queue BY nosort DESC LIMIT 0 n STORE`, then `LTRIM`), and the same pipeline reads
#   them (`LRANGE`, and one of the landing list's batch list, empty here);
# DESIGN=fast: oxidekiq's reliable fetch through its fast path (the same file): one transaction,
#   `MULTI; SORT queue BY nosort DESC LIMIT 0 n STORE <list>; LTRIM; EVAL <guard>; LRANGE <list>; EXEC`,
#   acknowledged as with DESIGN=script;
#   once every job of a batch is done, one `DEL` of its list acknowledges them (ACK=sadd: each batch's
#   jobs are first marked done by one `SADD` of their places to its acks set, as when a batch is
#   acknowledged in parts, the worst case); the acks ride in the next fetch's pipeline, as oxidekiq's do
#   under load.
# DESIGN=old: the batch script before the batch lists (read from git at OLD_REV, e9935e1): it takes each
#   payload into Lua (`LRANGE`), writes it into the working hash and returns it; acks are `HDEL`s of
#   ids, 200 at a time.
# DESIGN=lmove: working lists the payloads reach without Lua (the shape of Sidekiq Pro's super_fetch, with one
#   list per batch so that an acknowledgement scans at most a batch): MULTI, 50 LMOVE queue -> the batch's
#   list, EXEC; every 200 jobs one pipeline of LREM <its list> -1 <payload> per job (the last one of a list
#   deletes it). Acknowledged in fetch order here, the best case for LREM.
#
# PAYLOAD (KB: 0.2, 1, 4, 16) pads NoopJob's arguments to about that size; without it the payload is
# the benchmark's own (KIND=noop: NoopJob, 162 bytes; KIND=activejob: NoopActiveJob, 496 bytes).
#
# A private redis-server on a free port (never 6379), under `valgrind --tool=callgrind --instr-atstart=no`;
# JOBS jobs enqueued with Ruby Sidekiq's client (as bench/driver.rb enqueues them); the count covers the
# fetch-and-ack loop only. Prints Redis's instructions per job.
require_relative "probe_support"
include ProbeSupport

DESIGN = ENV.fetch("DESIGN", "script")
KIND = ENV.fetch("KIND", "noop")
JOBS = Integer(ENV.fetch("JOBS", "20000"))
PAYLOAD = ENV["PAYLOAD"]
ACK = ENV.fetch("ACK", "del")
OLD_REV = ENV.fetch("OLD_REV", "e9935e1")
BATCH = Integer(ENV.fetch("BATCH", "50"))
ACK_EVERY = [200, BATCH].max
WORK = Dir.mktmpdir("oxidekiq-fetch-probe")
OUT = ENV.fetch("OUT", File.join(WORK, "callgrind.out"))
abort "DESIGN is floor, basic, script, fast, old or lmove" unless %w[floor basic script fast old lmove].include?(DESIGN)
abort "KIND is noop or activejob" unless %w[noop activejob].include?(KIND)

# The raw string literal (r#"..."#) that follows `marker` in a Rust source file (at git revision `rev`
# when given).
def rust_raw(path, marker, rev = nil)
  src = rev ? IO.popen(["git", "-C", ROOT, "show", "#{rev}:#{path}"], &:read) : File.read(File.join(ROOT, path))
  from = src.index(marker) or raise "#{marker} not found in #{path}"
  start = src.index('r#"', from) + 3
  src[start...src.index('"#', start)]
end

rev = DESIGN == "old" ? OLD_REV : nil
fetch_lua = rust_raw("src/connection/lua.rs", "macro_rules! lua_common", rev) + rust_raw("src/processing/fetch/reliable.rs", "const FETCH_LUA", rev)
guard_lua = DESIGN == "fast" ? rust_raw("src/processing/fetch/reliable.rs", "const GUARD_LUA") : nil

# NoopJobs padded to about PAYLOAD KB each.
def enqueue_padded(redis, jobs)
  target = (Float(PAYLOAD) * 1024).round
  pad = [target - 170, 0].max
  (0...jobs).each_slice(1000) do |idx|
    Sidekiq::Client.push_bulk("class" => NoopJob, "args" => idx.map { |i| [i, "x" * pad] })
  end
  queued = redis.llen("queue:default")
  raise "enqueued #{queued} of #{jobs}" unless queued == jobs
end

redis_pid, _url, redis = start_redis(WORK, callgrind(OUT))
begin
  PAYLOAD ? enqueue_padded(redis, JOBS) : enqueue(redis, KIND, JOBS)
  bytes = redis.lrange("queue:default", 0, 0).first.bytesize

  queue = "queue:default"
  working = "oxidekiq:working:probe:default"
  sha = %w[script old].include?(DESIGN) ? redis.script(:load, fetch_lua) : nil
  callgrind_on(redis_pid)
  t0 = now
  done = 0
  next_id = 1
  held = []
  pending_acks = []
  loop do
    got =
      case DESIGN
      when "floor"
        Array(redis.rpop(queue, 100))
      when "basic"
        Array(redis.rpop(queue, BATCH))
      when "script"
        # ARGV as oxidekiq sends them (no size limit reached, a 32 MB batch budget). The batch lists are
        # read in the same round trip.
        # KEYS: dead set, then per queue its landing list and that source's batch list, its queue and
        # that source's batch list.
        landed = "oxidekiq:batch:probe:1:ab:default:@#{next_id}"
        list = "oxidekiq:batch:probe:1:ab:default:@#{next_id + 1}"
        next_id += 2
        riders = pending_acks
        pending_acks = []
        flat, _landed, jobs = redis.pipelined do |p|
          p.evalsha(sha, keys: ["dead", "oxidekiq:landing:probe:1:ab:default", landed, queue, list],
                         argv: [BATCH, 16 * 1024 * 1024, 32 * 1024 * 1024, "probe",
                                Time.now.to_f.to_s, Time.now.to_f.to_s, "0", 10_000])
          p.lrange(landed, 0, -1)
          p.lrange(list, 0, -1)
          # The acks waiting for a fetch ride in its pipeline (src/processing/fetch/reliable.rs `Reliable::ride`).
          riders.each { |cmd| cmd.(p) }
        end
        raise "unexpected records #{flat.inspect}" if flat.each_slice(3).any? { |_, t, _| %w[dead err].include?(t) }
        jobs.each_with_index.map { |j, i| [list, i, j] }
      when "fast"
        # The payload limit as oxidekiq passes it (16 MiB, below the 32 MiB budget); the second batch
        # number is where the guard would move a batch it must not let be read.
        list = "oxidekiq:batch:probe:1:ab:default:@#{next_id}"
        aside = "oxidekiq:batch:probe:1:ab:default:@#{next_id + 1}"
        next_id += 2
        riders = pending_acks
        pending_acks = []
        replies = redis.pipelined do |p|
          p.call("MULTI")
          p.call("SORT", queue, "BY", "nosort", "DESC", "LIMIT", 0, BATCH, "STORE", list)
          p.call("LTRIM", queue, 0, -(BATCH + 1))
          p.call("EVAL", guard_lua, 3, queue, list, aside, 16 * 1024 * 1024)
          p.call("LRANGE", list, 0, -1)
          p.call("EXEC")
          riders.each { |cmd| cmd.(p) }
        end
        _taken, _trimmed, guard, jobs = replies[5]
        raise "the guard answered #{guard.inspect}" unless guard.is_a?(Integer)
        jobs.each_with_index.map { |j, i| [list, i, j] }
      when "old"
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
    if got.empty?
      redis.pipelined { |p| pending_acks.each { |cmd| cmd.(p) } } unless pending_acks.empty?
      break
    end
    held.concat(got)
    done += got.size
    next if held.size < ACK_EVERY && done < JOBS

    case DESIGN
    when "floor", "basic"
      nil
    when "script", "fast"
      # Sent with the next fetch (the last ones on their own once the queue is empty).
      held.group_by(&:first).each do |list, jobs|
        pending_acks << lambda do |p|
          p.sadd("#{list}:acks", jobs.map { |_, i, _| i }) if ACK == "sadd"
          p.del([list, "#{list}:acks"])
        end
      end
    when "old"
      redis.hdel(working, held.map { |id, _| id.to_s })
    else
      redis.pipelined { |p| held.each { |list, j| p.lrem(list, -1, j) } }
    end
    held.clear
  end
  secs = now - t0
  dumped, total = callgrind_dump(redis_pid, OUT)
  left = redis.llen(queue) + (DESIGN == "old" ? redis.hlen(working) : redis.keys("oxidekiq:*").size)
  raise "#{left} jobs left in Redis after the probe" unless left.zero?
  raise "fetched #{done} of #{JOBS}" unless done == JOBS

  printf("%s%s, %s (%d-byte payloads): %d jobs, Redis %.0f instructions/job (%.1f s under valgrind)\n",
         DESIGN, DESIGN == "script" && ACK == "sadd" ? " (ACK=sadd)" : "", PAYLOAD ? "padded" : KIND, bytes, JOBS, total.to_f / JOBS, secs)
  puts "profile: #{dumped}"
ensure
  stop_all([redis_pid])
end
