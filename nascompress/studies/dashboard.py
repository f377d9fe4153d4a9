"""optuna-dashboard on a study's storage, served from this process (a thread) until stopped.

SQLite: serving a live SQLite file that a study is writing has crashed studies
(optuna-dashboard#545), so an SQLite storage is served from a snapshot copy (SQLite's online
backup, consistent even mid-write) taken at start; restart the dashboard to refresh it. Journal
and PostgreSQL storages are served live.

Safety: the dashboard has no login, so it listens on this machine's loopback address by default
and refuses another address unless ``expose=True`` (``--expose-storage-without-login``): anyone who
can reach the port reads every study of the storage. It is read-only unless ``writable=True``
(``--writable``): the API's writes (``DELETE /api/studies/1``, notes, renames) are answered 403.
``--writable`` changes the live studies of a PostgreSQL or journal storage; on SQLite it is
refused (the writes would go to the snapshot, not to the file the user named). Requests without an ``Accept-Encoding``
header (curl, scripts) are served, not failed with a traceback in the terminal. A request whose
``Host`` header is not this dashboard's address (the bound address, ``localhost``, ``127.0.0.1``
or ``[::1]``, with its port; this machine's own names too when it listens beyond loopback) is
answered 403: a web page of another site that points its name at this machine (DNS rebinding)
cannot read the studies.

The snapshot folder (made beside the study file, removed when the dashboard stops, a killed
dashboard's leftover removed only when provably one): :mod:`nascompress.studies.snapshots`.
"""

from __future__ import annotations

import json
import socketserver
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server
import ipaddress
import socket

import optuna

from nascompress.config import check_settings, setting
from nascompress.errors import NascompressError, SettingError

from .snapshots import make_snapshot_dir, remove_snapshot_dir, snapshot_sqlite
from .storage import find_study
from .storage_open import open_storage
from .inspect import directions, metric_names
from .report import front_figures

WRITABLE_FLAG = "--writable"
_READ_METHODS = ("GET", "HEAD", "OPTIONS")


def is_loopback(host: str) -> bool:
    """Is ``host`` an address (or name) of this machine's loopback interface only?"""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def allowed_hosts(host: str, port: int) -> frozenset[str]:
    """The ``Host`` header values a dashboard bound to ``host``:``port`` answers (lower case): the
    bound address, ``localhost``, ``127.0.0.1`` and ``[::1]`` with the port (also without it on
    port 80); this machine's host names and addresses too when ``host`` is not loopback."""
    names = {host.strip().lower(), "localhost", "127.0.0.1", "::1"}
    if not is_loopback(host):
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        try:
            names |= {info[4][0].split("%")[0].lower() for info in socket.getaddrinfo(socket.gethostname(), None)}
        except OSError:
            pass
    out = set()
    for n in names:
        n = n.strip("[]")
        shown = f"[{n}]" if ":" in n else n
        out.add(f"{shown}:{port}")
        if port == 80:
            out.add(shown)
    return frozenset(out)


def _refuse(start_response: Any, status: str, reason: str) -> list[bytes]:
    body = json.dumps({"reason": reason}).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]


def _guard(app: Any, *, writable: bool, hosts: frozenset[str] | None = None) -> Any:
    """The dashboard's WSGI app, read-only unless ``writable`` (a write is answered 403 with the
    reason), answering only requests whose ``Host`` header is one of ``hosts`` (others: 403; None:
    any), with a missing ``Accept-Encoding`` header read as none (optuna-dashboard's static files
    otherwise fail with a KeyError)."""

    def guarded(environ: dict[str, Any], start_response: Any) -> Any:
        if hosts is not None and environ.get("HTTP_HOST", "").strip().lower() not in hosts:
            return _refuse(
                start_response,
                "403 Forbidden",
                "this dashboard answers only requests addressed to its own address (Host header); "
                "open it with the address it printed",
            )
        environ.setdefault("HTTP_ACCEPT_ENCODING", "")
        if not writable and environ.get("REQUEST_METHOD", "GET").upper() not in _READ_METHODS:
            return _refuse(
                start_response,
                "403 Forbidden",
                f"this dashboard is read-only: restart it with {WRITABLE_FLAG} to change studies",
            )
        if environ.get("PATH_INFO", "").startswith(("/api/", "/static/")):
            return app(environ, start_response)
        return _with_style(app, environ, start_response)

    return guarded


