# Instructions per job of one warm oxidekiq drain, counted by callgrind: a figure that the machine's load
# does not change (wall-clock and /proc CPU figures on a shared 2-core box do), for comparing one change of
# the hot path with the next. Not a benchmark of speed: valgrind runs one thread at a time.
#
#   ruby bench/callgrind.rb                      # 20 000 NoopJob, -c 200
#   KIND=activejob JOBS=20000 ruby bench/callgrind.rb
#   KIND=activejob-locale ruby bench/callgrind.rb # the ActiveJob payload with an extra {"locale" => "en"} hash
#   KIND=unique ruby bench/callgrind.rb          # UniqueNoopJob (KIND=sequential: SequentialNoopJob)
#   OXIDEKIQ_BIN=... OUT=/tmp/cg.out CONC=200 ruby bench/callgrind.rb
#   NATIVE=1 ruby bench/callgrind.rb             # no valgrind: peak RSS (VmHWM) of the same drain, and
#                                                # user/system CPU per job of oxidekiq and Redis (rough:
#                                                # the drain's end is polled, the box is not kept quiet)
#   REDIS=1 ruby bench/callgrind.rb              # count redis-server's instructions per job instead
#                                                # (oxidekiq runs natively; OUT is Redis's profile)
#
# A private redis-server on a free port (never 6379); the jobs are enqueued with Ruby Sidekiq's client as
# bench/driver.rb does, then parked (RENAME); oxidekiq starts under `valgrind --tool=callgrind
# --instr-atstart=no`, takes a probe job (start-up and the first job's lazy set-up are not counted), then
# `callgrind_control -i on` starts the count, the queue is released, and once every job is acknowledged
# `callgrind_control -d` dumps it. Prints instructions per job; `callgrind_annotate OUT` shows where.
require "rbconfig"
require "socket"
require "tmpdir"
require_relative "jobs"

Sidekiq.logger.level = Logger::WARN
ActiveJob::Base.logger = Logger.new(nil)

ROOT = File.expand_path("..", __dir__)
OXIDEKIQ = ENV.fetch("OXIDEKIQ_BIN", File.join(ROOT, "target/release/oxidekiq"))
KIND = ENV.fetch("KIND", "noop")
JOBS = Integer(ENV.fetch("JOBS", "20000"))
CONC = Integer(ENV.fetch("CONC", "200"))
WORK = Dir.mktmpdir("oxidekiq-callgrind")
OUT = ENV.fetch("OUT", File.join(WORK, "callgrind.out"))
EXTRA = ENV.fetch("EXTRA", "").split

def now = Process.clock_gettime(Process::CLOCK_MONOTONIC)

def wait_until(what, secs)
  deadline = now + secs
  until yield
    raise "timed out waiting for #{what}" if now > deadline
    sleep 0.1
  end
end

