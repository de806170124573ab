# The benchmark driver, run by bench/run.sh (which builds the binaries and starts a private Redis).
#
# Every drain follows the same steps whatever the system (bench/README.md, "Method"): FLUSHALL, enqueue
# with Ruby Sidekiq's own client (`Sidekiq::Client.push_bulk`, chunks of 1000), park the queue under
# another name (RENAME), start the drainer and wait until it has run one probe job (its cold start, timed
# apart), read its CPU time and Redis's (/proc/<pid>/stat), RENAME the queue back and block until Redis
# says it is empty (a keyspace event: the driver sleeps in select(2) meanwhile, costing the box nothing),
# wait for oxidekiq's acknowledgements, read the CPU times again, then TERM the drainer and wait.
# jobs/s = jobs / seconds from the release to the empty queue; CPU µs/job = CPU time spent / jobs.
#
# Environment: REDIS_URL, OXIDEKIQ_BIN, RUSTY_BIN, RESULTS_DIR, WORK_DIR (set by run.sh); JOBS (100000),
# ROUNDS (3), SCENARIOS (default: drain,defaults,activejob,io,latency,latency_ratio,locks,schedule,rss,scaleout,
# quiet,payloads), IO_JOBS (JOBS / 5), LOCK_JOBS (JOBS), SCHEDULE_JOBS (JOBS), SCALE_PROCS (1,2,4), LATENCY_RATE (5000),
# LATENCY_SECS (10), LATENCY_RATIO_RATE (1000), LATENCY_RUNS (5), LATENCY_OXIDEKIQ_CONC (200), LATENCY_RUBY_CONC (25),
# DEFAULTS_JOBS (JOBS; Ruby at most DEFAULTS_RUBY_JOBS, 30000), OXIDEKIQ_LOG_OFF (oxidekiq's arguments for
# "logging off"; default `--log-level warn` when its --help lists --log-level, else none: not measured),
# RUN_TIMEOUT (600 s), PAYLOAD_SIZES (0.2,1,4,16 KB), PAYLOAD_JOBS (min(JOBS, 100000), at most 256 MB of payload a round; Ruby at most 20000),
# PAYLOAD_CONC (200), UNIQUE_JOBS_LIB (unset: where sidekiq-unique-jobs 7.1.33 and brpoplpush-redis_script
# 0.1.3 are unpacked, e.g. /work/ext/uniq, for the locks scenario's Ruby peer; unset, Ruby runs unlocked).
# The end of the output is issue 42's targets 4-7, each with its figure, threshold and verdict.
require "etc"
require "fileutils"
require "socket"
require "uri"
require "json"
require "rbconfig"
require "set"
require "tmpdir"
require "time"
require_relative "jobs"

Sidekiq.logger.level = Logger::WARN
ActiveJob::Base.logger = Logger.new(nil)
REDIS_URL = ENV.fetch("REDIS_URL")
Sidekiq.configure_client { |c| c.redis = { url: REDIS_URL, size: 2 } }

ROOT = File.expand_path("..", __dir__)
OXIDEKIQ = ENV.fetch("OXIDEKIQ_BIN", File.join(ROOT, "target/release/oxidekiq"))
RUSTY = ENV.fetch("RUSTY_BIN", File.join(ROOT, "bench/rusty/target/release/rusty-sidekiq-bench"))
SIDEKIQ = ENV.fetch("SIDEKIQ_BIN") { Gem.bin_path("sidekiq", "sidekiq") }
RESULTS = ENV.fetch("RESULTS_DIR", File.join(ROOT, "bench/results"))
WORK = ENV.fetch("WORK_DIR") { Dir.mktmpdir("oxidekiq-bench") }
JOBS = Integer(ENV.fetch("JOBS", "100000"))
ROUNDS = Integer(ENV.fetch("ROUNDS", "3"))
IO_JOBS = Integer(ENV.fetch("IO_JOBS", (JOBS / 5).to_s))
# The lock scenario drains as many jobs as the no-op drain: at JOBS / 5 (20 000) the no-lock base took
# 55-76 ms, too short to time (264 000 jobs/s against 356 000-373 000 over 100 000 jobs, same build).
LOCK_JOBS = Integer(ENV.fetch("LOCK_JOBS", JOBS.to_s))
SCHEDULE_JOBS = Integer(ENV.fetch("SCHEDULE_JOBS", JOBS.to_s))
LATENCY_RATE = Integer(ENV.fetch("LATENCY_RATE", "5000"))
LATENCY_SECS = Float(ENV.fetch("LATENCY_SECS", "10"))
# Issue 42's latency target: p99 at LATENCY_RATIO_RATE jobs/s at most 1/5 of Ruby Sidekiq's, in every one of
# LATENCY_RUNS runs (alternating oxidekiq, Ruby, oxidekiq, ...), each system at its best drain concurrency.
LATENCY_RATIO_RATE = Integer(ENV.fetch("LATENCY_RATIO_RATE", "1000"))
LATENCY_RUNS = Integer(ENV.fetch("LATENCY_RUNS", "5"))
LATENCY_OXIDEKIQ_CONC = Integer(ENV.fetch("LATENCY_OXIDEKIQ_CONC", "200"))
LATENCY_RUBY_CONC = Integer(ENV.fetch("LATENCY_RUBY_CONC", "25"))
# The defaults scenario (issue 42's target 4): each system at its default command line (no -c; oxidekiq no
# --threads either), with its per-job logging on and off. Ruby Sidekiq drains a few thousand jobs a second at
# -c 10: at most DEFAULTS_RUBY_JOBS a round keep its rounds near ten seconds, plenty for a per-job figure.
DEFAULTS_JOBS = Integer(ENV.fetch("DEFAULTS_JOBS", JOBS.to_s))
DEFAULTS_RUBY_JOBS = [DEFAULTS_JOBS, Integer(ENV.fetch("DEFAULTS_RUBY_JOBS", "30000"))].min
RUN_TIMEOUT = Float(ENV.fetch("RUN_TIMEOUT", "600"))
# oxidekiq's runtime threads (`--threads`): 1 by default, as docs/configuration.md advises for a box
# whose other core runs Redis; "cpus" leaves oxidekiq's own default (one per CPU less the control plane's, at least
# one: 1 on 2 CPUs, where the two are the same). The drain scenario also measures "cpus".
THREADS = ENV.fetch("OXIDEKIQ_THREADS", "1")
SCALE_PROCS = ENV.fetch("SCALE_PROCS", "1,2,4").split(",").map { |x| Integer(x) }
# The payload scenario: Redis's CPU per job at these payload sizes (KB), up to PAYLOAD_JOBS jobs a round (enough
# that the floor's drain of small payloads lasts past a tenth of a second), every system at -c PAYLOAD_CONC.
PAYLOAD_SIZES = ENV.fetch("PAYLOAD_SIZES", "0.2,1,4,16").split(",").map { |x| Float(x) }
PAYLOAD_JOBS = Integer(ENV.fetch("PAYLOAD_JOBS", [JOBS, 100_000].min.to_s))
# A round's payload bytes are capped (16 KB x 100 000 would be 1.6 GB in Redis), and Ruby Sidekiq drains at
# most RUBY_PAYLOAD_JOBS a round (it drains a few thousand a second): a per-job figure needs no more.
PAYLOAD_ROUND_BYTES = 256 * 1024 * 1024
RUBY_PAYLOAD_JOBS = 20_000
PAYLOAD_CONC = Integer(ENV.fetch("PAYLOAD_CONC", "200"))
PAYLOAD_RELIABLE_MAX = 1.5
# The locks scenario's Ruby peer runs UniqueNoopJob under sidekiq-unique-jobs' while_executing lock when
# this points at the gem's unpacked source (bench/unique_jobs.rb); without it Ruby's unlocked NoopJob is
# the comparison, and the output says so.
UNIQUE_JOBS_LIB = ENV["UNIQUE_JOBS_LIB"]&.then { |d| d.empty? ? nil : File.expand_path(d) }
UNIQUE_JOBS_INCLUDES = UNIQUE_JOBS_LIB ? %w[brpoplpush-redis_script-0.1.3 sidekiq-unique-jobs-7.1.33].flat_map { |g| ["-I", File.join(UNIQUE_JOBS_LIB, g, "lib")] } : [].freeze
ALL = %w[drain defaults activejob io latency latency_ratio locks schedule rss scaleout quiet payloads].freeze
SCENARIOS = ENV.fetch("SCENARIOS", ALL.join(",")).split(",").map(&:strip).reject(&:empty?)
SYSTEMS = ENV.fetch("SYSTEMS", "oxidekiq,ruby,rusty").split(",").map { |x| x.strip.to_sym }
# Polling (readiness, acknowledgements, latency and schedule scenarios) is sparse: every 25 ms. The drain
# itself is not polled at all (keyspace events).
POLL = 0.025
QUEUE = "queue:default"
STAGING = "bench:staging"
CLK_TCK = Etc.sysconf(Etc::SC_CLK_TCK)

unknown = SCENARIOS - ALL
abort "driver: unknown scenario(s) #{unknown.join(', ')}; known: #{ALL.join(', ')}" unless unknown.empty?
FileUtils.mkdir_p(RESULTS)
FileUtils.mkdir_p(WORK)

$redis = Redis.new(url: REDIS_URL)
# The one keyspace event the drains wait on: the drained key deleted (a list popped empty is deleted,
# whatever popped it: BRPOP, BLMOVE, RPOP in a script). Only generic events are on, so each pop costs Redis
# one flag test, and only on the key's own channel (`__keyspace@0__:<key>`): a deleted key nobody subscribed
# to publishes to no one. (Until session 6 the driver listened on `__keyevent@0__:del`, the channel of every
# deleted key, so each lock a job released sent the driver a message: Redis CPU and wake-ups that are not
# the system's.)
$redis.config(:set, "notify-keyspace-events", "Kg")
REDIS_PID = Integer($redis.info("server").fetch("process_id"))

def now = Process.clock_gettime(Process::CLOCK_MONOTONIC)
def say(msg) = $stderr.puts("[bench #{Time.now.strftime('%H:%M:%S')}] #{msg}")

# ---------------------------------------------------------------------------------------------------
# Systems

SYSTEM_NAMES = { oxidekiq: "oxidekiq", ruby: "Ruby Sidekiq #{Sidekiq::VERSION}", rusty: "rusty-sidekiq",
                 floor: "floor (RPOP 100, no safety)" }.freeze

# The classes compiled into the oxidekiq binary (its registry names are string literals in it).
def oxidekiq_has?(klass)
  @oxi_bin ||= File.binread(OXIDEKIQ)
  @oxi_bin.include?(klass)
end

# `defaults`: the system's own default command line, as an operator starts it: no -c (both default to 10) and,
# for oxidekiq, no --threads (a thread per CPU less one).
def command(system, concurrency, queue: "default", extra: [], threads: THREADS, unique: false, defaults: false)
  conc = defaults ? [] : ["-c", concurrency.to_s]
  threads = "cpus" if defaults
  case system
  when :oxidekiq then [OXIDEKIQ, "-q", queue, *conc, *(threads == "cpus" ? [] : ["--threads", threads]), *extra]
  # Ruby runs the sidekiq script itself: the pid spawned is the Sidekiq process (its RSS is measured).
  when :ruby
    if unique # UniqueNoopJob under sidekiq-unique-jobs (bench/unique_jobs.rb, the gem from UNIQUE_JOBS_LIB)
      [RbConfig.ruby, *UNIQUE_JOBS_INCLUDES, SIDEKIQ, "-r", File.join(__dir__, "unique_jobs.rb"), "-q", queue, "-c", concurrency.to_s, *extra]
    else
      [RbConfig.ruby, SIDEKIQ, "-r", File.join(__dir__, "jobs.rb"), "-q", queue, *conc, *extra]
    end
  when :rusty then [RUSTY, concurrency.to_s]
  # The payload scenario's floor: a bare client popping 100 at a time (bench/floor.rb); no concurrency.
  when :floor then [RbConfig.ruby, File.join(__dir__, "floor.rb"), queue]
  else raise ArgumentError, system.to_s
  end
