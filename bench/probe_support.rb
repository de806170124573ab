# What bench/callgrind.rb and bench/fetch_probe.rb share: a private redis-server (optionally under callgrind),
# the benchmark's jobs enqueued by Ruby Sidekiq's client, and callgrind's totals.
require "etc"
require "socket"
require "tmpdir"
require_relative "jobs"

Sidekiq.logger.level = Logger::WARN
ActiveJob::Base.logger = Logger.new(nil)

module ProbeSupport
  ROOT = File.expand_path("..", __dir__)

  module_function

  def now = Process.clock_gettime(Process::CLOCK_MONOTONIC)

  def wait_until(what, secs)
    deadline = now + secs
    until yield
      raise "timed out waiting for #{what}" if now > deadline
      sleep 0.1
    end
  end

  # `valgrind --tool=callgrind` with counting off until `callgrind_control -i on`, writing to `out`.
  def callgrind(out) = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=#{out}"]

  # Starts redis-server on a free port (never 6379) with no persistence, `wrapper` in front of it (e.g.
  # callgrind). Returns [pid, url, client] once it answers PING.
  def start_redis(work, wrapper = [])
    port = 6379
    port = TCPServer.open("127.0.0.1", 0) { |s| s.addr[1] } while port == 6379
    pid = Process.spawn(*wrapper, "redis-server", "--port", port.to_s, "--bind", "127.0.0.1", "--save", "",
                        "--appendonly", "no", "--dir", work, out: File.join(work, "redis.log"), err: [:child, :out])
    url = "redis://127.0.0.1:#{port}/0"
    Sidekiq.configure_client { |c| c.redis = { url: url, size: 2 } }
    redis = Redis.new(url: url)
    wait_until("redis", 60) { redis.ping == "PONG" rescue false }
    [pid, url, redis]
  end

  # Pushes `jobs` jobs of `kind` to queue "default" as bench/driver.rb does: noop (NoopJob), activejob
  # (NoopActiveJob with the plain job's arguments), activejob-locale (the same with the `{"locale" => "en"}`
  # hash the benchmark used until session 6), unique / sequential (the lock benchmark's no-ops behind a
  # lock keyed by their arguments).
  def enqueue(redis, kind, jobs)
    (0...jobs).each_slice(1000) do |idx|
      if kind.start_with?("activejob")
        extra = kind == "activejob-locale" ? [{ "locale" => "en" }] : []
        Sidekiq::Client.push_bulk(
          "class" => ActiveJob::QueueAdapters::SidekiqAdapter::JobWrapper, "wrapped" => NoopActiveJob,
          "queue" => "default", "args" => idx.map { |i| [NoopActiveJob.new(i, *extra).serialize] }
        )
      elsif %w[unique sequential].include?(kind)
        klass = kind == "unique" ? "UniqueNoopJob" : "SequentialNoopJob"
        Sidekiq::Client.push_bulk("class" => klass, "args" => idx.map { |i| [i] })
      else
        Sidekiq::Client.push_bulk("class" => NoopJob, "args" => idx.map { |i| [i] })
      end
    end
    queued = redis.llen("queue:default")
    raise "enqueued #{queued} of #{jobs}" unless queued == jobs
  end

  # Dumps the counts of the process `pid` runs under callgrind; returns [file, instructions counted].
  def callgrind_dump(pid, out)
    system("callgrind_control", "-d", pid.to_s, out: File::NULL) or raise "callgrind_control -d failed"
    dumped = Dir["#{out}*"].reject { |f| f == out }.min || out
    [dumped, File.foreach(dumped).grep(/^(summary|totals):/).first.to_s.split[1].to_i]
  end

  def callgrind_on(pid)
    system("callgrind_control", "-i", "on", pid.to_s, out: File::NULL) or raise "callgrind_control -i on failed"
  end

  # Voluntary context switches of every thread of process `pid` so far (a thread that blocked: parked,
  # waiting for a socket or a lock), from /proc/<pid>/task/*/status.
  def voluntary_switches(pid)
    Dir["/proc/#{pid}/task/*/status"].sum do |f|
      File.read(f)[/^voluntary_ctxt_switches:\s+(\d+)/, 1].to_i
    rescue Errno::ENOENT
      0
    end
  end

  # [user, system] CPU seconds of process `pid` so far (utime and stime, fields 14-15 of proc(5)).
  def cpu_times(pid)
    ticks = Etc.sysconf(Etc::SC_CLK_TCK).to_f
    File.read("/proc/#{pid}/stat").split(") ", 2).last.split.values_at(11, 12).map { |t| t.to_i / ticks }
  end

  # Stops every process of `pids` still running.
  def stop_all(pids)
    pids.each do |p|
      Process.kill("TERM", p)
      Process.wait(p)
    rescue Errno::ESRCH, Errno::ECHILD
      nil
    end
  end
end
