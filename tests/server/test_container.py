"""What the container image relies on: `moeserve healthcheck` (its HEALTHCHECK, no curl in the
image) exits 0 only when /health answers 200, reads MOESERVE_PORT/MOESERVE_HOST as the server
does (0.0.0.0, the image's listen address, is reached on loopback), and fails with a reason on
a refused connection, a 503 and a server that never answers; and the server started with the
image's environment (MOESERVE_HOST=0.0.0.0) is reachable on loopback."""
import os
import signal
import socket
import subprocess
import tempfile
import threading
import unittest

import srvtest


def healthcheck(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("MOESERVE_")}
    e.update(env or {})
    return subprocess.run([srvtest.binary(), "healthcheck"] + list(args), capture_output=True,
                          timeout=30, env=e)


class FakeServer:
    """A listener that answers every connection with `reply` (None: never answers)."""

    def __init__(self, reply):
        self.reply = reply
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            c.recv(4096)
            if self.reply is not None:
                c.sendall(self.reply)
                c.close()

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


class Healthcheck(unittest.TestCase):
    def test_ready_server(self):
        # the image's environment: the address and port come from MOESERVE_HOST/MOESERVE_PORT
        port = srvtest.free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("MOESERVE_")}
        env.update({"MOESERVE_HOST": "0.0.0.0", "MOESERVE_PORT": str(port),
                    "MOESERVE_MODEL": srvtest.fixture_model()})
        with tempfile.TemporaryFile() as log:
            proc = subprocess.Popen([srvtest.binary()], stdout=log, stderr=subprocess.STDOUT,
                                    env=env)
            try:
                srvtest.wait_until(lambda: proc.poll() is not None or healthcheck(
                    env={"MOESERVE_PORT": str(port), "MOESERVE_HOST": "0.0.0.0"}).returncode == 0,
                    60, "moeserve healthcheck to pass")
                self.assertIsNone(proc.poll(), "the server exited")
                p = healthcheck("--port", str(port), "--host", "127.0.0.1")
                self.assertEqual(p.returncode, 0, p.stderr)
            finally:
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(30)
                log.seek(0)
                out = log.read().decode()
            self.assertEqual(rc, 0, out)
            self.assertIn("listening on http://0.0.0.0:%d" % port, out)

    def test_failures(self):
        port = srvtest.free_port()  # nothing listens there now
        p = healthcheck("--port", str(port))
        self.assertEqual(p.returncode, 1)
        self.assertIn("cannot connect to 127.0.0.1:%d" % port, p.stderr.decode())
        fake = FakeServer(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")
        try:
            p = healthcheck("--port", str(fake.port))
            self.assertEqual(p.returncode, 1)
            self.assertIn("/health answered 503", p.stderr.decode())
        finally:
            fake.close()
        fake = FakeServer(None)
        try:
            p = healthcheck("--port", str(fake.port), "--timeout", "0.5")
            self.assertEqual(p.returncode, 1)
            self.assertIn("no answer", p.stderr.decode())
        finally:
            fake.close()
        for bad in (["--port", "0"], ["--port", "x"], ["--bogus", "1"], ["--timeout", "0"]):
            self.assertEqual(healthcheck(*bad).returncode, 2, bad)


if __name__ == "__main__":
    srvtest.main()