end

# `env`: variables for this drainer only (the defaults scenario's BENCH_SIDEKIQ_LOG_LEVEL, read by jobs.rb).
# RAILS_MAX_THREADS is cleared: oxidekiq reads it for its default concurrency.
def spawn_system(system, concurrency, log_name, env: {}, **opts)
  cmd = command(system, concurrency, **opts)
  log = File.join(WORK, "#{log_name}.log")
  pid = Process.spawn({ "REDIS_URL" => REDIS_URL, "RUST_LOG" => nil, "RAILS_MAX_THREADS" => nil }.merge(env), *cmd,
                      chdir: WORK, in: File::NULL, out: log, err: [:child, :out])
  $live << pid
  pid
end

def proc_status(pid, field)
  line = File.foreach("/proc/#{pid}/status").find { |l| l.start_with?("#{field}:") }
  line && line.split[1].to_i # kB
rescue Errno::ENOENT, Errno::ESRCH
  nil
end

# Drainers started and not yet reaped: only these are ever signalled.
$live = Set.new
at_exit { $live.dup.each { |pid| stop(pid) } }

def alive?(pid)
  return false unless $live.include?(pid)
  return true if Process.waitpid(pid, Process::WNOHANG).nil?
  $live.delete(pid)
  false
end

def stop(pid)
  return unless $live.delete?(pid)
  Process.kill("TERM", pid)
  deadline = now + 30
  until Process.waitpid(pid, Process::WNOHANG)
    if now > deadline
      Process.kill("KILL", pid)
      Process.waitpid(pid)
      break
    end
    sleep 0.01
  end
rescue Errno::ESRCH, Errno::ECHILD
  nil
end

# ---------------------------------------------------------------------------------------------------
# Enqueueing, always through Ruby Sidekiq's client

def push_chunks(total)
  (0...total).each_slice(1000) { |idx| yield idx }
end

def enqueue_plain(klass, total, &args)
  push_chunks(total) { |idx| Sidekiq::Client.push_bulk("class" => klass, "args" => idx.map(&args)) }
end

# What `perform_later` pushes (Rails 6.1's Sidekiq adapter), in bulk: JobWrapper around the serialized job.
# The job's arguments are the plain NoopJob's (`[i]`), so the ratio to plain is the cost of the wrapping
# alone (until session 6 the ActiveJob job also carried a `{"locale" => "en"}` hash the plain job did not).
def enqueue_activejob(total)
  push_chunks(total) do |idx|
    Sidekiq::Client.push_bulk(
      "class" => ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper, "wrapped" => NoopActiveJob,
      "queue" => "default", "args" => idx.map { |i| [NoopActiveJob.new(i).serialize] }
    )
  end
end

# A NoopJob whose one string argument pads the whole payload (as Ruby's client writes it) to about `bytes`:
# the padding is measured on a probe job pushed to a scratch queue (created_at and enqueued_at vary by a
# digit or two from one job to the next).
def payload_pad(bytes)
  @pads ||= {}
  @pads[bytes] ||= begin
    Sidekiq::Client.push("class" => NoopJob, "args" => [""], "queue" => "bench_probe")
    base = $redis.lindex("queue:bench_probe", 0).bytesize
    $redis.del("queue:bench_probe")
    "x" * [bytes - base, 0].max
  end
end

def enqueue_payload(bytes, total)
  pad = payload_pad(bytes)
  push_chunks(total) { |idx| Sidekiq::Client.push_bulk("class" => NoopJob, "args" => idx.map { [pad] }) }
end

ENQUEUE = {
  noop: ->(n) { enqueue_plain(NoopJob, n) { |i| [i] } },
  activejob: ->(n) { enqueue_activejob(n) },
  io: ->(n) { enqueue_plain(HardWorker, n) { ["x", 50] } },
  unique: ->(n) { enqueue_plain("UniqueNoopJob", n) { |i| [i] } },
  sequential: ->(n) { enqueue_plain("SequentialNoopJob", n) { |i| [i] } },
}.freeze

# ---------------------------------------------------------------------------------------------------
# One drain

# Where oxidekiq holds fetched, unacknowledged jobs: batch lists, landing lists, and the working hashes and
# lists of older releases.
def working_keys = %w[oxidekiq:batch:* oxidekiq:working:* oxidekiq:landing:*].flat_map { |p| $redis.keys(p) }
# Jobs held in one such key: a batch list's jobs not in its acks set, a landing list's jobs, a working
# hash's entries (older releases).
def held(key)
  case $redis.type(key)
  when "list"
    acks = key.start_with?("oxidekiq:batch:") ? $redis.scard(key.sub("oxidekiq:batch:", "oxidekiq:acks:")) : 0
    $redis.llen(key) - acks
  when "hash" then $redis.hlen(key)
  else 0
  end
end
def failures = $redis.zcard("retry") + $redis.zcard("dead")

# CPU time (user + system, children included: none of the drainers forks) of `pid` so far, in seconds.
def cpu_seconds(pid)
  fields = File.read("/proc/#{pid}/stat").split(") ", 2).last.split
  fields[11, 4].sum(&:to_i).to_f / CLK_TCK # utime stime cutime cstime (fields 14-17 of proc(5))
rescue Errno::ENOENT, Errno::ESRCH
  nil
end

# CPU seconds the whole machine spent busy so far (/proc/stat: all but idle and iowait).
def machine_busy_seconds
  f = File.foreach("/proc/stat").first.split.drop(1).map(&:to_i)
  (f.sum - f[3] - f[4]).to_f / CLK_TCK
end

# Redis's CPU time so far, in seconds, as Redis reads it (INFO cpu: getrusage, to the microsecond): the same
# time /proc/<pid>/stat counts in 10 ms ticks, precise enough for the floor's half microsecond a job over
# 20 000 jobs (one tick). The INFO command is the driver's and left out of the per-job commands.
def redis_cpu_seconds
  cpu = $redis.info("cpu")
  Float(cpu.fetch("used_cpu_sys")) + Float(cpu.fetch("used_cpu_user"))
rescue StandardError
  cpu_seconds(REDIS_PID) || 0.0
end

def cpu_snapshot(pids) = { sys: pids.sum { |p| cpu_seconds(p) || 0.0 }, redis: redis_cpu_seconds,
                           machine: machine_busy_seconds }

# A second connection in SUBSCRIBE mode on `key`'s own keyspace channel, spoken in raw RESP so the
# driver can sleep in select(2) on it (and wake every 0.5 s only to check that the drainers are alive).
def subscribe_del(key)
  uri = URI(REDIS_URL)
  sock = TCPSocket.new(uri.host, uri.port)
  sock.setsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY, 1)
  channel = "__keyspace@0__:#{key}"
  sock.write("*2\r\n$9\r\nSUBSCRIBE\r\n$#{channel.bytesize}\r\n#{channel}\r\n")
  buf = +""
  until buf.include?(channel) && buf.count("\n") >= 6 # *3 $9 subscribe $n channel :1
    raise "no answer to SUBSCRIBE" unless IO.select([sock], nil, nil, 5)
    buf << sock.readpartial(4096)
  end
  sock
end

# Blocks until Redis deletes `key` (the queue popped empty): the `del` event on the channel of
# `subscribe_del(key)` (its other events, such as the release's `rename_to`, are not it). Returns the
# monotonic time it was seen.
def wait_deleted(sock, key, pids, label, t0)
  buf = +""
  event = "__keyspace@0__:#{key}\r\n$3\r\ndel\r\n"
  loop do
    if IO.select([sock], nil, nil, 0.5)
      buf << sock.readpartial(65_536)
      return now if buf.include?(event)
      buf = buf[-200..] if buf.size > 4096
    else
      raise "#{label}: a drainer exited early (see #{WORK}/#{label}*.log)" unless pids.all? { |p| alive?(p) }
      raise "#{label}: timed out after #{RUN_TIMEOUT} s with #{$redis.llen(QUEUE)} jobs left" if now - t0 > RUN_TIMEOUT
    end
  end
ensure
  sock.close
end

# The driver's own commands, left out of the per-job Redis figures.
DRIVER_COMMANDS = %w[keys hlen llen type scard info config rename subscribe ping].freeze

# Redis's own count of the commands run since CONFIG RESETSTAT (INFO commandstats), per job:
# { "evalsha" => [calls per job, µs per job], ... }, the drainer's commands only, busiest first.
def redis_commands(jobs)
  $redis.info("commandstats").filter_map do |key, value|
    name = key.to_s.delete_prefix("cmdstat_")
    next if DRIVER_COMMANDS.include?(name.split("|").first) # Redis 7 names subcommands "config|resetstat"
    # redis-rb 4.x parses each line into a hash; a raw line is "calls=..,usec=..,..".
    value = value.split(",").to_h { |kv| kv.split("=", 2) } if value.is_a?(String)
    calls = value.fetch("calls").to_f
    usec = value.fetch("usec").to_f
    [name, [calls / jobs, usec / jobs]]
  end.sort_by { |_, (_, us)| -us }.to_h
end

def wait_acked(label, t0)
  loop do
    return now - t0 if working_keys.all? { |k| held(k).zero? }
    raise "#{label}: in-flight jobs never acknowledged" if now - t0 > RUN_TIMEOUT
    sleep POLL
  end
end

# Spawns `procs` drainers and waits until they have run one probe job each way round: a NoopJob pushed and
# taken (and for oxidekiq acknowledged), and, for several processes, every one of them in `processes`.
def warm_up(system, pids, label)
  deadline = now + 60
  Sidekiq::Client.push("class" => NoopJob, "args" => [0])
  loop do
    done = $redis.llen(QUEUE).zero? && (system != :oxidekiq || working_keys.all? { |k| held(k).zero? })
    done &&= $redis.scard("processes") >= pids.size if pids.size > 1
    break if done
    raise "#{label}: a drainer exited during start-up (see #{WORK}/#{label}*.log)" unless pids.all? { |p| alive?(p) }
    raise "#{label}: no drainer took the probe job in 60 s" if now > deadline
    sleep POLL
  end
  sleep 0.2 # the probe's own bookkeeping (acks, logs) settles
end

