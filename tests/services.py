"""Real services for tests: a throwaway PostgreSQL server, headless Chromium, a local HTTP server.

A test that needs a service calls :func:`unavailable` when it cannot have it: the test is
skipped with one line, unless ``NASCOMPRESS_REQUIRE_SERVICES=1`` (CI sets it), where it fails.

PostgreSQL: ``initdb`` / ``pg_ctl`` from ``/usr/lib/postgresql/<version>/bin`` (Debian package
``postgresql``). initdb refuses to run as root, so as root the server runs as the ``postgres``
user (``runuser -u postgres``) in a temp directory it owns. The server listens on 127.0.0.1
on a free port, with a password-protected user and database.

Chromium: Debian packages ``chromium`` and ``chromium-driver``, driven by selenium with the
flags from shared/ENVIRONMENT.md; selenium's driver download is never used (the driver path is
given and ``SE_OFFLINE=true``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import glob
import http.server
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

REQUIRE = os.environ.get("NASCOMPRESS_REQUIRE_SERVICES") == "1"
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,2400",
]


def unavailable(msg: str) -> None:
    """Skip the test with one line, or fail it when NASCOMPRESS_REQUIRE_SERVICES=1."""
    if REQUIRE:
        pytest.fail(f"{msg} (NASCOMPRESS_REQUIRE_SERVICES=1: services are required)", pytrace=False)
    pytest.skip(msg)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


# ----------------------------------------------------------------------------------------------
# PostgreSQL


def pg_bindir() -> Path | None:
    """The PostgreSQL server binaries (newest installed version), or None."""
    for d in sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(Path(p).parent.name) if Path(p).parent.name.isdigit() else 0,
        reverse=True,
    ):
        if (Path(d) / "initdb").exists() and (Path(d) / "pg_ctl").exists():
            return Path(d)
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


class PostgresServer:
    """A PostgreSQL server in a temp directory; ``url`` has a password-protected user."""

    user = "nascompress"
    database = "studies"

    def __init__(self) -> None:
        self.bindir = pg_bindir()
        self.password = secrets.token_hex(8)
        self.port = 0
        self.dir: Path | None = None
        self.as_postgres = os.geteuid() == 0

    @property
    def url(self) -> str:
        return f"postgresql://{self.user}:{self.password}@127.0.0.1:{self.port}/{self.database}"

    def _run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        cmd = list(args)
        if self.as_postgres:
            cmd = ["runuser", "-u", "postgres", "--"] + cmd
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    def start(self) -> None:
        """Start it; raise RuntimeError with one line saying why it could not start."""
        if self.bindir is None:
            raise RuntimeError("PostgreSQL server binaries not found (apt-get install -y postgresql)")
        try:
            import psycopg
        except ImportError:
            raise RuntimeError("psycopg is not installed (pip install 'psycopg[binary]')") from None
        self.dir = Path(tempfile.mkdtemp(prefix="nascompress-pg-"))
        atexit.register(self.stop)  # no server left behind if the test process ends early
        if self.as_postgres:
            try:
                shutil.chown(self.dir, "postgres", "postgres")
            except (LookupError, PermissionError) as e:
                raise RuntimeError(f"running as root needs the 'postgres' user to own the data dir: {e}") from None
        data, sock = self.dir / "data", self.dir / "sock"
        self._run("mkdir", "-p", str(sock))
        r = self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "-E",
            "UTF8",
            "--no-sync",
        )
        if r.returncode != 0:
            raise RuntimeError(f"initdb failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        for _ in range(3):  # a free port can be taken between choosing and binding it: retry
            self.port = free_port()
            opts = (
                f"-p {self.port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c max_connections=50 -c shared_buffers=16MB"
            )
            r = self._run(
                str(self.bindir / "pg_ctl"),
                "-D",
                str(data),
                "-o",
                opts,
                "-l",
                str(self.dir / "server.log"),
                "-w",
                "-t",
                "30",
                "start",
            )
            if r.returncode == 0:
                break
        else:
            log = (self.dir / "server.log").read_text()[-300:] if (self.dir / "server.log").exists() else ""
            raise RuntimeError(f"pg_ctl start failed: {(r.stderr or r.stdout).strip()[-200:]} {log}")
        with psycopg.connect(
            host=str(sock), port=self.port, user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute(f"CREATE ROLE {self.user} LOGIN PASSWORD '{self.password}'")  # hex: no quoting issue
            conn.execute(f"CREATE DATABASE {self.database} OWNER {self.user}")

    def stop(self) -> None:
        if self.dir is None:
            return
        data = self.dir / "data"
        if (data / "postmaster.pid").exists():
            self._run(str(self.bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None


@contextlib.contextmanager
def postgres() -> Iterator[PostgresServer]:
    """A running server for the ``with`` block (unavailable() if it cannot start)."""
    server = PostgresServer()
    try:
        server.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        server.stop()
        unavailable(f"PostgreSQL cannot be started here: {e}")
    try:
        yield server
    finally:
        server.stop()


# ----------------------------------------------------------------------------------------------
# HTTP and Chromium


@contextlib.contextmanager
def serve_dir(directory: str | Path) -> Iterator[str]:
    """Serve a directory on 127.0.0.1 (a free port); yields the base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def chromium_paths() -> tuple[str, str] | None:
    """(browser, driver) from the Debian packages, or None."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver") or (
        "/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None
    )
    return (browser, driver) if browser and driver else None


@contextlib.contextmanager
def chromium() -> Iterator[object]:
    """A headless Chromium (selenium WebDriver) that records JS errors from the first script on.

    ``driver.js_errors()`` returns the uncaught errors and console errors seen so far.
    """
    paths = chromium_paths()
    if paths is None:
        unavailable("headless Chromium is not installed (apt-get install -y chromium chromium-driver)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        unavailable("selenium is not installed (pip install -e '.[test]')")
    os.environ.setdefault("SE_OFFLINE", "true")
    opts = webdriver.ChromeOptions()
    opts.binary_location = paths[0]
    for f in CHROMIUM_FLAGS:
        opts.add_argument(f)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(service=Service(executable_path=paths[1]), options=opts)
    except Exception as e:  # noqa: BLE001 (one line: why the browser did not start)
        unavailable(f"headless Chromium cannot be started: {type(e).__name__}: {str(e).strip().splitlines()[0]}")
    driver.execute_cdp_cmd(
        "Page.addScriptToEvaluateOnNewDocument",
        {
            "source": (
                "window.__errors = [];"
                "window.addEventListener('error', e => window.__errors.push(String(e.message || e)));"
                "window.addEventListener('unhandledrejection', e => window.__errors.push(String(e.reason)));"
            )
        },
    )

    def js_errors() -> list[str]:
        errs = list(driver.execute_script("return window.__errors || []") or [])
        errs += [e["message"] for e in driver.get_log("browser") if e.get("level") == "SEVERE"]
        return errs

    driver.js_errors = js_errors  # type: ignore[attr-defined]
    try:
        yield driver
    finally:
        driver.quit()


def wait_until(cond, timeout: float = 30, every: float = 0.1) -> bool:  # noqa: ANN001
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(every)
    return bool(cond())
