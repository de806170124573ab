# frozen_string_literal: true

# oxidekiq's canary router: a Sidekiq client middleware that sends a chosen share of a class's new
# jobs to the queue "<queue>_rust", which oxidekiq serves, and the rest where Ruby always sent them.
#
#   require "oxidekiq"   # this file (copy it into lib/, or require it by path)
#   Sidekiq.configure_client { |c| c.client_middleware { |chain| chain.add Oxidekiq::Router } }
#
# Add the same line to `Sidekiq.configure_server` too, so jobs the Ruby server pushes (scheduled
# jobs coming due, retries) are routed as well. Put it last in the chain, after the middleware that
# add `bid` (Pro batches) or `unique_for` (Enterprise): jobs carrying those stay on Ruby. Jobs with a
# sidekiq-unique-jobs `lock_digest` are routed: oxidekiq runs the gem's server side.
#
# The share is set with `oxidekiq route CLASS PERCENT` and kept in the Redis hash "oxidekiq:routes";
# each process reads it at most every REFRESH seconds, so a job costs no Redis call of its own.
# A job is routed only while a live oxidekiq process serves "<queue>_rust" with a worker for its class
# (key "oxidekiq:serving:<queue>_rust|<Class>", kept alive by oxidekiq's heartbeat with a short TTL):
# with no live oxidekiq, everything stays on Ruby. A job of a routed class found on "<queue>_rust"
# (a retry of a job Rust ran) goes back to "<queue>" once the share is 0 or no oxidekiq serves it.
# Any Redis error leaves the job where Ruby would send it.
#
# push_bulk (and ActiveJob's perform_all_later) on Sidekiq 6.4-7.3 pushes a whole batch to the queue of
# its first job (client.rb atomic_push reads payloads.first["queue"]), so bulk jobs follow the decision
# made for the first one: the share holds across batches, not within one. 8.x groups by queue.
#
# Works with the client middleware API of Sidekiq 6.4 through 8.x:
# `call(job_class_or_string, job, queue, redis_pool)`, yielding to push (client.rb in each version).

module Oxidekiq
  ROUTES_KEY = "oxidekiq:routes"
  SERVING_PREFIX = "oxidekiq:serving:"
  RUST_SUFFIX = "_rust"
  # Seconds a process keeps the route table and the liveness answers (src/processing/migrate/route.rs
  # RUBY_REFRESH_SECS must match).
  REFRESH = 3.0
  # Payload keys of Ruby-side contracts oxidekiq cannot honour (src/processing/migrate/check.rs Contract, those
  # not `honoured`), but a sidekiq-unique-jobs `lock` without `lock_digest`: the gem's client
  # middleware may add the digest after this one runs, so it is not tested here; oxidekiq hands such
  # a job to Ruby (--handoff) or fails it, never runs it unlocked.
  CONTRACT_KEYS = %w[bid unique_for].freeze

  # The route table and liveness answers of one Redis pool, shared by every Router instance: Sidekiq
  # builds a new middleware instance for every push (middleware/chain.rb `retrieve` -> `make_new`, 6.4
  # through 8.x), so the cache lives here, once per process and pool.
  class Cache
    def initialize(refresh)
      @refresh = refresh.to_f
      @mutex = Mutex.new
      @routes = {}
      @routes_at = nil
      @live = {}
    end

    def routes(redis_pool)
      @mutex.synchronize do
        if @routes_at.nil? || now - @routes_at >= @refresh
          # Stamped first: on a Redis error the old table is kept for another period, not retried per job.
          @routes_at = now
          @live = {}
          raw = redis_pool.with { |conn| conn.call("HGETALL", ROUTES_KEY) }
          # redis-rb 4 (Sidekiq 6.x) and RESP2 answer a flat array; redis-client on RESP3 a Hash.
          raw = Hash[*raw] if raw.is_a?(Array)
          @routes = raw.each_with_object({}) { |(k, v), h| h[k.to_s] = v.to_i.clamp(0, 100) }
        end
        @routes
      end
    end

    def live?(redis_pool, target, klass)
      key = "#{SERVING_PREFIX}#{target}|#{klass}"
      @mutex.synchronize do
        hit = @live[key]
        return hit[0] if hit && now - hit[1] < @refresh
        # Stamped first, as above: an error answers "not live" until the next period.
        @live[key] = [false, now]
        alive = redis_pool.with { |conn| conn.call("EXISTS", key) }.to_i > 0
        @live[key] = [alive, now]
        alive
      end
    end

    private

    def now
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end
  end

  @caches = {}
  @caches_mutex = Mutex.new

  # The cache of one Redis pool (Sidekiq's client uses one pool per process unless sharded).
  def self.cache(redis_pool, refresh = REFRESH)
    @caches_mutex.synchronize { @caches[redis_pool.object_id] ||= Cache.new(refresh) }
  end

  class Router
    # Sidekiq 7+/8 set this on middleware that responds to it; unused here.
    attr_accessor :config

    def call(_job_class, job, _queue, redis_pool)
      route(job, redis_pool) if job.is_a?(Hash)
      yield
    end

    # Sets job["queue"] to where this job should go; leaves it alone on any doubt.
    def route(job, redis_pool)
      # Scheduled jobs are routed when they come due (the server's push runs this middleware again).
      return if job.key?("at")
      queue = job["queue"].to_s
      return if queue.empty?
      klass = (job["wrapped"] || job["class"]).to_s
      cache = Oxidekiq.cache(redis_pool)
      share = cache.routes(redis_pool)[klass]
      return unless share

      if queue.end_with?(RUST_SUFFIX)
        base = queue.delete_suffix(RUST_SUFFIX)
        return if base.empty?
        job["queue"] = base unless share > 0 && cache.live?(redis_pool, queue, klass)
        return
      end
      return unless share > 0
      return if CONTRACT_KEYS.any? { |k| !job[k].nil? }
      return unless rand(100) < share
      target = queue + RUST_SUFFIX
      job["queue"] = target if cache.live?(redis_pool, target, klass)
    rescue => e
      Oxidekiq.warn_once(e)
    end
  end

  @warned = false

  def self.warn_once(error)
    return if @warned
    @warned = true
    msg = "oxidekiq router: #{error.class}: #{error.message}; jobs stay on Ruby queues"
    defined?(Sidekiq.logger) && Sidekiq.logger ? Sidekiq.logger.warn(msg) : warn(msg)
  end
end