# Enqueue `jobs` jobs, start `procs` drainers of `system`, time one warm drain. Returns a round's record.
# `tail`: the jobs' own duration. At the empty queue every job has started (each system fetches only for
# a free slot), so the drain is complete `tail` seconds later, whatever the system: it is added to all.
# `quiet`: nothing but the keyspace event (no CPU readings, no acknowledgement polling).
# `defaults`, `env`: the defaults scenario's default command line and environment (command, spawn_system);
# `count_log`: count the start and done lines the drainer wrote, per job (the log files of that round).
def drain_once(system, concurrency, kind, jobs, label, tail, procs: 1, quiet: false, threads: THREADS, extra: [],
               defaults: false, env: {}, count_log: false)
  $redis.flushall
  if (bytes = kind.to_s[/\Apayload_(\d+)\z/, 1])
    enqueue_payload(Integer(bytes), jobs)
  else
    ENQUEUE.fetch(kind).call(jobs)
  end
  queued = $redis.llen(QUEUE)
  raise "enqueued #{queued} of #{jobs}" unless queued == jobs
  payload_bytes = $redis.lindex(QUEUE, 0).bytesize
  $redis.rename(QUEUE, STAGING)

  t_spawn = now
  pids = Array.new(procs) do |k|
    spawn_system(system, concurrency, procs > 1 ? "#{label}-p#{k + 1}" : label, defaults: defaults, env: env,
                 **(if system == :oxidekiq then { threads: threads, extra: extra }
                    elsif system == :ruby && kind == :unique then { unique: true }
                    else {}
                    end))
  end
  warm_up(system, pids, label)
  ready = now - t_spawn
  sock = subscribe_del(QUEUE)
  unless quiet
    $redis.config(:resetstat)
    before = cpu_snapshot(pids)
  end
  t0 = now
  $redis.rename(STAGING, QUEUE)
  empty = wait_deleted(sock, QUEUE, pids, label, t0) - t0
  acked = wait_acked(label, t0) if system == :oxidekiq && !quiet
  sleep tail if tail.positive?
  wall = now - t0
  unless quiet
    after = cpu_snapshot(pids)
    commands = redis_commands(jobs)
  end
  hwm = pids.map { |p| proc_status(p, "VmHWM") }.compact.max
  pids.each { |p| stop(p) }
  secs = empty + tail
  # wall: release to the last acknowledgement (and the tail), the window of the CPU readings and busy shares.
  rec = { seconds: secs, jobs_per_s: jobs / secs, ready_s: ready, acked_s: acked, hwm_kb: hwm, wall_s: wall,
          failed: failures, left: $redis.llen(QUEUE), payload_bytes: payload_bytes }
  rec[:commands] = commands if commands
  rec[:log_lines_per_job] = log_lines(label, procs) / jobs.to_f if count_log
  if before && after
    rec[:cpu_us] = (after[:sys] - before[:sys]) * 1e6 / jobs
    rec[:redis_us] = (after[:redis] - before[:redis]) * 1e6 / jobs
    rec[:sys_busy] = (after[:sys] - before[:sys]) / wall
    rec[:redis_busy] = (after[:redis] - before[:redis]) / wall
    # Everything else the machine ran meanwhile (other users, the driver), in cores: 0 on a quiet box.
    rec[:others] = [((after[:machine] - before[:machine]) - (after[:sys] - before[:sys]) -
                     (after[:redis] - before[:redis])) / wall, 0.0].max
  end
  rec
ensure
  pids&.each { |p| stop(p) }
end

# Lines the drainer(s) of `label` wrote saying a job started or was done (Sidekiq's and oxidekiq's text
# lines end "INFO: start" / "INFO: done"), in this round's log files (each spawn truncates its own).
def log_lines(label, procs)
  files = procs > 1 ? Array.new(procs) { |k| "#{label}-p#{k + 1}" } : [label]
  files.sum do |f|
    path = File.join(WORK, "#{f}.log")
    File.exist?(path) ? File.foreach(path).count { |l| l.end_with?("INFO: start\n", "INFO: done\n") } : 0
  end
end

def median(xs)
  s = xs.compact.sort
  return nil if s.empty?
  s.size.odd? ? s[s.size / 2] : (s[s.size / 2 - 1] + s[s.size / 2]) / 2.0
end

$rows = []  # throughput rows
$notes = []

def measure(scenario, system, concurrency, kind, jobs, tail: 0.0, procs: 1, rounds_n: ROUNDS, quiet: false, record: true,
            threads: THREADS)
  measure_alternating([{ scenario: scenario, system: system, concurrency: concurrency, kind: kind, jobs: jobs,
                         tail: tail, procs: procs, quiet: quiet, threads: threads }], rounds_n: rounds_n, record: record).first
end

# Measures several configurations round by round in turn (A1 B1 A2 B2 ...), so that a ratio between them
# compares rounds taken under the same conditions on a machine whose load drifts. Returns one row each.
def measure_alternating(configs, rounds_n: ROUNDS, record: true)
  configs = configs.select { |c| SYSTEMS.include?(c[:system]) || c[:system] == :floor }
  configs.each do |c|
    c[:threads] ||= THREADS
    c[:extra] ||= []
    c[:env] ||= {}
    c[:label] = "#{c[:scenario]}-#{c[:kind]}-#{c[:system]}-c#{c[:concurrency]}#{c[:procs] > 1 ? "-x#{c[:procs]}" : ''}" \
                "#{c[:system] == :oxidekiq && c[:threads] != THREADS ? "-t#{c[:threads]}" : ''}" \
                "#{c[:extra].join('-')}#{c[:tag]}".gsub(%r{[ /,:;()]}, "_")
    c[:rounds] = []
    say "#{c[:label]}: #{rounds_n} round(s) of #{c[:jobs]} #{c[:kind]} jobs#{c[:procs] > 1 ? " over #{c[:procs]} processes" : ''}" \
        "#{c[:quiet] ? ' (quiet)' : ''}#{configs.size > 1 ? ' (rounds alternate with ' + (configs - [c]).map { |o| o[:name] || "#{SYSTEM_NAMES[o[:system]]} #{o[:kind]}" }.join(', ') + ')' : ''}"
  end
  rounds_n.times do |r|
    configs.each do |c|
      next if c[:error]
      rec = drain_once(c[:system], c[:concurrency], c[:kind], c[:jobs], c[:label], c[:tail], procs: c[:procs], quiet: c[:quiet],
                       threads: c[:threads], extra: c[:extra], defaults: c[:defaults], env: c[:env],
                       count_log: c[:count_log])
      say format("  %s round %d: %.3f s, %.0f jobs/s%s%s, ready after %.2f s%s, peak RSS %.1f MB%s", c[:label], r + 1,
                 rec[:seconds], rec[:jobs_per_s],
                 rec[:cpu_us] ? format(", CPU %.1f µs/job (%.0f%% of a core)", rec[:cpu_us], rec[:sys_busy] * 100) : "",
                 rec[:redis_us] ? format(", Redis %.1f µs/job (%.0f%%), others %.2f cores", rec[:redis_us], rec[:redis_busy] * 100, rec[:others]) : "",
                 rec[:ready_s], rec[:acked_s] ? format(", all acked at %.3f s", rec[:acked_s]) : "",
                 (rec[:hwm_kb] || 0) / 1024.0, rec[:failed].positive? ? ", #{rec[:failed]} FAILED" : "")
      say format("  %s: %.2f start/done log lines per job", c[:label], rec[:log_lines_per_job]) if rec[:log_lines_per_job]
      c[:rounds] << rec
    rescue StandardError => e
      say "  #{c[:label]} FAILED: #{e.message}"
      $notes << "#{c[:label]}: failed (#{e.message})"
      c[:error] = e.message
    end
  end
  configs.map do |c|
    name = SYSTEM_NAMES[c[:system]]
    name += c[:threads] == "cpus" ? " (default threads)" : " (#{c[:threads]} threads)" if c[:system] == :oxidekiq && c[:threads] != THREADS
    name = c[:name] if c[:name]
    base = { scenario: c[:scenario], system: c[:system], name: name, concurrency: c[:concurrency],
             kind: c[:kind], procs: c[:procs], jobs: c[:jobs] }
    row = if c[:error]
            base.merge(error: c[:error])
          else
            rounds = c[:rounds]
            rates = rounds.map { |x| x[:jobs_per_s] }
            base.merge(tail_s: c[:tail], rounds: rounds, median: median(rates), min: rates.min, max: rates.max,
                       cpu_us: median(rounds.map { |x| x[:cpu_us] }), redis_us: median(rounds.map { |x| x[:redis_us] }),
                       sys_busy: median(rounds.map { |x| x[:sys_busy] }), redis_busy: median(rounds.map { |x| x[:redis_busy] }),
                       others: rounds.filter_map { |x| x[:others] }.max,
                       commands: rounds.sort_by { |x| x[:jobs_per_s] }[rounds.size / 2][:commands],
                       rss_mb: median(rounds.map { |x| x[:hwm_kb] })&./(1024.0), ready_s: median(rounds.map { |x| x[:ready_s] }),
                       acked_s: median(rounds.map { |x| x[:acked_s] }), failed: rounds.sum { |x| x[:failed] },
                       payload_bytes: median(rounds.map { |x| x[:payload_bytes] }),
                       log_lines_per_job: median(rounds.map { |x| x[:log_lines_per_job] }),
                       wall_jobs_per_s: median(rounds.map { |x| x[:wall_s] && c[:jobs] / x[:wall_s] }))
          end
    $rows << row if record
    row
  end
end

def best(rows) = rows.compact.reject { |r| r[:median].nil? }.max_by { |r| r[:median] }

$ratios = []
# a / b of the medians of `field` (jobs/s by default; :cpu_us for CPU per job).
def ratio(label, a, b, a_name = nil, b_name = nil, field: :median)
  return if a.nil? || b.nil? || a[field].nil? || b[field].nil? || b[field].zero?
  $ratios << { label: label, value: a[field] / b[field],
               a: a_name || "#{a[:name]} -c #{a[:concurrency]}", b: b_name || "#{b[:name]} -c #{b[:concurrency]}" }
end

# ---------------------------------------------------------------------------------------------------
# Scenarios

$latency = []
$idle = []
$schedule = []

def scenario_drain
  ox = [10, 25, 200].to_h { |c| [c, measure("no-op drain", :oxidekiq, c, :noop, JOBS)] }
  # oxidekiq's own default (no --threads: a runtime thread per CPU less one), for comparison (not a candidate for "best").
  measure("no-op drain", :oxidekiq, 200, :noop, JOBS, threads: "cpus") unless THREADS == "cpus"
  rb = [10, 25].to_h { |c| [c, measure("no-op drain", :ruby, c, :noop, JOBS)] }
  ru = [10, 25, 50].to_h { |c| [c, measure("no-op drain", :rusty, c, :noop, JOBS)] }
  [10, 25].each do |c|
    ratio("no-op drain, same concurrency: oxidekiq / Ruby Sidekiq", ox[c], rb[c])
    ratio("no-op drain, same concurrency: oxidekiq / rusty-sidekiq", ox[c], ru[c])
  end
  ratio("no-op drain, each at its best: oxidekiq / Ruby Sidekiq", best(ox.values), best(rb.values))
  ratio("no-op drain, each at its best: oxidekiq / rusty-sidekiq", best(ox.values), best(ru.values))
  ratio("CPU per no-op job, each at its best: Ruby Sidekiq / oxidekiq", best(rb.values), best(ox.values), field: :cpu_us)
  ratio("CPU per no-op job, each at its best: rusty-sidekiq / oxidekiq", best(ru.values), best(ox.values), field: :cpu_us)
end

# oxidekiq's arguments for "per-job logging off": OXIDEKIQ_LOG_OFF if set (an empty value: none), else
# `--log-level warn` when the binary's --help lists --log-level; nil when it has no such switch.
def oxidekiq_log_off
  return @oxidekiq_log_off if defined?(@oxidekiq_log_off)
  @oxidekiq_log_off = if ENV.key?("OXIDEKIQ_LOG_OFF")
                        ENV["OXIDEKIQ_LOG_OFF"].split.then { |a| a.empty? ? nil : a }
                      elsif `#{OXIDEKIQ} --help 2>/dev/null`.include?("--log-level")
                        %w[--log-level warn]
                      end
end

$defaults = {}

