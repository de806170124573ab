# The benchmark's Ruby job classes: loaded by the driver (client side, to enqueue) and by Ruby Sidekiq
# (`sidekiq -r bench/jobs.rb`, server side, to drain). Same names and arguments as the Rust workers in
# workers/src/lib.rs and bench/rusty.
require "sidekiq"
require "active_job"
require "active_job/queue_adapters/sidekiq_adapter"

Redis.silence_deprecations = true if Redis.respond_to?(:silence_deprecations=)
ActiveJob::Base.queue_adapter = :sidekiq

# The defaults scenario's "logging off" (bench/driver.rb): Sidekiq 6.4's job logger writes its start and done
# lines at INFO through `Sidekiq.logger`, which the CLI creates at INFO and only raises to DEBUG for `-v`; this
# file is required (`-r`) after that, so a level set here holds for every job. Unset: Sidekiq's default.
if (level = ENV["BENCH_SIDEKIQ_LOG_LEVEL"]) && !level.empty?
  Sidekiq.logger.level = level.downcase.to_sym
end

class NoopJob
  include Sidekiq::Worker
  def perform(*args); end
end

class HardWorker
  include Sidekiq::Worker
  def perform(name, count)
    raise ArgumentError, "count must not be negative" if count < 0
    sleep(count / 1000.0)
  end
end

# Enqueue-to-start latency probe: `sent_at` is the producer's clock (epoch seconds, float) when it
# pushed the job; the job appends `now - sent_at` (seconds) to the list `bench:latency` before anything else.
class LatencyJob
  include Sidekiq::Worker
  def perform(sent_at)
    delay = Time.now.to_f - sent_at
    Sidekiq.redis { |r| r.rpush("bench:latency", delay.to_s) }
  end
end

# The ActiveJob twin of the Rust NoopActiveJob: the cost of ActiveJob's wrapping, nothing else.
class NoopActiveJob < ActiveJob::Base
  queue_as :default
  def perform(*args); end
end

# The ActiveJob twin of the Rust WelcomeEmailJob, on queue `default` for the benchmark.
class WelcomeEmailJob < ActiveJob::Base
  queue_as :default
  def perform(user_id, options = {}); end
end
