# The benchmark driver, run by bench/run.sh (which builds the binaries and starts a private Redis).
#
# Every measurement follows the same steps whatever the system: FLUSHALL, enqueue with Ruby Sidekiq's
# own client (`Sidekiq::Client.push_bulk`, chunks of 1000), spawn the drainer (cold start included), poll
# over one persistent connection every 2 ms until the queue is empty, read the drainer's peak RSS
# (VmHWM), then TERM it and wait. jobs/s = jobs / (seconds from spawn to empty queue).
#
# Environment: REDIS_URL, OXIDEKIQ_BIN, RUSTY_BIN, RESULTS_DIR, WORK_DIR (set by run.sh); JOBS (100000),
# ROUNDS (3), SCENARIOS (all: drain,activejob,io,latency,locks,schedule,rss), IO_JOBS and LOCK_JOBS
# (JOBS / 5), SCHEDULE_JOBS (JOBS), LATENCY_RATE (5000), LATENCY_SECS (10), RUN_TIMEOUT (600 s).
require "fileutils"
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
LOCK_JOBS = Integer(ENV.fetch("LOCK_JOBS", (JOBS / 5).to_s))
SCHEDULE_JOBS = Integer(ENV.fetch("SCHEDULE_JOBS", JOBS.to_s))
LATENCY_RATE = Integer(ENV.fetch("LATENCY_RATE", "5000"))
LATENCY_SECS = Float(ENV.fetch("LATENCY_SECS", "10"))
RUN_TIMEOUT = Float(ENV.fetch("RUN_TIMEOUT", "600"))
ALL = %w[drain activejob io latency locks schedule rss].freeze
SCENARIOS = ENV.fetch("SCENARIOS", ALL.join(",")).split(",").map(&:strip).reject(&:empty?)
SYSTEMS = ENV.fetch("SYSTEMS", "oxidekiq,ruby,rusty").split(",").map { |x| x.strip.to_sym }
POLL = 0.002
QUEUE = "queue:default"

unknown = SCENARIOS - ALL
abort "driver: unknown scenario(s) #{unknown.join(', ')}; known: #{ALL.join(', ')}" unless unknown.empty?
FileUtils.mkdir_p(RESULTS)
FileUtils.mkdir_p(WORK)

$redis = Redis.new(url: REDIS_URL)

def now = Process.clock_gettime(Process::CLOCK_MONOTONIC)
def say(msg) = $stderr.puts("[bench #{Time.now.strftime('%H:%M:%S')}] #{msg}")

# ---------------------------------------------------------------------------------------------------
# Systems

SYSTEM_NAMES = { oxidekiq: "oxidekiq", ruby: "Ruby Sidekiq #{Sidekiq::VERSION}", rusty: "rusty-sidekiq" }.freeze

# The classes compiled into the oxidekiq binary (its registry names are string literals in it).
def oxidekiq_has?(klass)
  @oxi_bin ||= File.binread(OXIDEKIQ)
  @oxi_bin.include?(klass)
end

def command(system, concurrency, queue: "default", extra: [])
  case system
  when :oxidekiq then [OXIDEKIQ, "-q", queue, "-c", concurrency.to_s, *extra]
  # Ruby runs the sidekiq script itself: the pid spawned is the Sidekiq process (its RSS is measured).
  when :ruby then [RbConfig.ruby, SIDEKIQ, "-r", File.join(__dir__, "jobs.rb"), "-q", queue, "-c", concurrency.to_s, *extra]
  when :rusty then [RUSTY, concurrency.to_s]
  else raise ArgumentError, system.to_s
  end
end

