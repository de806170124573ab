# Local check of the router on a real Sidekiq client (run by ruby/versions_check.sh for 7.3.9, 8.1.7 and
# Debian's 6.4.1): at 100% with a live registration every job goes to default_rust except a Pro-batch job
# and a scheduled one; with the registration gone (and the 3 s cache turned over) new jobs stay on
# default; Redis is asked about twice per cache period, never per job. Prints what it found.
require "sidekiq"
require ENV.fetch("MW")
Sidekiq.configure_client do |c|
  c.redis = { url: ENV.fetch("REDIS_URL") }
  c.client_middleware { |chain| chain.add Oxidekiq::Router }
end
Sidekiq.logger.level = Logger::ERROR rescue nil
class HardWorker; include Sidekiq::Job rescue include Sidekiq::Worker; end
Sidekiq.redis do |c|
  c.call("FLUSHALL")
  c.call("HSET", "oxidekiq:routes", "HardWorker", "100")
  c.call("ZADD", "oxidekiq:serving:default_rust|HardWorker", (Time.now.to_f + 60).to_s, "x:1:ab")
end
10.times { |i| HardWorker.perform_async("a", i) }
Sidekiq::Client.push("class" => "HardWorker", "args" => ["b", 1], "bid" => "x")
HardWorker.perform_in(60, "c", 1)
Sidekiq.redis do |c|
  puts "#{Sidekiq::VERSION} rust=#{c.call("LLEN", "queue:default_rust")} default=#{c.call("LLEN", "queue:default")} scheduled=#{c.call("ZCARD", "schedule")}"
  c.call("DEL", "oxidekiq:serving:default_rust|HardWorker")
end
sleep 3.2
5.times { |i| HardWorker.perform_async("d", i) }
Sidekiq.redis { |c| puts "no live: rust=#{c.call("LLEN", "queue:default_rust")} default=#{c.call("LLEN", "queue:default")}" }
Sidekiq.redis { |c| puts c.call("INFO", "commandstats").lines.grep(/hgetall|exists/).map { |l| l.split(",").first }.join(" ") }