# optuna-dashboard's plots keep plotly's toolbar shown over their top right corner, where its
# Pareto front's colour bars have their titles: shown only while the pointer is over the plot
DASHBOARD_CSS = (
    ".js-plotly-plot .plotly .modebar{opacity:0;transition:opacity .2s}"
    ".js-plotly-plot:hover .plotly .modebar{opacity:1}"
)


def _with_style(app: Any, environ: dict[str, Any], start_response: Any) -> Any:
    """``app``'s answer, with :data:`DASHBOARD_CSS` in an HTML page's head."""
    seen: dict[str, Any] = {}

    def keep(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        seen.update(status=status, headers=headers, exc_info=exc_info)
        return lambda data: None  # the page is written below, whole

    body = b"".join(app(environ, keep))
    headers = seen["headers"]
    if any(k.lower() == "content-type" and v.startswith("text/html") for k, v in headers) and b"</head>" in body:
        body = body.replace(b"</head>", f"<style>{DASHBOARD_CSS}</style></head>".encode(), 1)
        headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
        headers.append(("Content-Length", str(len(body))))
    start_response(seen["status"], headers, seen["exc_info"])
    return [body]


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass


@dataclass
class DashboardHandle:
    """A running dashboard.

    Attributes:
        url: the dashboard's address (``http://HOST:PORT/dashboard/``).
        study_url: the study's page.
        storage: the served storage, password masked.
        snapshot: the SQLite snapshot file served (None when the storage is served live).
        note: a line to show the user (e.g. that a snapshot is served), or None.
    """

    url: str
    study_url: str
    host: str
    port: int
    storage: str
    snapshot: Path | None
    note: str | None
    writable: bool = False
    _server: Any = field(repr=False, default=None)
    _thread: threading.Thread | None = field(repr=False, default=None)
    _tmpdir: Path | None = field(repr=False, default=None)

    def stop(self) -> None:
        """Stop serving, close the port and delete the snapshot (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
        if self._tmpdir is not None:
            remove_snapshot_dir(self._tmpdir)
            self._tmpdir = None

    def wait(self) -> None:
        """Block until stopped (Ctrl-C raises KeyboardInterrupt here; call :meth:`stop` then)."""
        while self._thread is not None and self._thread.is_alive():
            time.sleep(0.2)

    def __enter__(self) -> DashboardHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@dataclass(frozen=True)
class DashboardSettings:
    """``nascompress study dashboard``'s settings (:func:`start_dashboard`'s keywords)."""

    host: str = setting("127.0.0.1", help="Address to listen on (default: this machine only).")
    port: int = setting(0, lo=0, hi=65535, help="Port (0: a free one).")
    expose: bool = setting(
        False,
        option="--expose-storage-without-login",
        help=(
            "Allow a --host other than loopback: the dashboard has no login, so every machine that reaches the "
            "port reads all studies of the storage."
        ),
    )
    writable: bool = setting(
        False, help=("Let the dashboard change the storage (delete studies, notes); default read-only.")
    )

    def __post_init__(self) -> None:
        check_settings(self)


def _add_fronts(storage: Any, name: str) -> None:
    """Add the report's fronts (:func:`~nascompress.studies.report.front_figures`: trials by kind,
    one legend, never coloured by trial number) to the study of the dashboard's snapshot, where
    optuna-dashboard shows them beside its own plots (its built-in Pareto front colours by trial
    number). Only a snapshot is written, never the study's storage."""
    from optuna_dashboard import save_plotly_graph_object  # ~2 s at start-up; `study dashboard` only

    study = optuna.load_study(study_name=name, storage=storage)
    trials = study.get_trials(deepcopy=False)
    for div, fig in front_figures(trials, metric_names(study), directions(study)):
        save_plotly_graph_object(study, fig, graph_object_id=f"nascompress-{div}")


