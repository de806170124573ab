# Prints what happened, read through Sidekiq's own API (as the Web UI would show it).
require "sidekiq"
require "sidekiq/api"
Redis.silence_deprecations = true if Redis.respond_to?(:silence_deprecations=)
Sidekiq.configure_client { |c| c.redis = { url: ENV.fetch("REDIS_URL") } }
Sidekiq.logger.level = Logger::WARN
s = Sidekiq::Stats.new
puts "processed: #{s.processed}"
puts "failed:    #{s.failed}"
puts "enqueued:  #{s.enqueued}"
puts "scheduled: #{s.scheduled_size}"
puts "in retry:  #{s.retry_size}"
Sidekiq::RetrySet.new.each { |e| puts "  retry  #{e.display_class} #{e.display_args.inspect}: #{e["error_class"]}: #{e["error_message"][0, 90]}" }
puts "in dead:   #{s.dead_size}"
Sidekiq::DeadSet.new.each { |e| puts "  dead   #{e.display_class} #{e.display_args.inspect}: #{e["error_class"]}: #{e["error_message"]}" }
