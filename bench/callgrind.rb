# Instructions per job of one warm oxidekiq drain, counted by callgrind: a figure that the machine's load
# does not change (wall-clock and /proc CPU figures on a shared 2-core box do), for comparing one change of
# the hot path with the next. Not a benchmark of speed: valgrind runs one thread at a time.
#
#   ruby bench/callgrind.rb                      # 20 000 NoopJob, -c 200
#   KIND=activejob JOBS=20000 ruby bench/callgrind.rb
#   KIND=activejob-locale ruby bench/callgrind.rb # the ActiveJob payload with an extra {"locale" => "en"} hash
#   KIND=unique ruby bench/callgrind.rb          # UniqueNoopJob (KIND=sequential: SequentialNoopJob)
#   OXIDEKIQ_BIN=... OUT=/tmp/cg.out CONC=200 ruby bench/callgrind.rb
#   NATIVE=1 ruby bench/callgrind.rb             # no valgrind: peak RSS (VmHWM) of the same drain, the
#                                                # user/system CPU per job of oxidekiq and Redis (rough:
#                                                # the drain's end is polled, the box is not kept quiet),
#                                                # and oxidekiq's voluntary context switches per job
#   SYSCALLS=1 ruby bench/callgrind.rb           # no valgrind: per job, the syscalls of each oxidekiq
#                                                # thread and of Redis by kind, the wake-ups each thread
#                                                # made (sched_wakeup, counted on the waker) and its
#                                                # switches out, its voluntary context switches, and the
#                                                # commands Redis ran (INFO commandstats); all counts,
#                                                # so load-independent (perf stat attached over the
#                                                # drain; about 0.5 s of idle before it is counted too:
#                                                # its rate is printed, measured before the drain)
#   REDIS=1 ruby bench/callgrind.rb              # count redis-server's instructions per job instead
#                                                # (oxidekiq runs natively; OUT is Redis's profile;
#                                                # it includes this script's polling, a few commands
#                                                # every 0.1 s)
#
# A private redis-server on a free port (never 6379); the jobs are enqueued with Ruby Sidekiq's client as
# bench/driver.rb does, then parked (RENAME); oxidekiq starts under `valgrind --tool=callgrind
# --instr-atstart=no`, takes a probe job (start-up and the first job's lazy set-up are not counted), then
# `callgrind_control -i on` starts the count, the queue is released, and once every job is acknowledged
# `callgrind_control -d` dumps it. Prints instructions per job; `callgrind_annotate OUT` shows where.
require_relative "probe_support"
include ProbeSupport

OXIDEKIQ = ENV.fetch("OXIDEKIQ_BIN", File.join(ROOT, "target/release/oxidekiq"))
KIND = ENV.fetch("KIND", "noop")
JOBS = Integer(ENV.fetch("JOBS", "20000"))
CONC = Integer(ENV.fetch("CONC", "200"))
WORK = Dir.mktmpdir("oxidekiq-callgrind")
OUT = ENV.fetch("OUT", File.join(WORK, "callgrind.out"))
EXTRA = ENV.fetch("EXTRA", "").split
REDIS_CG = ENV["REDIS"] == "1"
SYSCALLS = ENV["SYSCALLS"] == "1"
PERF_EVENTS = ["-e", "syscalls:sys_enter_*", "-e", "sched:sched_wakeup", "-e", "sched:sched_switch"].freeze

# Starts `perf stat` counting PERF_EVENTS per thread of `pid` into `out` until it gets SIGINT.
def perf_stat(pid, out)
  Process.spawn("perf", "stat", "--per-thread", "-x", ",", "-o", out, *PERF_EVENTS, "-p", pid.to_s,
                out: File::NULL, err: File::NULL)
end

# perf stat's CSV: { "thread name" => { "event" => count } } (threads of one name added up, tids dropped).
def perf_counts(out)
  File.foreach(out).each_with_object(Hash.new { |h, k| h[k] = Hash.new(0) }) do |line, acc|
    thread, count, _, event = line.split(",")
    next unless event && count =~ /\A\d+\z/ && count.to_i.positive?
    acc[thread.sub(/-\d+\z/, "")][event.sub(/\A(syscalls:sys_enter_|sched:)/, "")] += count.to_i
  end
end

# Voluntary context switches per thread name of process `pid`.
def thread_switches(pid)
  Dir["/proc/#{pid}/task/*"].each_with_object(Hash.new(0)) do |t, acc|
    acc[File.read("#{t}/comm").strip] += File.read("#{t}/status")[/^voluntary_ctxt_switches:\s+(\d+)/, 1].to_i
  rescue Errno::ENOENT
    nil
  end
end

# Redis's INFO commandstats: { "command" => calls }, without the commands this script polls with.
def command_calls(redis)
  redis.info("commandstats").filter_map do |k, v|
    name = k.to_s.delete_prefix("cmdstat_")
    next if %w[keys hlen llen type info rename ping].include?(name)
    [name, (v.is_a?(String) ? v[/calls=(\d+)/, 1] : v.fetch("calls")).to_i]
  end.to_h
end