def spawn_system(system, concurrency, log_name, **opts)
  cmd = command(system, concurrency, **opts)
  log = File.join(WORK, "#{log_name}.log")
  pid = Process.spawn({ "REDIS_URL" => REDIS_URL, "RUST_LOG" => nil }, *cmd,
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
def enqueue_activejob(total)
  push_chunks(total) do |idx|
    Sidekiq::Client.push_bulk(
      "class" => ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper, "wrapped" => NoopActiveJob,
      "queue" => "default", "args" => idx.map { |i| [NoopActiveJob.new(i, { "locale" => "en" }).serialize] }
    )
  end
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

# Where oxidekiq holds fetched, unacknowledged jobs: working hashes and landing lists.
def working_keys = $redis.keys("oxidekiq:working:*") + $redis.keys("oxidekiq:landing:*")
def held(key) = key.start_with?("oxidekiq:landing:") ? $redis.llen(key) : $redis.hlen(key)
def failures = $redis.zcard("retry") + $redis.zcard("dead")

# Enqueue `jobs` jobs, then time one cold-start drain by `system`. Returns a round's record.
# `tail`: the jobs' own duration. At the empty queue every job has started (each system fetches only for
# a free slot), so the drain is complete `tail` seconds later, whatever the system: it is added to all.
def drain_once(system, concurrency, kind, jobs, label, tail)
  $redis.flushall
  ENQUEUE.fetch(kind).call(jobs)
  queued = $redis.llen(QUEUE)
  raise "enqueued #{queued} of #{jobs}" unless queued == jobs

  t0 = now
  pid = spawn_system(system, concurrency, label)
  timed_drain(pid, system, jobs, label, t0, tail)
ensure
  stop(pid) if pid
end

def timed_drain(pid, system, jobs, label, t0, tail)
  started = nil
  loop do
    left = $redis.llen(QUEUE)
    started ||= now - t0 if left < jobs
    break if left.zero?
    raise "#{label}: the drainer exited early (see #{WORK}/#{label}.log)" unless alive?(pid)
    raise "#{label}: timed out after #{RUN_TIMEOUT} s with #{left} jobs left" if now - t0 > RUN_TIMEOUT
    sleep POLL
  end
  empty = now - t0 + tail
  acked = nil
  if system == :oxidekiq # also: every fetched job acknowledged (its working list emptied)
    loop do
      break acked = now - t0 if working_keys.all? { |k| held(k).zero? }
      raise "#{label}: in-flight jobs never acknowledged" if now - t0 > RUN_TIMEOUT
      sleep POLL
    end
  end
  hwm = proc_status(pid, "VmHWM")
  stop(pid)
  { seconds: empty, jobs_per_s: jobs / empty, start_s: started, acked_s: acked, hwm_kb: hwm,
    failed: failures, left: $redis.llen(QUEUE) }
end

def median(xs)
  s = xs.compact.sort
  return nil if s.empty?
  s.size.odd? ? s[s.size / 2] : (s[s.size / 2 - 1] + s[s.size / 2]) / 2.0
end

$rows = []  # throughput rows
$notes = []

def measure(scenario, system, concurrency, kind, jobs, tail: 0.0)
  return unless SYSTEMS.include?(system)
  label = "#{scenario}-#{kind}-#{system}-c#{concurrency}".gsub(%r{[ /]}, "_")
  say "#{label}: #{ROUNDS} round(s) of #{jobs} #{kind} jobs"
  rounds = []
  ROUNDS.times do |r|
    rec = drain_once(system, concurrency, kind, jobs, label, tail)
    say format("  round %d: %.3f s, %.0f jobs/s, first job at %.3f s%s, peak RSS %.1f MB%s", r + 1, rec[:seconds],
               rec[:jobs_per_s], rec[:start_s] || 0, rec[:acked_s] ? format(", all acked at %.3f s", rec[:acked_s]) : "",
               (rec[:hwm_kb] || 0) / 1024.0, rec[:failed].positive? ? ", #{rec[:failed]} FAILED" : "")
    rounds << rec
  end
  rates = rounds.map { |x| x[:jobs_per_s] }
  row = { scenario: scenario, system: system, name: SYSTEM_NAMES[system], concurrency: concurrency, kind: kind,
          jobs: jobs, tail_s: tail, rounds: rounds, median: median(rates), min: rates.min, max: rates.max,
          rss_mb: median(rounds.map { |x| x[:hwm_kb] })&./(1024.0), start_s: median(rounds.map { |x| x[:start_s] }),
          acked_s: median(rounds.map { |x| x[:acked_s] }), failed: rounds.sum { |x| x[:failed] } }
  $rows << row
  row
rescue StandardError => e
  say "  #{label} FAILED: #{e.message}"
  $notes << "#{label}: failed (#{e.message})"
  row = { scenario: scenario, system: system, name: SYSTEM_NAMES[system], concurrency: concurrency, kind: kind,
          jobs: jobs, error: e.message }
  $rows << row
  row
end

def best(rows) = rows.compact.reject { |r| r[:median].nil? }.max_by { |r| r[:median] }

$ratios = []
def ratio(label, a, b, a_name = nil, b_name = nil)
  return if a.nil? || b.nil? || a[:median].nil? || b[:median].nil?
  $ratios << { label: label, value: a[:median] / b[:median],
               a: a_name || "#{a[:name]} -c #{a[:concurrency]}", b: b_name || "#{b[:name]} -c #{b[:concurrency]}" }
end

# ---------------------------------------------------------------------------------------------------
# Scenarios

$latency = []
$idle = []
$schedule = []

def scenario_drain
  ox = [200, 25].map { |c| measure("no-op drain", :oxidekiq, c, :noop, JOBS) }
  rb = [10, 25].map { |c| measure("no-op drain", :ruby, c, :noop, JOBS) }
  ru = [10, 50].map { |c| measure("no-op drain", :rusty, c, :noop, JOBS) }
  ratio("no-op drain: oxidekiq / Ruby Sidekiq (best)", ox.first, best(rb))
  ratio("no-op drain: oxidekiq / rusty-sidekiq (best)", ox.first, best(ru))
end

def scenario_activejob
  [[:oxidekiq, 200], [:ruby, 10]].each do |system, c|
    aj = measure("ActiveJob no-op", system, c, :activejob, JOBS)
    plain = $rows.find { |r| r[:scenario] == "no-op drain" && r[:system] == system && r[:concurrency] == c && r[:median] }
    plain ||= measure("no-op baseline", system, c, :noop, JOBS) # when the drain scenario did not run
    ratio("ActiveJob / plain no-op: #{SYSTEM_NAMES[system]} -c #{c}", aj, plain, "ActiveJob NoopActiveJob", "NoopJob")
  end
end

def scenario_io
  ox = measure("I/O 50 ms", :oxidekiq, 1000, :io, IO_JOBS, tail: 0.05)
  rb = [25, 50, 100].map { |c| measure("I/O 50 ms", :ruby, c, :io, IO_JOBS, tail: 0.05) }
  ru = measure("I/O 50 ms", :rusty, 1000, :io, IO_JOBS, tail: 0.05)
  $notes << "I/O 50 ms: times are spawn → empty queue + 50 ms (the last jobs fetched finish then), for every system"
  ratio("I/O 50 ms: oxidekiq / Ruby Sidekiq (best)", ox, best(rb))
  ratio("I/O 50 ms: oxidekiq / rusty-sidekiq", ox, ru)
end

def scenario_locks
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
  end
end

def percentile(sorted, p)
  return nil if sorted.empty?
  sorted[[(p * sorted.size).ceil - 1, 0].max]
end

# A steady LATENCY_RATE jobs/s of LatencyJob for LATENCY_SECS against an already running, warmed-up drainer.
def latency_once(system, concurrency)
  return unless SYSTEMS.include?(system)
  label = "latency-#{system}-c#{concurrency}"
  if system == :oxidekiq && !oxidekiq_has?("LatencyJob")
    $notes << "latency: LatencyJob is not in this oxidekiq build; skipped (spec in bench/README.md)"
    return
  end
  say "#{label}: #{LATENCY_RATE} jobs/s for #{LATENCY_SECS} s"
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
    due = (elapsed * LATENCY_RATE).floor - pushed
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
  $latency << rec
rescue StandardError => e
  say "  #{label} FAILED: #{e.message}"
  $notes << "#{label}: failed (#{e.message})"
  stop(pid) if pid
end

def scenario_latency
  latency_once(:oxidekiq, 200)
  latency_once(:ruby, 25)
  latency_once(:rusty, 50)
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
    t0 = now
    pid = spawn_system(:oxidekiq, 10, label, queue: "bench_idle", extra: ["--poll-interval", "0.1"])
    first = nil
    loop do
      left = $redis.zcard("schedule")
      first ||= now - t0 if left < SCHEDULE_JOBS
      break if left.zero?
      raise "#{label}: oxidekiq exited early" unless alive?(pid)
      raise "#{label}: timed out with #{left} left" if now - t0 > RUN_TIMEOUT
      sleep POLL
    end
    secs = now - t0
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
             start_s: median(rounds.map { |x| x[:first_s] }), failed: 0 }