# Issue 42's target 4: CPU per no-op job (and Redis's per job) of each system at its default command line
# (`sidekiq -r jobs.rb -q default`: concurrency 10; `oxidekiq -q default`: concurrency 10, a thread per CPU
# less one), with its default per-job logging (a start and a done line) and with it off (Ruby: Sidekiq.logger
# at WARN, set by jobs.rb from BENCH_SIDEKIQ_LOG_LEVEL; oxidekiq: oxidekiq_log_off). The four configurations
# take their rounds in turn (oxidekiq on, Ruby on, oxidekiq off, Ruby off, then again), so that a drift in the
# machine's load lands on both systems; the ratios are of the medians and also given round by round.
def scenario_defaults
  off_args = oxidekiq_log_off
  base = { concurrency: 10, kind: :noop, tail: 0.0, procs: 1, quiet: false, defaults: true, count_log: true }
  configs = {}
  %i[on off].each do |mode|
    scenario = "defaults, logging #{mode}"
    ox = base.merge(scenario: scenario, system: :oxidekiq, jobs: DEFAULTS_JOBS, tag: "-default-log#{mode}",
                    name: "oxidekiq (no -c, no --threads#{mode == :off ? ", #{off_args&.join(' ')}" : ''})")
    ox[:extra] = off_args if mode == :off
    rb = base.merge(scenario: scenario, system: :ruby, jobs: DEFAULTS_RUBY_JOBS, tag: "-default-log#{mode}",
                    name: "Ruby Sidekiq #{Sidekiq::VERSION} (no -c#{mode == :off ? ', logger at WARN' : ''})")
    rb[:env] = { "BENCH_SIDEKIQ_LOG_LEVEL" => "warn" } if mode == :off
    configs[[mode, :oxidekiq]] = ox unless mode == :off && off_args.nil?
    configs[[mode, :ruby]] = rb
  end
  if off_args.nil? && SYSTEMS.include?(:oxidekiq)
    $notes << "defaults: this oxidekiq build has no switch for its log level (no --log-level in --help; OXIDEKIQ_LOG_OFF " \
              "unset), so it ran with its per-job lines only; the logging-off ratios set Ruby with its lines off against " \
              "oxidekiq with them on: a lower bound of the ratio with both off"
  end
  keys = configs.keys.select { |_, system| SYSTEMS.include?(system) }
  rows = measure_alternating(keys.map { |k| configs[k] })
  got = keys.zip(rows).to_h { |k, r| [k, r && !r[:error] && r[:median] ? r : nil] }
  %i[on off].each do |mode|
    ox = got[[mode, :oxidekiq]] || (mode == :off ? got[[:on, :oxidekiq]] : nil)
    rb = got[[mode, :ruby]]
    next unless ox && rb
    lower = mode == :off && got[[:off, :oxidekiq]].nil?
    per = lambda do |field|
      ox[:rounds].zip(rb[:rounds]).filter_map { |x, y| y && x[field]&.positive? && y[field] / x[field] }
    end
    $defaults[mode] = { ruby: rb[:name], oxidekiq: ox[:name], lower_bound: lower,
                        ruby_cpu_us: rb[:cpu_us], oxidekiq_cpu_us: ox[:cpu_us],
                        ruby_redis_us: rb[:redis_us], oxidekiq_redis_us: ox[:redis_us],
                        ruby_log_lines: rb[:log_lines_per_job], oxidekiq_log_lines: ox[:log_lines_per_job],
                        cpu_ratio: rb[:cpu_us] && ox[:cpu_us]&.positive? ? rb[:cpu_us] / ox[:cpu_us] : nil,
                        redis_ratio: rb[:redis_us] && ox[:redis_us]&.positive? ? rb[:redis_us] / ox[:redis_us] : nil,
                        cpu_per_round: per.(:cpu_us), redis_per_round: per.(:redis_us) }
    if mode == :off
      [[rb, rb[:log_lines_per_job]], (lower ? [] : [ox, ox[:log_lines_per_job]])].each do |r, lines|
        next unless lines && lines > 0.01
        $notes << format("defaults: %s still wrote %.2f start/done lines per job with its logging \"off\": the switch did " \
                         "not turn them off, so its logging-off figures are not that", r[:name], lines)
      end
    end
    suffix = lower ? " (oxidekiq's lines on: a lower bound)" : ""
    ratio("CPU per no-op job, defaults, logging #{mode}: Ruby Sidekiq / oxidekiq (target 80x)#{suffix}", rb, ox,
          rb[:name], ox[:name], field: :cpu_us)
    ratio("Redis CPU per no-op job, defaults, logging #{mode}: Ruby Sidekiq / oxidekiq (target 20x)#{suffix}", rb, ox,
          rb[:name], ox[:name], field: :redis_us)
  end
end

# ActiveJob against plain no-op jobs, rounds alternating (plain 1, ActiveJob 1, plain 2, ...): the ratio is
# taken round by round between neighbours, and its median and minimum reported.
def scenario_activejob
  [[:oxidekiq, 200], [:ruby, 10]].each do |system, c|
    next unless SYSTEMS.include?(system)
    plain, aj = measure_alternating([
      { scenario: "no-op (beside ActiveJob)", system: system, concurrency: c, kind: :noop, jobs: JOBS, tail: 0.0, procs: 1, quiet: false },
      { scenario: "ActiveJob no-op", system: system, concurrency: c, kind: :activejob, jobs: JOBS, tail: 0.0, procs: 1, quiet: false },
    ])
    name = "#{SYSTEM_NAMES[system]} -c #{c}"
    ratio("ActiveJob / plain no-op jobs/s (alternating rounds): #{name}", aj, plain, "ActiveJob NoopActiveJob", "NoopJob")
    ratio("ActiveJob / plain no-op CPU per job: #{name}", aj, plain, "ActiveJob NoopActiveJob", "NoopJob", field: :cpu_us)
    next unless aj[:rounds] && plain[:rounds]
    per = aj[:rounds].zip(plain[:rounds]).filter_map { |x, y| y && x[:jobs_per_s] / y[:jobs_per_s] }
    $notes << "ActiveJob / plain no-op jobs/s, #{name}, round by round (each ActiveJob round over the plain round just " \
              "before it): #{per.map { |v| format('%.2fx', v) }.join(', ')}; minimum #{format('%.2fx', per.min)}"
  end
end

def scenario_io
  ox = measure("I/O 50 ms", :oxidekiq, 1000, :io, IO_JOBS, tail: 0.05)
  rb = [25, 50, 100].map { |c| measure("I/O 50 ms", :ruby, c, :io, IO_JOBS, tail: 0.05) }
  ru = measure("I/O 50 ms", :rusty, 1000, :io, IO_JOBS, tail: 0.05)
  $notes << "I/O 50 ms: times are release → empty queue + 50 ms (the last jobs fetched finish then), for every system"
  ratio("I/O 50 ms: oxidekiq / Ruby Sidekiq (best)", ox, best(rb))
  ratio("I/O 50 ms: oxidekiq / rusty-sidekiq", ox, ru)
end

def scenario_locks
  locked = {}
  base = measure("locks", :oxidekiq, 200, :noop, LOCK_JOBS) or return
  base[:name] = "oxidekiq NoopJob"
  { unique: "UniqueNoopJob", sequential: "SequentialNoopJob" }.each do |kind, klass|
    unless oxidekiq_has?(klass)
      $notes << "locks: #{klass} is not in this oxidekiq build; skipped (spec in bench/README.md)"
      next
    end
    row = measure("locks", :oxidekiq, 200, kind, LOCK_JOBS)
    row[:name] = "oxidekiq #{klass}"
    ratio("locks: #{klass} / NoopJob (no lock)", row, base)
    locked[kind] = row
    next unless row[:cpu_us] && base[:cpu_us]
    above = row[:cpu_us] - base[:cpu_us]
    $notes << format("locks: CPU per %s job, oxidekiq + Redis: %.1f + %.1f µs (NoopJob: %.1f + %.1f); oxidekiq's share " \
                     "above a plain job %.1f µs (target under 1 µs: %s)", klass, row[:cpu_us], row[:redis_us].to_f,
                     base[:cpu_us], base[:redis_us].to_f, above, above < 1.0 ? "met" : "not met")
  end
  return unless SYSTEMS.include?(:ruby) && locked[:unique]
  # Ruby's jobs/s is a rate: a fifth of the jobs (at most 20 000) keeps its rounds under a minute.
  ruby_jobs = [LOCK_JOBS, 20_000].min
  if UNIQUE_JOBS_LIB
    rb = measure("locks", :ruby, 10, :unique, ruby_jobs) or return
    rb[:name] = "Ruby Sidekiq #{Sidekiq::VERSION} UniqueNoopJob (sidekiq-unique-jobs 7.1.33, while_executing)"
    ratio("locks: oxidekiq UniqueNoopJob / Ruby Sidekiq UniqueNoopJob under sidekiq-unique-jobs while_executing (target 20x)",
          locked[:unique], rb)
  else
    rb = measure("locks", :ruby, 10, :noop, ruby_jobs) or return
    rb[:name] = "Ruby Sidekiq #{Sidekiq::VERSION} NoopJob (no lock: UNIQUE_JOBS_LIB unset)"
    ratio("locks: oxidekiq UniqueNoopJob / Ruby Sidekiq NoopJob WITHOUT a lock (sidekiq-unique-jobs not loaded: " \
          "UNIQUE_JOBS_LIB unset; target 20x against the locked figure)", locked[:unique], rb)
    $notes << "locks: Ruby Sidekiq ran its NoopJob without a lock (UNIQUE_JOBS_LIB unset): the ratio to it understates " \
              "the locked comparison; set UNIQUE_JOBS_LIB to the unpacked sidekiq-unique-jobs 7.1.33 (see bench/unique_jobs.rb)"
  end
end

$payloads = []

# Redis's CPU per job at several payload sizes (PAYLOAD_SIZES KB: a NoopJob whose string argument pads the
# payload), for oxidekiq's reliable fetch, its basic fetch, the floor (bench/floor.rb: `RPOP queue 100` and
# nothing else) and Ruby Sidekiq, all at -c PAYLOAD_CONC, rounds alternating between the four at each size
# so that a drift of the machine's load lands on all of them. Issue 42's target 5: reliable fetch within
# PAYLOAD_RELIABLE_MAX (1.5x) of the floor in every round at every size ("met" only then), and basic fetch at
# or below the floor (medians) at every size.
def scenario_payloads
  PAYLOAD_SIZES.each do |kb|
    bytes = (kb * 1024).round
    scenario = format("payload %g KB", kb)
    jobs = [PAYLOAD_JOBS, PAYLOAD_ROUND_BYTES / bytes].min
    base = { scenario: scenario, concurrency: PAYLOAD_CONC, kind: :"payload_#{bytes}", jobs: jobs, tail: 0.0,
             procs: 1, quiet: false }
    configs = [
      base.merge(system: :oxidekiq, name: "oxidekiq, reliable fetch"),
      base.merge(system: :oxidekiq, name: "oxidekiq, basic fetch", extra: %w[--fetch basic]),
      base.merge(system: :floor, concurrency: 1),
      base.merge(system: :ruby, jobs: [jobs, RUBY_PAYLOAD_JOBS].min),
    ]
    reliable, basic, floor, ruby = configs.map { |c| SYSTEMS.include?(c[:system]) || c[:system] == :floor ? c : nil }
    list = [reliable, basic, floor, ruby].compact
    rows = measure_alternating(list)
    row = lambda do |c|
      r = c && rows[list.index { |x| x.equal?(c) }]
      r && !r[:error] ? r : nil
    end
    rel, flo, bas = row.(reliable), row.(floor), row.(basic)
    per = rel && flo ? rel[:rounds].zip(flo[:rounds]).filter_map { |x, y| y && y[:redis_us].positive? && x[:redis_us] / y[:redis_us] } : []
    $payloads << { kb: kb, bytes: median((rel || flo || {})[:rounds].to_a.map { |x| x[:payload_bytes] }),
                   reliable: rel&.dig(:redis_us), basic: row.(basic)&.dig(:redis_us), floor: flo&.dig(:redis_us),
                   ruby: row.(ruby)&.dig(:redis_us), ruby_name: row.(ruby) && "#{row.(ruby)[:name]} -c #{row.(ruby)[:concurrency]}",
                   ratio: rel && flo && flo[:redis_us].positive? ? rel[:redis_us] / flo[:redis_us] : nil, per_round: per,
                   met: !per.empty? && per.size == ROUNDS && per.all? { |x| x <= PAYLOAD_RELIABLE_MAX },
                   basic_ratio: bas && flo && flo[:redis_us].positive? ? bas[:redis_us] / flo[:redis_us] : nil }
    $payloads.last[:basic_met] = !$payloads.last[:basic_ratio].nil? && $payloads.last[:basic_ratio] <= 1.0
  end
end

def percentile(sorted, p)
  return nil if sorted.empty?
  sorted[[(p * sorted.size).ceil - 1, 0].max]
end

# A steady `rate` jobs/s of LatencyJob for LATENCY_SECS against an already running, warmed-up drainer. Returns
# the run's record, kept in $latency when `record`.
def latency_once(system, concurrency, rate: LATENCY_RATE, record: true, tag: "")
  return unless SYSTEMS.include?(system)
  label = "latency-#{system}-c#{concurrency}#{tag}"
  if system == :oxidekiq && !oxidekiq_has?("LatencyJob")
    note = "latency: LatencyJob is not in this oxidekiq build; skipped (spec in bench/README.md)"
    $notes << note unless $notes.include?(note)
    return
  end
  say "#{label}: #{rate} jobs/s for #{LATENCY_SECS} s"
  $redis.flushall
  pid = spawn_system(system, concurrency, label)
  # Warm-up: one probe job answered proves the drainer is up and polling.
  deadline = now + 60
  until $redis.llen("bench:latency").positive?
    Sidekiq::Client.push("class" => LatencyJob, "args" => [Time.now.to_f]) if $redis.llen(QUEUE).zero?
    raise "#{label}: the drainer exited early" unless alive?(pid)
    raise "#{label}: no answer to the warm-up job" if now > deadline
    sleep 0.05
  end
  sleep 0.5
  $redis.del("bench:latency")
  pushed = 0
  t0 = now
  until (elapsed = now - t0) >= LATENCY_SECS
    due = (elapsed * rate).floor - pushed
    if due.positive?
      sent = Time.now.to_f
      Sidekiq::Client.push_bulk("class" => LatencyJob, "args" => Array.new(due) { [sent] })
      pushed += due
    end
    sleep 0.001
  end
  produced_rate = pushed / (now - t0)
  backlog = $redis.llen(QUEUE)
  deadline = now + 60
  sleep 0.01 while $redis.llen("bench:latency") < pushed && now < deadline
  hwm = proc_status(pid, "VmHWM")
  stop(pid)
  samples = $redis.lrange("bench:latency", 0, -1).map { |s| Float(s) * 1000 }.sort
  raise "#{label}: #{samples.size} of #{pushed} jobs answered" if samples.size < pushed
  rec = { system: system, name: SYSTEM_NAMES[system], concurrency: concurrency, pushed: pushed,
          rate: produced_rate, backlog: backlog, p50_ms: percentile(samples, 0.50), p99_ms: percentile(samples, 0.99),
          max_ms: samples.last, rss_mb: hwm && hwm / 1024.0, failed: failures }
  say format("  %.0f jobs/s produced: p50 %.2f ms, p99 %.2f ms, max %.2f ms", rec[:rate], rec[:p50_ms],
             rec[:p99_ms], rec[:max_ms])
  $latency << rec if record
  rec
rescue StandardError => e
  say "  #{label} FAILED: #{e.message}"
  $notes << "#{label}: failed (#{e.message})"
  stop(pid) if pid
  nil
end

def scenario_latency
  latency_once(:oxidekiq, LATENCY_OXIDEKIQ_CONC)
  latency_once(:ruby, LATENCY_RUBY_CONC)
  latency_once(:rusty, 50)
end

$latency_ratio = []

# Issue 42's target 6: enqueue-to-start p99 at LATENCY_RATIO_RATE jobs/s at most 1/5 of Ruby Sidekiq's, in
# every one of LATENCY_RUNS runs; the runs alternate (oxidekiq 1, Ruby 1, oxidekiq 2, ...) so that a drift
# in the machine's load lands on both, and run k of one is compared with run k of the other.
def scenario_latency_ratio
  return unless SYSTEMS.include?(:oxidekiq) && SYSTEMS.include?(:ruby)
  say "latency_ratio: #{LATENCY_RUNS} runs each of #{LATENCY_RATIO_RATE} jobs/s for #{LATENCY_SECS} s, oxidekiq -c " \
      "#{LATENCY_OXIDEKIQ_CONC} and Ruby Sidekiq -c #{LATENCY_RUBY_CONC} alternating"
  LATENCY_RUNS.times do |k|
    ox = latency_once(:oxidekiq, LATENCY_OXIDEKIQ_CONC, rate: LATENCY_RATIO_RATE, record: false, tag: "-ratio#{k + 1}")
    return if ox.nil? && !oxidekiq_has?("LatencyJob")
    rb = latency_once(:ruby, LATENCY_RUBY_CONC, rate: LATENCY_RATIO_RATE, record: false, tag: "-ratio#{k + 1}")
    ratio = ox && rb && ox[:p99_ms].positive? ? rb[:p99_ms] / ox[:p99_ms] : nil
    $latency_ratio << { run: k + 1, oxidekiq: ox, ruby: rb, ratio: ratio, met: !ratio.nil? && ratio >= 5.0 }
    say format("  run %d: p99 Ruby %s ms / oxidekiq %s ms = %s", k + 1, rb ? format("%.2f", rb[:p99_ms]) : "-",
               ox ? format("%.2f", ox[:p99_ms]) : "-", ratio ? format("%.1fx", ratio) : "-")
  end
end

# SCHEDULE_JOBS due jobs in `schedule` (pushed by Ruby's client with `at` = now - 1); oxidekiq watches a
# queue no job is in, so only promotion is timed: spawn to ZCARD schedule == 0.
def scenario_schedule
  return unless SYSTEMS.include?(:oxidekiq)
  label = "schedule-oxidekiq"
  say "#{label}: #{ROUNDS} round(s) promoting #{SCHEDULE_JOBS} due jobs"
  rounds = []
  ROUNDS.times do |r|
    $redis.flushall
    at = Time.now.to_f - 1
    push_chunks(SCHEDULE_JOBS) { |idx| Sidekiq::Client.push_bulk("class" => NoopJob, "args" => idx.map { |i| [i] }, "at" => at) }
    raise "schedule holds #{$redis.zcard('schedule')} of #{SCHEDULE_JOBS}" unless $redis.zcard("schedule") == SCHEDULE_JOBS
    sock = subscribe_del("schedule")
    t0 = now
    pid = spawn_system(:oxidekiq, 10, label, queue: "bench_idle", extra: ["--poll-interval", "0.1"])
    # The first promotion is polled every 2 ms, only until it happens (during oxidekiq's start, before any
    # promotion work); the end is the keyspace event of the emptied set.
    first = nil
    until first
      first = now - t0 if $redis.zcard("schedule") < SCHEDULE_JOBS
      raise "#{label}: oxidekiq exited early" unless alive?(pid)
      raise "#{label}: nothing promoted in #{RUN_TIMEOUT} s" if now - t0 > RUN_TIMEOUT
      sleep 0.002 unless first
    end
    secs = wait_deleted(sock, "schedule", [pid], label, t0) - t0
    hwm = proc_status(pid, "VmHWM")
    stop(pid)
    promoted = $redis.llen(QUEUE)
    rec = { seconds: secs, jobs_per_s: SCHEDULE_JOBS / secs, first_s: first,
            after_first_per_s: SCHEDULE_JOBS / (secs - first), promoted: promoted, hwm_kb: hwm }
    say format("  round %d: %.3f s, %.0f jobs/s (first promotion at %.3f s: %.0f jobs/s after it), %d in queue:default",
               r + 1, secs, rec[:jobs_per_s], first, rec[:after_first_per_s], promoted)
    $notes << "#{label}: only #{promoted} of #{SCHEDULE_JOBS} promoted jobs in queue:default" if promoted != SCHEDULE_JOBS
    rounds << rec
  end
  rates = rounds.map { |x| x[:jobs_per_s] }
  $notes << format("scheduled promotion: timed from spawn (the poller's first pass waits 2-3 poll intervals); " \
                   "from the first promotion on: %.0f jobs/s (median)", median(rounds.map { |x| x[:after_first_per_s] }))
  $rows << { scenario: "scheduled promotion", system: :oxidekiq, name: "oxidekiq (poll 0.1 s)", concurrency: 10,
             kind: :schedule, jobs: SCHEDULE_JOBS, rounds: rounds, median: median(rates), min: rates.min,
             max: rates.max, rss_mb: median(rounds.map { |x| x[:hwm_kb] })&./(1024.0),
             ready_s: median(rounds.map { |x| x[:first_s] }), failed: 0 }
rescue StandardError => e
  say "  #{label} FAILED: #{e.message}"
  $notes << "#{label}: failed (#{e.message})"
end

SCALE_CONC = Integer(ENV.fetch("SCALE_CONC", "200"))
$scale = []

# 1, 2, 4 oxidekiq processes (-c SCALE_CONC each) on one Redis draining JOBS no-op jobs between them.
def scenario_scaleout
  return unless SYSTEMS.include?(:oxidekiq)
  SCALE_PROCS.each do |n|
    row = measure("scale-out", :oxidekiq, SCALE_CONC, :noop, JOBS, procs: n, record: false)
    $scale << row if row && row[:median]
  end
end

$quiet = []

# The peers (and oxidekiq) again, each alone, with nothing measured but the drain's time: no CPU readings
# and no acknowledgement polling, only the keyspace event. Compared with the measured rounds' medians.
def scenario_quiet
  pick = lambda do |system, fallback|
    rows = $rows.select { |r| r[:scenario] == "no-op drain" && r[:system] == system && r[:median] && r[:name] == SYSTEM_NAMES[system] }
    best(rows) || { concurrency: fallback }
  end
  [[:ruby, 10], [:rusty, 50], [:oxidekiq, 200]].each do |system, fallback|
    ref = pick.call(system, fallback)
    row = measure("quiet", system, ref[:concurrency], :noop, JOBS, quiet: true, record: false)
    next unless row && row[:median]
    $quiet << { system: system, name: SYSTEM_NAMES[system], concurrency: ref[:concurrency], quiet: row[:median],
                quiet_min: row[:min], quiet_max: row[:max], measured: ref[:median] }
  end
end

def scenario_rss
  [[:oxidekiq, 200], [:ruby, 10], [:rusty, 10]].select { |system, _| SYSTEMS.include?(system) }.each do |system, c|
    $redis.flushall
    pid = spawn_system(system, c, "idle-#{system}-c#{c}")
    sleep 3
    rss = proc_status(pid, "VmRSS")
    stop(pid)
    $idle << { system: system, name: SYSTEM_NAMES[system], concurrency: c, rss_mb: rss && rss / 1024.0 }
    say format("idle %s -c %d: %.1f MB", system, c, (rss || 0) / 1024.0)
  end
end

# ---------------------------------------------------------------------------------------------------
# Run and report

def sh(cmd) = `#{cmd} 2>/dev/null`.strip

meta = {
  date: Time.now.utc.iso8601,
  machine: { nproc: Integer(sh("nproc")), cpu: File.foreach("/proc/cpuinfo").find { |l| l.start_with?("model name") }&.split(":", 2)&.last&.strip,
             kernel: sh("uname -sr"), mem_gb: (File.read("/proc/meminfo")[/MemTotal:\s+(\d+)/, 1].to_i / 1048576.0).round(1) },
  oxidekiq: { commit: sh("git -C #{ROOT} rev-parse --short=12 HEAD") + (sh("git -C #{ROOT} status --porcelain -- src workers Cargo.toml Cargo.lock").empty? ? "" : "-dirty"),
              version: sh("#{OXIDEKIQ} --version"), binary: OXIDEKIQ },
  ruby: RUBY_VERSION, sidekiq: Sidekiq::VERSION, activejob: ActiveJob.version.to_s,
  rusty_sidekiq: File.read(File.join(ROOT, "bench/rusty/Cargo.lock"))[/name = "rusty-sidekiq"\nversion = "([^"]+)"/, 1],
  redis: sh("redis-server --version")[/v=(\S+)/, 1],
  loadavg_start: File.read("/proc/loadavg").split.first(3).join(" "),
  params: { jobs: JOBS, rounds: ROUNDS, io_jobs: IO_JOBS, lock_jobs: LOCK_JOBS, schedule_jobs: SCHEDULE_JOBS, scale_procs: SCALE_PROCS, scale_conc: SCALE_CONC,
            latency_rate: LATENCY_RATE, latency_secs: LATENCY_SECS, latency_ratio_rate: LATENCY_RATIO_RATE,
            latency_runs: LATENCY_RUNS, latency_oxidekiq_conc: LATENCY_OXIDEKIQ_CONC, latency_ruby_conc: LATENCY_RUBY_CONC,
            defaults_jobs: DEFAULTS_JOBS, defaults_ruby_jobs: DEFAULTS_RUBY_JOBS, payload_sizes: PAYLOAD_SIZES,
            payload_jobs: PAYLOAD_JOBS, payload_conc: PAYLOAD_CONC, scenarios: SCENARIOS },
}
say "oxidekiq #{meta[:oxidekiq][:commit]} (#{meta[:oxidekiq][:version]}); #{meta[:machine][:nproc]} x #{meta[:machine][:cpu]}"

