#!/usr/bin/env python3
"""Drives braid's chat page (`GET /`) in a real headless Chromium.

Usage: scripts/chat_page_test.py [--braid target/release/braid] [--model smollm2]
                                 [--url http://127.0.0.1:PORT] [--screenshot FILE]

Starts `braid serve` (unless --url names a running server), opens the page
in Chromium driven over the DevTools protocol on a pipe (Python's standard
library only: no websocket or browser-automation package), and checks:
* the model list is filled from /v1/models;
* a message typed and sent streams an answer in (the page is seen while
  streaming, then done with a finish reason and a token count);
* a second turn carries the history;
* the Stop button cuts a long answer (finish: stopped).
Then it saves a screenshot of the page with the streamed answers.
Needs Debian's `chromium` (or CHROMIUM=/path/to/chrome).
"""

import argparse
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request


class Browser:
    """Chromium with --remote-debugging-pipe: JSON messages, NUL-ended,
    written to its fd 3 and read from its fd 4."""

    def __init__(self, exe):
        self.profile = tempfile.TemporaryDirectory(prefix="braid-chromium-")
        to_r, self.to_w = os.pipe()
        self.from_r, from_w = os.pipe()
        # Chromium reads commands on fd 3 and writes replies on fd 4 (moved
        # out of the way first, in case the pipes are fds 3 and 4 already).
        def fds():
            r, w = os.dup(to_r), os.dup(from_w)
            os.dup2(r, 3)
            os.dup2(w, 4)
        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--window-size=1100,800", "--no-first-run",
             # No network beyond localhost here: keep Chromium from reaching out.
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-quic",
             f"--user-data-dir={self.profile.name}", "about:blank"],
            preexec_fn=fds, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self.buf = b""
        self.next_id = 0
        self.session = None

    def call(self, method, params=None, session=True, timeout=30):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self.to_w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while time.time() < deadline:
            while b"\0" not in self.buf:
                chunk = os.read(self.from_r, 1 << 16)
                if not chunk:
                    raise RuntimeError("chromium closed the pipe")
                self.buf += chunk
            raw, self.buf = self.buf.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
        raise TimeoutError(method)

    def open(self, url):
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)["sessionId"]
        self.call("Page.enable")
        self.call("Page.navigate", {"url": url})

    def js(self, expr):
        r = self.call("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr, timeout=90, what=None):
        deadline = time.time() + timeout
        while time.time() < deadline:
            v = self.js(expr)
            if v:
                return v
            time.sleep(0.05)
        raise TimeoutError(what or expr)

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))

    def close(self):
        try:
            self.call("Browser.close", session=False, timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("braid serve exited")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.3)
    raise TimeoutError("the server did not become healthy")


def send(b, text, max_tokens):
    """Types `text` into the page and sends it, as a user would."""
    b.js(f"document.getElementById('max_tokens').value = {max_tokens}")
    b.js(f"document.getElementById('prompt').value = {json.dumps(text)}")
    b.js("document.getElementById('send').click()")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--braid", default="target/release/braid")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--url")
    ap.add_argument("--screenshot", default="target/chat-page.png")
    a = ap.parse_args()
    exe = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not exe:
        print("SKIP: no chromium (apt-get install chromium)")
        return
    server = None
    url = a.url
    if not url:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([a.braid, "serve", "-m", a.model, "--port", str(port), "--served-name", "chat-page-test"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    b = None
    try:
        wait_healthy(url, server)
        b = Browser(exe)
        b.open(url + "/")
        models = b.wait("[...document.querySelectorAll('#model option')].map(o => o.value).join(',')", what="the model list")
        print(f"ok: model list {models}")
        b.js("document.getElementById('temperature').value = 0")
        b.js("document.getElementById('system').value = 'Answer in one short sentence.'")

        send(b, "What is the capital of France?", 40)
        b.wait("document.body.dataset.state === 'streaming' && document.querySelector('.assistant').textContent.length > 0", what="streamed text")
        print("ok: the answer streams in")
        b.wait("document.body.dataset.state === 'done'", what="the end of the answer")
        answer = b.js("document.querySelector('.assistant').textContent")
        stats = b.js("document.querySelector('.stats').textContent")
        assert answer.strip() and "finish:" in stats and "tokens" in stats, (answer, stats)
        print(f"ok: streamed answer {answer!r} ({stats})")

        send(b, "And of Italy?", 40)
        b.wait("document.querySelectorAll('.stats').length === 2", what="the second answer")
        second = b.js("document.querySelectorAll('.assistant')[1].textContent")
        assert second.strip(), second
        print(f"ok: second turn {second!r}")

        send(b, "Write a long story about a dragon.", 2000)
        b.wait("document.body.dataset.state === 'streaming' && document.querySelectorAll('.assistant')[2].textContent.length > 20", what="a long answer streaming")
        b.js("document.getElementById('stop').click()")
        b.wait("document.querySelectorAll('.stats').length === 3", what="the stopped answer")
        stats = b.js("document.querySelectorAll('.stats')[2].textContent")
        assert "finish: stopped" in stats, stats
        print(f"ok: stop button ({stats})")
        assert not b.js("document.querySelector('.error')"), b.js("document.querySelector('.error').textContent")

        b.js("window.scrollTo(0, 0)")
        os.makedirs(os.path.dirname(a.screenshot) or ".", exist_ok=True)
        b.screenshot(a.screenshot)
        print(f"ok: screenshot {a.screenshot}")
    finally:
        if b:
            b.close()
        if server:
            server.terminate()
            server.wait(timeout=20)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
