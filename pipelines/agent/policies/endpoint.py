"""One client for OpenAI-compatible chat endpoints: the policy, a distillation teacher, the judge.

Servers differ in what they accept beyond the OpenAI API. vLLM keeps a stop string in the output
only when asked (``include_stop_str_in_output``), SGLang under another name (``no_stop_trim``);
``transformers serve`` and OpenAI's own API answer HTTP 422 / 400 to any field they do not know.
:class:`ChatClient` therefore sends server-specific fields only to the server they belong to: the
``server`` setting names it, or ``auto`` asks ``/v1/models`` once (vLLM and SGLang say who they are
in ``owned_by``) and sends standard fields to anything else. A server that still rejects one of
those fields is asked again without them, once, with a warning. ``transformers serve`` (5.x)
fails on stop strings for vision models (its stop criterion wants a tokenizer and gets the
processor; it answers 500, then drops the kept-alive connection): a server other than vLLM and
SGLang that answers 500 twice to a request with ``stop`` and answers the same request without it
gets no stop strings from then on (with a warning), and the policy cuts each turn at ``</code>``
itself. After a 5xx or a dropped connection, later requests open new connections. A hosted model
that wants ``max_completion_tokens`` instead of ``max_tokens`` (HTTP 400 naming it) gets it.

Failures are one line that says what happened, in the server's own words where it gave any:

- no answer (refused connection, timeout, 429, 5xx): retried with exponential backoff, then
  ``... did not answer after N tries: <last reason>``;
- a rejected request (any other 4xx): never retried; ``... rejected the request (HTTP 422):
  <what the server said>``, with the fix the message points to (an unknown model name lists the
  served ones; a refused image says to serve a vision-language model; a refused key names the
  environment variable);
- malformed output (a 200 whose body is not a chat completion): retried like no answer, then
  ``... returned malformed output N times: <what came back>``.

Every request in flight is tracked, so a progress display can show a stalled server
(:meth:`ChatClient.activity`), and :meth:`ChatClient.close` cancels the waiting: requests run on
daemon threads (:class:`DaemonPool`) whose retries stop at once, so an interrupted command exits on
the first Ctrl-C instead of waiting out every retry of every request in flight.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pipelines.config.client import ClientConfig
from pipelines.errors import EndpointError, UserError

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
SERVER_FIELDS: dict[str, dict[str, Any]] = {
    "vllm": {"include_stop_str_in_output": True, "skip_special_tokens": False},
    "sglang": {"no_stop_trim": True, "skip_special_tokens": False},
    "transformers": {},
    "openai": {},
}
"""Fields each server gets beyond the OpenAI API (keep the stop string, keep special tokens)."""

_WARN_EVERY_S = 30.0
CLOSE_DRAIN_S = 2.0
"""How long :meth:`ChatClient.close` waits for the requests in flight to end."""


class Cancelled(Exception):
    """The client was closed while a request waited (an interrupted command)."""


def v1_url(base_url: str) -> str:
    """``base_url`` ending in ``/v1`` (``http://host:8000`` and ``http://host:8000/v1/`` alike)."""
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def server_message(resp: Any) -> str:
    """What the server said about a failed request, on one line (FastAPI ``detail``, OpenAI and
    vLLM ``error.message``, SGLang ``message``, or the raw text)."""
    try:
        data = resp.json()
    except ValueError:
        text = resp.text
    else:
        text = _message_of(data)
    text = " ".join(str(text).split())
    return (text[:297] + "...") if len(text) > 300 else (text or "(empty body)")


def _message_of(data: Any) -> str:
    if not isinstance(data, dict):
        return json.dumps(data)
    for key in ("error", "detail", "message"):
        value = data.get(key)
        if isinstance(value, dict):
            return str(value.get("message") or json.dumps(value))
        if isinstance(value, list):  # FastAPI validation errors: [{"loc": [...], "msg": ...}]
            return "; ".join(
                f"{'.'.join(str(p) for p in v.get('loc', []))}: {v.get('msg', '')}"
                if isinstance(v, dict) else str(v) for v in value)
        if value:
            return str(value)
    return json.dumps(data)


class DaemonPool:
    """A fixed set of daemon threads running submitted calls. Unlike ``ThreadPoolExecutor``,
    whose threads the interpreter joins at exit, nothing here holds up the exit of an
    interrupted command."""

    def __init__(self, workers: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(max(1, workers)):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(exc)


def wait_all(futures: list[Future]) -> list[Any]:
    """Every future's result, in order; the first failure is raised as soon as it happens.

    Waits in short slices, so a Ctrl-C in the main thread is never held up by a request."""
    from concurrent.futures import FIRST_EXCEPTION, wait

    pending = set(futures)
    while pending:
        done, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()
    return [f.result() for f in futures]


class ChatClient:
    """Posts chat completions to one OpenAI-compatible endpoint (see the module docstring).

    ``role`` names the endpoint in messages (``model server``, ``teacher``, ``judge``);
    ``url_hint`` says how to point the command at a running server and ``model_hint`` how to
    name the served model (each the real flag or key of the command that uses it).
    """

    def __init__(self, base_url: str, cfg: ClientConfig | None = None, *,
                 role: str = "model server",
                 url_hint: str = "start it (e.g. `vllm serve MODEL --port 8000`) and pass its URL",
                 model_hint: str = "pass the served model's name",
                 max_connections: int = 64, warn: bool = True,
                 on_attempt: Callable[[bool], None] | None = None) -> None:

        self.cfg = cfg or ClientConfig()
        self.url = v1_url(base_url)
        self.role, self.url_hint, self.model_hint = role, url_hint, model_hint
        self.api_key = os.environ.get(self.cfg.api_key_env, "EMPTY")
        self._server: str | None = None if self.cfg.server == "auto" else self.cfg.server
        self._dropped_extras = False
        self._stop_ok = False       # a request with stop strings succeeded here
        self._completion_tokens = False  # send max_completion_tokens instead of max_tokens
        self._stop_fails = self._server == "transformers"  # send no stop strings
        self._pool_size = max(8, max_connections)
        self._http = self._new_http()
        self._retired: list[Any] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no request is in flight
        self._ids = itertools.count()
        self._flights: dict[int, float] = {}
        self._retry_note: tuple[float, str] | None = None
        self._last_warn = 0.0
        self._cancel = threading.Event()
        self._warn_enabled = warn
        self._on_attempt = on_attempt
        self.usage = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0, "cost": 0.0,
                      "cost_reported": 0}

    def _new_http(self) -> Any:
        import httpx

        return httpx.Client(timeout=self.cfg.timeout_s, limits=httpx.Limits(
            max_connections=self._pool_size, max_keepalive_connections=self._pool_size))

    def _fresh_connections(self, used: Any) -> None:
        """After a server error or a dropped connection, later requests open new connections:
        a server may close a kept-alive connection after a 500 (uvicorn does), and the next
        request sent on it would fail for nothing. Requests in flight finish on the old ones."""
        with self._lock:
            if self._http is used and not self._cancel.is_set():
                self._retired.append(self._http)
                self._http = self._new_http()

    # -- the server --------------------------------------------------------------------------

    def models(self) -> list[dict[str, Any]] | None:
        """``/v1/models``'s entries, or None when it does not answer with a list."""
        import httpx

        try:
            resp = self._http.get(f"{self.url}/models", headers=self._headers(),
                                  timeout=min(10.0, self.cfg.timeout_s))
            data = resp.json().get("data") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else None

    @property
    def server(self) -> str:
        """The server kind requests are shaped for (asked once when the setting is ``auto``)."""
        if self._server is None:
            owners = {str(m.get("owned_by", "")).lower() for m in self.models() or []}
            kind = next((k for k in ("vllm", "sglang") if k in owners), "openai")
            with self._lock:
                self._server = self._server or kind
        return self._server

    @property
    def sends_stop(self) -> bool:
        """False once the server turned out to fail on stop strings (or is `transformers`)."""
        return not self._stop_fails

    def extra_fields(self) -> dict[str, Any]:
        return {} if self._dropped_extras else dict(SERVER_FIELDS[self.server])

    def resolve_model(self, name: str | None) -> str:
        """``name``, else the one model the server lists, else ``default`` (servers that serve
        one model accept any name); several listed models need a name."""
        if name:
            return name
        models = self.models() or []
        ids = [str(m["id"]) for m in models if m.get("id")]
        if len(ids) == 1:
            return ids[0]
        if len(ids) > 1:
            shown = ", ".join(ids[:8]) + (f" (+{len(ids) - 8} more)" if len(ids) > 8 else "")
            raise UserError(f"{self.role} {self.url} serves {len(ids)} models ({shown}) and no "
                            "model name was given", hint=self.model_hint)
        return "default"

    # -- requests ----------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def complete(self, body: dict[str, Any],
                 parse: Callable[[dict[str, Any]], Any] = lambda data: data) -> Any:
        """POST ``body`` (plus this server's fields) to ``/chat/completions``; ``parse`` reads
        the answer (a ValueError / KeyError / TypeError / IndexError there means malformed)."""
        import httpx

        tries = self.cfg.max_retries + 1
        attempt, last, malformed = 0, "", False
        probe_without_stop = probed = False
        stop_failures = 0  # HTTP 500 answers to this request with stop strings
        while True:
            if self._cancel.is_set():
                raise Cancelled(f"{self.role} {self.url}: cancelled")
            extras = self.extra_fields()
            payload = {**body, **extras}
            if self._stop_fails or probe_without_stop:
                payload.pop("stop", None)
            if self._completion_tokens and "max_tokens" in payload:
                payload["max_completion_tokens"] = payload.pop("max_tokens")
            fid = next(self._ids)
            with self._lock:  # with close(): a request is either in flight or never sent
                if self._cancel.is_set():
                    raise Cancelled(f"{self.role} {self.url}: cancelled")
                self._flights[fid] = time.monotonic()
                http = self._http
            try:
                resp = http.post(f"{self.url}/chat/completions", json=payload,
                                 headers=self._headers())
            except httpx.TimeoutException:
                last, malformed = f"no answer within {self.cfg.timeout_s:g} s", False
            except (httpx.HTTPError, RuntimeError) as exc:
                # (RuntimeError: the client was closed under a request in flight.)
                if self._cancel.is_set():
                    raise Cancelled(f"{self.role} {self.url}: cancelled") from None
                if not isinstance(exc, httpx.HTTPError):
                    raise
                last, malformed = f"{type(exc).__name__}: {str(exc)[:160]}", False
                if isinstance(exc, (httpx.ReadError, httpx.RemoteProtocolError)):
                    self._fresh_connections(http)
            else:
                status = resp.status_code
                if status == 200:
                    try:
                        data = resp.json()
                        if not isinstance(data, dict):
                            raise TypeError("not a JSON object")
                        result = parse(data)
                    except (ValueError, KeyError, TypeError, IndexError):
                        last, malformed = f"{' '.join(resp.text.split())[:160]!r}", True
                    else:
                        self._attempted(True)
                        self._count_usage(data)
                        self._stop_worked(payload, probe_without_stop)
                        return result
                elif status in RETRY_STATUS:
                    last, malformed = f"HTTP {status}: {server_message(resp)}", False
                    stop_failures += int(status == 500 and "stop" in payload)
                    if status >= 500:
                        self._fresh_connections(http)
                else:
                    message = server_message(resp)
                    if extras and status in (400, 422) and self._names_extra(message, extras):
                        self._drop_extras(message)
                        continue
                    if (status == 400 and "max_completion_tokens" in message
                            and "max_tokens" in payload and not self._completion_tokens):
                        # OpenAI's reasoning models take the limit under its newer name.
                        self._completion_tokens = True
                        continue
                    self._attempted(False)
                    raise self._rejected(status, message, body)
            finally:
                with self._lock:
                    self._flights.pop(fid, None)
                    if not self._flights:
                        self._idle.notify_all()
            if (stop_failures >= 2 and not probed and "stop" in payload and not self._stop_ok
                    and self.server not in ("vllm", "sglang")):
                # Twice a 500 for this request with stop strings: perhaps the server cannot
                # honour them (`transformers serve` with a vision model fails on them). Ask once
                # without, at once; a transient 500 rarely comes twice.
                probed = probe_without_stop = True
                continue
            self._attempted(False)
            probe_without_stop = False
            attempt += 1
            if attempt >= tries:
                break
            delay = self.cfg.backoff_s * (2 ** (attempt - 1))
            note = f"{last}; retry {attempt} of {self.cfg.max_retries}"
            with self._lock:
                self._retry_note = (time.monotonic(), note)
            self._warn(f"{self.role} {self.url}: {note}" + (f" in {delay:g} s" if delay else ""))
            if self._cancel.wait(delay):
                raise Cancelled(f"{self.role} {self.url}: cancelled")
        if malformed:
            raise EndpointError(f"{self.role} {self.url} returned malformed output {tries} "
                                f"time(s) (not an OpenAI chat completion): {last}",
                                hint="point it at an OpenAI-compatible /v1/chat/completions "
                                     "endpoint (vLLM, SGLang, `transformers serve`, a hosted API)")
        raise EndpointError(f"{self.role} {self.url} did not answer after {tries} tries: {last}",
                            hint=self.url_hint)

    def _stop_worked(self, payload: dict[str, Any], probed: bool) -> None:
        """Remember whether stop strings work here: a request without them that succeeded just
        after one with them failed means the server cannot take them."""
        if "stop" in payload:
            self._stop_ok = True
        elif probed and not self._stop_fails:
            with self._lock:
                first, self._stop_fails = not self._stop_fails, True
            if first:
                self._warn(f"{self.role} {self.url} fails on stop strings but answers "
                           "without them; generating without and cutting each turn at the stop "
                           "string (slower: each code turn runs on to its token limit)", force=True)

    def _attempted(self, ok: bool) -> None:
        if self._on_attempt is not None:
            self._on_attempt(ok)

    def _count_usage(self, data: dict[str, Any]) -> None:
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        cost = usage.get("cost", data.get("cost"))
        with self._lock:
            self.usage["requests"] += 1
            for key in ("prompt_tokens", "completion_tokens"):
                if isinstance(usage.get(key), (int, float)):
                    self.usage[key] += int(usage[key])
            if isinstance(cost, (int, float)):
                self.usage["cost"] += float(cost)
                self.usage["cost_reported"] += 1

    @staticmethod
    def _names_extra(message: str, extras: dict[str, Any]) -> bool:
        text = message.lower()
        return any(k.lower() in text for k in extras) or any(
            w in text for w in ("unexpected field", "extra field", "extra_forbidden",
                                "unrecognized request argument", "unknown parameter",
                                "extra inputs are not permitted"))

    def _drop_extras(self, message: str) -> None:
        with self._lock:
            first = not self._dropped_extras
            self._dropped_extras = True
        if first:
            self._warn(f"{self.role} {self.url} rejects the {self.server} fields "
                       f"({', '.join(SERVER_FIELDS[self.server])}): {message}; sending standard "
                       f"OpenAI fields only (set the server kind to silence this)", force=True)

    def _rejected(self, status: int, message: str, body: dict[str, Any]) -> EndpointError:
        text = message.lower()
        head = f"{self.role} {self.url}"
        has_images = any(isinstance(m.get("content"), list) and any(
            p.get("type") == "image_url" for p in m["content"]) for m in body.get("messages", []))
        if status in (401, 403):
            return EndpointError(f"{head} refused the API key (HTTP {status}): {message}",
                                 hint=f"export the key in ${self.cfg.api_key_env}")
        if status == 404 or ("model" in text and ("not found" in text or "does not exist" in text
                                                   or "unknown model" in text)):
            ids = [str(m.get("id")) for m in self.models() or [] if m.get("id")]
            serves = f" (it serves: {', '.join(ids[:8])})" if ids else ""
            return EndpointError(f"{head} has no model '{body.get('model')}' (HTTP {status}: "
                                 f"{message})", hint=self.model_hint + serves)
        if has_images and any(w in text for w in ("image", "vision", "multimodal", "multi-modal",
                                                  "modality")):
            return EndpointError(f"{head} refuses images (HTTP {status}: {message})",
                                 hint="serve a vision-language model (e.g. Qwen2.5-VL); every "
                                      "request carries the task's images")
        if "context" in text and ("length" in text or "too long" in text or "maximum" in text):
            return EndpointError(f"{head} rejected a request as too long (HTTP {status}: "
                                 f"{message})", hint="lower agent.max_context_tokens or "
                                 "agent.max_new_tokens_per_turn, or serve with a longer context")
        return EndpointError(f"{head} rejected the request (HTTP {status}): {message}",
                             hint="change the setting the server names, or name the server kind "
                                  "(openai / vllm / sglang / transformers) in the recipe")

    # -- what is going on --------------------------------------------------------------------

    def activity(self) -> str | None:
        """One short line when the server looks stalled (a request waiting longer than
        ``stall_s``, or a retry in the last minute); None while all is well."""
        now = time.monotonic()
        with self._lock:
            waits = [now - t for t in self._flights.values()]
            note = self._retry_note
        parts = []
        if waits and max(waits) >= self.cfg.stall_s:
            parts.append(f"waiting {max(waits):.0f} s for {self.url} ({len(waits)} in flight)")
        if note is not None and now - note[0] < 60.0:
            parts.append(note[1])
        return "; ".join(parts) or None

    def _warn(self, text: str, force: bool = False) -> None:
        if not self._warn_enabled:
            return
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last_warn < _WARN_EVERY_S:
                return
            self._last_warn = now
        from rich.markup import escape

        from pipelines.console import err

        err.print(f"[yellow]warning:[/] {escape(text)}", soft_wrap=True, highlight=False)

    def close(self, drain_s: float = CLOSE_DRAIN_S) -> None:
        """Stop waiting: requests still retrying give up, the connections close, and for up to
        ``drain_s`` seconds the requests in flight are waited for, so that none is still on its
        way when this returns (httpx lets a request that got past its own closed-client check
        open a new connection after ``close``: a teacher brought back on the same port would
        get it). A request the server is already answering may outlive the wait; it has been
        sent and sends nothing more."""
        with self._lock:
            self._cancel.set()
            clients, self._retired = [self._http, *self._retired], []
        for client in clients:
            client.close()
        with self._idle:
            self._idle.wait_for(lambda: not self._flights, timeout=drain_s)