SCENARIOS.each { |s| send("scenario_#{s}") }

# Text and markdown tables

def fmt_rate(x) = x ? x.round.to_s.reverse.scan(/\d{1,3}/).join(",").reverse : "-"
def fmt_mb(x) = x ? format("%.1f", x) : "-"

def fmt_us(x) = x ? format("%.1f", x) : "-"
def fmt_us2(x) = x ? format("%.2f", x) : "-"
def fmt_pct(x) = x ? format("%.0f%%", x * 100) : "-"

HEAD = ["scenario", "system", "conc", "jobs", "median jobs/s", "min", "max", "CPU µs/job", "Redis µs/job",
        "others (cores)", "peak RSS MB", "ready s"].freeze
table = $rows.map do |r|
  if r[:error]
    [r[:scenario], r[:name], r[:concurrency].to_s, r[:jobs].to_s, "FAILED", "-", "-", "-", "-", "-", "-", "-"]
  else
    [r[:scenario], r[:name] + (r[:failed].to_i.positive? ? " (#{r[:failed]} failed!)" : ""), r[:concurrency].to_s,
     r[:jobs].to_s, fmt_rate(r[:median]), fmt_rate(r[:min]), fmt_rate(r[:max]), fmt_us(r[:cpu_us]), fmt_us(r[:redis_us]),
     r[:others] ? format("%.2f", r[:others]) : "-", fmt_mb(r[:rss_mb]), r[:ready_s] ? format("%.2f", r[:ready_s]) : "-"]
  end
