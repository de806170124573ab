"""A minimal OTLP/HTTP receiver for measuring the cost of tracing (bench/callgrind.rb with OTEL_* set):
answers every POST with 200 and counts the bytes, so the exporter's full path runs. Not a collector.

    python3 bench/otlp_sink.py 4318 &      # then OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318
"""
import http.server
import sys


class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    received = 0

    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0"))
        self.rfile.read(n)
        Sink.received += n
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 4318
    http.server.ThreadingHTTPServer(("127.0.0.1", port), Sink).serve_forever()