def start_dashboard(
    name: str,
    *,
    storage: str | None = None,
    host: str = DashboardSettings.host,
    port: int = DashboardSettings.port,
    expose: bool = False,
    writable: bool = False,
) -> DashboardHandle:
    """Serve optuna-dashboard for the storage holding study ``name``.

    Args:
        name: the study (it must exist; its storage is served, with all its studies).
        storage: a ``--storage`` value, or None for the project's default files.
        host: the address to listen on (127.0.0.1: this machine only).
        port: the port; 0 picks a free one.
        expose: allow a ``host`` other than loopback (the dashboard has no login: anyone who
            reaches the port reads every study of the storage).
        writable: let the dashboard change the storage (delete studies, write notes); default
            read-only.

    Returns:
        A :class:`DashboardHandle` (``.url``, ``.stop()``).
    """
    import optuna_dashboard  # ~2 s at start-up; `study dashboard` only

    if not expose and not is_loopback(host):
        can = "read, change and delete" if writable else "read"
        raise SettingError(
            f"the dashboard has no login: on {{host}} {host} every machine that reaches this one "
            f"could {can} the studies of its storage; keep the default {{host}} 127.0.0.1 (and "
            "tunnel, e.g. ssh -L), or pass {expose} to serve it there knowingly"
        )
    spec, st = find_study(name, storage)
    if writable and spec.kind == "sqlite":  # the snapshot's writes would never reach the file
        raise SettingError(
            f"{{writable}} cannot change SQLite storage {spec.display}: the dashboard serves a "
            "snapshot copy of it (a live SQLite file that a study writes can crash it, "
            "optuna-dashboard#545), so deletions and edits would not reach the file; leave out "
            "{writable} to browse it, or (no study writing it) run optuna-dashboard on "
            f"{spec.display} itself"
        )
    study_id = st.get_study_id_from_name(name)
    tmpdir: Path | None = None
    served, note, snap = spec, None, None
    if spec.kind == "sqlite":
        try:
            tmpdir = make_snapshot_dir(spec)
        except OSError as e:
            raise NascompressError(f"cannot snapshot {spec.display} for the dashboard: {e.strerror or e}") from None
        try:
            served = snapshot_sqlite(spec, tmpdir)
        except NascompressError:
            remove_snapshot_dir(tmpdir)
            raise
        snap = served.path
        stamp = time.strftime("%H:%M:%S")
        note = (
            f"serving a snapshot of {spec.display} taken at {stamp} (a live SQLite file that a study writes "
            "can crash it, optuna-dashboard#545); restart the dashboard to refresh"
        )
        st = open_storage(served, create=False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if snap is not None:  # the snapshot only: the study's own storage is never written
                _add_fronts(st, name)
            app = optuna_dashboard.wsgi(st)
        try:  # the app is wrapped once the port is known (the Host check needs it): set_app below
            server = make_server(host, port, app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler)
        except OSError as e:
            raise NascompressError(f"cannot serve the dashboard on {host}:{port}: {e.strerror or e}") from None
    except BaseException:
        if tmpdir is not None:
            remove_snapshot_dir(tmpdir)
        raise
    real_port = server.server_address[1]
    server.set_app(_guard(app, writable=writable, hosts=allowed_hosts(host, real_port)))
    thread = threading.Thread(target=server.serve_forever, name="nascompress-dashboard", daemon=True)
    thread.start()
    url_host = f"[{host}]" if ":" in host else host
    base = f"http://{url_host}:{real_port}/dashboard/"
    return DashboardHandle(
        url=base,
        study_url=f"{base}studies/{study_id}",
        host=host,
        port=real_port,
        storage=spec.display,
        snapshot=snap,
        note=note,
        writable=writable,
        _server=server,
        _thread=thread,
        _tmpdir=tmpdir,
    )