rescue StandardError => e
  say "  #{label} FAILED: #{e.message}"
  $notes << "#{label}: failed (#{e.message})"
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
  params: { jobs: JOBS, rounds: ROUNDS, io_jobs: IO_JOBS, lock_jobs: LOCK_JOBS, schedule_jobs: SCHEDULE_JOBS,
            latency_rate: LATENCY_RATE, latency_secs: LATENCY_SECS, scenarios: SCENARIOS },
}
say "oxidekiq #{meta[:oxidekiq][:commit]} (#{meta[:oxidekiq][:version]}); #{meta[:machine][:nproc]} x #{meta[:machine][:cpu]}"

SCENARIOS.each { |s| send("scenario_#{s}") }

# Text and markdown tables

def fmt_rate(x) = x ? x.round.to_s.reverse.scan(/\d{1,3}/).join(",").reverse : "-"
def fmt_mb(x) = x ? format("%.1f", x) : "-"

HEAD = ["scenario", "system", "conc", "jobs", "median jobs/s", "min", "max", "peak RSS MB", "start s"].freeze
table = $rows.map do |r|
  if r[:error]
    [r[:scenario], r[:name], r[:concurrency].to_s, r[:jobs].to_s, "FAILED", "-", "-", "-", "-"]
  else
    [r[:scenario], r[:name] + (r[:failed].to_i.positive? ? " (#{r[:failed]} failed!)" : ""), r[:concurrency].to_s,
     r[:jobs].to_s, fmt_rate(r[:median]), fmt_rate(r[:min]), fmt_rate(r[:max]), fmt_mb(r[:rss_mb]),
     r[:start_s] ? format("%.2f", r[:start_s]) : "-"]
  end
