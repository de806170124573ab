# The floor of the payload scenario (bench/driver.rb, `payloads`): what Redis must at least do to hand jobs
# out, a bare client popping 100 at a time (`RPOP queue:<q> 100`) and doing nothing with them: no working
# copy, no acknowledgement, no safety at all. It speaks raw RESP over one socket so that its own CPU (it
# shares the 2 cores with Redis) stays small: no client library, no decoding of the payloads.
#
#   REDIS_URL=redis://127.0.0.1:PORT/0 ruby bench/floor.rb [queue]   # default queue: default
#
# When the queue is empty it sleeps 2 ms between pops (only before the release and after the drain: while
# jobs are there every call returns 100 of them). TERM ends it.
require "socket"
require "uri"

uri = URI(ENV.fetch("REDIS_URL"))
queue = "queue:#{ARGV.fetch(0, 'default')}"
sock = TCPSocket.new(uri.host, uri.port)
sock.setsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY, 1)
db = uri.path.to_s.delete_prefix("/")
unless db.empty? || db == "0"
  sock.write("*2\r\n$6\r\nSELECT\r\n$#{db.bytesize}\r\n#{db}\r\n")
  sock.gets
end
pop = "*3\r\n$4\r\nRPOP\r\n$#{queue.bytesize}\r\n#{queue}\r\n$3\r\n100\r\n"
trap("TERM") { exit }

buf = String.new(capacity: 65_536)
loop do
  sock.write(pop)
  head = sock.gets
  count = head[1..].to_i # "*-1": empty (the key is gone), "*N": N bulk strings follow
  if count <= 0
    sleep 0.002
    next
  end
  count.times do
    len = sock.gets[1..].to_i
    sock.read(len + 2, buf) # the payload and its CRLF, dropped (one buffer, no allocation a job)
  end
end
