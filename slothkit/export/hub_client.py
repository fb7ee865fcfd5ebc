"""The HTTP client huggingface_hub uses while slothkit pushes: timeouts on every request and
one stall deadline over the whole push.

Left alone, huggingface_hub's client waits forever; some of its requests pass ``timeout=None``,
which in httpx and httpx2 overrides a client's own timeouts (the repo listing, ``GET
/api/models/REPO/tree/main``, is one: a connect to a stopped server then waits for the
operating system's limit, over two minutes); it tries each request up to six times, pausing
1 to 8 s between tries; and slothkit retries the whole upload. Limits per request multiply
through those retries: a Hub that stopped answering kept a push waiting over 25 minutes.

So while slothkit pushes, every client huggingface_hub builds (its client factory,
``huggingface_hub.set_client_factory``, is wrapped for the push) sends through a
WatchedTransport that

- gives each request connect, read, write and pool timeouts: the smallest of the request's
  own, `timeout_s` (connect: at most CONNECT_TIMEOUT_S) and the time left to the deadline;
- keeps the deadline, `stall_timeout_s` after the last byte sent to or received from the Hub.
  The clock runs while the push waits on the network: a request in flight, or the pauses and
  retries after a failed one. It stops after a complete exchange, so local work between
  requests (hashing large files) never counts.  After a request fails, bytes sent no longer
  restart the clock until the Hub answers again: a stopped Hub whose kernel still completes
  connects takes a retry's request into its socket buffers, so "sent" proves nothing.
  Counted, they would let every retry restart the clock, and a deadline longer than
  `timeout_s` (the defaults: 180 s and 60 s) would never come.  The price: a retry that
  sends one body for longer than the deadline with no answer in between is cut off
  (a multipart upload is answered part by part).  An Xet transfer (hf_xet's own HTTP client)
  would pass outside this transport: pushes upload through LFS instead (hub_transfers);
- raises PushStalled when the deadline is reached: a request in flight runs into it, a request
  would start after it, or a request fails with less than RETRY_PAUSE_MAX_S left (the pause
  before huggingface_hub's next try could end past it). huggingface_hub does not retry a
  PushStalled (not a network error), so the push ends by its deadline; slothkit reports it as
  a HubConnectionError saying what had been uploaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

from huggingface_hub.utils import _http as hub_http

from slothkit.export.hub_options import HubOptions

# The HTTP library huggingface_hub sends through: httpx2 from huggingface_hub 2.x, httpx (the
# same API under its former name) before; the transports wrapped here must be its classes.
http = getattr(hub_http, "httpx2", None) or hub_http.httpx

CONNECT_TIMEOUT_S = 10.0
# huggingface_hub's http_backoff pauses at most max_wait_time=8 s before its next try.
RETRY_PAUSE_MAX_S = 8.0
TIMEOUT_KINDS = ("connect", "read", "write", "pool")


def url_without_query(url) -> str:
    """The URL to show a user: an upload URL's query holds a signature (a credential)."""
    return str(url).split("?", 1)[0]


def _is_commit(request: http.Request) -> bool:
    return request.method == "POST" and "/commit/" in request.url.path


@dataclasses.dataclass(eq=False)  # compared and hashed by identity, as exceptions are
class PushStalled(Exception):
    """The push's stall deadline passed: raised inside huggingface_hub's requests, reported
    by slothkit.export.hub as HubConnectionError."""

    stall_s: float
    waited_s: float  # since the last byte moved
    request: str  # "METHOD URL" (no query) of the request that met the deadline
    cause: BaseException | None  # the network error of that request, if it failed
    uploads_confirmed: int  # PUT requests (files, or parts of one) the server answered with 2xx
    bytes_confirmed: int  # the bytes those uploads sent
    commits_confirmed: int
    commit_unanswered: bool  # a commit request was sent and its answer never came

    def __str__(self) -> str:
        return f"no progress for {self.waited_s:.1f} s (stall_timeout_s={self.stall_s:g}) at {self.request}"


@dataclasses.dataclass
class _Exchange:
    """One request of the push, from its start to the end of its response."""

    request: http.Request
    remaining_s: float  # to the deadline, when it started
    sent: int = 0
    ended: bool = False


