"""Small data builders shared by several test modules."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Self

# The repository root (the checkout), wherever the test module using it lives under tests/.
REPO = Path(__file__).resolve().parent.parent


def make_sharegpt(root: Path, n: int = 8) -> tuple[str, str]:
    """A small PyVision-protocol SFT dataset in LLaMA-Factory's sharegpt layout."""
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        colour = ["red", "green", "blue", "yellow"][i % 4]
        rgb = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220),
               "yellow": (230, 220, 30)}[colour]
        Image.new("RGB", (64, 48), rgb).save(root / f"img{i}.png")
        Image.new("RGB", (32, 32), rgb).save(root / f"zoom{i}.png")
        rows.append({"conversations": [
            {"from": "human", "value": "<image>What is the colour of the object?"},
            {"from": "gpt", "value": "I will zoom in.\n<code>\n```python\nplt.imshow(image_clue_0)\n"
                                     "plt.show()\n```\n</code>"},
            {"from": "human", "value": "<interpreter>\nText Result:\nNone\nImage Result:\n<image>"
                                       "\n</interpreter>"},
            {"from": "gpt", "value": f"It is {colour}.\n<answer>\n\\boxed{{{colour}}}\n</answer>"},
        ], "images": [f"img{i}.png", f"zoom{i}.png"]})
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "dataset_info.json").write_text(json.dumps({"pyvision_sft": {
        "file_name": "train.jsonl", "formatting": "sharegpt",
        "columns": {"messages": "conversations", "images": "images"}}}))
    return str(root), "pyvision_sft"


def chat_completion(text: str, stop_reason: str | None = None, finish: str = "stop",
                    usage: dict | None = None) -> dict:
    """An OpenAI chat-completion body, as vLLM's server returns it."""
    return {"choices": [{"message": {"content": text}, "finish_reason": finish,
                         "stop_reason": stop_reason}],
            "usage": usage or {"prompt_tokens": 100, "completion_tokens": 20}}


class FakeOpenAI:
    """An OpenAI-compatible endpoint on 127.0.0.1 for tests (policies, judges, the eval engine).

    ``respond(request_body) -> (status, payload)`` answers each POST; with ``threaded`` it runs on
    one thread per request, so a test can check that a client really sends requests concurrently.
    GET answers the model list (``models``: its entries, default one named ``model``). A payload
    that is ``bytes`` is sent as it is (garbage). Parsed requests are kept in ``requests``. A
    context manager. ``port`` 0 picks a free one; a given port brings a stopped endpoint back
    where it was."""

    def __init__(self, respond, *, threaded: bool = False, model: str = "qwen",
                 port: int = 0, models: list[dict] | None = None) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer

        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, payload: dict | bytes) -> None:
                raw = isinstance(payload, bytes)
                data = payload if raw else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/html" if raw else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                listed = models if models is not None else [{"id": model}]
                self._send(200, {"object": "list", "data": listed})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                outer.requests.append(body)
                self._send(*respond(body))

            def log_message(self, *args):
                return None

        base = ThreadingHTTPServer if threaded else HTTPServer

        class Server(base):  # type: ignore[valid-type, misc]
            def handle_error(self, request, client_address):
                """A client that gave up (a timeout under load) is the test's business, not a
                traceback on stderr, where a CLI test would read it as the command's."""

        self.httpd = Server(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def scripted_openai(replies: list[tuple[int, dict]]) -> FakeOpenAI:
    """A sequential endpoint that answers with ``replies`` in order, then with 500."""
    queue = list(replies)
    return FakeOpenAI(lambda body: queue.pop(0) if queue else (500, {}))


@contextlib.contextmanager
def _sigint_as_from_a_shell() -> Iterator[None]:
    """While starting a child: SIGINT handled (a handler resets to the default across exec) and
    unblocked, as a shell starts a command. An ignored SIGINT or a blocked mask survives exec, and
    Python installs no KeyboardInterrupt handler for an ignored SIGINT; state a library left in the
    test process must not decide what a user's Ctrl-C does."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, handler)


def interrupt_after_requests(args: list[str], server: FakeOpenAI, n_requests: int,
                             hang: threading.Event, cwd: Path, env: dict[str, str],
                             settle_s: float = 0.0) -> tuple[int, str, float]:
    """Run ``pyvision ARGS`` against ``server``; once it has sent ``n_requests`` (the last of them
    hangs on ``hang``), send one SIGINT. Returns (stderr, seconds from SIGINT to exit)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **env}
    with _sigint_as_from_a_shell():
        proc = subprocess.Popen([sys.executable, "-m", "pyvision_cli.main", *args], env=env,
                                cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(server.requests) < n_requests and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.1)
        assert len(server.requests) == n_requests, proc.communicate(timeout=5)
        time.sleep(settle_s)
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        # Generous: interpreter shutdown on a loaded 2-core machine has taken over 40 s.
        _out, err = proc.communicate(timeout=100)
        return proc.returncode, err, time.monotonic() - start
    finally:
        hang.set()
        if proc.poll() is None:
            proc.kill()
        server.close()
