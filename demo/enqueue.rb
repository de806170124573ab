# Enqueues a mix of jobs the way a Rails app does, with real Ruby Sidekiq 6.4 and ActiveJob 6.1.
# The Ruby classes here are the twins of the Rust workers in workers/src/lib.rs: same names, same
# arguments. Only the client side is needed to enqueue them.
require "sidekiq"
require "active_job"
require "active_job/queue_adapters/sidekiq_adapter"

Redis.silence_deprecations = true if Redis.respond_to?(:silence_deprecations=)
Sidekiq.configure_client { |c| c.redis = { url: ENV.fetch("REDIS_URL") } }
Sidekiq.logger.level = Logger::WARN
ActiveJob::Base.queue_adapter = :sidekiq
ActiveJob::Base.logger = Logger.new(nil)

class HardWorker
  include Sidekiq::Worker
  def perform(name, count)
    raise ArgumentError, "count must not be negative" if count < 0
    sleep(count / 1000.0)
  end
end

class NoopJob
  include Sidekiq::Worker
  def perform(*args); end
end

class WelcomeEmailJob < ActiveJob::Base
  queue_as :mailers
  def perform(user_id, options = {}); end
end

n = Integer(ENV.fetch("DEMO_JOBS", "1000"))
Sidekiq::Client.push_bulk("class" => NoopJob, "args" => Array.new(n) { |i| [i, "noop"] })
50.times { |i| HardWorker.perform_async("user-#{i}", rand(1..20)) }
3.times { |i| HardWorker.perform_async("bad-#{i}", -1) }                  # fail: to the retry set
HardWorker.set(retry: 0).perform_async("doomed", -1)                      # retry: 0 -> dead set
20.times { |i| WelcomeEmailJob.perform_later(1000 + i, { "locale" => %w[en fr de][i % 3] }) }
WelcomeEmailJob.perform_later(7)                                          # options left out
HardWorker.perform_in(2, "scheduled", 5)                                  # runs in Rust ~2 s later
Sidekiq::Client.push("class" => "Reports::Nightly", "args" => [1])        # no Rust worker: retry set
puts "enqueued #{n + 50 + 3 + 1 + 21 + 1 + 1} jobs (#{n} NoopJob, 54 HardWorker, 21 WelcomeEmailJob, 1 scheduled, 1 unknown class)"