end
NPROC = Etc.nprocessors
SCALE_HEAD = ["oxidekiq processes", "conc each", "median jobs/s", "min", "max", "oxidekiq CPU µs/job", "Redis CPU µs/job",
              "oxidekiq busy", "Redis busy", "box busy", "others (cores)", "limit"].freeze
scale_rows = $scale.map do |r|
  box = r[:sys_busy] && r[:redis_busy] ? (r[:sys_busy] + r[:redis_busy]) / NPROC : nil
  limit = if r[:redis_busy] && r[:redis_busy] >= 0.9 then "Redis (one core full)"
          elsif box && box >= 0.85 then "the #{NPROC} cores (Redis #{fmt_pct(r[:redis_busy])} of one)"
          else "neither saturated"
          end
  [r[:procs].to_s, r[:concurrency].to_s, fmt_rate(r[:median]), fmt_rate(r[:min]), fmt_rate(r[:max]), fmt_us(r[:cpu_us]),
   fmt_us(r[:redis_us]), fmt_pct(r[:sys_busy]), fmt_pct(r[:redis_busy]), fmt_pct(box),
   r[:others] ? format("%.2f", r[:others]) : "-", limit]
end
redis_floor = median($scale.map { |r| r[:redis_us] })
if redis_floor
  $notes << format("scale-out: Redis spends %.1f µs of CPU per no-op job (median over the scale-out runs), so one Redis " \
                   "core caps any Sidekiq-compatible fleet using this protocol at about %s jobs/s; busy = CPU seconds " \
                   "per wall second (1.0 = one core), box = all of it over the #{NPROC} cores", redis_floor,
                   fmt_rate(1e6 / redis_floor))
end
QUIET_HEAD = ["system", "conc", "measured median jobs/s", "quiet median jobs/s", "quiet min", "quiet max", "quiet / measured"].freeze
quiet_rows = $quiet.map do |q|
  [q[:name], q[:concurrency].to_s, fmt_rate(q[:measured]), fmt_rate(q[:quiet]), fmt_rate(q[:quiet_min]),
   fmt_rate(q[:quiet_max]), q[:measured] ? format("%.2fx", q[:quiet] / q[:measured]) : "-"]
end
ratio_rows = $ratios.map { |q| [q[:label], format("%.2fx", q[:value]), "#{q[:a]} vs #{q[:b]}"] }
PAYLOAD_HEAD = ["payload", "bytes", "reliable Redis µs/job", "basic", "floor", "Ruby Sidekiq", "reliable / floor",
                "round by round", "reliable <= #{PAYLOAD_RELIABLE_MAX}x every round", "basic / floor", "basic <= floor"].freeze
def met(ok) = ok ? "met" : "not met"
payload_rows = $payloads.map do |x|
  [format("%g KB", x[:kb]), x[:bytes].to_s, fmt_us2(x[:reliable]), fmt_us2(x[:basic]), fmt_us2(x[:floor]), fmt_us2(x[:ruby]),
   x[:ratio] ? format("%.2fx", x[:ratio]) : "-", x[:per_round].map { |v| format("%.2fx", v) }.join(" "),
   met(x[:met]), x[:basic_ratio] ? format("%.2fx", x[:basic_ratio]) : "-", x[:basic_ratio] ? met(x[:basic_met]) : "-"]
end
unless $payloads.empty?
  ruby_name = $payloads.filter_map { |x| x[:ruby_name] }.first
  all_met = $payloads.all? { |x| x[:met] }
  $notes << "payloads: Redis CPU µs per job (INFO cpu, getrusage) over up to #{PAYLOAD_JOBS} no-op jobs a round (at most 256 MB of payload; Ruby Sidekiq at most #{RUBY_PAYLOAD_JOBS}), -c #{PAYLOAD_CONC}, " \
            "rounds alternating reliable, basic, floor#{ruby_name ? ", #{ruby_name}" : ''}; the floor is bench/floor.rb " \
            "(`RPOP queue:default 100` in a loop, nothing else); reliable fetch within #{PAYLOAD_RELIABLE_MAX}x of the floor in every " \
            "round at every size: #{met(all_met)}; basic fetch at or below the floor (medians) at every size: " \
            "#{met($payloads.all? { |x| x[:basic_met] })}"
end

# Issue 42's target 4: the default command lines, logging on and off, and each system at its best (the drain).
fx = ->(v) { v ? format("%.1fx", v) : "-" }
drain_best = lambda do |system|
  best($rows.select { |r| r[:scenario] == "no-op drain" && r[:system] == system && r[:name] == SYSTEM_NAMES[system] })
end
best_ox, best_rb = drain_best.(:oxidekiq), drain_best.(:ruby)
if best_ox && best_rb
  $defaults[:best] = { ruby: "#{best_rb[:name]} -c #{best_rb[:concurrency]}", oxidekiq: "#{best_ox[:name]} -c #{best_ox[:concurrency]}",
                       ruby_cpu_us: best_rb[:cpu_us], oxidekiq_cpu_us: best_ox[:cpu_us],
                       ruby_redis_us: best_rb[:redis_us], oxidekiq_redis_us: best_ox[:redis_us],
                       cpu_ratio: best_rb[:cpu_us] && best_ox[:cpu_us]&.positive? ? best_rb[:cpu_us] / best_ox[:cpu_us] : nil,
                       redis_ratio: best_rb[:redis_us] && best_ox[:redis_us]&.positive? ? best_rb[:redis_us] / best_ox[:redis_us] : nil }
  ratio("Redis CPU per no-op job, each at its best: Ruby Sidekiq / oxidekiq", best_rb, best_ox, field: :redis_us)
end
DEFAULTS_HEAD = ["configuration", "Ruby CPU µs/job", "oxidekiq CPU µs/job", "CPU Ruby / oxidekiq", "round by round",
                 "target 80x", "Ruby Redis µs/job", "oxidekiq Redis µs/job", "Redis Ruby / oxidekiq", "round by round",
                 "target 20x", "log lines/job Ruby, oxidekiq"].freeze
DEFAULTS_LABEL = { on: "defaults, logging on", off: "defaults, logging off", best: "each at its best (no-op drain)" }.freeze
defaults_rows = %i[on off best].filter_map do |mode|
  d = $defaults[mode] or next
  label = DEFAULTS_LABEL[mode] + (d[:lower_bound] ? " (oxidekiq's on: lower bound)" : "")
  lines = mode == :best ? "-" : [d[:ruby_log_lines], d[:oxidekiq_log_lines]].map { |v| v ? format("%.2f", v) : "-" }.join(", ")
  [label, fmt_us(d[:ruby_cpu_us]), fmt_us(d[:oxidekiq_cpu_us]), fx.(d[:cpu_ratio]),
   d[:cpu_per_round].to_a.map(&fx).join(" "), d[:cpu_ratio] ? met(d[:cpu_ratio] >= 80) : "-",
   fmt_us2(d[:ruby_redis_us]), fmt_us2(d[:oxidekiq_redis_us]), fx.(d[:redis_ratio]),
   d[:redis_per_round].to_a.map(&fx).join(" "), d[:redis_ratio] ? met(d[:redis_ratio] >= 20) : "-", lines]
end

# Issue 42's target 6: p99 at LATENCY_RATIO_RATE jobs/s, run by run.
LATR_HEAD = ["run", "oxidekiq p99 ms", "oxidekiq p50 ms", "Ruby Sidekiq p99 ms", "Ruby p50 ms", "Ruby p99 / oxidekiq p99",
             "target 5x"].freeze
latr_rows = $latency_ratio.map do |x|
  ms = ->(rec, k) { rec ? format("%.2f", rec[k]) : "-" }
  [x[:run].to_s, ms.(x[:oxidekiq], :p99_ms), ms.(x[:oxidekiq], :p50_ms), ms.(x[:ruby], :p99_ms), ms.(x[:ruby], :p50_ms),
   fx.(x[:ratio]), x[:ratio] ? met(x[:met]) : "-"]