class StallClock:
    """How long the push has waited on the network without a byte moving, and what it had
    done by then. Thread-safe: huggingface_hub uploads several files at once."""

    def __init__(self, stall_s: float):
        self.stall_s = stall_s
        self._lock = threading.Lock()
        # Since when the push has waited on the network without a byte moving; None: it is not
        # waiting (no request in flight, and none failed since the last complete exchange).
        self._waiting_since: float | None = None
        self._in_flight = 0
        self._last: tuple[http.Request, BaseException | None] | None = None
        self._uploads_confirmed = 0
        self._bytes_confirmed = 0
        self._commits_confirmed = 0
        self._commit_unanswered = False
        # A request failed and the Hub has not answered since: bytes sent do not restart the
        # clock (module docstring), only bytes received do.
        self._failed_unanswered = False

    def _remaining(self, now: float) -> float:
        if self._waiting_since is None:
            return self.stall_s
        return self._waiting_since + self.stall_s - now

    def stalled(self, request: http.Request | None = None, cause: BaseException | None = None) -> PushStalled:
        """What the push had done, for the report; the request defaults to the latest one."""
        with self._lock:
            if request is None and self._last is not None:
                request, cause = self._last
            now = time.monotonic()
            return PushStalled(
                stall_s=self.stall_s,
                waited_s=now - self._waiting_since if self._waiting_since is not None else 0.0,
                request=f"{request.method} {url_without_query(request.url)}" if request is not None else "",
                cause=cause,
                uploads_confirmed=self._uploads_confirmed,
                bytes_confirmed=self._bytes_confirmed,
                commits_confirmed=self._commits_confirmed,
                commit_unanswered=self._commit_unanswered,
            )

    def begin(self, request: http.Request) -> _Exchange:
        with self._lock:
            now = time.monotonic()
            remaining = self._remaining(now)
            if remaining > 0:
                self._waiting_since = self._waiting_since if self._waiting_since is not None else now
                self._in_flight += 1
                self._last = (request, None)
                if _is_commit(request):
                    self._commit_unanswered = True
        if remaining <= 0:  # never sent: the report names the request that failed before it
            raise self.stalled()
        return _Exchange(request, remaining)

    def moved(self, exchange: _Exchange, sent: int = 0) -> None:
        """Bytes went out (`sent`) or came in for `exchange`: the clock starts again, unless
        they went out after a failed request that the Hub has not answered since."""
        exchange.sent += sent
        with self._lock:
            if sent and self._failed_unanswered:
                return  # maybe only into the socket buffers of a Hub that stopped reading
            if not sent:
                self._failed_unanswered = False  # the Hub answered
            self._waiting_since = time.monotonic()

    def answered(self, exchange: _Exchange, status: int) -> None:
        """The response of `exchange` was read (or closed by its reader)."""
        if exchange.ended:
            return
        exchange.ended = True
        with self._lock:
            self._in_flight -= 1
            # No request in flight and none failed: the push is not waiting on the network.
            self._waiting_since = None if self._in_flight == 0 else time.monotonic()
            if 200 <= status < 300 and exchange.request.method == "PUT":
                self._uploads_confirmed += 1
                self._bytes_confirmed += exchange.sent
            if _is_commit(exchange.request):
                self._commit_unanswered = False
                self._commits_confirmed += 200 <= status < 300

    def failed(self, exchange: _Exchange, error: BaseException) -> None:
        """`exchange` ended in a network error; raises PushStalled when no retry can make the deadline."""
        if exchange.ended:
            return
        exchange.ended = True
        with self._lock:
            self._in_flight -= 1
            self._last = (exchange.request, error)  # the clock keeps running: the push still waits
            self._failed_unanswered = True
            too_late = self._remaining(time.monotonic()) <= RETRY_PAUSE_MAX_S
        if too_late:
            raise self.stalled(exchange.request, error) from error

    def pause(self, seconds: float) -> None:
        """slothkit's own pause before retrying the upload, unless it would end past the deadline."""
        with self._lock:
            too_late = self._remaining(time.monotonic()) <= seconds
        if too_late:
            raise self.stalled()
        time.sleep(seconds)


class _SentBytes(http.SyncByteStream):
    """A request body that tells the clock as each chunk goes out."""

    def __init__(self, stream: http.SyncByteStream, clock: StallClock, exchange: _Exchange):
        self.stream, self.clock, self.exchange = stream, clock, exchange

    def __iter__(self):
        for chunk in self.stream:
            yield chunk
            self.clock.moved(self.exchange, sent=len(chunk))  # the chunk was written

    def close(self) -> None:
        self.stream.close()


class _ReceivedBytes(http.SyncByteStream):
    """A response body that tells the clock as each chunk comes in, and when it is done."""

    def __init__(self, stream: http.SyncByteStream, clock: StallClock, exchange: _Exchange, status: int):
        self.stream, self.clock, self.exchange, self.status = stream, clock, exchange, status

    def __iter__(self):
        try:
            for chunk in self.stream:
                self.clock.moved(self.exchange)
                yield chunk
        except http.TransportError as error:
            self.clock.failed(self.exchange, error)
            raise

    def close(self) -> None:
        try:
            self.stream.close()
        finally:
            self.clock.answered(self.exchange, self.status)


