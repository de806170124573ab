# Summarises the folded stacks (inferno-collapse-perf output) of one oxidekiq drain: where its CPU goes.
# By component: walking each sample's stack from the leaf up, the first frame that names a component
# decides (so malloc inside Job::parse counts as payload parsing, and tokio's spawn inside the processor
# as tokio). By leaf: the kind of work at the top of the stack, whoever called it.
#   ruby bench/flame_summary.rb folded > summary.txt   (bench/flame.sh runs it)
COMPONENTS = [
  ["log lines: formatting and the log writer thread (logging.rs, tracing)", /\Aoxidekiq::logging|\Atracing|\Aoxidekiq-log\z/],
  ["ActiveJob: unwrap, then the worker's args from text (activejob.rs)", /\Aoxidekiq::activejob/],
  ["payload parsing (job.rs Job::parse)", /\Aoxidekiq::job::/],
  ["worker args + perform (registry.rs, worker.rs, workers crate)", /\Aoxidekiq::(registry|worker)::|\Aoxidekiq_workers::/],
  ["Redis client: commands, reply parsing, socket I/O (redis crate)", /\Aredis::|\Acombine::/],
  ["tokio: task spawn and teardown, I/O driver (epoll), wake-ups, channels", /\Atokio::(runtime|sync|task|util|loom)/],
  ["processor: a job's run and ack (processor.rs, middleware)", /\Aoxidekiq::(processor|middleware)/],
  ["fetch and the manager: fetch loop, acker, work table (fetch/, manager.rs)", /\Aoxidekiq::(fetch|manager)::/],
  ["the rest of oxidekiq (launcher.rs, heartbeat, metrics, prom)", /\Aoxidekiq::/],
].freeze
OTHER = "unattributed (runtime start-up, libc/kernel without a Rust caller)"
LEAVES = [
  ["malloc / free / realloc", /malloc|_int_free|cfree|realloc|unlink_chunk|__libc_free|\Ami_|\A_mi_/],
  ["memcpy / memmove", /memcpy|memmove/],
  ["kernel: syscalls (socket and log file I/O, futex, scheduling)", /copy_folio|finish_task_switch|_raw_spin|entry_SYSCALL|do_syscall|\Atcp_|__x64_sys|clear_page|\.isra|\Acopy_|\A__schedule|\Aep_|\Afutex|\Aunix_|\Aipt_|\Anf_|\A__fget|\Aext4|\Akmem|\A__d_lookup|\Askb_/],
  ["clock_gettime", /clock_gettime/],
  ["serde_json", /\Aserde_json|\Aserde_core/],
].freeze
comp = Hash.new(0)
leaf = Hash.new(0)
total = 0
ARGF.each_line do |line|
  stack, _, n = line.rpartition(" ")
  n = n.to_i
  frames = stack.split(";").map(&:strip)
  total += n
  hit = frames.reverse_each.lazy.filter_map { |f| COMPONENTS.find { |_, re| f =~ re } }.first
  comp[hit ? hit.first : OTHER] += n
  l = LEAVES.find { |_, re| frames.last =~ re }
  leaf[l ? l.first : "everything else"] += n
end
abort "no samples" if total.zero?
puts "oxidekiq's CPU samples during the drain, by component (the frame nearest the leaf decides):"
(COMPONENTS.map(&:first) + [OTHER]).each { |name| printf("  %5.1f%%  %s\n", 100.0 * comp[name] / total, name) }
puts "", "The same samples by the work at the top of the stack, whoever called it:"
(LEAVES.map(&:first) + ["everything else"]).each { |name| printf("  %5.1f%%  %s\n", 100.0 * leaf[name] / total, name) }
