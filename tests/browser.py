"""A headless Chromium driven over the DevTools protocol, for tests of the docs site.

``chromium --dump-dom`` shows a page as loaded, but nothing can be typed into it, and Material's
search runs in a web worker that ``--virtual-time-budget`` never lets finish. With
``--remote-debugging-pipe`` Chromium reads DevTools commands (JSON, each ended by a NUL byte) on
its file descriptor 3 and answers on 4: no port, no websocket library, only the standard library.

    with Browser(path, profile) as b:
        b.open("http://127.0.0.1:8000/")
        b.type_into(".md-search__input", "zero_stage")
        b.wait_for("document.querySelectorAll('.md-search-result__item').length > 0")

Every call has a deadline: a browser that stops answering fails the test, it never hangs it.
"""

import json
import os
import select
import subprocess
import time


class BrowserError(AssertionError):
    pass


class Browser:
    def __init__(self, path, profile, timeout=60.0):
        self._path, self._profile, self._timeout = path, str(profile), timeout
        self._proc = self._session = None
        self._buf, self._next_id = b"", 0

    def __enter__(self):
        to_child, self._to_browser = os.pipe()      # the browser reads its fd 3
        self._from_browser, from_child = os.pipe()  # and writes its fd 4

        def fds_3_and_4():                          # in the child, before exec
            a, b = os.dup(to_child), os.dup(from_child)
            os.dup2(a, 3)                           # dup2 makes them inheritable
            os.dup2(b, 4)

        self._proc = subprocess.Popen(
            [self._path, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", f"--user-data-dir={self._profile}", "--remote-debugging-pipe",
             "about:blank"],
            preexec_fn=fds_3_and_4, close_fds=False, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(to_child)
        os.close(from_child)
        return self

    def __exit__(self, *exc):
        try:
            if self._proc.poll() is None:
                try:
                    self._send("Browser.close")
                except OSError:
                    pass
                try:
                    self._proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait(timeout=15)
        finally:
            os.close(self._to_browser)
            os.close(self._from_browser)
            self._proc.stderr.close()

    # --- the protocol ------------------------------------------------------------------------

    def _send(self, method, params=None, session=None):
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        return self._next_id

    def call(self, method, params=None, page=True):
        """Send one command (to the open page unless ``page=False``) and return its result."""
        want = self._send(method, params, self._session if page else None)
        deadline = time.monotonic() + self._timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                msg = json.loads(raw)
                if msg.get("id") == want:
                    if "error" in msg:
                        raise BrowserError(f"{method}: {msg['error']}")
                    return msg.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"{method}: no answer from the browser in {self._timeout} s")
            ready, _, _ = select.select([self._from_browser], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise BrowserError(f"{method}: the browser exited (rc "
                                       f"{self._proc.poll()}): {self._proc.stderr.read()[-2000:]!r}")
                self._buf += chunk

    # --- what a test does with a page --------------------------------------------------------

    def open(self, url):
        target = self.call("Target.createTarget", {"url": url}, page=False)["targetId"]
        self._session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                  page=False)["sessionId"]
        self.wait_for("document.readyState === 'complete'")

    def evaluate(self, expression):
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True})
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression, timeout=None):
        """Evaluate ``expression`` until it is true; its last value if it never is."""
        deadline = time.monotonic() + (timeout or self._timeout)
        while True:
            value = self.evaluate(expression)
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.2)

    def type_into(self, selector, text):
        """Focus the element and type ``text`` over what it holds, as the keyboard would (input
        events and all)."""
        sel = json.dumps(selector)
        if not self.wait_for(f"!!document.querySelector({sel})"):
            raise BrowserError(f"no element {selector} on the page")
        self.evaluate(f"(e => {{ e.focus(); e.select && e.select(); }})(document.querySelector({sel}))")
        for char in text:                           # a key down and up per character
            self.call("Input.dispatchKeyEvent", {"type": "keyDown", "text": char, "key": char})
            self.call("Input.dispatchKeyEvent", {"type": "keyUp", "key": char})