end
latr_met = $latency_ratio.count { |x| x[:met] }

# Issue 42's target 7: what one Redis core sustains, jobs/s = 1e6 / Redis µs per job, for fleets of each kind,
# with the scale-out rows as the check (measured jobs/s / Redis busy share = the ceiling that row implies).
FLEET_HEAD = ["fleet of", "jobs", "Redis µs/job", "jobs/s one Redis core sustains"].freeze
fleet = []
fleet << ["oxidekiq, reliable fetch (#{best_ox[:name]} -c #{best_ox[:concurrency]}, no-op drain)", "no-op", best_ox[:redis_us]] if best_ox&.dig(:redis_us)
fleet << ["Ruby Sidekiq (-c #{best_rb[:concurrency]}, no-op drain)", "no-op", best_rb[:redis_us]] if best_rb&.dig(:redis_us)
%i[on off].each do |mode|
  d = $defaults[mode] or next
  fleet << ["oxidekiq, default command line, logging #{mode}", "no-op", d[:oxidekiq_redis_us]] if d[:oxidekiq_redis_us] && !d[:lower_bound]
  fleet << ["Ruby Sidekiq, default command line, logging #{mode}", "no-op", d[:ruby_redis_us]] if d[:ruby_redis_us]
end
$payloads.each do |x|
  size = format("%g KB", x[:kb])
  fleet << ["oxidekiq, reliable fetch (-c #{PAYLOAD_CONC})", size, x[:reliable]] if x[:reliable]
  fleet << ["oxidekiq, basic fetch (-c #{PAYLOAD_CONC})", size, x[:basic]] if x[:basic]
  fleet << ["Ruby Sidekiq (-c #{PAYLOAD_CONC})", size, x[:ruby]] if x[:ruby]
  fleet << ["(the floor: RPOP 100, nothing else)", size, x[:floor]] if x[:floor]
end
$fleet = fleet.map { |who, jobs, us| { fleet: who, jobs: jobs, redis_us: us, ceiling: us.positive? ? 1e6 / us : nil } }
fleet_rows = $fleet.map { |f| [f[:fleet], f[:jobs], fmt_us2(f[:redis_us]), fmt_rate(f[:ceiling])] }
# The projection the scale-out rows check: oxidekiq's reliable fetch on no-op jobs at -c 200 (the drain's row,
# else the smallest payload's).
proj_us = ($rows.find { |r| r[:scenario] == "no-op drain" && r[:system] == :oxidekiq && r[:name] == SYSTEM_NAMES[:oxidekiq] && r[:concurrency] == SCALE_CONC } ||
           {})[:redis_us] || $payloads.min_by { |x| x[:kb] }&.dig(:reliable)
projection = proj_us&.positive? ? 1e6 / proj_us : nil
# The busy share is Redis's CPU over the window from the release to the last acknowledgement, so the row's
# jobs/s for the check is over that same window (a little below the table's release-to-empty figure).
FLEET_CHECK_HEAD = ["oxidekiq processes", "measured jobs/s", "jobs/s to the last ack", "Redis busy",
                    "implied ceiling (jobs/s to last ack / busy)", "projected (1e6 / Redis µs)", "implied / projected"].freeze
$fleet_check = $scale.map do |r|
  implied = r[:wall_jobs_per_s] && r[:redis_busy]&.positive? ? r[:wall_jobs_per_s] / r[:redis_busy] : nil
  { procs: r[:procs], jobs_per_s: r[:median], window_jobs_per_s: r[:wall_jobs_per_s], redis_busy: r[:redis_busy],
    implied: implied, projected: projection, implied_over_projected: implied && projection ? implied / projection : nil }
end
fleet_check_rows = $fleet_check.map do |c|
  [c[:procs].to_s, fmt_rate(c[:jobs_per_s]), fmt_rate(c[:window_jobs_per_s]), fmt_pct(c[:redis_busy]), fmt_rate(c[:implied]),
   fmt_rate(c[:projected]), c[:implied_over_projected] ? format("%.2fx", c[:implied_over_projected]) : "-"]
end

# The summary: issue 42's targets 4-7, each with its figure, threshold and verdict ("not measured" when the
# scenarios behind it did not run).
$targets = []
def target(id, what, figure, threshold, verdict) = $targets << { target: id, what: what, figure: figure || "-",
                                                                  threshold: threshold, verdict: verdict || "not measured" }
%i[on off best].each do |mode|
  d = $defaults[mode]
  what = DEFAULTS_LABEL[mode] + (d&.dig(:lower_bound) ? " (oxidekiq's lines on: lower bound)" : "")
  fig = ->(r, a, b) { d && d[r] ? format("%.1fx (%s / %s µs)", d[r], fmt_us2(d[a]), fmt_us2(d[b])) : nil }
  target("4", "CPU per no-op job, Ruby / oxidekiq, #{what}", fig.(:cpu_ratio, :ruby_cpu_us, :oxidekiq_cpu_us), ">= 80x",
         d&.dig(:cpu_ratio) && met(d[:cpu_ratio] >= 80))
  target("4", "Redis CPU per no-op job, Ruby / oxidekiq, #{what}", fig.(:redis_ratio, :ruby_redis_us, :oxidekiq_redis_us), ">= 20x",
         d&.dig(:redis_ratio) && met(d[:redis_ratio] >= 20))
end
if $payloads.empty?
  target("5", "reliable fetch's Redis µs/job / the floor's, every round at every size (payloads)", nil, "<= #{PAYLOAD_RELIABLE_MAX}x", nil)
  target("5", "basic fetch's Redis µs/job / the floor's (medians), at every size (payloads)", nil, "<= 1.0x", nil)
else
  worst = $payloads.flat_map { |x| x[:per_round] }.max
  target("5", "reliable fetch's Redis µs/job / the floor's, every round at every size (#{$payloads.map { |x| format('%g', x[:kb]) }.join(', ')} KB)",
         worst && format("worst round %.2fx", worst), "<= #{PAYLOAD_RELIABLE_MAX}x", met($payloads.all? { |x| x[:met] }))
  bw = $payloads.filter_map { |x| x[:basic_ratio] }.max
  target("5", "basic fetch's Redis µs/job / the floor's (medians), at every size", bw && format("worst size %.2fx", bw),
         "<= 1.0x", bw && met($payloads.all? { |x| x[:basic_met] }))
end
if $latency_ratio.empty?
  target("6", "enqueue-to-start p99 at #{LATENCY_RATIO_RATE} jobs/s, Ruby / oxidekiq (latency_ratio)", nil,
         ">= 5x in #{LATENCY_RUNS} of #{LATENCY_RUNS}", nil)
else
  rs = $latency_ratio.map { |x| x[:ratio] }
  target("6", "enqueue-to-start p99 at #{LATENCY_RATIO_RATE} jobs/s, Ruby -c #{LATENCY_RUBY_CONC} / oxidekiq -c #{LATENCY_OXIDEKIQ_CONC}",
         "met in #{latr_met} of #{LATENCY_RUNS} (#{rs.map(&fx).join(' ')})", ">= 5x in #{LATENCY_RUNS} of #{LATENCY_RUNS}",
         met(latr_met == LATENCY_RUNS && $latency_ratio.size == LATENCY_RUNS))
end
if $fleet.empty?
  target("7", "jobs/s one Redis core sustains (drain, defaults or payloads; checked by scaleout)", nil, "stated", nil)
else
  pick = ->(prefix) { $fleet.find { |f| f[:fleet].start_with?(prefix) } }
  parts = [["oxidekiq reliable", pick.("oxidekiq, reliable") || pick.("oxidekiq, default")], ["oxidekiq basic", pick.("oxidekiq, basic")],
           ["Ruby", pick.("Ruby Sidekiq")]].filter_map { |n, f| f && "#{n} #{fmt_rate(f[:ceiling])} (#{f[:jobs]})" }
  checks = $fleet_check.filter_map { |c| c[:implied_over_projected] && format("%dp %.2fx", c[:procs], c[:implied_over_projected]) }
  target("7", "jobs/s one Redis core sustains (1e6 / Redis µs per job)#{checks.empty? ? '' : '; scale-out implied / projected'}",
         (parts + checks).join("; "), "stated", "stated")
end
TARGET_HEAD = ["target", "what", "figure", "threshold", "verdict"].freeze
target_rows = $targets.map { |t| [t[:target], t[:what], t[:figure], t[:threshold], t[:verdict]] }
lat_rows = $latency.map do |l|
  [l[:name], l[:concurrency].to_s, fmt_rate(l[:rate]), l[:backlog].to_s, format("%.2f", l[:p50_ms]), format("%.2f", l[:p99_ms]),
   format("%.2f", l[:max_ms]), fmt_mb(l[:rss_mb])]
end
LAT_HEAD = ["system", "conc", "jobs/s produced", "queued at end", "p50 ms", "p99 ms", "max ms", "peak RSS MB"].freeze
idle_rows = $idle.map { |i| [i[:name], i[:concurrency].to_s, fmt_mb(i[:rss_mb])] }
IDLE_HEAD = ["system", "conc", "idle RSS MB (after 3 s)"].freeze

# The first `left` columns are left-aligned, the others right-aligned.
def text_table(head, rows, left: 2)
  widths = head.each_index.map { |i| ([head[i]] + rows.map { |r| r[i] }).map(&:length).max }
  line = ->(cells) { cells.each_with_index.map { |c, i| i < left ? c.ljust(widths[i]) : c.rjust(widths[i]) }.join("  ").rstrip }
  ([line.(head), widths.map { |w| "-" * w }.join("  ")] + rows.map(&line)).join("\n")
end

def md_table(head, rows)
  align = head.each_index.map { |i| i < 2 ? "---" : "---:" }
  (["| #{head.join(' | ')} |", "| #{align.join(' | ')} |"] + rows.map { |r| "| #{r.join(' | ')} |" }).join("\n")
end

acked_note = $rows.select { |r| r[:system] == :oxidekiq && r[:acked_s] && r[:median] }.map do |r|
  format("%s, %s -c %d: timed at %.3f s, every job acknowledged at %.3f s (medians)", r[:scenario], r[:name], r[:concurrency], r[:jobs] / r[:median], r[:acked_s])
end

header = "oxidekiq #{meta[:oxidekiq][:commit]} · #{meta[:date]} · #{meta[:machine][:nproc]} CPU x #{meta[:machine][:cpu]} · " \
         "Redis #{meta[:redis]} · Ruby #{meta[:ruby]} · Sidekiq #{meta[:sidekiq]} · rusty-sidekiq #{meta[:rusty_sidekiq]} · " \
         "#{ROUNDS} round(s)"
out = +"\n#{header}\n\n"
out << text_table(HEAD, table) << "\n" unless table.empty?
out << "\n" << text_table(["ratio (medians)", "value", "compared"], ratio_rows) << "\n" unless ratio_rows.empty?
out << "\nEnqueue-to-start latency at a steady #{LATENCY_RATE} jobs/s for #{LATENCY_SECS} s (LatencyJob):\n" \
       << text_table(LAT_HEAD, lat_rows) << "\n" unless lat_rows.empty?
out << "\n" << text_table(IDLE_HEAD, idle_rows) << "\n" unless idle_rows.empty?
out << "\nScale-out: oxidekiq processes on one Redis, #{JOBS} no-op jobs between them:\n" \
       << text_table(SCALE_HEAD, scale_rows) << "\n" unless scale_rows.empty?
out << "\nRedis CPU per job by payload size (-c #{PAYLOAD_CONC}, up to #{PAYLOAD_JOBS} jobs a round, medians):\n" \
       << text_table(PAYLOAD_HEAD, payload_rows) << "\n" unless payload_rows.empty?