redis_pid, url, redis = start_redis(WORK, REDIS_CG ? callgrind(OUT) : [])
counted = REDIS_CG ? redis_pid : nil
pids = [redis_pid]
begin
  enqueue(redis, KIND, JOBS)
  redis.rename("queue:default", "bench:staging")

  log = File.join(WORK, "oxidekiq.log")
  native = ENV["NATIVE"] == "1" || REDIS_CG || SYSCALLS
  valgrind = native ? [] : callgrind(OUT)
  vg = Process.spawn({ "REDIS_URL" => url, "RUST_LOG" => nil },
                     *valgrind, OXIDEKIQ, "-q", "default", "-c", CONC.to_s, *EXTRA,
                     chdir: WORK, in: File::NULL, out: log, err: File.join(WORK, "valgrind.log"))
  pids << vg
  # Batch lists (reliable fetch), landing lists, and the working hashes of older versions.
  in_flight = lambda do
    # Count by type: batch lists, landing lists, the working hashes and lists of older releases
    # (a key may also go between KEYS and the count: it then counts 0).
    %w[oxidekiq:batch:* oxidekiq:working:* oxidekiq:landing:*].flat_map { |p| redis.keys(p) }.sum do |k|
      case redis.type(k)
      when "list" then redis.llen(k)
      when "hash" then redis.hlen(k)
      else 0
      end
    end
  end
  Sidekiq::Client.push("class" => NoopJob, "args" => [0])
  wait_until("the probe job", 300) { redis.llen("queue:default").zero? && in_flight.call.zero? }
  sleep 1
  hwm = ->(field) { File.foreach("/proc/#{vg}/status").grep(/^#{field}:/).first.to_s.split[1].to_i / 1024.0 }
  rss_idle = hwm.call("VmRSS")
  counted ||= vg unless native
  callgrind_on(counted) if counted
  if SYSCALLS
    idle_out = File.join(WORK, "perf-idle.csv")
    system("perf", "stat", "--per-thread", "-x", ",", "-o", idle_out, *PERF_EVENTS, "-p", vg.to_s, "--",
           "sleep", "1", out: File::NULL, err: File::NULL)
    perfs = { "oxidekiq" => vg, "redis" => redis_pid }.map do |name, pid|
      out = File.join(WORK, "perf-#{name}.csv")
      [name, out, perf_stat(pid, out)]
    end
    sleep 0.5 # perf attaches its ~360 counters to every thread
    threads0 = thread_switches(vg)
    commands0 = command_calls(redis)
  end
  cpu0 = [cpu_times(vg), cpu_times(redis_pid)]
  switches0 = voluntary_switches(vg)
  t0 = now
  redis.rename("bench:staging", "queue:default")
  wait_until("the drain", 1800) { redis.llen("queue:default").zero? && in_flight.call.zero? }
  secs = now - t0
  cpu1 = [cpu_times(vg), cpu_times(redis_pid)]
  switches = (voluntary_switches(vg) - switches0).to_f / JOBS
  sleep 1 # the log writer's last batch
  if SYSCALLS
    perfs.each { |_, _, perf| Process.kill("INT", perf) }
    perfs.each { |_, _, perf| Process.wait(perf) }
    threads1 = thread_switches(vg)
    commands1 = command_calls(redis)
    printf("%s: %d jobs, -c %d, %.2f s (counts per job; idle: oxidekiq's own rate in 1 s before the drain)\n",
           KIND, JOBS, CONC, secs)
    idle = perf_counts(idle_out)
    perfs.each do |name, out, _|
      perf_counts(out).sort.each do |thread, events|
        shown = events.select { |_, n| n.to_f / JOBS >= 0.0005 }.sort_by { |_, n| -n }
        next if shown.empty?
        puts "  #{name} thread #{thread}: " + shown.map { |e, n|
          idle_n = name == "oxidekiq" ? idle[thread][e] : 0
          format("%s %.4f%s", e, n.to_f / JOBS, idle_n.positive? ? " (idle #{idle_n}/s)" : "")
        }.join(", ")
      end
    end
    puts "  voluntary context switches per job: " +
         threads1.map { |t, n| format("%s %.4f", t, (n - threads0[t]).to_f / JOBS) }.join(", ")
    puts "  Redis commands per job: " +
         commands1.filter_map { |c, n| d = n - commands0[c].to_i; d.positive? && format("%s %.4f", c, d.to_f / JOBS) }.join(", ")
    Process.kill("TERM", vg)
    Process.wait(vg)
    pids.delete(vg)
    exit
  end
  if native && !REDIS_CG
    us = ->(i, k) { (cpu1[i][k] - cpu0[i][k]) * 1e6 / JOBS }
    printf("%s: %d jobs, -c %d: peak RSS %.1f MB (%.1f MB after the probe job), %.2f s; CPU us/job " \
           "(user/system, polled every 0.1 s): oxidekiq %.1f/%.1f, Redis %.1f/%.1f; oxidekiq's voluntary " \
           "context switches per job %.3f\n",
           KIND, JOBS, CONC, hwm.call("VmHWM"), rss_idle, secs, us.call(0, 0), us.call(0, 1), us.call(1, 0), us.call(1, 1),
           switches)
    Process.kill("TERM", vg)
    Process.wait(vg)
    pids.delete(vg)
    exit
  end
  dumped, total = callgrind_dump(counted, OUT)
  Process.kill("TERM", vg)
  Process.wait(vg)
  pids.delete(vg)
  lines = File.foreach(log).count { |l| l.include?(" done") || l.include?("\"done\"") }
  failed = redis.zcard("retry") + redis.zcard("dead")
  printf("%s: %d jobs, -c %d: %.0f instructions/job (%d in all, %.1f s under valgrind; %d done lines; %d failed)\n",
         KIND, JOBS, CONC, total.to_f / JOBS, total, secs, lines, failed)
  puts "profile: #{dumped} (callgrind_annotate #{dumped}); log: #{log}"
ensure
  stop_all(pids)
end