end
ratio_rows = $ratios.map { |q| [q[:label], format("%.2fx", q[:value]), "#{q[:a]} vs #{q[:b]}"] }
lat_rows = $latency.map do |l|
  [l[:name], l[:concurrency].to_s, fmt_rate(l[:rate]), l[:backlog].to_s, format("%.2f", l[:p50_ms]), format("%.2f", l[:p99_ms]),
   format("%.2f", l[:max_ms]), fmt_mb(l[:rss_mb])]
end
LAT_HEAD = ["system", "conc", "jobs/s produced", "queued at end", "p50 ms", "p99 ms", "max ms", "peak RSS MB"].freeze
idle_rows = $idle.map { |i| [i[:name], i[:concurrency].to_s, fmt_mb(i[:rss_mb])] }
IDLE_HEAD = ["system", "conc", "idle RSS MB (after 3 s)"].freeze

def text_table(head, rows)
  widths = head.each_index.map { |i| ([head[i]] + rows.map { |r| r[i] }).map(&:length).max }
  line = ->(cells) { cells.each_with_index.map { |c, i| i.zero? || i == 1 ? c.ljust(widths[i]) : c.rjust(widths[i]) }.join("  ") }
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
out << "\n" << (acked_note + $notes).map { |n| "note: #{n}" }.join("\n") << "\n" unless (acked_note + $notes).empty?
puts out

md = +"# oxidekiq benchmark results\n\n"
md << "- date: #{meta[:date]}\n- machine: #{meta[:machine][:nproc]} CPUs, #{meta[:machine][:cpu]}, #{meta[:machine][:mem_gb]} GB, #{meta[:machine][:kernel]}\n"
md << "- oxidekiq: commit #{meta[:oxidekiq][:commit]} (#{meta[:oxidekiq][:version]}, #{OXIDEKIQ.delete_prefix("#{ROOT}/")})\n"
md << "- peers: Ruby Sidekiq #{meta[:sidekiq]} (Ruby #{meta[:ruby]}, ActiveJob #{meta[:activejob]}), rusty-sidekiq #{meta[:rusty_sidekiq]}; Redis #{meta[:redis]}\n"
md << "- command: `#{ENV.fetch('BENCH_COMMAND', 'bash bench/run.sh')}` (JOBS=#{JOBS}, ROUNDS=#{ROUNDS}, SCENARIOS=#{SCENARIOS.join(',')})\n"
md << "- method: one Redis; jobs enqueued with Ruby Sidekiq's `push_bulk`; each round starts the drainer cold and " \
      "times spawn → `LLEN queue:default` == 0 (polled every 2 ms on one connection); peak RSS = VmHWM.\n\n"
md << md_table(HEAD, table) << "\n\n" unless table.empty?
md << md_table(["ratio (medians)", "value", "compared"], ratio_rows) << "\n\n" unless ratio_rows.empty?
md << "Enqueue-to-start latency at a steady #{LATENCY_RATE} jobs/s for #{LATENCY_SECS} s:\n\n" << md_table(LAT_HEAD, lat_rows) << "\n\n" unless lat_rows.empty?
md << md_table(IDLE_HEAD, idle_rows) << "\n\n" unless idle_rows.empty?
md << (acked_note + $notes).map { |n| "- #{n}\n" }.join << "\n" unless (acked_note + $notes).empty?
md << "![no-op drain and I/O-bound jobs/s](drain.png)\n" if $rows.any? { |r| %w[no-op\ drain I/O\ 50\ ms].include?(r[:scenario]) && r[:median] }
File.write(File.join(RESULTS, "results.md"), md)
File.write(File.join(RESULTS, "results.json"),
           JSON.pretty_generate(meta: meta, throughput: $rows, ratios: $ratios, latency: $latency, idle_rss: $idle, notes: $notes))

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