port = 6379
port = TCPServer.open("127.0.0.1", 0) { |s| s.addr[1] } while port == 6379
REDIS_CG = ENV["REDIS"] == "1"
redis_vg = REDIS_CG ? ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=#{OUT}"] : []
redis_pid = Process.spawn(*redis_vg, "redis-server", "--port", port.to_s, "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", WORK, out: File.join(WORK, "redis.log"), err: [:child, :out])
counted = REDIS_CG ? redis_pid : nil
pids = [redis_pid]
begin
  url = "redis://127.0.0.1:#{port}/0"
  Sidekiq.configure_client { |c| c.redis = { url: url, size: 2 } }
  redis = Redis.new(url: url)
  wait_until("redis", 10) { redis.ping == "PONG" rescue false }

  (0...JOBS).each_slice(1000) do |idx|
    if KIND.start_with?("activejob")
      # The benchmark's ActiveJob payload carries the plain job's arguments; activejob-locale adds the
      # `{"locale" => "en"}` hash the benchmark used until session 6.
      extra = KIND == "activejob-locale" ? [{ "locale" => "en" }] : []
      Sidekiq::Client.push_bulk(
        "class" => ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper, "wrapped" => NoopActiveJob,
        "queue" => "default", "args" => idx.map { |i| [NoopActiveJob.new(i, *extra).serialize] }
      )
    elsif %w[unique sequential].include?(KIND)
      # The lock benchmark's probes (bench/driver.rb): a no-op behind a lock keyed by its arguments.
      klass = KIND == "unique" ? "UniqueNoopJob" : "SequentialNoopJob"
      Sidekiq::Client.push_bulk("class" => klass, "args" => idx.map { |i| [i] })
    else
      Sidekiq::Client.push_bulk("class" => NoopJob, "args" => idx.map { |i| [i] })
    end
  end
  raise "enqueued #{redis.llen('queue:default')} of #{JOBS}" unless redis.llen("queue:default") == JOBS
  redis.rename("queue:default", "bench:staging")

  log = File.join(WORK, "oxidekiq.log")
  native = ENV["NATIVE"] == "1" || REDIS_CG
  valgrind = native ? [] : ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=#{OUT}"]
  vg = Process.spawn({ "REDIS_URL" => url, "RUST_LOG" => nil },
                     *valgrind, OXIDEKIQ, "-q", "default", "-c", CONC.to_s, *EXTRA,
                     chdir: WORK, in: File::NULL, out: log, err: File.join(WORK, "valgrind.log"))
  pids << vg
  in_flight = lambda do
    (redis.keys("oxidekiq:working:*") + redis.keys("oxidekiq:landing:*")).sum do |k|
      k.start_with?("oxidekiq:landing:") ? redis.llen(k) : redis.hlen(k)
    end
  end
  Sidekiq::Client.push("class" => NoopJob, "args" => [0])
  wait_until("the probe job", 300) { redis.llen("queue:default").zero? && in_flight.call.zero? }
  sleep 1
  hwm = ->(field) { File.foreach("/proc/#{vg}/status").grep(/^#{field}:/).first.to_s.split[1].to_i / 1024.0 }
  rss_idle = hwm.call("VmRSS")
  counted ||= vg unless native
  if counted
    system("callgrind_control", "-i", "on", counted.to_s, out: File::NULL) or raise "callgrind_control -i on failed"
  end
  # user and system CPU seconds of a process (clock ticks of /proc/<pid>/stat)
  cpu = ->(pid) { File.read("/proc/#{pid}/stat").split(")").last.split.values_at(11, 12).map { |t| t.to_f / 100 } }
  cpu0 = [cpu.call(vg), cpu.call(redis_pid)]
  t0 = now
  redis.rename("bench:staging", "queue:default")
  wait_until("the drain", 1800) { redis.llen("queue:default").zero? && in_flight.call.zero? }
  secs = now - t0
  cpu1 = [cpu.call(vg), cpu.call(redis_pid)]
  sleep 1 # the log writer's last batch
  if native && !REDIS_CG
    us = ->(i, k) { (cpu1[i][k] - cpu0[i][k]) * 1e6 / JOBS }
    printf("%s: %d jobs, -c %d: peak RSS %.1f MB (%.1f MB after the probe job), %.2f s; CPU us/job " \
           "(user/system, polled every 0.1 s): oxidekiq %.1f/%.1f, Redis %.1f/%.1f\n",
           KIND, JOBS, CONC, hwm.call("VmHWM"), rss_idle, secs, us.call(0, 0), us.call(0, 1), us.call(1, 0), us.call(1, 1))
    Process.kill("TERM", vg)
    Process.wait(vg)
    pids.delete(vg)
    exit
  end
  system("callgrind_control", "-d", counted.to_s, out: File::NULL) or raise "callgrind_control -d failed"
  Process.kill("TERM", vg)
  Process.wait(vg)
  pids.delete(vg)
  dumped = Dir["#{OUT}*"].reject { |f| f == OUT }.min || OUT
  total = File.foreach(dumped).grep(/^(summary|totals):/).first.to_s.split[1].to_i
  lines = File.foreach(log).count { |l| l.include?(" done") || l.include?("\"done\"") }
  failed = redis.zcard("retry") + redis.zcard("dead")
  printf("%s: %d jobs, -c %d: %.0f instructions/job (%d in all, %.1f s under valgrind; %d done lines; %d failed)\n",
         KIND, JOBS, CONC, total.to_f / JOBS, total, secs, lines, failed)
  puts "profile: #{dumped} (callgrind_annotate #{dumped}); log: #{log}"
ensure
  pids.each do |p|
    Process.kill("TERM", p)
    Process.wait(p)
  rescue Errno::ESRCH, Errno::ECHILD
    nil
  end
end