class WatchedTransport(http.BaseTransport):
    """Sends through `transport` with the push's timeouts, and keeps its stall clock (module docstring)."""

    def __init__(self, transport: http.BaseTransport, limits: dict, clock: StallClock | None):
        self.transport, self.limits, self.clock = transport, limits, clock

    def _timeouts(self, request: http.Request, remaining_s: float | None) -> dict:
        own = request.extensions.get("timeout") or {}
        timeouts = {}
        for kind in TIMEOUT_KINDS:
            candidates = [own.get(kind), self.limits.get(kind), remaining_s]
            finite = [value for value in candidates if value is not None]
            timeouts[kind] = min(finite) if finite else None
        return timeouts

    def handle_request(self, request: http.Request) -> http.Response:
        if self.clock is None:
            request.extensions = {**request.extensions, "timeout": self._timeouts(request, None)}
            return self.transport.handle_request(request)
        exchange = self.clock.begin(request)
        # A read or write that waits past remaining_s is a stall even if bytes moved since the
        # request began: then the request fails early and huggingface_hub tries it again.
        request.extensions = {**request.extensions, "timeout": self._timeouts(request, exchange.remaining_s)}
        request.stream = _SentBytes(request.stream, self.clock, exchange)
        try:
            response = self.transport.handle_request(request)
        except http.TransportError as error:
            self.clock.failed(exchange, error)
            raise
        except BaseException:
            self.clock.answered(exchange, 0)
            raise
        self.clock.moved(exchange)  # the status line and headers came in
        response.stream = _ReceivedBytes(response.stream, self.clock, exchange, response.status_code)
        return response

    def close(self) -> None:
        self.transport.close()


def _limits(timeout_s: float | None) -> dict:
    if timeout_s is None:
        return {}
    return {
        "connect": min(timeout_s, CONNECT_TIMEOUT_S),
        "read": timeout_s,
        "write": timeout_s,
        "pool": timeout_s,
    }


def _watch(client: http.Client, limits: dict, clock: StallClock | None) -> None:
    # httpx(2) has no public way to change a built client's transports, and the client comes from
    # the factory in use (a user's may carry proxies and certificates, as mounts): each of its
    # transports is wrapped in place.
    client._transport = WatchedTransport(client._transport, limits, clock)
    client._mounts = {
        pattern: WatchedTransport(transport, limits, clock) if transport is not None else None
        for pattern, transport in client._mounts.items()
    }


@contextlib.contextmanager
def hub_client(options: HubOptions):
    """Make every HTTP client huggingface_hub builds in the block send through a
    WatchedTransport (module docstring); yield the block's StallClock (None without a deadline).

    After a connection error huggingface_hub closes its shared client and builds a new one
    from its client factory, so the factory is what is wrapped
    (``huggingface_hub.set_client_factory``, which also drops the current client): each client
    built in the block, the first one included, is watched. The factory is put back afterwards.

    Args:
        options: the push's; its timeout_s is the seconds any connect (at most
            CONNECT_TIMEOUT_S), read or write may wait (None: no limit per request), its
            stall_timeout_s the seconds the push may go on without a byte sent or received
            (None: no deadline).
    """
    if options.timeout_s is None and options.stall_timeout_s is None:
        yield None
        return
    import huggingface_hub
    from huggingface_hub.utils import _http

    # The factory in use has no public getter; the default stands in where it is missing.
    factory = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)
    clock = StallClock(options.stall_timeout_s) if options.stall_timeout_s is not None else None
    limits = _limits(options.timeout_s)
    unwatched: dict[int, tuple[http.Client, http.BaseTransport, dict]] = {}

    def watched_client() -> http.Client:
        client = factory()
        if id(client) not in unwatched:  # a factory may hand out the same client again
            unwatched[id(client)] = (client, client._transport, client._mounts)
            _watch(client, limits, clock)
        return client

    huggingface_hub.set_client_factory(watched_client)
    try:
        yield clock
    finally:
        huggingface_hub.set_client_factory(factory)
        # A client the factory keeps must not carry this push's timeouts and deadline past it.
        for client, transport, mounts in unwatched.values():
            client._transport, client._mounts = transport, mounts


def stalled_in(error: BaseException) -> PushStalled | None:
    """The PushStalled behind `error` (huggingface_hub wraps upload failures in RuntimeError)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, PushStalled):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
