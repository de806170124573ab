# Redis's CPU per job of one way of fetching, measured from a bare client that speaks raw RESP over one
# socket (so that its own CPU, on the cores Redis shares, stays small): the evidence for the fast path's
# shape and its batch size (bench/results/redis-per-job.md, session 12). Not a benchmark of oxidekiq.
#
#   ruby bench/fetch_raw.rb PORT DESIGN BATCH BYTES JOBS
#
# Runs against the redis-server on 127.0.0.1:PORT (start a private one; never 6379), which it fills with
# JOBS payloads of about BYTES bytes in `queue:x` (deleting what was there), then drains, BATCH jobs a
# fetch, every batch list deleted with the next fetch (as oxidekiq's acks ride on it). Prints Redis's CPU
# (INFO cpu, getrusage: all of its threads) per job over the drain and the busiest commands' µs per job
# (INFO commandstats, wall-clock time inside each command).
#
# DESIGN=floor: `RPOP queue:x BATCH`, no safety (bench/floor.rb pops 100).
# DESIGN=fast: oxidekiq's fast path: `MULTI; SORT .. BY nosort DESC LIMIT 0 BATCH STORE <list>; LTRIM;
#   EVAL <the guard of src/processing/fetch/reliable.rs>; LRANGE <list>; EXEC`.
# DESIGN=script: oxidekiq's batch script (its `FETCH_LUA`, sent with `EVALSHA`) over the queue and an empty
#   landing list, and `LRANGE` of both batch lists.
# DESIGN=chunkN: the same with one `SORT` and one `LRANGE` per N jobs of the batch (one list each; the guard
#   looks at the first only: for measuring, not for use).
require "socket"

port, design, batch, bytes, jobs = ARGV[0].to_i, ARGV[1], ARGV[2].to_i, ARGV[3].to_i, ARGV[4].to_i
abort "usage: ruby bench/fetch_raw.rb PORT floor|script|fast|chunkN BATCH BYTES JOBS" if port.zero? || port == 6379 || jobs.zero?

# The raw string literal (r#"..."#) that follows `marker` in a Rust source file of this tree.
def rust_raw(path, marker)
  src = File.read(File.join(__dir__, "..", path))
  from = src.index('r#"', src.index(marker)) + 3
  src[from...src.index('"#', from)]
end
GUARD = rust_raw("src/processing/fetch/reliable.rs", "const GUARD_LUA")
SCRIPT = rust_raw("src/connection/lua.rs", "macro_rules! lua_common") + rust_raw("src/processing/fetch/reliable.rs", "const FETCH_LUA")

SOCK = TCPSocket.new("127.0.0.1", port)
SOCK.setsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY, 1)

def encode(*args) = "*#{args.size}\r\n" + args.map { |a| a = a.to_s; "$#{a.bytesize}\r\n#{a}\r\n" }.join

def reply
  line = SOCK.gets
  case line[0]
  when "+", ":" then line[1..].chomp
  when "-" then raise line
  when "$" then (n = line[1..].to_i).negative? ? nil : SOCK.read(n + 2)[0, n]
  when "*" then (n = line[1..].to_i).negative? ? nil : Array.new(n) { reply }
  end
end

def pipeline(cmds) = (SOCK.write(cmds.map { |c| encode(*c) }.join); cmds.map { reply })
def call(*args) = pipeline([args]).first
def cpu = call("INFO", "cpu").scan(/used_cpu_(?:sys|user):([\d.]+)/).flatten.sum(&:to_f)

sha = call("SCRIPT", "LOAD", SCRIPT)
call("DEL", "queue:x")
pad = "x" * [bytes - 50, 0].max
(0...jobs).each_slice(1000) do |ids|
  pipeline(ids.map { |i| ["LPUSH", "queue:x", %({"class":"NoopJob","args":["#{pad}"],"jid":"#{i}"})] })
end
call("CONFIG", "RESETSTAT")
before = cpu
n = 0
taken = 0
held = []
loop do
  list = "oxidekiq:batch:raw:1:ab:x:@#{n += 1}"
  acks = held.empty? ? [] : [["DEL", *held]]
  got =
    case design
    when "floor"
      Array(pipeline([["RPOP", "queue:x", batch]]).first).size
    when "script"
      landed = "#{list}.landed"
      cmds = [["EVALSHA", sha, 5, "dead", "oxidekiq:landing:raw:1:ab:x", landed, "queue:x", list, batch,
               16 * 1024 * 1024, 32 * 1024 * 1024, "raw", "0", "0", "0", 10_000],
              ["LRANGE", landed, 0, -1], ["LRANGE", list, 0, -1]]
      held = [landed, list]
      pipeline(cmds + acks)[1..2].sum(&:size)
    when "fast", /\Achunk(\d+)\z/
      size = design == "fast" ? batch : Regexp.last_match(1).to_i
      parts = (0...(batch + size - 1) / size).map { |i| ["#{list}.#{i}", i * size] }
      cmds = [["MULTI"], *parts.map { |key, skip| ["SORT", "queue:x", "BY", "nosort", "DESC", "LIMIT", skip, size, "STORE", key] },
              ["LTRIM", "queue:x", 0, -(batch + 1)],
              ["EVAL", GUARD, 3, "queue:x", parts[0][0], "#{list}.aside", 16 * 1024 * 1024],
              *parts.map { |key, _| ["LRANGE", key, 0, -1] }, ["EXEC"]]
      held = parts.map(&:first)
      pipeline(cmds + acks)[cmds.size - 1].last(parts.size).sum(&:size)
    else abort "DESIGN is floor, script, fast or chunkN"
    end
  break if got.zero?

  taken += got
end
call("DEL", *held) unless held.empty?
spent = cpu - before
stats = call("INFO", "commandstats").lines.filter_map { |l| l =~ /cmdstat_(\w+):calls=\d+,usec=(\d+)/ && [$1, $2.to_f / taken] }
printf("%-8s batch %4d, %6d-byte payloads, %d jobs: Redis %.3f µs/job (%s)\n", design, batch, bytes, taken, spent * 1e6 / taken,
       stats.sort_by { -_2 }.first(6).map { |c, us| format("%s %.2f", c, us) }.join(", "))