out << "\nQuiet check (each alone, nothing measured but the drain's time):\n" \
       << text_table(QUIET_HEAD, quiet_rows) << "\n" unless quiet_rows.empty?
out << "\nDefault command lines (issue 42's target 4; no -c, oxidekiq no --threads; rounds alternate between the systems):\n" \
       << text_table(DEFAULTS_HEAD, defaults_rows) << "\n" unless defaults_rows.empty?
out << "\nEnqueue-to-start p99 at #{LATENCY_RATIO_RATE} jobs/s for #{LATENCY_SECS} s, runs alternating (issue 42's target 6): " \
       "met in #{latr_met} of #{LATENCY_RUNS}\n" << text_table(LATR_HEAD, latr_rows) << "\n" unless latr_rows.empty?
out << "\nThe fleet's ceiling (issue 42's target 7): jobs/s one Redis core sustains = 1e6 / Redis µs per job:\n" \
       << text_table(FLEET_HEAD, fleet_rows) << "\n" unless fleet_rows.empty?
out << "\nChecked by the scale-out rows (measured jobs/s / Redis busy share = the ceiling that row implies):\n" \
       << text_table(FLEET_CHECK_HEAD, fleet_check_rows) << "\n" unless fleet_check_rows.empty?
out << "\n" << (acked_note + $notes).map { |n| "note: #{n}" }.join("\n") << "\n" unless (acked_note + $notes).empty?
out << "\nIssue 42 targets (this run):\n" << text_table(TARGET_HEAD, target_rows, left: 5) << "\n" unless target_rows.empty?
puts out

md = +"# oxidekiq benchmark results\n\n"
md << "- date: #{meta[:date]}\n- machine: #{meta[:machine][:nproc]} CPUs, #{meta[:machine][:cpu]}, #{meta[:machine][:mem_gb]} GB, #{meta[:machine][:kernel]}\n"
md << "- oxidekiq: commit #{meta[:oxidekiq][:commit]} (#{meta[:oxidekiq][:version]}, #{OXIDEKIQ.delete_prefix("#{ROOT}/")}), " \
      "#{THREADS == 'cpus' ? 'its default threads (no `--threads`)' : "`--threads #{THREADS}`"} unless a row says otherwise\n"
md << "- peers: Ruby Sidekiq #{meta[:sidekiq]} (Ruby #{meta[:ruby]}, ActiveJob #{meta[:activejob]}), rusty-sidekiq #{meta[:rusty_sidekiq]}; Redis #{meta[:redis]}\n"
md << "- load average (1, 5, 15 min) at the start: #{meta[:loadavg_start]}; at the end: #{File.read('/proc/loadavg').split.first(3).join(' ')}; " \
      "the others column: cores busy with anything but the drainer and Redis during the drain (max over rounds)\n"
md << "- command: `#{ENV.fetch('BENCH_COMMAND', 'bash bench/run.sh')}` (JOBS=#{JOBS}, ROUNDS=#{ROUNDS}, SCENARIOS=#{SCENARIOS.join(',')})\n"
md << "- method: one Redis; jobs enqueued with Ruby Sidekiq's `push_bulk` and parked (RENAME); the drainer is started " \
      "and runs one probe job (ready s: its cold start); CPU times read from /proc/<pid>/stat (utime+stime+cutime+cstime) " \
      "of the drainer(s), Redis's from its INFO cpu (getrusage, to the µs); the queue is released (RENAME) and the driver blocks until Redis reports " \
      "it deleted (keyspace event, no polling); oxidekiq's acknowledgements are then awaited (polled every 25 ms); CPU " \
      "read again. jobs/s = jobs / seconds from release to empty queue; CPU µs/job = CPU spent over the drain / jobs; " \
      "peak RSS = VmHWM. Medians of the rounds.\n\n"
md << md_table(HEAD, table) << "\n\n" unless table.empty?
md << md_table(["ratio (medians)", "value", "compared"], ratio_rows) << "\n\n" unless ratio_rows.empty?
md << "Enqueue-to-start latency at a steady #{LATENCY_RATE} jobs/s for #{LATENCY_SECS} s:\n\n" << md_table(LAT_HEAD, lat_rows) << "\n\n" unless lat_rows.empty?
md << md_table(IDLE_HEAD, idle_rows) << "\n\n" unless idle_rows.empty?
cmd_rows = $rows.select { |r| r[:commands] && (%w[no-op\ drain ActiveJob\ no-op locks].include?(r[:scenario]) || r[:scenario].start_with?("payload", "defaults")) }.map do |r|
  top = r[:commands].first(10).map { |name, (calls, us)| format("%s %.3g (%.2f µs)", name, calls, us) }.join(", ")
  [r[:scenario], r[:name], r[:concurrency].to_s, top]
end
unless cmd_rows.empty?
  md << "Redis commands per job (INFO commandstats over the drain, the median round; µs: Redis's own time in the " \
        "command, per job; commands a script runs are counted on their own and inside the script's time too):\n\n" \
        << md_table(["scenario", "system", "conc", "busiest commands: calls/job (µs/job)"], cmd_rows) << "\n\n"
end
md << "Scale-out: oxidekiq processes (-c #{SCALE_CONC} each) on one Redis, #{JOBS} no-op jobs between them:\n\n" \
      << md_table(SCALE_HEAD, scale_rows) << "\n\n" unless scale_rows.empty?
md << "Redis CPU per job by payload size (no-op jobs, -c #{PAYLOAD_CONC}, up to #{PAYLOAD_JOBS} jobs a round, medians of " \
      "the rounds; µs of Redis CPU per job; the floor pops 100 at a time and does nothing else):\n\n" \
      << md_table(PAYLOAD_HEAD, payload_rows) << "\n\n" unless payload_rows.empty?
md << "Quiet check: each system again, alone, with nothing measured but the drain's time (no CPU readings, no " \
      "acknowledgement polling), against the measured rounds:\n\n" << md_table(QUIET_HEAD, quiet_rows) << "\n\n" unless quiet_rows.empty?
md << "Default command lines (issue 42's target 4): `sidekiq -r bench/jobs.rb -q default` and `oxidekiq -q default` (no -c: " \
      "concurrency 10 both; oxidekiq no --threads: a thread per CPU less one), each with its per-job start and done lines " \
      "(logging on) and without them (Ruby: Sidekiq.logger at WARN; oxidekiq: #{oxidekiq_log_off ? "`#{oxidekiq_log_off.join(' ')}`" : 'no switch in this build'}); " \
      "rounds alternate between the systems; log lines/job counted in each round's log:\n\n" \
      << md_table(DEFAULTS_HEAD, defaults_rows) << "\n\n" unless defaults_rows.empty?
md << "Enqueue-to-start p99 at #{LATENCY_RATIO_RATE} jobs/s for #{LATENCY_SECS} s (issue 42's target 6), oxidekiq -c " \
      "#{LATENCY_OXIDEKIQ_CONC} and Ruby Sidekiq -c #{LATENCY_RUBY_CONC}, runs alternating: met in #{latr_met} of #{LATENCY_RUNS}\n\n" \
      << md_table(LATR_HEAD, latr_rows) << "\n\n" unless latr_rows.empty?
md << "The fleet's ceiling (issue 42's target 7): the jobs per second one Redis core sustains, 1e6 / Redis µs per job, " \
      "for a fleet of each kind:\n\n" << md_table(FLEET_HEAD, fleet_rows) << "\n\n" unless fleet_rows.empty?
md << "Checked by the scale-out rows (measured jobs/s / Redis busy share = the ceiling that row implies; projected: " \
      "1e6 / the Redis µs per job of oxidekiq's reliable fetch on no-op jobs):\n\n" \
      << md_table(FLEET_CHECK_HEAD, fleet_check_rows) << "\n\n" unless fleet_check_rows.empty?
md << (acked_note + $notes).map { |n| "- #{n}\n" }.join << "\n" unless (acked_note + $notes).empty?
md << "## Issue 42 targets (this run)\n\n" << md_table(TARGET_HEAD, target_rows) << "\n\n" unless target_rows.empty?
md << "![no-op drain and I/O-bound jobs/s](drain.png)\n" if $rows.any? { |r| %w[no-op\ drain I/O\ 50\ ms].include?(r[:scenario]) && r[:median] }
File.write(File.join(RESULTS, "results.md"), md)
File.write(File.join(RESULTS, "results.json"),
           JSON.pretty_generate(meta: meta, throughput: $rows, ratios: $ratios, latency: $latency, idle_rss: $idle,
                                scale_out: $scale, quiet: $quiet, payloads: $payloads, defaults: $defaults,
                                latency_ratio: $latency_ratio, fleet_ceiling: $fleet, fleet_check: $fleet_check,
                                issue42_targets: $targets, notes: $notes))

# Chart: jobs/s (median bar, min-max whisker) per system for the no-op drain and the I/O-bound drain.
panels = [["no-op drain", "drain", "no-op drain, #{JOBS} jobs"], ["I/O 50 ms", "io", "50 ms I/O, #{IO_JOBS} jobs"]].filter_map do |scenario, file, title|
  rows = $rows.select { |r| r[:scenario] == scenario && r[:median] }
  next if rows.empty?
  File.write(File.join(WORK, "#{file}.dat"), rows.each_with_index.map { |r, i|
    "#{i} #{r[:median].round} #{r[:min].round} #{r[:max].round} #{{ oxidekiq: 0xc0392b, ruby: 0x8e44ad, rusty: 0x2980b9 }.fetch(r[:system])}\n"
  }.join)
  short = { oxidekiq: "oxidekiq", ruby: "Sidekiq #{Sidekiq::VERSION[/\A\d+\.\d+/]}", rusty: "rusty-sidekiq" }
  tics = rows.each_with_index.map { |r, i| "\"#{short.fetch(r[:system])}\\n-c #{r[:concurrency]}\" #{i}" }.join(", ")
  [file, title, tics, rows.size]
end
if panels.empty?
  nil
elsif system("command -v gnuplot >/dev/null")
  png = File.join(RESULTS, "drain.png")
  gp = +"set terminal pngcairo size #{600 * panels.size},540 font 'sans,10'\nset output '#{png}'\n"
  gp << "set multiplot layout 1,#{panels.size} title 'jobs/s, median of #{ROUNDS} (whiskers: min-max) · oxidekiq #{meta[:oxidekiq][:commit]} · #{meta[:machine][:nproc]} CPU'\n"
  gp << "set style fill solid 0.85 noborder\nset boxwidth 0.6\nset grid ytics\nset yrange [0:*]\nset format y '%.0f'\nunset key\nset bmargin 4\n"
  panels.each do |file, title, tics, n|
    gp << "set title '#{title}'\nset xrange [-0.6:#{n - 0.4}]\nset xtics (#{tics}) font 'sans,9'\n"
    dat = File.join(WORK, "#{file}.dat")
    gp << "plot '#{dat}' using 1:2:5 with boxes lc rgb variable, '' using 1:3:(0):($4 - $3) with vectors nohead lw 1.5 lc rgb 'black', " \
          "'' using 1:4:(sprintf('%d', $2)) with labels offset 0,0.8 font 'sans,8'\n"
  end
  gp << "unset multiplot\n"
  File.write(File.join(WORK, "chart.gp"), gp)
  if system("gnuplot", File.join(WORK, "chart.gp"))
    say "wrote #{png}"
  else
    say "gnuplot failed; script in #{WORK}/chart.gp"
  end
else
  say "gnuplot not found: no chart (bench/run.sh installs gnuplot-nox)"
end
say "wrote #{RESULTS}/results.md and results.json"
