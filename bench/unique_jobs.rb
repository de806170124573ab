# The lock benchmark's Ruby peer (bench/driver.rb, `locks`, when UNIQUE_JOBS_LIB is set): Ruby Sidekiq
# running UniqueNoopJob under sidekiq-unique-jobs' `while_executing` lock, the gem loaded from its unpacked
# source (`-I $UNIQUE_JOBS_LIB/sidekiq-unique-jobs-7.1.33/lib -I .../brpoplpush-redis_script-0.1.3/lib`:
# 7.1.33 is the gem line for Sidekiq 6.4, as fixtures/unique-jobs/record.sh runs it; no gem code is in
# this repository). The driver pushes plain jobs (no client middleware): the server middleware computes
# each job's lock digest from its class and arguments, takes the lock around perform and releases it.
#
#   sidekiq -r bench/unique_jobs.rb -q default -c 10    (the driver adds the -I flags)
require_relative "jobs"
require "sidekiq_unique_jobs"

SidekiqUniqueJobs.configure do |config|
  config.logger.level = Logger::WARN if config.respond_to?(:logger)
  config.reaper = :none # no reaper pass during a drain: the lock's own cost only
end

Sidekiq.configure_server do |config|
  config.server_middleware { |chain| chain.add SidekiqUniqueJobs::Middleware::Server }
  SidekiqUniqueJobs::Server.configure(config)
end

# The twin of the Rust UniqueNoopJob (locked by its arguments), under the gem's lock taken while it runs.
class UniqueNoopJob
  include Sidekiq::Worker
  sidekiq_options lock: :while_executing
  def perform(*args); end
end
